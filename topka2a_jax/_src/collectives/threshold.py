"""Top-k without a sort: a magnitude threshold found in a few passes.

Exact top-k sorts, which costs far more than the communication it saves on
large buffers. This selection (in the spirit of MSTopK) works on integer
keys, which XLA reduces and compares quickly, and reads the whole buffer
once; everything after that works on arrays a fraction of its size:

1. **Group maxima.** Each row is viewed as ``G ~ 24 k`` interleaved groups
   (fewer for dense selections, see :data:`GROUPS_PER_ENTRY`, and more for
   very sparse ones, so that no group exceeds 32 entries); group ``g``
   holds positions ``g, g + G, g + 2G, ...``. A key is the
   magnitude's bit pattern (monotonic in the magnitude for non-negative
   floats) with its lowest bits replaced by the position within the group,
   so one integer max per group yields both the group's largest magnitude
   and where it is. With 24 groups per selected entry, two large entries
   rarely share a group.
2. **Candidates.** A strided sample of the group keys gives a bound that
   about ``1.5 k`` keys reach; one counting pass checks that between ``k``
   and ``2 k`` do (should the sample mislead, counting passes bisect until
   they do), and the keys at or above it are compacted, in position order,
   into ``2 k`` candidate slots. Where ties leave more keys at the bound
   than slots (a background of exact zeros), the first slots' worth in
   position order are taken, and the check of step 5 sorts the row exactly
   if that left a larger entry out.
3. **Threshold.** Counting passes over the candidates, cheap at that size,
   narrow a bracket ``[lo, hi)`` so that at most ``k`` candidates reach
   ``hi`` and at least ``k`` reach ``lo``.
4. **Selection.** Every candidate at or above ``hi`` is taken, then the band
   ``[lo, hi)`` fills the remaining slots in position order, so exactly ``k``
   distinct, valid positions come out, whatever the ties (all zeros
   included).
5. **Check.** A group yields only its largest entry, so an input whose
   structure aligns with the groups' stride (a large column of a matrix
   whose width divides it) can hide many large entries. One more pass
   bounds exact top-k's mass; where the selection keeps less than 99% of
   it, or leaves out a nonzero entry while selecting zeros, the row sorts
   exactly instead (:func:`_falls_short`).

Both compactions (:func:`_first_set`) pack their flags 32 to a word and place
words, not flags: a running count over the words, one small scatter that
marks where each word's ones begin, and population counts find every slot's
word and bit without a search.

Rows too short to gain (under 16,384 entries), selections of more than a
quarter of a row, and dtypes other than 32-bit floats fall back to the exact
sort. Entries not selected stay in the residual like any others, so nothing
is lost: the selection only changes which entries wait.

Example:
  >>> rows = jax.random.normal(jax.random.key(0), (1, 20_000))
  >>> values, indices = jax.jit(threshold_magnitudes, static_argnums=1)(rows, 20)
  >>> exact = jax.lax.top_k(jnp.abs(rows), 20)[0].sum()
  >>> bool(jnp.abs(values).sum() > 0.99 * exact)  # of exact top-k's mass
  True

References:
  Shi et al. "Towards Scalable Distributed Training of Deep Learning on
  Public Cloud Clusters" (MSTopK: a threshold found by sampling and
  bisection instead of a sort). MLSys 2021.

  Lin, Han, Mao, Wang, Dally. "Deep Gradient Compression: Reducing the
  Communication Bandwidth for Distributed Training" (a sampled threshold;
  error feedback). ICLR 2018.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from topka2a_jax._src.collectives.selection import top_magnitudes
from topka2a_jax._src.sizes import ceil_div, round_up

GROUPS_PER_ENTRY = 24
"""Groups per selected entry: fewer, larger groups lose more mass to entries
that share a group with a larger one. Dense selections get fewer, so that
every group holds at least 2 entries."""

SAMPLE_SIZE = 4096
"""Group keys sampled per row to estimate the candidates' bound."""

CANDIDATES_PER_ENTRY = 2
"""Candidate slots per selected entry; the sampled bound aims at 1.5 k."""

BISECTIONS = 16
"""Counting passes over the candidates that narrow the threshold's bracket.
The band left between its bounds fills the last slots in position order;
sixteen halvings of the candidates' key range leave it too narrow to cost
measurable mass (``benchmarks/selection.py`` and the tests measure it)."""

