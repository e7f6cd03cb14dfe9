"""The data axis each exchange was built over, read from the optimizer that holds it.

Every transform with an exchange marks its update function with its data axis
(:func:`marked`), so that a wrapper, :func:`topka2a_jax.accumulate_gradients`,
takes the axis from the exchange it wraps rather than asking for it again
(:func:`exchange_axes`).

Example:
  >>> update = marked(lambda updates, state, params=None: (updates, state), "data")
  >>> exchange_axes(optax.chain(optax.GradientTransformation(lambda p: (), update)))
  {'data'}
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from topka2a_jax._src.transforms.clipping import held

EXCHANGE_AXIS = "topka2a_exchange_axis"
"""The attribute of an exchange's update function that holds its data axis."""

F = TypeVar("F", bound=Callable[..., Any])


def marked(update: F, axis_name: Hashable) -> F:
  """``update``, marked as an exchange's over ``axis_name``."""
  setattr(update, EXCHANGE_AXIS, axis_name)
  return update


def exchange_axes(tx: Any) -> set[Hashable]:
  """The data axes of every exchange ``tx`` holds, however deep (chains, wrappers)."""
  return {getattr(found, EXCHANGE_AXIS) for found in held(tx)
          if callable(found) and hasattr(found, EXCHANGE_AXIS)}
