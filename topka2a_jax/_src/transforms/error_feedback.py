"""One device's step of the transform: buckets, their collectives, and the switches.

Called inside ``jax.shard_map`` on this device's gradient leaves (its shards,
where the parameters are sharded over other mesh axes) and residuals:

* :func:`plan` fuses the leaves into buckets (``planner/buckets.py``), planned by
  the cost model (``planner/fusion.py``);
* :func:`exchange_buckets` adds every leaf's residual (error feedback),
  packs each bucket into one flat buffer (:func:`pack_bucket`), runs its
  collective (``collectives/exchanges.py``) and returns the
  means and what stays behind;
* :func:`step` wraps that in the two run-time switches of the one compiled
  step: a step with a non-finite gradient anywhere is skipped everywhere
  (``nonfinite.py``), and the first ``warmup_steps`` go dense.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> options = Options.create(0.5, min_size=0)
  >>> def one_step(grad, residual):
  ...   zero = jnp.zeros((), jnp.int32)
  ...   means, residuals, count, skipped = step(
  ...       options, [grad[0]], [residual[0]], zero, zero, bad=None)
  ...   return means[0], residuals[0][None], count
  >>> grads, zeros = jax.device_put(
  ...     (jnp.arange(32.0).reshape(8, 4), jnp.zeros((8, 4))),
  ...     NamedSharding(mesh, P("data")))
  >>> mean, residuals, count = jax.shard_map(
  ...     one_step, mesh=mesh, in_specs=P("data"),
  ...     out_specs=(P(), P("data"), P()))(grads, zeros)
  >>> bool(jnp.allclose(8 * mean + residuals.sum(0), grads.sum(0))), int(count)
  (True, 1)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from topka2a_jax._src import layout
from topka2a_jax._src.axis import (
  DataAxis,
  bound_axis_size,
  grouped_by_varying_axes,
  vary_like,
  varying_axes,
)
from topka2a_jax._src.collectives import exchanges, low_rank
from topka2a_jax._src.collectives.algorithms import ALGORITHMS, DENSE
from topka2a_jax._src.options import Options
from topka2a_jax._src.planner import buckets
from topka2a_jax._src.planner.cost import TWO_LEVEL
from topka2a_jax._src.planner.fusion import step_model
from topka2a_jax._src.transforms.nonfinite import (
  applied_or_skipped,
  counted,
  step_is_bad,
)


def pack_bucket(leaves: Sequence[jax.Array], dtype: jnp.dtype) -> jax.Array:
  """Concatenates the leaves, flattened and cast to ``dtype``, into one buffer.

  Args:
    leaves: the bucket's arrays, in packing order.
    dtype: the buffer's dtype.

  Returns:
    A 1-D array of the leaves' total size.
  """
  return jnp.concatenate([jnp.ravel(leaf).astype(dtype) for leaf in leaves])


def unpack_bucket(buffer: jax.Array, sizes: Sequence[int]) -> list[jax.Array]:
  """Splits a flat buffer back into consecutive 1-D pieces of ``sizes``.

  Args:
    buffer: what :func:`pack_bucket` made (or a buffer of the same length).
    sizes: element count of every piece, in packing order.

  Returns:
    The pieces, flat; reshape them to the leaves' shapes.
  """
  pieces, start = [], 0
  for size in sizes:
    pieces.append(buffer[start : start + size])
    start += size
  return pieces


def residual_dtype(dtype: jnp.dtype) -> jnp.dtype:
  """Residuals are float32, or float64 for float64 leaves: nothing rounds away."""
  return jnp.promote_types(jnp.float32, dtype)


def plan(options: Options, sizes: Sequence[int],
         num_devices: int) -> list[buckets.Bucket]:
  """The buckets for leaves of ``sizes``, as the planner or ``fusion`` sets them."""
  model = step_model(sizes, num_devices, options.density,
                     network=options.outer_network(), cluster=options.cluster(),
                     min_size=options.min_size,
                     backward_seconds=options.backward_seconds,
                     value_bytes=options.value_bytes,
                     residual_slices=options.error_feedback,
                     whole_selection=options.whole_selection)
  threshold = (model.best_threshold(options.algorithm) if options.fusion == "auto"
               else options.fusion)
  return [planned.bucket for planned in model.layout(options.algorithm, threshold)]


def _buckets(options: Options, grads: Sequence[jax.Array],
             num_devices: int) -> list[tuple[list[int], buckets.Bucket]]:
  """The planned buckets with their leaf positions, empty leaves left out.

  Leaves that differ across other mesh axes (shards of a parameter split
  over ``"model"``) never share a bucket with leaves that do not (a
  parameter replicated over it): a replicated leaf then gets the same
  update on every device of those axes.
  """
  nonempty = [i for i, grad in enumerate(grads) if grad.size > 0]
  groups = [[nonempty[j] for j in group] for group in
            grouped_by_varying_axes([grads[i] for i in nonempty])]
  return [([live[j] for j in bucket.leaves], bucket)
          for live in groups
          for bucket in plan(options, [grads[i].size for i in live], num_devices)]


def _accumulator(grad: jax.Array, residual: Any, per_node: int,
                 inner_axis: Hashable, dtype: jnp.dtype) -> jax.Array:
  """``grad + residual`` as ``L`` slices of ``m`` entries: ``(L, m)``.

  The flattened leaf is zero-padded to ``L m``; this device's residual, one
  slice (or the whole leaf for ``L = 1``), is added to its own slice, row
  ``j`` for device ``j`` of the inner axis. None adds nothing (the leaf keeps
  no residual).
  """
  flat = jnp.ravel(grad).astype(dtype)
  width = layout.residual_slice(flat.size, per_node)
  rows = jnp.pad(flat, (0, per_node * width - flat.size)).reshape(per_node, width)
  if residual is None:
    return rows
  if per_node == 1:
    return rows + jnp.ravel(residual)[None]
  return exchanges.add_to_own_row(rows, inner_axis, jnp.ravel(residual))


def wire_limit(options: Options, dtypes: Sequence[jnp.dtype]) -> float | None:
  """The largest magnitude a sparse bucket of ``dtypes`` may send, or None.

  What a device sends must fit the values' wire dtype (``value_dtype``:
  float16 ends at 65,504, float8_e4m3fn at 448) and, once averaged, the
  leaves' own dtype (a float16 parameter's mean update). Error feedback's
  bursts, many steps' gradients summed, can exceed both; they are clipped
  to this limit and the excess stays in the residual.
  """
  wire = [*dtypes, *([options.value_dtype] if options.value_dtype is not None else [])]
  limit = min(float(jnp.finfo(dtype).max) for dtype in wire)
  return None if limit >= float(jnp.finfo(jnp.float32).max) else limit


def _split_columns(rows: jax.Array, widths: Sequence[int]) -> list[jax.Array]:
  """``(L, sum of widths)`` split into ``(L, width)`` pieces, left to right."""
  return [rows[:, start - width:start]
          for start, width in zip(itertools.accumulate(widths), widths)]


def exchange_buckets(options: Options, grads: Sequence[jax.Array],
                     residuals: Sequence[Any], sparse: bool,
                     send: jax.Array | None = None) -> tuple[list, list]:
  """Means of ``grads + residuals`` over the axis, and the new residuals.

  Over a pair of data axes with ``L`` devices per node, every residual is
  this device's slice of its leaf (``_src/layout.py``). A bucket routed
  two-level packs its leaves slice by slice (slice ``j`` of the buffer holds
  slice ``j`` of every leaf), so what the outer exchange leaves unsent splits
  into the leaves' slices. A sparse bucket routed flat reduce-scatters what
  it leaves unsent inside the node, which puts each slice's node sum on the
  device that keeps it; nothing is lost either way. Sparse buckets send at
  most :func:`wire_limit` per entry on every wire: each device's values are
  clipped to it (a node's sums, on the two-level route), the exchanges send
  means where they sum, and the excess waits in the residual.

  Args:
    options: the transform's options.
    grads: this device's gradient leaves.
    residuals: for every leaf, its residual (shaped like the leaf, ``(1,)``
      for a scalar, or its slice over a pair of axes) or
      ``optax.MaskedNode()`` where it keeps none; for a leaf that goes low
      rank, a ``low_rank.Carry``.
    sparse: False sends every bucket dense (warm-up): nothing stays behind.
    send: a boolean scalar, the same on every device, or None (True). False
      sends nothing (a skipped step): the means are zero and every residual
      comes back as ``grads + residuals``.

  Returns:
    ``(means, new residuals)``, leaf by leaf; the means are invariant along
    the axis.
  """
  if options.is_low_rank:
    return _exchange_low_rank(options, grads, residuals, sparse)
  num_devices = bound_axis_size(options.axis_name)
  per_node = options.axis.per_node() or 1
  inner_axis = options.axis.inner
  # Empty leaves: an empty mean, typed invariant along the axis like the others.
  means: list[jax.Array] = [g if g.size else _zeros_like_mean(g, options.axis)
                            for g in grads]
  new_residuals: list[Any] = [optax.MaskedNode()] * len(grads)
  for members, bucket in _buckets(options, grads, num_devices):
    dtype = jnp.result_type(*(residual_dtype(grads[i].dtype) for i in members))
    keeps = [options.keeps_residual(grads[i].size) for i in members]
    sizes = [grads[i].size for i in members]
    widths = [layout.residual_slice(size, per_node) for size in sizes]
    rows = [_accumulator(grads[i], residuals[i] if keep else None, per_node,
                         inner_axis, dtype) for i, keep in zip(members, keeps)]
    algorithm = ALGORITHMS[bucket.algorithm] if sparse else DENSE
    limit = wire_limit(options, [grads[i].dtype for i in members])
    if not algorithm.sparse:
      limit = None
    elif limit is not None and send is not None:  # nothing sent: nothing to clip
      limit = jnp.where(send, limit, jnp.inf)
    options_kw = {"value_dtype": options.value_dtype, "selection": options.selection,
                  "send": send}
    if bucket.route == TWO_LEVEL:  # clipped where the node's sum is formed
      result = exchanges.two_level(
          jnp.concatenate(rows, axis=1).ravel(), options.axis_name, options.density,
          outer=exchanges.COLLECTIVES[algorithm.name], limit=limit, **options_kw)
      mean_pieces = [piece.ravel()[:size] for piece, size in zip(
          _split_columns(result.mean.reshape(per_node, -1), widths), sizes)]
      unsent = unpack_bucket(result.unsent, widths)
    else:
      flat = [r.ravel()[:size] for r, size in zip(rows, sizes)]
      sent = flat if limit is None else [jnp.clip(f, -limit, limit) for f in flat]
      result = exchanges.COLLECTIVES[algorithm.name](
          pack_bucket(sent, dtype), options.axis_name, options.density, **options_kw)
      mean_pieces = unpack_bucket(result.mean, sizes)
      unsent = unpack_bucket(result.unsent, sizes)
      if limit is not None:  # what the clip held back joins what was not sent,
        # before a pair of data axes sums it onto the devices keeping each slice
        unsent = [left + whole - clipped
                  for left, whole, clipped in zip(unsent, flat, sent)]
      unsent = unsent_slices(unsent, widths, per_node, inner_axis,
                             algorithm.sparse and any(keeps), send)
    for i, keep, mean, left in zip(members, keeps, mean_pieces, unsent):
      means[i] = mean.reshape(grads[i].shape).astype(grads[i].dtype)
      if keep:
        new_residuals[i] = left.reshape(residuals[i].shape).astype(residuals[i].dtype)
  return means, new_residuals


def _exchange_low_rank(options: Options, grads: Sequence[jax.Array],
                       residuals: Sequence[Any], sparse: bool) -> tuple[list, list]:
  """:func:`exchange_buckets` for ``algorithm="powersgd"``: matrices low rank, the rest dense.

  The leaves whose state is a :class:`low_rank.Carry` go through
  :func:`low_rank.powersgd`; every other leaf goes through the dense
  buckets. ``sparse=False`` (warm-up) sends the matrices dense as well,
  which empties their residuals and keeps their ``Q``.
  """
  low = [i for i, carry in enumerate(residuals) if isinstance(carry, low_rank.Carry)]
  rest = sorted(set(range(len(grads))) - set(low))
  means: list[Any] = [g if g.size else _zeros_like_mean(g, options.axis) for g in grads]
  new: list[Any] = list(residuals)
  dense_options = dataclasses.replace(options, algorithm=DENSE.name, rank=None)
  rest_means, _ = exchange_buckets(dense_options, [grads[i] for i in rest],
                           [optax.MaskedNode()] * len(rest), sparse)
  for i, mean in zip(rest, rest_means):
    means[i] = mean
  if not low:
    return means, new
  carries = [residuals[i] for i in low]
  accumulators = []
  for i, carry in zip(low, carries):
    acc = grads[i].astype(residual_dtype(grads[i].dtype))
    if not isinstance(carry.residual, optax.MaskedNode):
      acc = acc + carry.residual
    accumulators.append(acc)
  if sparse:
    low_means, left, factors = low_rank.powersgd(
        accumulators, [carry.factor for carry in carries], options.axis_name)
  else:
    low_means = jax.lax.pmean(accumulators, options.axis_name)
    left = [jnp.zeros_like(acc) for acc in accumulators]
    factors = [carry.factor for carry in carries]
  for i, carry, mean, rest_left, factor in zip(low, carries, low_means, left, factors):
    means[i] = mean.astype(grads[i].dtype)
    kept = (carry.residual if isinstance(carry.residual, optax.MaskedNode)
            else rest_left.astype(carry.residual.dtype))
    new[i] = low_rank.Carry(kept, factor)
  return means, new


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
  rows = [jnp.pad(left, (0, per_node * width - left.size)).reshape(per_node, width)
          for left, width in zip(unsent, widths)]
  if not sparse:
    zeros = [jnp.zeros((width,), left.dtype) for left, width in zip(unsent, widths)]
    if send is None:
      return zeros
    own = jax.lax.axis_index(inner_axis)
    return [jnp.where(send, zero, jax.lax.dynamic_index_in_dim(row, own, keepdims=False))
            for zero, row in zip(zeros, rows)]
  summed = jax.lax.psum_scatter(jnp.concatenate(rows, axis=1), inner_axis,
                                scatter_dimension=0, tiled=True)
  return unpack_bucket(summed[0], widths)


def _zeros_like_mean(grad: jax.Array, axis: DataAxis) -> jax.Array:
  """Zeros typed like the mean of ``grad``: invariant along the axis only."""
  return vary_like(jnp.zeros(grad.shape, grad.dtype), grad, drop=axis.names)


def dense_while_warming_up(options: Options, count: jax.Array, run: Any,
                           *args: Any) -> Any:
  """``run(*args, sparse=False)`` while ``count < warmup_steps``, else ``sparse=True``.

  A run-time switch (``lax.cond``): the compiled step holds both branches.
  """
  if options.warmup_steps == 0:
    return run(*args, sparse=True)
  return jax.lax.cond(count < options.warmup_steps,
                      functools.partial(run, sparse=False),
                      functools.partial(run, sparse=True), *args)


def _applied(options: Options, grads: list, residuals: list,
             count: jax.Array) -> tuple[list, list, jax.Array]:
  """The exchange, dense while ``count < warmup_steps``; one more applied step."""
  run = functools.partial(exchange_buckets, options)
  means, new = dense_while_warming_up(options, count, run, grads, residuals)
  return means, new, optax.safe_increment(count)


def _applied_or_held(options: Options, bad: jax.Array, grads: list, residuals: list,
                     count: jax.Array) -> tuple[list, list, jax.Array]:
  """:func:`_applied`, or a skipped step where ``bad``, without a branch.

  On a bad step every device's gradient counts as zero and the collectives
  send nothing (``send=False``), so the means are zero and every residual
  comes back as it was; the count stays. The selection and the collectives
  run either way. A ``lax.cond`` between the two steps would keep each
  branch's outputs apart and copy every residual out of it on every step,
  a full pass over the model that this avoids, and the residuals are
  updated in place.
  """
  live = [jnp.where(bad, jnp.zeros_like(g), g) for g in grads]
  run = functools.partial(exchange_buckets, options, send=jnp.logical_not(bad))
  means, new = dense_while_warming_up(options, count, run, live, residuals)
  return means, new, counted(count, jnp.logical_not(bad))


def _skipped(options: Options, grads: list, residuals: list,
             count: jax.Array) -> tuple[list, list, jax.Array]:
  """Zero updates; residuals and count as they were."""
  zeros = [_zeros_like_mean(g, options.axis) for g in grads]
  return zeros, residuals, count


def _may_overflow(options: Options, grads: Sequence[jax.Array]) -> bool:
  """Whether a step's means can come out non-finite from finite gradients.

  Leaves or wire values narrower than float32 can (:func:`wire_limit`), and
  so can the exchanges that send few-bit codes: their owners add ``P``
  decoded shards, whose sum overflows from finite values near float32's
  largest.
  """
  entry = ALGORITHMS.get(options.algorithm)
  return (any(wire_limit(options, [g.dtype]) is not None for g in grads)
          or (entry is not None and entry.quantizes))


def step(options: Options, grads: list, residuals: list, count: jax.Array,
         nonfinite_steps: jax.Array, bad: jax.Array | None
         ) -> tuple[list, list, jax.Array, jax.Array]:
  """One applied or skipped step of the transform on this device.

  Args:
    options: the transform's options.
    grads: this device's gradient leaves.
    residuals: their residuals (``optax.MaskedNode()`` where none is kept).
    count: applied steps so far.
    nonfinite_steps: skipped steps so far.
    bad: whether some device's gradient is non-finite, decided already by
      :func:`topka2a_jax.skip_nonfinite`; None to decide here (when
      ``options.skip_nonfinite``). With a decision, a step whose means come
      out non-finite (an overflow, :func:`_may_overflow`) is skipped too.

  Returns:
    ``(means, residuals, count, nonfinite_steps)`` after the step.
  """
  bad = step_is_bad(bad, grads, options.axis_name, options.skip_nonfinite)
  if bad is not None and not options.is_low_rank:
    means, new, new_count = _applied_or_held(options, bad, grads, residuals, count)
  else:  # PowerSGD's factors move on zeros too: its skipped step is a branch
    means, new, new_count = applied_or_skipped(
        bad, functools.partial(_applied, options), functools.partial(_skipped, options),
        grads, residuals, count)
  if bad is None:
    return means, new, new_count, nonfinite_steps
  if not _may_overflow(options, grads):
    return means, new, new_count, counted(nonfinite_steps, bad)
  # The means may overflow from finite inputs. They are identical on every
  # device, so every device decides alike.
  broke = jnp.zeros((), bool)
  for mean in means:
    if mean.size:
      broke = broke | jnp.any(~jnp.isfinite(mean))
  shards = tuple(sorted(varying_axes(broke), key=str))  # pieces over "model"
  if shards:
    broke = jax.lax.pmax(broke.astype(jnp.int32), shards) > 0
  keep = lambda old, made: jax.tree.map(lambda o, m: jnp.where(broke, o, m), old, made)
  means = [jnp.where(broke, jnp.zeros_like(m), m) for m in means]
  return (means, keep(residuals, new), keep(count, new_count),
          counted(nonfinite_steps, bad | broke))