MASS_KEPT = 0.99
"""Share of exact top-k's magnitude sum (a bound on it, found in one pass) a
row's selection must keep; a selection that may keep less sorts exactly
instead."""

_MIN_LENGTH = 4 * SAMPLE_SIZE  # shorter rows sort exactly
# XLA's CPU backend splits reductions over more than 32 entries into a tree,
# which writes the whole keyed buffer out first: several times slower. Sparse
# selections therefore get more groups rather than larger ones.
_MAX_PER_GROUP = 32
_MAX_KEY = 0x7FFFFFFF


def _at_least(keys: jax.Array, bound: jax.Array) -> jax.Array:
  """1 where ``keys >= bound`` (per row), else 0, as int32.

  Keys are in [-1, 2^31) and bounds in [0, 2^31), so ``bound - 1 - key``
  cannot overflow and its sign bit is the comparison, an integer that XLA
  packs and counts quickly.
  """
  return lax.shift_right_logical(bound[:, None] - 1 - keys, 31)


def _pack(flags: jax.Array) -> jax.Array:
  """Packs 0/1 int32 ``flags`` (R, n) into (R, ceil(n / 32)) uint32 words.

  Flag ``i`` of a row is bit ``i % 32`` of word ``i // 32``. Counting through
  packed words is several times faster on XLA's CPU backend than summing the
  flags, which it materialises before a tree of windowed sums.
  """
  rows, length = flags.shape
  bits = jnp.pad(flags, ((0, 0), (0, -length % 32))).reshape(rows, -1, 32)
  return jnp.sum(bits.astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32),
                 axis=2)


def _count(words: jax.Array) -> jax.Array:
  """Per row, how many bits of the packed ``words`` are set."""
  return jnp.sum(lax.population_count(words).astype(jnp.int32), axis=1)


_PREFIX_BLOCK = 128
_PREFIX_EXACT = 1 << 24  # float32 holds every integer below it exactly


def _running_sum(counts: jax.Array, bound: int) -> jax.Array:
  """Inclusive running sums of non-negative int32 ``counts`` along the last axis.

  ``bound`` bounds every entry. The sums are blocks of 128 multiplied by a
  triangle of ones (float32 products, exact below 2^24), then the blocks'
  running totals the same way: far fewer operations to compile than XLA's
  cumulative sum, which it rewrites into a tree of windowed sums, and no
  slower to run. Sums that may reach 2^24 take the cumulative sum.

  Example:
    >>> _running_sum(jnp.array([[3, 0, 2, 5]], jnp.int32), 5)
    Array([[ 3,  3,  5, 10]], dtype=int32)
  """
  length = counts.shape[-1]
  if bound * length >= _PREFIX_EXACT:
    return jnp.cumsum(counts, axis=-1)
  if length <= _PREFIX_BLOCK:
    triangle = np.triu(np.ones((length, length), np.float32))
    return jnp.matmul(counts.astype(jnp.float32), triangle,
                      precision=lax.Precision.HIGHEST).astype(jnp.int32)
  blocks = ceil_div(length, _PREFIX_BLOCK)
  padded = jnp.pad(counts, [(0, 0)] * (counts.ndim - 1) + [(0, blocks * _PREFIX_BLOCK
                                                             - length)])
  within = _running_sum(padded.reshape(*counts.shape[:-1], blocks, _PREFIX_BLOCK),
                        bound)
  totals = _running_sum(within[..., -1], bound * _PREFIX_BLOCK)
  before = jnp.concatenate([jnp.zeros_like(totals[..., :1]), totals[..., :-1]], -1)
  summed = within + before[..., None]
  return summed.reshape(*counts.shape[:-1], blocks * _PREFIX_BLOCK)[..., :length]


