"""Each bucket's exchange on one device: error feedback, the wire's clip, one collective.

Called by the step (``exchange_step.py``) inside ``jax.shard_map``, with the
step's buckets (:meth:`ExchangePlan.buckets`, planned by ``planner/``):

* every leaf's residual is added to its gradient (error feedback,
  :func:`exchange_buckets`; in float32 at least, :func:`accumulation_dtype`);
* each bucket's leaves are clipped to the wire's range (:func:`clipped_to_wire`),
  packed into one flat buffer (:func:`pack_bucket`) and sent by one collective
  of ``collectives/exchanges.py``, flat or two-level;
* what the collective left unsent, and what the clip held back, is the new
  residual, as this device's slice of each leaf over a pair of data axes
  (:func:`unsent_slices`).

The exchange ends at every leaf's whole mean (:data:`MEANS`,
:func:`exchange_buckets`), or at this device's owned shard of it
(:data:`OWNERS`, :func:`owner_buckets`, for the sharded optimizer);
PowerSGD's leaves go beside the buckets (:func:`exchange_low_rank`). Each
returns a :class:`Sent` record.

Example:
  >>> from topka2a_jax._src.options import Options
  >>> from topka2a_jax._src.transforms.exchange_plan import ExchangePlan
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> plan = ExchangePlan.create(Options.create(0.5, min_size=0), ["w"], [(4,)])
  >>> def one_bucket(grad, residual):
  ...   buckets = plan.buckets([grad[0]], 8)
  ...   sent = exchange_buckets(plan, buckets, [grad[0]], [residual[0]], sparse=True)
  ...   return sent.means[0], sent.residuals[0][None]
  >>> grads, zeros = jax.device_put(
  ...     (jnp.arange(32.0).reshape(8, 4), jnp.zeros((8, 4))),
  ...     NamedSharding(mesh, P("data")))
  >>> mean, residuals = jax.shard_map(
  ...     one_bucket, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data")))(grads, zeros)
  >>> bool(jnp.allclose(8 * mean + residuals.sum(0), grads.sum(0)))  # nothing lost
  True
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from topka2a_jax._src import layout
from topka2a_jax._src.axis import (
  DataAxis,
  bound_axis_size,
  grouped_by_varying_axes,
  vary_like,
)
from topka2a_jax._src.buffers import padded_rows, split_by_widths
from topka2a_jax._src.collectives import exchanges, low_rank, registry
from topka2a_jax._src.collectives.algorithms import ALGORITHMS, DENSE
from topka2a_jax._src.collectives.selection import get_selection
from topka2a_jax._src.planner.buckets import Bucket
from topka2a_jax._src.planner.cost import TWO_LEVEL
from topka2a_jax._src.planner.report import form_scope
from topka2a_jax._src.sizes import ceil_div

if TYPE_CHECKING:
  from topka2a_jax._src.transforms.exchange_plan import ExchangePlan


MEANS, OWNERS = "means", "owners"
"""Where a step's exchange ends: every leaf's whole mean, or this device's owned shard of it."""


class Sent(NamedTuple):
  """What one step's buckets delivered on this device, leaf by leaf.

  Attributes:
    means: every leaf's mean (whole, invariant along the axis), or this
      device's flat shard of it (:data:`OWNERS`, varying along the axis).
    residuals: every leaf's new residual (``optax.MaskedNode()`` where none
      is kept).
    factors: PowerSGD's new ``Q`` of every leaf (:func:`exchange_low_rank`);
      None for the other exchanges.
  """

  means: list
  residuals: list
  factors: list | None = None


def zeros_like_mean(grad: jax.Array, axis: DataAxis) -> jax.Array:
  """Zeros typed like the mean of ``grad``: invariant along the axis only."""
  return vary_like(jnp.zeros(grad.shape, grad.dtype), grad, drop=axis.names)


def pack_bucket(leaves: Sequence[jax.Array], dtype: jnp.dtype) -> jax.Array:
  """Concatenates the leaves, flattened and cast to ``dtype``, into one buffer.

  Args:
    leaves: the bucket's arrays, in packing order.
    dtype: the buffer's dtype.

  Returns:
    A 1-D array of the leaves' total size.
  """
  return jnp.concatenate([jnp.ravel(leaf).astype(dtype) for leaf in leaves])


