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

Both compactions, and every count, work on flags packed 32 to a word
(``packed_flags.py``).

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

from topka2a_jax._src.collectives.packed_flags import (
  MAX_KEY,
  at_least,
  count_set,
  first_set,
  pack,
  set_positions,
)
from topka2a_jax._src.collectives.top_k import top_magnitudes
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
measurable mass (the evidence page "Selection" and the tests measure it)."""

MASS_KEPT = 0.99
"""Share of exact top-k's magnitude sum (a bound on it, found in one pass) a
row's selection must keep; a selection that may keep less sorts exactly
instead."""

_MIN_LENGTH = 4 * SAMPLE_SIZE  # shorter rows sort exactly
# XLA's CPU backend splits reductions over more than 32 entries into a tree,
# which writes the whole keyed buffer out first: several times slower. Sparse
# selections therefore get more groups rather than larger ones.
_MAX_PER_GROUP = 32


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
      MAX_KEY & ~((1 << low_bits) - 1))
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
  fails bisect with further counts, between the bound and the largest key
  where more than ``slots`` reach it, between 0 (every key reaches it) and
  the bound where fewer than ``k`` do; ties may leave more than ``slots``.

  Returns:
    ``(bound, count, words)``: the bound, how many keys reach it, and their
    flags packed by :func:`_pack`.
  """
  groups = group_max.shape[1]
  stride = max(1, groups // SAMPLE_SIZE)
  sample = jnp.sort(group_max[:, ::stride], axis=1)
  wanted = 0.75 * slots * sample.shape[1] / groups
  lo = sample[:, max(0, sample.shape[1] - math.ceil(wanted) - 1)]
  words = pack(at_least(group_max, lo))
  count = count_set(words)
  # Every key is >= 0, so every group reaches 0; there are at least k groups.
  enough = count >= k
  every_group = np.full(words.shape[1], 0xFFFFFFFF, np.uint32)
  every_group[-1] >>= -groups % 32
  hi = jnp.where(enough, MAX_KEY, lo)
  lo = jnp.where(enough, lo, 0)
  words = jnp.where(enough[:, None], words, every_group)
  count = jnp.where(enough, count, groups)

  def too_many(state):
    lo, hi, count, _, step = state
    return jnp.any((count > slots) & (hi - lo > 1)) & (step < 32)

  def bisect(state):
    lo, hi, count, words, step = state
    mid = lo + (hi - lo) // 2
    mid_words = pack(at_least(group_max, mid))
    mid_count = count_set(mid_words)
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
    (the evidence page "Selection" and the tests measure how close).

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
  candidate = first_set(words, slots)
  keys = jnp.where(jnp.arange(slots) < reached[:, None],
                   jnp.take_along_axis(group_max, jnp.clip(candidate, 0, groups - 1),
                                       axis=1), -1)

  top = jnp.max(keys, axis=1)
  lo, hi = bound, jnp.where(top == MAX_KEY, top, top + 1)

  def narrow(_, bracket):
    lo, hi = bracket
    mid = lo + (hi - lo) // 2
    enough = count_set(pack(at_least(keys, mid))) >= k
    return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

  lo, hi = lax.fori_loop(0, BISECTIONS, narrow, (lo, hi))

  above = at_least(keys, hi)
  band = at_least(keys, lo) - above
  # Slots: the candidates above hi in position order, then the band's.
  slot = set_positions([above, band], k)
  group = jnp.take_along_axis(candidate, slot, axis=1)
  within = jnp.take_along_axis(keys, slot, axis=1) & jnp.int32(
      (1 << per_group.bit_length()) - 1)
  indices = within * groups + group
  values = jnp.take_along_axis(rows, indices, axis=1)
  # The rows are read as they come. Read through a flat view handed to the
  # conds, XLA wrote that view out first, a pass over every bucket, which
  # slowed the defaults' update on the link (the network evidence page).
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

  Args:
    rows: ``(R, n)``, the rows selected from.
    values: ``(R, k)``, the selection of every row.
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