def _first_set(words: jax.Array, m: int) -> jax.Array:
  """Positions of the first ``m`` set bits in every row of packed ``words``.

  A running count over the words (see :func:`_pack`) gives the slot where
  each word's ones begin; a scatter marks those slots as bits, so
  that a running count of marks (32 times shorter than the slots) and a
  population count give every slot's word, and five halving steps of
  population counts find the bit in it. A row with fewer than ``m`` ones
  gets unspecified positions in its last slots.

  Example:
    >>> words = jax.jit(_pack)(jnp.array([[0, 1, 1, 0, 1]], jnp.int32))
    >>> jax.jit(_first_set, static_argnums=1)(words, 2)
    Array([[1, 2]], dtype=int32)
  """
  rows, num_words = words.shape
  ones = lax.population_count(words).astype(jnp.int32)
  nonzero = (ones > 0).astype(jnp.int32)
  through, nonzero_through = _running_sum(jnp.stack([ones, nonzero]), 32)
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
  before = _running_sum(marked, 32) - marked
  shift = jnp.arange(32, dtype=jnp.uint32)
  through_bit = (jnp.uint32(2) << shift) - 1  # bits 0..shift (all 32 wrap)
  word_rank = (before[:, :, None] + lax.population_count(
      marks[:, :, None] & through_bit).astype(jnp.int32)).reshape(rows, -1)[:, :m] - 1
  word = jnp.take_along_axis(nonzero_words, jnp.clip(word_rank, 0, num_words - 1),
                             axis=1)

  rank = jnp.arange(1, m + 1, dtype=jnp.int32) - jnp.take_along_axis(
      start, word, axis=1)  # 1-based within the word
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


def _group_keys(rows: jax.Array, groups: int, per_group: int) -> jax.Array:
  """``(R, groups)`` keys: each group's largest magnitude and where it is.

  Group ``g`` holds positions ``g + j * groups`` for ``j < per_group``, and
  also position ``per_group * groups + g`` if the row is that long (at most
  ``groups`` entries may be left over); its key is the largest magnitude's
  bit pattern with the low bits replaced by that ``j`` (``per_group`` for the
  leftover). Taking the leftover apart keeps XLA's CPU backend from padding
  the buffer, which it does by writing a copy.
  """
  num_rows = rows.shape[0]
  low_bits = per_group.bit_length()
  magnitude = lax.bitcast_convert_type(rows, jnp.int32) & jnp.int32(
      _MAX_KEY & ~((1 << low_bits) - 1))
  whole = per_group * groups
  keys = jnp.max(magnitude[:, :whole].reshape(num_rows, per_group, groups)
                 | jnp.arange(per_group, dtype=jnp.int32)[None, :, None], axis=1)
  leftover = magnitude[:, whole:] | per_group
  return keys.at[:, :leftover.shape[1]].max(leftover)


