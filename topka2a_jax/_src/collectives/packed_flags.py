"""Flags packed 32 to a word, counted and compacted without a sort.

The threshold selection (``threshold.py``) and the owner's re-selection
(``received.py``) both end the same way: a 0/1 flag per entry says which
entries to take, and the first ``m`` set flags of every row become ``m``
positions. Summing int32 flags is slow on XLA's CPU backend (it writes
them out before a tree of windowed sums), so the flags are packed into
uint32 words (:func:`pack`) and counted with population counts
(:func:`count_set`). Two compactions place them:

* :func:`first_set`, for long rows, places words, not flags: a running count
  over the words (:func:`running_sum`), one small scatter that marks where
  each word's ones begin, and population counts find every slot's word and
  bit without a search. Its work grows with ``m``, not with the row.
* :func:`set_positions`, for rows a few times ``m``, lists the positions of
  every word's ones and scatters each word's list to its first slot: fewer
  kernels to compile, and its work grows with the row.

Example:
  >>> words = pack(jnp.array([[0, 1, 1, 0, 1]], jnp.int32))
  >>> count_set(words), first_set(words, 2)
  (Array([3], dtype=int32), Array([[1, 2]], dtype=int32))
  >>> set_positions([jnp.array([[0, 1, 1, 0, 1]]), jnp.array([[1, 0, 0, 0, 0]])], 3)
  Array([[1, 2, 4]], dtype=int32)
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from topka2a_jax._src.sizes import ceil_div

MAX_KEY = 0x7FFFFFFF
"""The largest key :func:`at_least` compares: a float32 magnitude's bit
pattern (sign cleared) is a key, monotonic in the magnitude."""


def at_least(keys: jax.Array, bound: jax.Array) -> jax.Array:
  """1 where ``keys >= bound`` (per row), else 0, as int32.

  Keys are in [-1, 2^31) and bounds in [0, 2^31), so ``bound - 1 - key``
  cannot overflow and its sign bit is the comparison, an integer that XLA
  packs and counts quickly.
  """
  return lax.shift_right_logical(bound[:, None] - 1 - keys, 31)


def pack(flags: jax.Array) -> jax.Array:
  """Packs 0/1 int32 ``flags`` (R, n) into (R, ceil(n / 32)) uint32 words.

  Flag ``i`` of a row is bit ``i % 32`` of word ``i // 32``. Counting through
  packed words is several times faster on XLA's CPU backend than summing the
  flags, which it materialises before a tree of windowed sums.
  """
  rows, length = flags.shape
  bits = jnp.pad(flags, ((0, 0), (0, -length % 32))).reshape(rows, -1, 32)
  return jnp.sum(bits.astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32),
                 axis=2)


def count_set(words: jax.Array) -> jax.Array:
  """Per row, how many bits of the packed ``words`` are set."""
  return jnp.sum(lax.population_count(words).astype(jnp.int32), axis=1)


_PREFIX_BLOCK = 128
_PREFIX_EXACT = 1 << 24  # float32 holds every integer below it exactly


def running_sum(counts: jax.Array, bound: int) -> jax.Array:
  """Inclusive running sums of non-negative int32 ``counts`` along the last axis.

  ``bound`` bounds every entry. The sums are blocks of 128 multiplied by a
  triangle of ones (float32 products, exact below 2^24), then the blocks'
  running totals the same way: far fewer operations to compile than XLA's
  cumulative sum, which it rewrites into a tree of windowed sums, and no
  slower to run. Sums that may reach 2^24 take the cumulative sum.

  Example:
    >>> running_sum(jnp.array([[3, 0, 2, 5]], jnp.int32), 5)
    Array([[ 3,  3,  5, 10]], dtype=int32)
  """
  if bound * counts.shape[-1] >= _PREFIX_EXACT:
    return jnp.cumsum(counts, axis=-1)
  return _float_running_sum(counts.astype(jnp.float32)).astype(jnp.int32)


def _float_running_sum(x: jax.Array) -> jax.Array:
  """:func:`running_sum` of float32 integers whose sums stay below 2^24."""
  length = x.shape[-1]
  if length <= _PREFIX_BLOCK:
    triangle = np.triu(np.ones((length, length), np.float32))
    return jnp.matmul(x, triangle, precision=lax.Precision.HIGHEST)
  blocks = ceil_div(length, _PREFIX_BLOCK)
  padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, blocks * _PREFIX_BLOCK - length)])
  within = _float_running_sum(padded.reshape(*x.shape[:-1], blocks, _PREFIX_BLOCK))
  totals = within[..., -1]
  before = _float_running_sum(totals) - totals  # what the earlier blocks hold
  summed = within + before[..., None]
  return summed.reshape(*x.shape[:-1], blocks * _PREFIX_BLOCK)[..., :length]


def first_set(words: jax.Array, m: int) -> jax.Array:
  """Positions of the first ``m`` set bits in every row of packed ``words``.

  A running count over the words (see :func:`pack`) gives the slot where
  each word's ones begin; a scatter marks those slots as bits, so
  that a running count of marks (32 times shorter than the slots) and a
  population count give every slot's word, and five halving steps of
  population counts find the bit in it. A row with fewer than ``m`` ones
  gets unspecified positions in its last slots.

  Example:
    >>> words = jax.jit(pack)(jnp.array([[0, 1, 1, 0, 1]], jnp.int32))
    >>> jax.jit(first_set, static_argnums=1)(words, 2)
    Array([[1, 2]], dtype=int32)
  """
  rows, num_words = words.shape
  ones = lax.population_count(words).astype(jnp.int32)
  nonzero = (ones > 0).astype(jnp.int32)
  through, nonzero_through = running_sum(jnp.stack([ones, nonzero]), 32)
  start = through - ones  # slot of each word's first one

  # Word index of the r-th word that holds a one.
  word_ids = jnp.broadcast_to(jnp.arange(num_words, dtype=jnp.int32), ones.shape)
  nonzero_words = jax.vmap(
      lambda rank, ids: jnp.zeros(num_words, jnp.int32).at[rank].set(
          ids, mode="drop"))(
              jnp.where(nonzero > 0, nonzero_through - 1, num_words), word_ids)

  # One bit per slot, set where a word's ones begin (starts are distinct).
  mark_words = ceil_div(m, 32)
  marks = jax.vmap(
      lambda at, bit: jnp.zeros(mark_words, jnp.uint32).at[at].add(
          bit, mode="drop"))(
              jnp.where((nonzero > 0) & (start < m), start // 32, mark_words),
              jnp.uint32(1) << (start % 32).astype(jnp.uint32))
  marked = lax.population_count(marks).astype(jnp.int32)
  before = running_sum(marked, 32) - marked
  shift = jnp.arange(32, dtype=jnp.uint32)
  through_bit = (jnp.uint32(2) << shift) - 1  # bits 0..shift (all 32 wrap)
  word_rank = (before[:, :, None] + lax.population_count(
      marks[:, :, None] & through_bit).astype(jnp.int32)).reshape(rows, -1)[:, :m] - 1
  word = jnp.take_along_axis(nonzero_words, jnp.clip(word_rank, 0, num_words - 1),
                             axis=1)

  rank = jnp.arange(1, m + 1, dtype=jnp.int32) - jnp.take_along_axis(
      start, word, axis=1)  # 1-based within the word
  return word * 32 + _bit_of_one(jnp.take_along_axis(words, word, axis=1), rank)


def _bit_of_one(value: jax.Array, rank: jax.Array) -> jax.Array:
  """The bit of the ``rank``-th (1-based) one of every uint32 ``value``.

  Five halving steps: population counts of the lower half of what is left
  say on which side the one lies. Where ``value`` holds fewer than
  ``rank`` ones, the bit is unspecified.
  """
  bit = jnp.zeros_like(rank)
  for width in (16, 8, 4, 2, 1):
    low = lax.population_count(
        (value >> bit.astype(jnp.uint32)) & jnp.uint32((1 << width) - 1)
    ).astype(jnp.int32)
    right = low < rank
    rank = jnp.where(right, rank - low, rank)
    bit = jnp.where(right, bit + width, bit)
  return bit


def set_positions(flag_sets: Sequence[jax.Array], m: int) -> jax.Array:
  """Positions of the first ``m`` set flags, one set after another.

  Every set flag of ``flag_sets[0]`` comes first, in position order, then
  those of ``flag_sets[1]``, and so on. A running count over the packed
  words of every set gives each word's first slot; five halving steps of
  population counts list the positions of each word's ones; one scatter
  then writes every word's list as a window of 32 slots at its first slot.
  A window's unused tail holds -1 and overlaps only later words' slots, so
  the scatter keeps the maximum. A row with fewer than ``m`` set flags gets
  unspecified positions in its last slots.

  Args:
    flag_sets: 0/1 int32 arrays, each ``(R, n)``; no position is set in two.
    m: slots per row.

  Returns:
    ``(R, m)`` int32 positions in ``[0, n)``.

  Example:
    >>> above = jnp.array([[0, 0, 1, 0]])
    >>> tied = jnp.array([[1, 0, 0, 1]])
    >>> jax.jit(set_positions, static_argnums=1)([above, tied], 2)
    Array([[2, 0]], dtype=int32)
  """
  rows = flag_sets[0].shape[0]
  words = jnp.stack([pack(flags) for flags in flag_sets])  # (sets, R, W)
  ones = lax.population_count(words).astype(jnp.int32)
  through = running_sum(ones, 32)
  totals = through[..., -1]
  earlier_sets = jnp.cumsum(totals, axis=0) - totals  # (sets, R): a handful
  first_slot = through - ones + earlier_sets[..., None]

  # The bit of every word's j-th one (j < 32; those past its ones are unused).
  bit = _bit_of_one(words[..., None], jnp.broadcast_to(
      jnp.arange(1, 33, dtype=jnp.int32), (*words.shape, 32)))
  word = jnp.arange(words.shape[-1], dtype=jnp.int32)[:, None]
  listed = jnp.where(jnp.arange(32) < ones[..., None], word * 32 + bit, -1)

  # Rows of m + 32 slots, so that a window starting before slot m fits.
  width = m + 32
  start = jnp.minimum(first_slot, m) + width * jnp.arange(rows, dtype=jnp.int32)[:, None]
  windows = lax.ScatterDimensionNumbers(
      update_window_dims=(1,), inserted_window_dims=(), scatter_dims_to_operand_dims=(0,))
  slots = lax.scatter_max(
      jnp.full(rows * width, -1, jnp.int32), start.reshape(-1, 1),
      listed.reshape(-1, 32), windows, mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)
  return slots.reshape(rows, width)[:, :m]
