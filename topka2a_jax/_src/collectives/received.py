"""The owner's re-selection: exact top-k of a shard it holds only sparsely.

In TopKA2A's sparse second phase (:func:`exchanges.topka2a_sparse
<topka2a_jax._src.collectives.exchanges.topka2a_sparse>`) every owner sends
the ``k`` largest entries of its summed shard. That shard is zero except at
the positions the senders sent, ``P`` rows of ``k`` distinct positions each,
so the selection works on those ``P k`` positions instead of the whole
shard, and it is exact:

1. **Distinct positions.** A position several senders chose is listed once,
   where it last appears (a scatter of the list's order, keeping the
   largest, then a comparison).
2. **Threshold.** A bisection over the magnitudes' bit patterns (31
   counting passes over the ``P k`` listed keys) finds the smallest key
   ``t >= 1`` that at most ``k`` listed entries reach.
3. **Selection.** Every listed entry at or above ``t`` is taken, then the
   entries whose key is exactly ``t - 1`` (those tied at the boundary, or
   the listed zeros when fewer than ``k`` entries are nonzero) fill the
   remaining slots in list order: exactly ``k`` distinct positions, and
   their magnitudes are exact top-k's (ties may pick other positions of
   equal magnitude).

The search never reads the whole shard, so it costs a fraction of a
threshold selection over it, and it compiles into far fewer kernels.

Example:
  >>> shard = jnp.array([0.0, 3.0, 0.0, -5.0, 1.0, 0.0])
  >>> received = jnp.array([[1, 3], [3, 4]])  # two senders, two positions each
  >>> values, indices = jax.jit(top_of_received, static_argnums=2)(shard, received, 2)
  >>> sorted(indices[0].tolist()), sorted(values[0].tolist())
  ([1, 3], [-5.0, 3.0])
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from topka2a_jax._src.collectives.packed_flags import (
  MAX_KEY,
  at_least,
  count_set,
  pack,
  set_positions,
)
from topka2a_jax._src.collectives.top_k import top_magnitudes

KEY_BITS = 31
"""Bisection steps: one per bit of a key, so the threshold is exact."""


def top_of_received(shard: jax.Array, received: jax.Array,
                    k: int) -> tuple[jax.Array, jax.Array]:
  """Selects the ``k`` largest-magnitude entries of a shard known to be sparse.

  Args:
    shard: ``(n,)`` floating array, zero outside ``received``. Keys are
      float32 magnitudes, exact for 32-bit and narrower floats; wider ones
      sort exactly (:func:`~topka2a_jax._src.collectives.top_k.top_magnitudes`).
    received: int32 positions into ``shard``, shape ``(P, m)``, each row's
      distinct (every sender's selection), ``k <= m``.
    k: entries to select, at least 1.

  Returns:
    ``(values, indices)``, each ``(1, k)``: ``k`` distinct positions of
    ``shard``, in list order, and the entries there. Their magnitudes are
    the ``k`` largest of ``shard``.
  """
  if shard.dtype.itemsize > 4:
    return top_magnitudes(shard[None], k)
  length = shard.shape[0]
  positions = received.ravel()
  order = jnp.arange(1, positions.size + 1, dtype=jnp.int32)
  last = jnp.zeros(length, jnp.int32).at[positions].max(order, mode="drop")
  keys = lax.bitcast_convert_type(jnp.abs(shard[positions]).astype(jnp.float32),
                                  jnp.int32)
  # -1 for a repeat of a listed position: below every bound, never taken.
  listed = jnp.where(last[positions] == order, keys, -1)[None]

  indices = positions[top_of_keys(listed[0], k)]
  return shard[indices][None], indices[None]


def top_of_keys(keys: jax.Array, k: int) -> jax.Array:
  """The positions of the ``k`` largest of ``keys``, in list order, without a sort.

  Args:
    keys: ``(m,)`` int32 in [-1, 2^31): float32 magnitudes' bit patterns,
      or -1 for an entry never to take (unless fewer than ``k`` others exist).
    k: positions to return, ``1 <= k <= m``.

  Returns:
    ``(k,)`` int32 distinct positions into ``keys``: those of every key
    above the ``k``-th largest in list order, then those of the keys equal
    to it in list order (ties to the first listed).

  Example:
    >>> top_of_keys(jnp.array([3, -1, 7, 3, 0], jnp.int32), 2).tolist()
    [2, 0]
  """
  listed = keys[None]

  def halve(_, bracket):  # the smallest t >= 1 that at most k listed keys reach
    lo, hi = bracket
    mid = lo + (hi - lo) // 2
    few = count_set(pack(at_least(listed, mid))) <= k
    return jnp.where(few, lo, mid + 1), jnp.where(few, mid, hi)

  row = listed[:, 0]  # typed like the data, so the loop's carry is too
  t, _ = lax.fori_loop(0, KEY_BITS, halve,
                       (jnp.ones_like(row), jnp.full_like(row, MAX_KEY)))
  above = at_least(listed, t)
  tied = at_least(listed, t - 1) - above
  return set_positions([above, tied], k)[0]