def accumulation_dtype(dtype: jnp.dtype) -> jnp.dtype:
  """Gradient and residual are added in float32, or float64 for float64 leaves.

  It is the residuals' dtype too unless ``residual_dtype=`` says otherwise,
  so that nothing rounds away.
  """
  return jnp.promote_types(jnp.float32, dtype)


def _accumulator(grad: jax.Array, residual: Any, per_node: int,
                 inner_axis: Hashable, dtype: jnp.dtype) -> jax.Array:
  """``grad + residual`` as ``L`` slices of ``m`` entries: ``(L, m)``.

  The flattened leaf is zero-padded to ``L m``; this device's residual, one
  slice (or the whole leaf for ``L = 1``), is added to its own slice, row
  ``j`` for device ``j`` of the inner axis. None adds nothing (the leaf keeps
  no residual).
  """
  rows = padded_rows(jnp.ravel(grad).astype(dtype), per_node)
  if residual is None:
    return rows
  if per_node == 1:
    return rows + jnp.ravel(residual)[None]
  return exchanges.add_to_own_row(rows, inner_axis, jnp.ravel(residual))


def exchange_buckets(plan: ExchangePlan, buckets: Sequence[tuple[list[int], Bucket]],
                     grads: Sequence[jax.Array], residuals: Sequence[Any], sparse: bool,
                     send: jax.Array | None = None) -> Sent:
  """Means of ``grads + residuals`` over the axis, and the new residuals.

  Over a pair of data axes with ``L`` devices per node, every residual is
  this device's slice of its leaf (``_src/layout.py``). A bucket routed
  two-level packs its leaves slice by slice (slice ``j`` of the buffer holds
  slice ``j`` of every leaf), so what the outer exchange leaves unsent splits
  into the leaves' slices. A sparse bucket routed flat reduce-scatters what
  it leaves unsent inside the node, which puts each slice's node sum on the
  device that keeps it; nothing is lost either way. Sparse buckets send at
  most :meth:`ExchangePlan.wire_limit` per entry on every wire: each device's
  values are clipped to it (a node's sums, on the two-level route), the
  exchanges send means where they sum, and the excess waits in the residual.

  Args:
    plan: the trace's plan.
    buckets: :meth:`ExchangePlan.buckets` of ``grads``.
    grads: this device's gradient leaves.
    residuals: for every leaf, its residual (shaped like the leaf, ``(1,)``
      for a scalar, or its slice over a pair of axes) or
      ``optax.MaskedNode()`` where it keeps none.
    sparse: False sends every bucket dense (warm-up): nothing stays behind.
    send: a boolean scalar, the same on every device, or None (True). False
      sends nothing (a skipped step): the means are zero and every residual
      comes back as ``grads + residuals``.

  Returns:
    :class:`Sent`: the means, invariant along the axis, and the new
    residuals, leaf by leaf.
  """
  axis = plan.options.axis
  per_node = axis.per_node() or 1
  # Empty leaves: an empty mean, typed invariant along the axis like the others.
  means: list[jax.Array] = [g if g.size else zeros_like_mean(g, axis) for g in grads]
  new_residuals: list[Any] = [optax.MaskedNode()] * len(grads)
  for members, bucket in buckets:
    dtype = jnp.result_type(*(accumulation_dtype(grads[i].dtype) for i in members))
    keeps = [not isinstance(residuals[i], optax.MaskedNode) for i in members]
    sizes = [grads[i].size for i in members]
    widths = [layout.residual_slice(size, per_node) for size in sizes]
    rows = [_accumulator(grads[i], residuals[i] if keep else None, per_node,
                         axis.inner, dtype) for i, keep in zip(members, keeps)]
    algorithm = ALGORITHMS[bucket.algorithm] if sparse else DENSE
    limit = _sent_limit(plan, [grads[i].dtype for i in members], send) if (
        algorithm.sparse) else None
    with form_scope(algorithm.name):  # comm_report reads the form back
      if bucket.route == TWO_LEVEL:
        mean_pieces, unsent = _two_level_pieces(plan, algorithm, rows, sizes, widths,
                                                limit, send)
      else:
        mean_pieces, unsent = _flat_pieces(plan, algorithm, rows, sizes, widths, limit,
                                           send, any(keeps))
    for i, keep, mean, left in zip(members, keeps, mean_pieces, unsent):
      means[i] = mean.reshape(grads[i].shape).astype(grads[i].dtype)
      if keep:
        new_residuals[i] = left.reshape(residuals[i].shape).astype(residuals[i].dtype)
  return Sent(means, new_residuals)


