"""The optimizer states of the library's transforms, as plain records.

Each transform's module builds and updates its state; the modules that lay
states out on a mesh (``_src/training/placement.py``) and save or restore them
(:mod:`topka2a_jax.checkpoint`) read these records only, so they need none of
the transforms.

Example:
  >>> state = TopKA2AState({"w": jnp.zeros((8, 4))}, jnp.int32(0), jnp.int32(0))
  >>> state.factors is None  # set by algorithm="powersgd" only
  True
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import optax


class TopKA2AState(NamedTuple):
  """State of :func:`topka2a_jax.topka2a`.

  Attributes:
    residuals: per device, not replicated. Mirrors the gradient pytree: for
      every sparsified leaf, what this device has not sent yet, shaped like
      its shard of the leaf (``(1,)`` for a scalar), float32 (float64 for
      float64 leaves); ``optax.MaskedNode()`` for leaves that go dense, and
      for all leaves when ``error_feedback=False``. Over a pair of data axes,
      only this device's slice of its shard, 1-D. As global arrays: one
      block per data index along dimension 0 (:func:`topka2a_jax.state_specs`).
    count: steps applied so far (int32, replicated); skipped steps do not
      count. ``warmup_steps`` compares against it.
    nonfinite_steps: steps skipped because some device's gradient held a NaN
      or an infinity (int32, replicated).
    factors: ``algorithm="powersgd"`` only (else None): mirrors the gradient
      pytree, each low-rank leaf's ``Q`` (``(n, rank)`` float32, replicated,
      warm-starting the next step; :func:`topka2a_jax.collectives.powersgd`), and
      ``optax.MaskedNode()`` for the leaves that go dense.
  """

  residuals: optax.Updates
  count: jax.Array
  nonfinite_steps: jax.Array
  factors: optax.Updates = None


class CompressedUpdatesState(NamedTuple):
  """State of :func:`topka2a_jax.compress_updates`.

  Attributes:
    exchange: the exchange's :class:`topka2a_jax.TopKA2AState`: residuals of
      the updates per device, counts replicated.
    inner: the inner optimizer's state, one copy per device: as global
      arrays, every leaf ``(P, *shape)`` split along dimension 0 by the data
      axis (and like its parameter over other mesh axes).
  """

  exchange: TopKA2AState
  inner: optax.OptState


class ShardedOptimizerState(NamedTuple):
  """State of :func:`topka2a_jax.sharded_optimizer`.

  Attributes:
    exchange: the exchange's :class:`topka2a_jax.TopKA2AState` (residuals
      per device, counts replicated).
    inner: the inner transform's state for this device's shards, every leaf
      per device: as global arrays, shape ``(P, *shard_shape)`` split along
      dimension 0 by the data axis.
  """

  exchange: TopKA2AState
  inner: optax.OptState


RESIDUAL, SHARD, REPLICA = "residual", "shard", "replica"
"""The kinds of per-device state: a residual (what one device has not sent),
one device's shard of :func:`topka2a_jax.sharded_optimizer`'s optimizer
state, or one device's copy of :func:`topka2a_jax.compress_updates`'
optimizer state."""

PER_DEVICE: dict[type, dict[str, str]] = {
    TopKA2AState: {"residuals": RESIDUAL},
    ShardedOptimizerState: {"inner": SHARD},
    CompressedUpdatesState: {"inner": REPLICA},
}
"""For each state, its per-device fields and their kind. Every other field
is replicated, or is itself one of these states (``exchange``)."""


def per_device_kind(state: NamedTuple, field: str) -> str | None:
  """The kind of per-device state ``field`` of ``state`` holds, or None.

  Example:
    >>> state = CompressedUpdatesState(TopKA2AState({}, 0, 0), ())
    >>> per_device_kind(state, "inner"), per_device_kind(state.exchange, "count")
    ('replica', None)
  """
  return PER_DEVICE.get(type(state), {}).get(field)
