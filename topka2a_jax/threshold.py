"""Top-k without a sort: a magnitude threshold found in a few passes.

Exact top-k sorts, which costs far more than the communication it saves on
large buffers. This selection (in the spirit of MSTopK) works on integer
keys, which XLA reduces and compares quickly, and touches the whole buffer
once:

1. **Group maxima.** Each row is viewed as ``G = 24 k`` interleaved groups
   (fewer for dense selections, see :data:`GROUPS_PER_ENTRY`); group ``g``
   holds positions ``g, g + G, g + 2G, ...``. A key is the
   magnitude's bit pattern (monotonic in the magnitude for non-negative
   floats) with its lowest bits replaced by the position within the group,
   so one integer max per group yields both the group's largest magnitude
   and where it is. With 24 groups per selected entry, two large entries
   rarely share a group.
2. **Threshold.** A strided sample of the group keys brackets the k-th
   largest (between 0.7 k and 1.3 k expected above; should the sample
   mislead, the bracket widens to all keys); a fixed number of counting
   passes over the group keys narrows the bracket ``[lo, hi)`` so that at
   most ``k`` keys reach ``hi`` and at least ``k`` reach ``lo``.
3. **Compaction.** Every group at or above ``hi`` is taken, then the band
   ``[lo, hi)`` fills the remaining slots in position order, so exactly ``k``
   distinct, valid positions come out, whatever the ties (all zeros
   included). The flags are packed into 32-bit words, so the running count
   and the binary search that place them in the ``k`` slots work on an
   array 32 times shorter.

Rows too short to gain (under 16,384 entries), selections of more than a
quarter of a row, and dtypes other than 32-bit floats fall back to the exact
sort. Entries not selected stay in the residual like any others, so nothing
is lost: the selection only changes which entries wait.

Example:
  >>> values, indices = threshold_magnitudes(rows, k)   # rows: (R, n)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from topka2a_jax.selection import top_magnitudes

GROUPS_PER_ENTRY = 24
"""Groups per selected entry: fewer, larger groups lose more mass to entries
that share a group with a larger one. Dense selections get fewer, so that
every group holds at least 2 entries."""

SAMPLE_SIZE = 4096
"""Group keys sampled per row to bracket the threshold."""

BISECTIONS = 4
"""Counting passes that narrow the bracket. The band left between its bounds
fills the last slots in position order; four halvings of the sampled
bracket leave it too narrow to cost measurable mass (``benchmarks/selection.py``
and the tests measure it), and each further pass costs about one pass over the
group keys."""

_MIN_LENGTH = 4 * SAMPLE_SIZE  # shorter rows sort exactly


def _at_least(keys: jax.Array, bound: jax.Array) -> jax.Array:
  """1 where ``keys >= bound`` (per row), else 0, in integer arithmetic.

  Keys and bounds are in [0, 2^31), so ``bound - 1 - key`` cannot overflow
  and its sign bit is the comparison. XLA vectorises this; a boolean compare
  and sum it does not.
  """
  return -((bound[:, None] - 1 - keys) >> 31)


def _first_set(flags: jax.Array, k: int) -> jax.Array:
  """Positions of the first ``k`` ones in every row of 0/1 ``flags``.

  Flags are packed 32 to a word (a shifted sum, which XLA vectorises), the
  words' population counts are summed cumulatively (32 times shorter than
  the flags), a binary search finds the word holding each of the first ``k``
  ones, and five halving steps of population counts find the bit in it.
  Rows must hold at least ``k`` ones.
  """
  rows, length = flags.shape
  bits = jnp.pad(flags, ((0, 0), (0, -length % 32))).reshape(rows, -1, 32)
  words = jnp.sum(bits.astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32), axis=2)
  ones = lax.population_count(words).astype(jnp.int32)
  through = jnp.cumsum(ones, axis=1)  # ones up to and including each word
  wanted = jnp.arange(1, k + 1, dtype=jnp.int32)
  word = jax.vmap(lambda t: jnp.searchsorted(t, wanted, method="scan_unrolled"))(
      through)
  rank = wanted - (jnp.take_along_axis(through, word, axis=1)
                   - jnp.take_along_axis(ones, word, axis=1))  # 1-based in word
  value = jnp.take_along_axis(words, word, axis=1)
  bit = jnp.zeros_like(rank)
  for width in (16, 8, 4, 2, 1):
    low = lax.population_count(
        (value >> bit.astype(jnp.uint32)) & jnp.uint32((1 << width) - 1)
    ).astype(jnp.int32)
    right = low < rank
    rank = jnp.where(right, rank - low, rank)
    bit = jnp.where(right, bit + width, bit)
  return word * 32 + bit


def threshold_magnitudes(rows: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Selects ``k`` large-magnitude entries of every row without sorting it.

  Args:
    rows: ``(R, n)`` floating array.
    k: entries per row, ``1 <= k <= n``.

  Returns:
    ``(values, indices)``, each ``(R, k)``: distinct valid positions (int32)
    and the entries there. Their magnitude sum is close to exact top-k's
    (``benchmarks/selection.py`` and the tests measure how close).

  Example:
    >>> values, indices = threshold_magnitudes(jnp.ones((2, 100_000)), 100)
  """
  num_rows, length = rows.shape
  groups = min(GROUPS_PER_ENTRY, length // (2 * k)) * k
  if length < _MIN_LENGTH or groups < 2 * k or rows.dtype.itemsize != 4:
    return top_magnitudes(rows, k)
  per_group = -(-length // groups)
  low_bits = max(1, (per_group - 1).bit_length())

  magnitude = lax.bitcast_convert_type(rows, jnp.int32) & jnp.int32(0x7FFFFFFF)
  keys = magnitude & jnp.int32(~((1 << low_bits) - 1))
  keys = jnp.pad(keys, ((0, 0), (0, per_group * groups - length)),
                 constant_values=-1)  # padding never wins a group
  keys = keys.reshape(num_rows, per_group, groups) | jnp.arange(
      per_group, dtype=jnp.int32)[None, :, None]
  group_max = jnp.max(keys, axis=1)  # (R, G): magnitude and position in group

  def count(bound: jax.Array) -> jax.Array:
    return jnp.sum(_at_least(group_max, bound), axis=1)

  stride = max(1, groups // SAMPLE_SIZE)
  sample = jnp.sort(group_max[:, ::stride], axis=1)
  expected = k * sample.shape[1] / groups
  hi = sample[:, sample.shape[1] - max(1, int(0.7 * expected))]
  lo = sample[:, max(0, sample.shape[1] - math.ceil(1.3 * expected) - 1)]
  lo = jnp.where(count(lo) >= k, lo, 0)  # every key is >= 0
  hi = jnp.where(count(hi) <= k, hi, jnp.int32(0x7FFFFFFF))

  def narrow(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    enough = count(mid) >= k
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

  lo, hi = lax.fori_loop(0, BISECTIONS, narrow, (lo, hi))

  above = _at_least(group_max, hi)
  band = _at_least(group_max, lo) - above
  # Slots: the groups above hi in position order, then the band's.
  found = _first_set(jnp.concatenate([above, band], axis=1), k)
  group = jnp.where(found >= groups, found - groups, found)
  within = jnp.take_along_axis(group_max, group, axis=1) & jnp.int32(
      (1 << low_bits) - 1)
  indices = within * groups + group
  return jnp.take_along_axis(rows, indices, axis=1), indices
