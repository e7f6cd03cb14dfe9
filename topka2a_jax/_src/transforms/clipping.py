"""Global-norm clipping beside the exchange: after it, on the mean, or a warning.

In dense training ``optax.clip_by_global_norm`` bounds the norm of the
averaged gradient. Placed after :func:`topka2a_jax.topka2a`, it does the
same here: the exchange's output is the mean of what the devices sent,
identical on every device, and the clip bounds the step's input as dense
training's does. Placed before it, each device clips its own gradient, and
error feedback then adds the residual (many steps' unsent entries) after the
clip, so the norm bounds neither what is exchanged nor what is applied.

:func:`warn_if_clipped_before_exchange` finds that order in an optimizer by
walking its closures (``optax.chain`` keeps its transforms in order), as the
training steps and :func:`topka2a_jax.init` do for the optimizer they get.

Example:
  >>> tx = optax.chain(optax.clip_by_global_norm(1.0), topka2a_jax.topka2a(0.01),
  ...                  optax.sgd(0.1))
  >>> with warnings.catch_warnings(record=True) as caught:
  ...   warnings.simplefilter("always")
  ...   warn_if_clipped_before_exchange(tx)
  >>> "after the exchange" in str(caught[0].message)
  True
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Iterator
from typing import Any

import optax

from topka2a_jax._src.caller import user_stacklevel

CLIP = "clip_by_global_norm"
EXCHANGE = "topka2a"

_CHAIN_UPDATE = optax.chain(optax.identity()).update.__code__
"""The code of every ``optax.chain``'s update: a chain is found by it, not by name.
``tests/test_clipping.py`` holds that it closes over its members' updates in order."""


def held(fn: Any, seen: set[int] | None = None) -> Iterator[Any]:
  """``fn`` and everything it holds, depth first, each once.

  What a function holds is its closure; a ``functools.partial`` holds its
  function and arguments, a bound method its function and object, a
  ``jax.jit``-wrapped function the function it wraps, a callable object its
  class's ``__call__`` and its attributes, an object reached that way its
  attributes, an object with ``init`` and ``update`` (a transform of the
  user's own class) those methods, a dict its values (``optax.partition``'s
  transforms).

  Args:
    fn: an update function, a ``GradientTransformation`` or a sequence of them
      (whose items are walked, not the sequence itself).
    seen: ids already walked (a closure may hold the same function twice).
  """
  seen = set() if seen is None else seen
  if id(fn) in seen or isinstance(fn, (str, bytes, int, float, type, types.ModuleType)):
    return
  seen.add(id(fn))
  if isinstance(fn, (tuple, list)):  # a GradientTransformation, or chain's update_fns
    for item in fn:
      yield from held(item, seen)
    return
  if isinstance(fn, dict):
    for item in fn.values():
      yield from held(item, seen)
    return
  yield fn
  for contents in _held_by(fn):
    yield from held(contents, seen)


def _held_by(fn: Any) -> list[Any]:
  """What ``fn`` holds directly (see :func:`held`)."""
  if isinstance(fn, types.FunctionType):
    return [*_closure(fn).values(), *([fn.__wrapped__] if hasattr(fn, "__wrapped__") else [])]
  if isinstance(fn, functools.partial):
    return [fn.func, *fn.args, *fn.keywords.values()]
  if isinstance(fn, types.MethodType):
    return [fn.__func__, *vars(fn.__self__).values()] if hasattr(fn.__self__, "__dict__") \
        else [fn.__func__]
  wrapped = getattr(fn, "__wrapped__", None)  # jax.jit's and functools.wraps' wrappers
  if wrapped is not None:
    return [wrapped]
  if callable(fn) and hasattr(fn, "__dict__"):  # a callable object
    return [type(fn).__call__, *vars(fn).values()]
  if callable(getattr(fn, "init", None)) and callable(getattr(fn, "update", None)):
    return [fn.update, fn.init]  # a transform of the user's own class
  return []


def transform_names(fn: Any) -> Iterator[str]:
  """The optax factories behind ``fn``: itself and everything its closures hold.

  Yields:
    The first part of every function's qualified name (``"chain"``,
    ``"clip_by_global_norm"``, ``"topka2a"``, ...), depth first.
  """
  for found in held(fn):
    qualname = getattr(found, "__qualname__", None)
    if callable(found) and isinstance(qualname, str):
      yield qualname.split(".")[0]


def _closure(fn: Any) -> dict[str, Any]:
  """The free variables ``fn`` closes over, by name (none for other objects)."""
  cells = getattr(fn, "__closure__", None) or ()
  contents = {}
  for name, cell in zip(fn.__code__.co_freevars if cells else (), cells):
    try:
      contents[name] = cell.cell_contents
    except ValueError:  # a cell not filled yet
      continue
  return contents


def chained(fn: Any) -> Iterator[tuple[Any, ...]]:
  """Every ``optax.chain`` behind ``fn``: its update functions, in the order it runs them."""
  for found in held(fn):
    if getattr(found, "__code__", None) is _CHAIN_UPDATE:  # it closes over its members
      yield next(tuple(value) for value in _closure(found).values()
                 if isinstance(value, (tuple, list)))


def warn_if_clipped_before_exchange(tx: Any) -> None:
  """Warns when ``optax.clip_by_global_norm`` runs before ``topka2a`` in ``tx``.

  Inside :func:`topka2a_jax.compress_updates` the inner optimizer runs per
  device by design, its clip included: no warning there.

  Args:
    tx: the optimizer of a training step.

  Warns:
    UserWarning: naming the order to write instead, at the user's line
      (the first frame outside the library, optax and JAX).
  """
  for update_fns in chained(getattr(tx, "update", tx)):
    names = [set(transform_names(fn)) for fn in update_fns]
    clips = [i for i, found in enumerate(names) if CLIP in found]
    if clips and any(EXCHANGE in found for found in names[clips[0] + 1:]):
      warnings.warn(
          "optax.clip_by_global_norm runs before topka2a_jax.topka2a: each device "
          "clips its own gradient, and error feedback then adds the residual "
          "after the clip, so the norm bounds neither what is exchanged nor the "
          "step. Clip after the exchange, on the mean, as dense training does: "
          "optax.chain(topka2a_jax.topka2a(...), optax.clip_by_global_norm(...), "
          "optimizer).", UserWarning, stacklevel=user_stacklevel())
      return
