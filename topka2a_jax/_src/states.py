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

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
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


class RoundInFlight(NamedTuple):
  """The round of :func:`topka2a_jax.local_steps` whose exchange runs beside
  the next round's steps (``local_steps(..., overlap=...)``).

  Attributes:
    sent: every device's pseudo-gradient of that round (where its round
      started minus where it ended), laid out as
      :class:`LocalStepsState`'s ``offset``; the training step hands it to
      the exchange, whose mean the next round's end applies.
    start: every device's offset at the start of its current round: its own
      share of ``sent`` applied at once under the eager rule, zeros under
      the delayed one; laid out as ``sent``.
    pending: whether ``sent`` is in flight (False until the first round
      ends); bool, replicated.
    rounds: the rounds sent so far (int32, replicated).
  """

  sent: optax.Params
  start: optax.Params
  pending: jax.Array
  rounds: jax.Array


class LocalStepsState(NamedTuple):
  """State of :func:`topka2a_jax.local_steps`.

  Attributes:
    exchange: the exchange's :class:`topka2a_jax.TopKA2AState`: residuals of
      the pseudo-gradients per device, counts of rounds replicated.
    inner: the inner optimizer's state, one copy per device, kept across
      rounds: as global arrays, every leaf ``(P, *shape)`` split along
      dimension 0 by the data axis.
    offset: every device's local parameters minus the shared ones, laid out
      as ``inner``: zero at the start of each round.
    outer: the outer optimizer's state, replicated.
    step: the inner steps taken in this round so far (int32, replicated).
    every: the (first) round's length the state was made for (int32,
      replicated): a restore into a state made for another refuses it.
    skipped: the inner steps skipped in a row, as not finite, up to now
      (int32, replicated); after 8 in a row the round is dropped, and the
      next starts from the shared parameters.
    in_flight: with ``overlap``, the round whose exchange runs beside this
      one (:class:`RoundInFlight`); None where rounds exchange in line.
  """

  exchange: TopKA2AState
  inner: optax.OptState
  offset: optax.Params
  outer: optax.OptState
  step: jax.Array
  every: jax.Array
  skipped: jax.Array
  in_flight: RoundInFlight | None = None


class AccumulatedGradientsState(NamedTuple):
  """State of :func:`topka2a_jax.accumulate_gradients`.

  Attributes:
    inner: the wrapped optimizer's state (its exchange included), as it is
      after the last accumulated step.
    grads: every device's sum of the gradients of this accumulation's calls
      so far, in at least float32, laid out as :class:`LocalStepsState`'s
      ``inner``: every leaf ``(P, *shape)`` split along dimension 0 by the
      data axis.
    step: the calls added so far (int32, replicated).
    every: the calls per accumulated step the state was made for (int32,
      replicated): a restore into a state made for another refuses it.
  """

  inner: optax.OptState
  grads: optax.Updates
  step: jax.Array
  every: jax.Array


RESIDUAL, SHARD, REPLICA = "residual", "shard", "replica"
"""The kinds of per-device state: a residual (what one device has not sent),
one device's shard of :func:`topka2a_jax.sharded_optimizer`'s optimizer
state, or one device's copy of :func:`topka2a_jax.compress_updates`' or
:func:`topka2a_jax.local_steps`' optimizer state, of the latter's local
parameters, or of :func:`topka2a_jax.accumulate_gradients`' sums (on
another device count, every device starts from the mean of the copies: the
round's mean progress, the mean gradient so far, is kept)."""

