"""How many entries to send, and which: top-k by magnitude, by the name ``selection=`` takes.

The counts are static Python ints computed from static shapes, so every
exchange has fixed shapes and compiles once.

* ``k = ceil(density * n)`` entries of an ``n``-element buffer
  (:func:`sparse_count`).
* TopKA2A splits the buffer into ``P`` contiguous shards of
  ``ceil(n / P)`` elements and takes ``ceil(k / P)`` from each
  (:class:`ShardLayout`).

One registry, :data:`SELECTIONS`, maps every name to ``(rows, k) ->
(values, indices)``; ``"auto"`` is the one for the backend
(:func:`auto_choice`), and the evidence page "Selection"
(``benchmarks/selection.py``) has the measurements behind it.

Example:
  >>> layout = ShardLayout.create(length=10, num_shards=4, density=0.5)
  >>> layout.shard_length, layout.per_shard
  (3, 2)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from topka2a_jax._src.sizes import ceil_div

# A density times a length that is an integer in exact arithmetic may come out
# a hair above it in floating point (0.07 * 100 = 7.000000000000001); this
# relative slack keeps ceil() from counting one entry too many.
_ROUNDING_SLACK = 1e-12


def check_density(density: Any) -> float:
  """``density`` as a float in (0, 1], or a ValueError naming the fix.

  Example:
    >>> check_density(-0.1)
    Traceback (most recent call last):
    ValueError: density must be a number in (0, 1], the fraction of gradient entries each device
    sends; got -0.1. For example density=0.01 sends 1%.
  """
  if (not isinstance(density, numbers.Real) or isinstance(density, bool)
      or not math.isfinite(density) or not 0.0 < density <= 1.0):
    raise ValueError(
        f"density must be a number in (0, 1], the fraction of gradient "
        f"entries each device sends; got {density!r}. For example "
        "density=0.01 sends 1%.")
  return float(density)


def sparse_count(length: int, density: float) -> int:
  """Returns ``k``, the number of entries sent from ``length`` at ``density``.

  Args:
    length: number of elements, at least 1.
    density: fraction to send, in (0, 1].

  Returns:
    ``ceil(density * length)``, at least 1 and at most ``length``.

  Raises:
    ValueError: ``density`` is not in (0, 1].

  Example:
    >>> sparse_count(1000, 0.01)
    10
  """
  k = math.ceil(check_density(density) * length * (1.0 - _ROUNDING_SLACK))
  return min(length, max(1, k))


class ShardLayout(NamedTuple):
  """Static shapes of TopKA2A's shard-wise selection for one buffer.

  Attributes:
    length: elements in the caller's buffer.
    num_shards: P, the devices along the axis; shard ``i`` is owned by device
      ``i``.
    shard_length: elements per shard, ``ceil(length / P)``; the buffer is
      zero-padded to ``P * shard_length``.
    per_shard: entries selected from every shard, ``ceil(k / P)``.
  """

  length: int
  num_shards: int
  shard_length: int
  per_shard: int

  @classmethod
  def create(cls, length: int, num_shards: int, density: float) -> ShardLayout:
    """Lays out a ``length``-element buffer over ``num_shards`` owners.

    Args:
      length: elements in the buffer, at least 1.
      num_shards: devices along the axis.
      density: fraction to send, in (0, 1].

    Returns:
      The layout.
    """
    shard_length = ceil_div(length, num_shards)
    per_shard = ceil_div(sparse_count(length, density), num_shards)
    # ceil(ceil(d*n)/P) <= ceil(n/P) for d <= 1, so shards always hold enough.
    return cls(length, num_shards, shard_length, per_shard)

  @property
  def padded_length(self) -> int:
    """Elements after padding: ``num_shards * shard_length``."""
    return self.num_shards * self.shard_length


def approx_magnitudes(rows: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Selects ``k`` large-magnitude entries of every row with ``lax.approx_max_k``.

  On TPUs an approximate top-k that keeps about 95% of the exact top-k's
  entries; other backends run XLA's fallback, which on a CPU takes as long
  as the exact sort and returns the same entries.

  Args:
    rows: array of shape ``(..., n)``.
    k: entries per row, ``1 <= k <= n``.

  Returns:
    ``(values, indices)``, each of shape ``(..., k)``, as :func:`top_magnitudes`.

  Example:
    >>> approx_magnitudes(jnp.array([[1.0, -5.0, 3.0]]), 2)
    (Array([[-5., 3.]], dtype=float32), Array([[1, 2]], dtype=int32))
  """
  _, indices = lax.approx_max_k(jnp.abs(rows), k, recall_target=0.95)
  return jnp.take_along_axis(rows, indices, axis=-1), indices


def top_magnitudes(rows: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Selects the ``k`` largest-magnitude entries of every row, exactly.

  Ties go to the lower index, so the result is deterministic.

  Args:
    rows: array of shape ``(..., n)``.
    k: entries per row, ``1 <= k <= n``.

  Returns:
    ``(values, indices)``, each of shape ``(..., k)``: the selected entries
    with their signs, and their distinct positions within the row (int32).

  Example:
    >>> top_magnitudes(jnp.array([[1.0, -5.0, 3.0]]), 2)
    (Array([[-5., 3.]], dtype=float32), Array([[1, 2]], dtype=int32))
  """
  _, indices = lax.top_k(jnp.abs(rows), k)
  return jnp.take_along_axis(rows, indices, axis=-1), indices


Selection = Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]


def _threshold_magnitudes(rows: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """``selection="threshold"``: :func:`threshold.threshold_magnitudes`.

  Imported on call: the threshold search falls back to this module's exact
  sort, so it imports this module.
  """
  from topka2a_jax._src.collectives import threshold
  return threshold.threshold_magnitudes(rows, k)


def auto_choice() -> str:
  """The selection ``"auto"`` runs on this backend.

  ``approx_max_k`` on a TPU, the backend its documentation says it is made
  for; the threshold search elsewhere, which falls back to the exact sort
  by itself on rows too short for it to gain and for selections of more
  than a quarter of a row.
  """
  return "approx" if jax.default_backend() == "tpu" else "threshold"


def auto_magnitudes(rows: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """``selection="auto"``: :data:`SELECTIONS` of :func:`auto_choice`.

  Args:
    rows: ``(R, n)`` floating array.
    k: entries per row.

  Returns:
    ``(values, indices)`` as every selection returns them.
  """
  return SELECTIONS[auto_choice()](rows, k)


SELECTIONS: dict[str, Selection] = {
    "auto": auto_magnitudes,
    "exact": top_magnitudes,
    "threshold": _threshold_magnitudes,
    "approx": approx_magnitudes,
}
"""How the sparse collectives pick entries: ``(rows, k) -> (values, indices)``."""


def check_selection(name: str) -> None:
  """Raises a ValueError listing the choices unless ``name`` is a selection.

  Example:
    >>> check_selection("top")
    Traceback (most recent call last):
    ValueError: unknown selection 'top'; choose one of 'auto', 'exact', 'threshold', 'approx'
  """
  if name not in SELECTIONS:
    raise ValueError(f"unknown selection {name!r}; choose one of "
                     f"{', '.join(repr(n) for n in SELECTIONS)}")


def get_selection(name: str) -> Selection:
  """The selection called ``name``, or a ValueError listing the choices."""
  check_selection(name)
  return SELECTIONS[name]
