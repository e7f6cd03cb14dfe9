"""Sizes: how many entries a density sends, and shards, chunks and words rounded up.

The counts are static Python ints computed from static shapes, so every
exchange has fixed shapes and compiles once.

* ``k = ceil(density * n)`` entries of an ``n``-element buffer
  (:func:`sparse_count`).
* TopKA2A splits the buffer into ``P`` contiguous shards of
  ``ceil(n / P)`` elements and takes ``ceil(k / P)`` from each
  (:class:`ShardLayout`).

Example:
  >>> ceil_div(10, 4), round_up(10, 4)
  (3, 12)
  >>> layout = ShardLayout.create(length=10, num_shards=4, density=0.5)
  >>> layout.shard_length, layout.per_shard
  (3, 2)
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

# A density times a length that is an integer in exact arithmetic may come out
# a hair above it in floating point (0.07 * 100 = 7.000000000000001); this
# relative slack keeps ceil() from counting one entry too many.
_ROUNDING_SLACK = 1e-12


def ceil_div(numerator: int, denominator: int) -> int:
  """``numerator / denominator`` rounded up, for positive ``denominator``."""
  return -(-numerator // denominator)


def round_up(value: int, multiple: int) -> int:
  """The smallest multiple of ``multiple`` that is at least ``value``."""
  return ceil_div(value, multiple) * multiple


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