def _candidates(group_max: jax.Array, k: int,
                slots: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The group keys that a per-row bound lets through, packed as flags.

  The bound comes from a sample and aims at ``0.75 * slots`` keys; one
  count checks that between ``k`` and ``slots`` keys reach it. Rows where it
  fails bisect with further counts (ties may leave more than ``slots``).

  Returns:
    ``(bound, count, words)``: the bound, how many keys reach it, and their
    flags packed by :func:`_pack`.
  """
  groups = group_max.shape[1]
  stride = max(1, groups // SAMPLE_SIZE)
  sample = jnp.sort(group_max[:, ::stride], axis=1)
  wanted = 0.75 * slots * sample.shape[1] / groups
  lo = sample[:, max(0, sample.shape[1] - math.ceil(wanted) - 1)]
  words = _pack(_at_least(group_max, lo))
  count = _count(words)
  # Every key is >= 0, and there are at least k groups.
  lo = jnp.where(count >= k, lo, 0)
  words = lax.cond(jnp.all(count >= k), lambda: words,
                   lambda: _pack(_at_least(group_max, lo)))
  count = jnp.where(count >= k, count, groups)
  hi = jnp.full_like(lo, _MAX_KEY)

  def too_many(state):
    lo, hi, count, _, step = state
    return jnp.any((count > slots) & (hi - lo > 1)) & (step < 32)

  def bisect(state):
    lo, hi, count, words, step = state
    mid = lo + (hi - lo) // 2
    mid_words = _pack(_at_least(group_max, mid))
    mid_count = _count(mid_words)
    move = count > slots
    up = move & (mid_count >= k)
    return (jnp.where(up, mid, lo), jnp.where(move & ~up, mid, hi),
            jnp.where(up, mid_count, count),
            jnp.where(up[:, None], mid_words, words), step + 1)

  lo, _, count, words, _ = lax.while_loop(
      too_many, bisect, (lo, hi, count, words, 0))
  return lo, count, words


def _group_size(length: int, smallest: int) -> int:
  """Entries per group: ``smallest``, or a little more if that divides the row.

  Groups that tile the row exactly leave no entries over to merge into the
  keys afterwards, so the group maxima are one reduction over whole groups;
  a size up to 1.5 times ``smallest`` that divides ``length`` is taken for
  that, at the price of fewer groups.
  """
  largest = min(_MAX_PER_GROUP, smallest + smallest // 2)
  return next((size for size in range(smallest, largest + 1) if length % size == 0),
              smallest)


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
    >>> select = jax.jit(threshold_magnitudes, static_argnums=1)
    >>> values, indices = select(jnp.ones((1, 20_000)), 20)
    >>> indices.shape, len(set(indices[0].tolist()))  # ties: k distinct entries
    ((1, 20), 20)
  """
  _, length = rows.shape
  target = min(GROUPS_PER_ENTRY, length // (2 * k)) * k
  if length < _MIN_LENGTH or target < 2 * k or rows.dtype.itemsize != 4:
    return top_magnitudes(rows, k)
  per_group = _group_size(length, min(_MAX_PER_GROUP, ceil_div(length, target)))
  groups = length // per_group
  if groups * per_group < length and (
      length - per_group * (groups - groups % 32) <= groups - groups % 32):
    groups -= groups % 32  # whole words of flags: packing needs no padding
  group_max = _group_keys(rows, groups, per_group)

  slots = round_up(min(CANDIDATES_PER_ENTRY * k, groups), 32)
  bound, reached, words = _candidates(group_max, k, slots)
  # Group ids, valid up to `reached`: the first slots' worth in position
  # order. Where ties at the bound let more keys through than there are
  # slots (a background of exact zeros: embedding rows absent from the
  # batch, dead units, masked parameters), a key above the tie that comes
  # late may be crowded out; _falls_short then finds the row short and it
  # sorts exactly.
  candidate = _first_set(words, slots)
  keys = jnp.where(jnp.arange(slots) < reached[:, None],
                   jnp.take_along_axis(group_max, jnp.clip(candidate, 0, groups - 1),
                                       axis=1), -1)

  top = jnp.max(keys, axis=1)
  lo, hi = bound, jnp.where(top == _MAX_KEY, top, top + 1)

  def narrow(_, bracket):
    lo, hi = bracket
    mid = lo + (hi - lo) // 2
    enough = _count(_pack(_at_least(keys, mid))) >= k
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

  lo, hi = lax.fori_loop(0, BISECTIONS, narrow, (lo, hi))

  above = _at_least(keys, hi)
  band = _at_least(keys, lo) - above
  # Slots: the candidates above hi in position order, then the band's.
  picked = _first_set(_pack(jnp.concatenate([above, band], axis=1)), k)
  slot = jnp.where(picked >= slots, picked - slots, picked)
  group = jnp.take_along_axis(candidate, slot, axis=1)
  within = jnp.take_along_axis(keys, slot, axis=1) & jnp.int32(
      (1 << per_group.bit_length()) - 1)
  indices = within * groups + group
  values = jnp.take_along_axis(rows, indices, axis=1)
  return lax.cond(_falls_short(rows, values), lambda: top_magnitudes(rows, k),
                  lambda: (values, indices))


def _falls_short(rows: jax.Array, values: jax.Array) -> jax.Array:
  """Whether some row's selection may keep less than exact top-k would.

  A group yields its largest entry only, so entries that share a group with
  a larger one are never candidates; where a row's structure aligns with the
  groups' stride (a large column of a matrix whose width divides it), many
  do. One pass over the rows bounds what exact top-k keeps: with ``t`` the
  smallest selected magnitude, exact top-k's magnitude sum is at most
  ``k t + sum(max(|x| - t, 0))``. A row falls short where the selection
  keeps less than :data:`MASS_KEPT` of that bound, or where ``t`` is zero
  (fewer than ``k`` nonzero entries) and some nonzero entry is left out.
  """
  k = values.shape[1]
  magnitudes = jnp.abs(values).astype(jnp.float32)
  t = jnp.min(magnitudes, axis=1, keepdims=True)
  bound = k * t[:, 0] + jnp.sum(jnp.maximum(jnp.abs(rows) - t, 0.0), axis=1)
  short = jnp.any(jnp.sum(magnitudes, axis=1) < MASS_KEPT * bound)

  def nonzero_left_out():  # recomputes |rows|: an operand would be written out
    count = lambda m: jnp.sum(jnp.sign(jnp.abs(m)), axis=1)  # exact up to 2**24
    return jnp.any(count(rows) > count(values))

  return lax.cond(jnp.any(t == 0), lambda: short | nonzero_left_out(), lambda: short)