def _two_level_pieces(plan: ExchangePlan, algorithm: Any, rows: list[jax.Array],
                      sizes: list[int], widths: list[int], limit: Any,
                      send: jax.Array | None) -> tuple[list, list]:
  """A bucket over a pair of axes, dense inside each node and ``algorithm`` between
  nodes, its leaves packed slice by slice: each leaf's mean and this device's
  unsent slice (what the outer exchange leaves is in slices already). Clipped
  where the node's sum is formed."""
  axis, options = plan.options.axis, plan.options
  per_node = axis.per_node()
  result = exchanges.two_level(
      jnp.concatenate(rows, axis=1).ravel(), axis.name, options.density,
      outer=registry.COLLECTIVES[algorithm.name], limit=limit,
      value_dtype=options.value_dtype, selection=options.selection, send=send)
  mean_pieces = [piece.ravel()[:size] for piece, size in zip(
      split_by_widths(result.mean.reshape(per_node, -1), widths), sizes)]
  return mean_pieces, split_by_widths(result.unsent, widths)


def _flat_pieces(plan: ExchangePlan, algorithm: Any, rows: list[jax.Array],
                 sizes: list[int], widths: list[int], limit: Any,
                 send: jax.Array | None, keeps: bool) -> tuple[list, list]:
  """A bucket over every device of the axis, packed leaf after leaf: each leaf's
  mean and this device's unsent slice (``keeps``: any leaf keeps a residual)."""
  axis, options = plan.options.axis, plan.options
  dtype = jnp.result_type(*rows)
  sent, held = clipped_to_wire([r.ravel()[:size] for r, size in zip(rows, sizes)], limit)
  result = registry.COLLECTIVES[algorithm.name](
      pack_bucket(sent, dtype), axis.name, options.density,
      value_dtype=options.value_dtype, selection=options.selection, send=send)
  # What the clip held back joins what was not sent, before a pair of data
  # axes sums it onto the devices keeping each slice.
  unsent = split_by_widths(result.unsent, sizes)
  if held is not None:
    unsent = [left + back for left, back in zip(unsent, held)]
  return split_by_widths(result.mean, sizes), unsent_slices(
      unsent, widths, axis.per_node() or 1, axis.inner, algorithm.sparse and keeps, send)


