"""Checks of the arguments users pass that many modules take: counts and optimizers.

Each returns the value as the library uses it, or raises an error that names
the argument and what to pass instead. :func:`keywords_after_inner` keeps an
older spelling of a wrapper's arguments working, with a warning, for one
version.

Example:
  >>> checked_count("fusion", 4, 1)
  4
"""

from __future__ import annotations

import functools
import numbers
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from topka2a_jax._src.caller import user_stacklevel

F = TypeVar("F", bound=Callable[..., Any])

INT32_MAX = 2**31 - 1
"""The largest count a state's int32 counter holds."""


def checked_count(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
  """``value`` as an int of at least ``minimum`` (and at most ``maximum``, where given):
  TypeError if not an int, else ValueError.

  Example:
    >>> checked_count("micro_batches", 0, 1)
    Traceback (most recent call last):
    ValueError: micro_batches must be at least 1, got 0
  """
  if not isinstance(value, numbers.Integral) or isinstance(value, bool):
    raise TypeError(f"{name} must be an int, got {value!r}")
  if value < minimum:
    raise ValueError(f"{name} must be at least {minimum}, got {value}")
  if maximum is not None and value > maximum:
    raise ValueError(f"{name} must be at most {maximum:,}"
                     + (" (the state counts it in int32)" if maximum == INT32_MAX else "")
                     + f", got {value:,}")
  return int(value)


def checked_optimizer(name: str, value: Any) -> Any:
  """``value`` if it is an optax transform (``init`` and ``update``), else a TypeError.

  Example:
    >>> checked_optimizer("inner", optax.adam)
    Traceback (most recent call last):
    TypeError: inner must be an optax.GradientTransformation, got the function adam itself: call
    it, e.g. optax.adam(1e-3)
  """
  if callable(getattr(value, "init", None)) and callable(getattr(value, "update", None)):
    return value
  if callable(value):
    what = getattr(value, "__name__", repr(value))
    raise TypeError(f"{name} must be an optax.GradientTransformation, got the "
                    f"function {what} itself: call it, e.g. optax.{what}(1e-3)")
  raise TypeError(f"{name} must be an optax.GradientTransformation such as "
                  f"optax.adam(1e-3), got {value!r}")


def keywords_after_inner(*names: str, renamed: dict[str, str] | None = None
                         ) -> Callable[[F], F]:
  """A wrapper whose arguments after ``inner`` are keyword-only, still taking them
  positionally, and under their ``renamed`` old names, for one version, each with a
  ``DeprecationWarning`` naming the spelling to write.

  Args:
    *names: the keyword-only parameters after ``inner``, in their old order.
    renamed: old keyword -> its name now.

  Example:
    >>> @keywords_after_inner("every")
    ... def wrapper(inner, *, every=4):
    ...   return every
    >>> with warnings.catch_warnings(record=True) as said:
    ...   warnings.simplefilter("always")
    ...   wrapper("adam", 8), str(said[0].message)[:51]
    (8, 'wrapper(inner, 8): pass every= by keyword, wrapper(')
  """
  renamed = renamed or {}

  def wrap(factory: F) -> F:
    name = factory.__name__

    @functools.wraps(factory)
    def call(*args: Any, **kwargs: Any) -> Any:
      for old, new in renamed.items():
        if old in kwargs:
          warnings.warn(f"{name}({old}=...) is now {name}({new}=...); {old}= goes in the "
                        "next version", DeprecationWarning, stacklevel=user_stacklevel())
          if new in kwargs or (new == "inner" and args):
            raise TypeError(f"{name}() got both {old}= and {new}=; give {new}= alone")
          kwargs[new] = kwargs.pop(old)
      if "inner" in kwargs and not args:
        args = (kwargs.pop("inner"),)
      extra = args[1:]
      if extra:
        if len(extra) > len(names):
          raise TypeError(f"{name}() takes the optimizer and then keywords only "
                          f"({', '.join(n + '=' for n in names)}); got {len(args)} "
                          "positional arguments")
        given = dict(zip(names, extra))
        twice = sorted(set(given) & set(kwargs))
        if twice:
          raise TypeError(f"{name}() got {twice[0]} both by position and by keyword")
        spelled = ", ".join(f"{key}={value!r}" for key, value in given.items())
        warnings.warn(
            f"{name}(inner, {', '.join(map(repr, extra))}): pass "
            f"{', '.join(key + '=' for key in given)} by keyword, {name}(inner, {spelled}); "
            "positional arguments after the optimizer go in the next version",
            DeprecationWarning, stacklevel=user_stacklevel())
        kwargs.update(given)
        args = args[:1]
      return factory(*args, **kwargs)

    return call  # type: ignore[return-value]

  return wrap
