"""Checks of the arguments users pass that many modules take: counts and optimizers.

Each returns the value as the library uses it, or raises an error that names
the argument and what to pass instead.

Example:
  >>> checked_count("fusion", 4, 1)
  4
"""

from __future__ import annotations

import numbers
from typing import Any

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
