"""Sizes: how many entries a density sends, and shards, chunks and words rounded up.

The counts are static Python ints computed from static shapes, so every
exchange has fixed shapes and compiles once.

* ``k = ceil(density * n)`` entries of an ``n``-element buffer
  (:func:`sparse_count`).
* TopKA2A splits the buffer into ``P`` contiguous shards of
  ``ceil(n / P)`` elements and takes ``ceil(k / P)`` from each
  (:class:`ShardLayout`).
* A few-bit exchange cuts a row into chunks of at most :data:`CHUNK`
  entries, one scale each, in whole words (:func:`chunking`,
  :func:`wire_bytes`).
* PowerSGD sends a leaf as a matrix (:func:`matrix_shape`) at a rank
  (:func:`leaf_rank`), where that saves at least half (:func:`compresses`).
* An index travels in the narrowest unsigned type that addresses its
  positions (:func:`index_dtype`).

Nothing here imports JAX: the cost model and the command-line planner read
these counts without it.

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
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

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
  if getattr(density, "shape", None) == () and getattr(density, "dtype", None) is not None \
      and np.issubdtype(density.dtype, np.floating):
    density = float(density)  # a concrete 0-d array, jnp.asarray(0.01); a tracer raises here
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


CHUNK = 4096
"""Entries of a few-bit exchange that share one scale, at most: 4 bytes of
scale per 4,096 codes (0.8% of a 1-bit message)."""

WORD = 32
"""Bits per packed word of few-bit codes."""


class Chunking(NamedTuple):
  """How a row of ``length`` entries is cut into chunks.

  Attributes:
    chunks: chunks per row, ``ceil(length / CHUNK)``.
    chunk: entries per chunk: the row split evenly into that many, rounded
      up to 32, so at most :data:`CHUNK` and fewer than 32 entries of
      padding per chunk.
  """

  chunks: int
  chunk: int

  @property
  def padded(self) -> int:
    """Entries of a row with its padding: ``chunks * chunk``."""
    return self.chunks * self.chunk


SCALE_ENTRIES = 8
"""What a chunk's float32 scale costs, in entries of a 4-bit code."""


def chunking(length: int, chunk: int = CHUNK, *, powers_of_two: bool = False) -> Chunking:
  """The chunks of a row of ``length`` entries.

  Args:
    length: entries in the row.
    chunk: entries per chunk, at most; a positive multiple of 32.
    powers_of_two: chunks of a power of two entries each, for a rotated code
      (``collectives/rotation.py``): of the powers of two from 32 to
      ``chunk`` (itself one), the one whose padding and scales cost least,
      a scale counted as :data:`SCALE_ENTRIES` entries. A long row takes
      ``chunk`` itself; a short one, chunks that fit it.

  Example:
    >>> chunking(10_000), chunking(100)
    (Chunking(chunks=3, chunk=3360), Chunking(chunks=1, chunk=128))
    >>> chunking(10_000, 512, powers_of_two=True), chunking(640, 512, powers_of_two=True)
    (Chunking(chunks=20, chunk=512), Chunking(chunks=5, chunk=128))
  """
  if chunk < WORD or chunk % WORD:
    raise ValueError(f"chunk must be a positive multiple of {WORD}, got {chunk!r}")
  if powers_of_two and chunk & (chunk - 1):
    raise ValueError(f"a rotated code's chunk must be a power of two (the "
                     f"Walsh-Hadamard transform's length), got {chunk!r}; try "
                     f"{1 << chunk.bit_length()} or {1 << (chunk.bit_length() - 1)}")
  length = max(int(length), 1)
  count = ceil_div(length, chunk)
  if powers_of_two:
    sizes = [WORD << i for i in range((chunk // WORD).bit_length())]
    return min((Chunking(ceil_div(length, size), size) for size in reversed(sizes)),
               key=lambda cut: cut.padded + SCALE_ENTRIES * cut.chunks)
  return Chunking(count, round_up(ceil_div(length, count), WORD))  # whole words


def wire_bytes(length: int, bits: int, chunk: int = CHUNK, *,
               powers_of_two: bool = False) -> int:
  """Bytes of one row's message of ``length`` entries: its codes and its scales."""
  cut = chunking(length, chunk, powers_of_two=powers_of_two)
  return 4 * cut.chunks * (cut.chunk * bits // WORD + 1)


def index_dtype(index_range: int) -> np.dtype:
  """The narrowest unsigned integer type holding positions ``0 .. range-1``.

  Args:
    index_range: number of distinct positions, at least 1.

  Returns:
    uint16 up to 65,536 positions, else uint32.

  Raises:
    ValueError: more positions than uint32 holds.

  Example:
    >>> index_dtype(65_536), index_dtype(65_537)
    (dtype('uint16'), dtype('uint32'))
  """
  if index_range <= 1 << 16:
    return np.dtype(np.uint16)
  if index_range <= 1 << 32:
    return np.dtype(np.uint32)
  raise ValueError(f"{index_range} positions do not fit 32-bit indices")


MIN_COMPRESSION = 2.0
"""Under ``algorithm="powersgd"`` a matrix goes low rank only where its rank-r
factors are at most half its size, ``(m + n) r <= m n / 2`` (PyTorch's
``min_compression_rate``); else dense."""


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
  """A leaf of ``shape`` as a matrix: all axes but the last by the last; None for a vector.

  Example:
    >>> matrix_shape((3, 3, 16, 32)), matrix_shape((32,))
    ((144, 32), None)
  """
  if len(shape) < 2:
    return None
  return math.prod(shape[:-1]), shape[-1]


def leaf_rank(shape: Sequence[int], rank: int) -> int:
  """The rank a leaf of ``shape`` is sent at: ``rank``, at most the matrix's smaller side."""
  m, n = matrix_shape(shape)
  return min(rank, m, n)


def compresses(shape: Sequence[int], rank: int, min_size: int) -> bool:
  """Whether a leaf of ``shape`` goes low rank (else dense).

  It must be a matrix of at least ``min_size`` elements whose factors are
  at most half its size (:data:`MIN_COMPRESSION`).

  Example:
    >>> compresses((1024, 1024), 4, 1024), compresses((1024, 3), 4, 1024)
    (True, False)
  """
  matrix = matrix_shape(shape)
  if matrix is None:
    return False
  m, n = matrix
  return (m * n >= max(min_size, 1)
          and (m + n) * leaf_rank(shape, rank) * MIN_COMPRESSION <= m * n)