def _to_owners(plan: ExchangePlan, algorithm: Any, sent: jax.Array,
               send: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """One leaf's first phase: its few-bit codes, or TopKA2A's top-k of each shard,
  to the owners. This device's summed shard, and what it left unsent."""
  axis_name, options = plan.options.axis.name, plan.options
  with form_scope(algorithm.name):
    if algorithm.codes is not None:
      return exchanges.codes_to_owners(
          sent, axis_name, algorithm.codes.bits, chunk=algorithm.codes.chunk, send=send,
          rotated=algorithm.codes.rotated)
    phase = exchanges.to_owners(sent, axis_name, options.density, options.value_dtype,
                                get_selection(options.selection), send)
  return phase.owned, phase.unsent.reshape(-1)[: sent.size]


def owner_buckets(plan: ExchangePlan, buckets: Sequence[tuple[list[int], Bucket]],
                  grads: Sequence[jax.Array], residuals: Sequence[Any], sparse: bool,
                  send: jax.Array | None = None) -> Sent:
  """The exchange ended at the owners: this device's shard of each leaf's mean, and the residuals.

  The first phase of every bucket's exchange and no second one, for an
  optimizer that runs on the owned shards (:func:`topka2a_jax.sharded_optimizer`).
  Device ``i`` owns entries ``[i m, (i + 1) m)`` of every flattened leaf
  (``m = ceil(n / P)``), so every sparse bucket must be one leaf (a plan
  with ``fusion=1``): TopKA2A's top-k of each shard, or a few-bit code of
  every entry, to the owners, clipped to the wire's range as
  :func:`exchange_buckets` clips; the dense buckets reduce-scatter their
  leaves together, each padded to ``P`` rows. One data axis only.

  Args:
    plan: the trace's plan.
    buckets: :meth:`ExchangePlan.buckets` of ``grads``.
    grads: this device's gradient leaves.
    residuals: theirs, or ``optax.MaskedNode()``.
    sparse: False reduces every leaf densely (warm-up): nothing stays behind.
    send: as for :func:`exchange_buckets`: False sends nothing.

  Returns:
    :class:`Sent`: the flat mean shards, varying along the axis, and the
    new residuals, leaf by leaf.
  """
  axis_name = plan.options.axis.name
  num_devices = bound_axis_size(axis_name)
  shards: list[Any] = [vary_like(jnp.zeros(ceil_div(g.size, num_devices), g.dtype), g)
                       for g in grads]
  new: list[Any] = [optax.MaskedNode()] * len(grads)
  keeps = [not isinstance(r, optax.MaskedNode) for r in residuals]
  accs = [jnp.ravel(g).astype(accumulation_dtype(g.dtype))
          + (jnp.ravel(r) if keep else 0) for g, r, keep in zip(grads, residuals, keeps)]
  dense = []
  for members, bucket in buckets:
    algorithm = ALGORITHMS[bucket.algorithm] if sparse else DENSE
    if not algorithm.sparse:
      dense.extend(members)
      continue
    (i,) = members  # one leaf a bucket: its owned shard is a slice of it
    (sent,), held = clipped_to_wire([accs[i]], _sent_limit(plan, [grads[i].dtype], send))
    owned, unsent = _to_owners(plan, algorithm, sent, send)
    shards[i] = owned / num_devices
    if keeps[i]:
      left = unsent if held is None else unsent + held[0]
      new[i] = left.reshape(residuals[i].shape).astype(residuals[i].dtype)
  for group in grouped_by_varying_axes([accs[i] for i in dense]):
    members = [dense[j] for j in group]
    live = [accs[i] if send is None else jnp.where(send, accs[i], 0) for i in members]
    widths = [ceil_div(acc.size, num_devices) for acc in live]
    rows = jnp.concatenate([padded_rows(acc, num_devices) for acc in live], axis=1)
    with form_scope(DENSE.name):
      summed = jax.lax.psum_scatter(rows, axis_name, scatter_dimension=0, tiled=True)[0]
    for i, part in zip(members, split_by_widths(summed, widths)):
      shards[i] = part / num_devices
      if keeps[i]:  # all sent, unless nothing was
        left = jnp.zeros_like(accs[i]) if send is None else jnp.where(send, 0, accs[i])
        new[i] = left.reshape(residuals[i].shape).astype(residuals[i].dtype)
  return Sent(shards, new)


ENDS = {MEANS: exchange_buckets, OWNERS: owner_buckets}
"""Each end's exchange of the buckets:
``(plan, buckets, grads, residuals, sparse, send) -> Sent``."""


def _sent_limit(plan: ExchangePlan, dtypes: Sequence[Any], send: jax.Array | None) -> Any:
  """:meth:`ExchangePlan.wire_limit` of a bucket of ``dtypes``, none where nothing is sent."""
  limit = plan.wire_limit(dtypes)
  if limit is not None and send is not None:  # nothing sent: nothing to clip
    limit = jnp.where(send, limit, jnp.inf)
  return limit


def clipped_to_wire(values: Sequence[jax.Array], limit: Any
                    ) -> tuple[list[jax.Array], list[jax.Array] | None]:
  """Each of this device's ``values`` clipped to ``[-limit, limit]``, and what the clip held back.

  The first is what may go on the wire (:meth:`ExchangePlan.wire_limit`), the
  second waits in the residual, so that ``sent + held`` is ``values``
  exactly; with no limit nothing is held back (None). Every exchange that
  sends a leaf's values clips them here: the buckets of
  :func:`exchange_buckets` and of :func:`owner_buckets`.

  Args:
    values: arrays in a float dtype wide enough for the sum (the
      accumulation dtype).
    limit: the largest magnitude, a scalar (it may be traced), or None for
      no limit.

  Returns:
    ``(sent, held)``, array by array, or ``(values, None)``.

  Example:
    >>> sent, held = clipped_to_wire([jnp.array([7e4, -1.0])], 65504.0)
    >>> sent[0].tolist(), held[0].tolist()
    ([65504.0, -1.0], [4496.0, 0.0])
  """
  if limit is None:
    return list(values), None
  sent = [jnp.clip(v, -limit, limit) for v in values]
  return sent, [v - s for v, s in zip(values, sent)]


def low_rank_positions(factors: Sequence[Any]) -> list[int]:
  """The positions of the leaves that hold a PowerSGD factor (the others go dense)."""
  return [i for i, factor in enumerate(factors) if not isinstance(factor, optax.MaskedNode)]


def exchange_low_rank(plan: ExchangePlan, buckets: Sequence[tuple[list[int], Bucket]],
                       grads: Sequence[jax.Array], residuals: Sequence[Any],
                       factors: Sequence[Any], sparse: bool) -> Sent:
  """``algorithm="powersgd"``: the leaves holding a factor low rank, the rest dense.

  The leaves whose factor is an array go through :func:`low_rank.powersgd`;
  every other leaf goes through the dense ``buckets``, planned for the
  others alone. ``sparse=False`` (warm-up) sends the matrices dense as
  well, which empties their residuals and keeps their ``Q``.

  Returns:
    :class:`Sent`, its ``factors`` the new ``Q`` of every leaf.
  """
  low = low_rank_positions(factors)
  rest = [i for i in range(len(factors)) if i not in set(low)]
  means: list[Any] = [g if g.size else zeros_like_mean(g, plan.options.axis) for g in grads]
  new, new_factors = list(residuals), list(factors)
  rest_sent = exchange_buckets(plan, buckets, [grads[i] for i in rest],
                               [optax.MaskedNode()] * len(rest), sparse)
  for i, mean in zip(rest, rest_sent.means):
    means[i] = mean
  if not low:
    return Sent(means, new, new_factors)
  accumulators = []
  for i in low:
    acc = grads[i].astype(accumulation_dtype(grads[i].dtype))
    if not isinstance(residuals[i], optax.MaskedNode):
      acc = acc + residuals[i]
    accumulators.append(acc)
  with form_scope("powersgd" if sparse else DENSE.name):
    if sparse:
      low_means, left, made = low_rank.powersgd(
          accumulators, [factors[i] for i in low], plan.options.axis.name)
    else:
      low_means = jax.lax.pmean(accumulators, plan.options.axis.name)
      left = [jnp.zeros_like(acc) for acc in accumulators]
      made = [factors[i] for i in low]
  for i, mean, rest_left, factor in zip(low, low_means, left, made):
    means[i] = mean.astype(grads[i].dtype)
    if not isinstance(residuals[i], optax.MaskedNode):
      new[i] = rest_left.astype(residuals[i].dtype)
    new_factors[i] = factor
  return Sent(means, new, new_factors)


def unsent_slices(unsent: Sequence[jax.Array], widths: Sequence[int],
                  per_node: int, inner_axis: Hashable, sparse: bool,
                  send: jax.Array | None = None) -> list[jax.Array]:
  """What a flat exchange left unsent, as this device's slice of every leaf.

  With ``L > 1`` devices per node, the node's unsent entries are summed
  slice by slice onto the devices that keep them: one reduce-scatter over
  the inner axis for the bucket. ``sparse=False`` (a dense exchange, or no
  residual kept) sends nothing more: a dense exchange leaves nothing
  unsent, unless ``send`` is False (a skipped step), when each device's
  own slice, its residual, is all it holds.
  """
  if per_node == 1:
    return list(unsent)
  rows = [padded_rows(left, per_node) for left in unsent]
  if not sparse:
    zeros = [jnp.zeros((width,), left.dtype) for left, width in zip(unsent, widths)]
    if send is None:
      return zeros
    own = jax.lax.axis_index(inner_axis)
    return [jnp.where(send, zero, jax.lax.dynamic_index_in_dim(row, own, keepdims=False))
            for zero, row in zip(zeros, rows)]
  summed = jax.lax.psum_scatter(jnp.concatenate(rows, axis=1), inner_axis,
                                scatter_dimension=0, tiled=True)
  return split_by_widths(summed[0], widths)