PER_DEVICE: dict[type, dict[str, str]] = {
    TopKA2AState: {"residuals": RESIDUAL},
    ShardedOptimizerState: {"inner": SHARD},
    CompressedUpdatesState: {"inner": REPLICA},
    LocalStepsState: {"inner": REPLICA, "offset": REPLICA},
    RoundInFlight: {"sent": REPLICA, "start": REPLICA},
    AccumulatedGradientsState: {"grads": REPLICA},
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


def map_per_device(state: Any, per_device: Callable[[str, Any], Any],
                   other: Callable[[Any], Any], *,
                   by_field: dict[str, Callable[[Any], Any]] | None = None,
                   is_leaf: Callable[[Any], bool] | None = None) -> Any:
  """``state`` with every per-device field and every other node replaced, wherever the states sit.

  Args:
    state: any pytree holding the transforms' states.
    per_device: ``(kind, field's value) -> its replacement`` for every
      per-device field (:data:`PER_DEVICE`).
    other: ``node -> its replacement`` for every leaf outside those fields
      (and every node ``is_leaf`` stops at).
    by_field: ``value -> its replacement`` for other fields of the states,
      by name, where ``other`` leaf by leaf would not do.
    is_leaf: nodes to hand ``other`` whole.

  Example:
    >>> state = (TopKA2AState({"w": jnp.zeros(4)}, jnp.int32(0), jnp.int32(0)), ())
    >>> map_per_device(state, lambda kind, value: kind, lambda leaf: None)[0].residuals
    'residual'
  """
  by_field = by_field or {}

  def stop(node: Any) -> bool:
    return type(node) in PER_DEVICE or (is_leaf is not None and is_leaf(node))

  def visit(node: Any) -> Any:
    if type(node) not in PER_DEVICE:
      return other(node)
    fields = {}
    for field, value in zip(node._fields, node):
      kind = per_device_kind(node, field)
      if kind is not None:
        fields[field] = per_device(kind, value)
      elif field in by_field:
        fields[field] = by_field[field](value)
      else:
        fields[field] = jax.tree.map(visit, value, is_leaf=stop)
    return node._replace(**fields)

  return jax.tree.map(visit, state, is_leaf=stop)


def local_params(params: optax.Params, opt_state: Any) -> optax.Params:
  """The parameters this device trains at: the shared ``params`` plus its offset.

  Inside ``shard_map``, with the state of :func:`local_steps` anywhere in
  ``opt_state``; ``params`` as they are for any other optimizer. Take the
  gradient there.

  Raises:
    ValueError: ``params`` are not the parameters the state was made for, the
      call is outside ``shard_map`` (the state holds every device's offset),
      or ``opt_state`` holds more than one ``local_steps`` state.

  Example:
    >>> local_params({"w": jnp.ones(2)}, (optax.EmptyState(),))["w"]
    Array([1., 1.], dtype=float32)
  """
  is_local = lambda node: isinstance(node, LocalStepsState)
  found = [node for node in jax.tree.leaves(opt_state, is_leaf=is_local) if is_local(node)]
  if not found:
    return params
  if len(found) > 1:
    raise ValueError(f"local_params found {len(found)} local_steps states in opt_state; "
                     "local_steps is the whole optimizer, so a state holds one")
  offset = found[0].offset
  if jax.tree.structure(params) != jax.tree.structure(offset):
    raise ValueError(
        "local_params(params, opt_state): params are not the parameters opt_state was "
        f"made for (a pytree {jax.tree.structure(params)}, where local_steps' state "
        f"holds offsets of {jax.tree.structure(offset)}); pass the shared parameters "
        "the step holds")
  for path, p, o in zip(jax.tree_util.tree_leaves_with_path(params),
                        jax.tree.leaves(params), jax.tree.leaves(offset)):
    if o.shape[1:] != np.shape(p):
      raise ValueError(f"local_params: parameter {jax.tree_util.keystr(path[0])} has shape "
                       f"{np.shape(p)}, its offset in opt_state {o.shape[1:]}; pass the "
                       "shared parameters the state was made for")
    if o.shape[0] != 1:
      raise ValueError(
          f"local_params is called outside shard_map: opt_state holds every device's "
          f"offset ({o.shape[0]} of them at {jax.tree_util.keystr(path[0])}), and each "
          "device trains at its own. Call it inside your shard_map step, where the "
          "state is this device's block (topka2a_jax.state_specs(state) lays it out), "
          "or use topka2a_jax.train_step, which does")
  return jax.tree.map(lambda p, o: (p + o[0]).astype(p.dtype), params, offset)


def holds_exchange(state: Any) -> bool:
  """Whether an optimizer state holds a :class:`topka2a_jax.TopKA2AState` anywhere.

  Example:
    >>> holds_exchange(optax.adam(1e-3).init({"w": jnp.zeros(2)}))
    False
  """
  is_exchange = lambda node: isinstance(node, TopKA2AState)
  return any(map(is_exchange, jax.tree.leaves(state, is_leaf=is_exchange)))
