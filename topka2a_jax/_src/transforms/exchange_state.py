"""The exchange's state, made and updated: the core every transform shares.

:func:`init_state` makes a :class:`topka2a_jax.TopKA2AState` (per-device
residuals, inside ``shard_map`` or as global arrays on the mesh);
:func:`update_state` checks it against the gradients and runs one step of
error feedback (:func:`exchange_step.step`), in a nested ``shard_map``
where the parameters are split over other mesh axes.
:func:`topka2a_jax.topka2a` is these two; :func:`topka2a_jax.compress_updates`
and :func:`topka2a_jax.sharded_optimizer` build on them.

Example:
  >>> options = Options.create(0.1, min_size=0, mesh=jax.make_mesh((8,), ("data",)))
  >>> init_state(options, {"w": jnp.zeros((4, 3))}).residuals["w"].shape  # 8 blocks
  (32, 3)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from topka2a_jax._src import layout, sizes
from topka2a_jax._src.axis import DataAxis, bound_axis_size, holds_tracer, is_bound
from topka2a_jax._src.caller import user_stacklevel
from topka2a_jax._src.collectives import low_rank
from topka2a_jax._src.collectives.algorithms import ALGORITHMS, AUTO
from topka2a_jax._src.options import Options
from topka2a_jax._src.states import TopKA2AState
from topka2a_jax._src.transforms import exchange_step
from topka2a_jax._src.transforms.bucket_exchange import accumulation_dtype
from topka2a_jax._src.transforms.exchange_plan import ExchangePlan, LeafPlan, leaf_plans
from topka2a_jax._src.transforms.extra_args import (
  BACKWARD_SECONDS,
  NONFINITE,
  PARAM_SPECS,
)
from topka2a_jax._src.transforms.leaves import (
  check_floating,
  check_per_device,
  given_specs,
  leaves_of,
  local_shapes,
  shard_specs,
)


def layout_mesh(options: Options, leaves: Sequence[Any]) -> Mesh | None:
  """The mesh to lay a fresh state out for, if the call is outside shard_map."""
  for mesh in (options.mesh, layout.mesh_laid_out_for()):
    if mesh is not None:
      return mesh
  for leaf in leaves:
    sharding = getattr(leaf, "sharding", None)
    if (isinstance(sharding, NamedSharding)
        and options.axis.on(sharding.mesh)):
      return sharding.mesh
  return None


def init_state(options: Options, params: optax.Params) -> TopKA2AState:
  """The transform's initial state for ``params``.

  Inside a shard_map over the data axis, every device makes its own
  residuals; outside, the state comes out as global arrays laid out for the
  mesh (:func:`layout_mesh`).

  Raises:
    TypeError: a non-floating parameter.
    ValueError: outside shard_map with no mesh to lay the state out for, or a
      parameter sharded over the data axis.
  """
  paths, leaves, treedef, _ = leaves_of(params)
  check_floating(leaves, paths, "parameter")
  _warn_if_codes_narrow_float64(options, leaves, paths)
  zero = jnp.zeros((), jnp.int32)
  if is_bound(options.axis_name):  # each leaf is this device's piece already
    parts = leaf_plans(options, paths, [leaf.shape for leaf in leaves])
    residuals = [
        jnp.zeros(residual_block_shape(options.axis, leaf.shape),
                  options.residual_dtype or accumulation_dtype(leaf.dtype))
        if part.keeps_residual else optax.MaskedNode()
        for leaf, part in zip(leaves, parts)]
    return TopKA2AState(treedef.unflatten(residuals), zero, zero,
                        initial_factors(options, parts, leaves, treedef))
  mesh = layout_mesh(options, leaves)
  if mesh is not None and not options.axis.on(mesh):
    raise ValueError(
        f"mesh has no axis {options.axis_name!r}; its axes are "
        f"{mesh.axis_names}. Build {options.caller} with the data-parallel axis: "
        "axis_name=...")
  if mesh is None:
    raise ValueError(
        f"{options.caller} does not know the mesh to lay its state out for: its "
        f"residuals are per device along {options.axis_name!r}. Build it with "
        f"{options.caller}(..., mesh=mesh), place the parameters on the mesh first "
        f"(jax.device_put(params, NamedSharding(mesh, P()))), or make the "
        f"state with topka2a_jax.init(tx, params, mesh).")
  return _global_state(options, mesh, paths, leaves, treedef)


def _warn_if_codes_narrow_float64(options: Options, leaves: Sequence[Any],
                                  paths: Sequence[str]) -> None:
  """Warns that few-bit codes carry float64 leaves in float32's range, once per init."""
  names = (options.auto_forms or () if options.algorithm == AUTO else (options.algorithm,))
  if not any(name in ALGORITHMS and ALGORITHMS[name].quantizes for name in names):
    return
  wide = [path for path, leaf in zip(paths, leaves) if leaf.dtype == jnp.float64]
  if wide:
    warnings.warn(
        f"{', '.join(wide[:3])}{' ...' if len(wide) > 3 else ''}: float64 gradients go "
        "through a few-bit code whose scales are float32, so a step with an entry "
        "beyond float32's range (3.4e38) is skipped (counted in nonfinite_steps). "
        "Send them with algorithm='dense' or a top-k to keep float64's range.",
        stacklevel=user_stacklevel())


def initial_factors(options: Options, parts: Sequence[LeafPlan], leaves: Sequence[Any],
                    treedef: Any) -> Any:
  """Each low-rank leaf's first ``Q``, ``optax.MaskedNode()`` elsewhere; None unless PowerSGD."""
  if not options.is_low_rank:
    return None
  return treedef.unflatten([
      low_rank.initial_factor(leaf.shape, options.rank, position)
      if part.low_rank else optax.MaskedNode()
      for position, (leaf, part) in enumerate(zip(leaves, parts))])


def residual_block_shape(axis: DataAxis, shape: Sequence[int]) -> tuple[int, ...]:
  """One device's residual for its ``shape``-d shard, inside ``shard_map``.

  Shaped like the shard (``(1,)`` for a scalar) over one data axis; over a
  pair, the device's slice of it (``layout.residual_slice``).
  """
  per_node = axis.per_node()
  if per_node is not None:
    return (layout.residual_slice(math.prod(shape), per_node),)
  return tuple(shape) or (1,)


def _global_state(options: Options, mesh: Mesh, paths: Sequence[str],
                  leaves: Sequence[Any], treedef: Any) -> TopKA2AState:
  """Zero residuals as global arrays, each split like its parameter."""
  num_devices = options.axis.size(mesh)
  per_node = options.axis.per_node(mesh)
  others = layout.automatic_axes(mesh, options.axis)
  tracing = holds_tracer(leaves)
  residuals: list[Any] = [optax.MaskedNode()] * len(leaves)
  specs = []
  for leaf, path in zip(leaves, paths):
    given = layout.param_spec_of(leaf, mesh)
    layout.check_not_over_data(given, options.axis, path)
    specs.append(layout.restrict_spec(given, leaf.shape, others))
  pieces = [layout.local_shape(leaf.shape, spec, others) for leaf, spec in zip(leaves, specs)]
  kept, shapes, shardings, factors = [], [], [], []
  for i, (leaf, spec, local_shape, part) in enumerate(zip(  # the update's rule
      leaves, specs, pieces, leaf_plans(options, paths, pieces))):
    local_size = math.prod(local_shape)
    if part.low_rank:
      factors.append((i, local_shape, math.prod(leaf.shape) // max(local_size, 1),
                      NamedSharding(mesh, layout.factor_spec(spec))))
    if part.keeps_residual:
      kept.append(i)
      shapes.append(jax.ShapeDtypeStruct(
          layout.residual_shape(leaf.shape, num_devices, per_node=per_node,
                                pieces=math.prod(leaf.shape) // local_size),
          options.residual_dtype or accumulation_dtype(leaf.dtype)))
      shardings.append(NamedSharding(mesh, layout.residual_spec(options.axis, spec)))

  def zeros() -> list[jax.Array]:  # the residuals, then count and nonfinite_steps
    return ([jnp.zeros(shape.shape, shape.dtype) for shape in shapes]
            + [jnp.zeros((), jnp.int32) for _ in range(2)])

  replicated = NamedSharding(mesh, P())
  if tracing:
    *made, count, skipped = [layout.constrain(z, s) for z, s in
                             zip(zeros(), shardings + [replicated] * 2)]
  else:  # made in place: never whole on one device, on every process alike
    *made, count, skipped = jax.jit(zeros,
                                    out_shardings=shardings + [replicated] * 2)()
  for i, array in zip(kept, made):
    residuals[i] = array
  return TopKA2AState(treedef.unflatten(residuals), count, skipped,
                      _global_factors(options, factors, len(leaves), treedef, tracing))


def _global_factors(options: Options, factors: Sequence[tuple], count: int,
                    treedef: Any, tracing: bool) -> Any:
  """The first ``Q`` of every low-rank leaf as a global array; None unless PowerSGD.

  Args:
    options: the transform's options.
    factors: ``(position, local shape, pieces, sharding)`` per low-rank leaf:
      one ``(n, rank)`` block for each of its ``pieces`` shards.
    count: leaves in all.
    treedef: their structure.
    tracing: whether this runs under a trace (the arrays are then constrained).
  """
  if not options.is_low_rank:
    return None

  def make() -> list[jax.Array]:
    made = []
    for position, shape, pieces, _ in factors:
      block = low_rank.initial_factor(shape, options.rank, position)
      made.append(jnp.tile(block, (pieces, 1)))
    return made

  shardings = [sharding for *_, sharding in factors]
  if tracing:
    made = [layout.constrain(f, s) for f, s in zip(make(), shardings)]
  else:
    made = jax.jit(make, out_shardings=shardings)()
  tree: list[Any] = [optax.MaskedNode()] * count
  for (position, *_), factor in zip(factors, made):
    tree[position] = factor
  return treedef.unflatten(tree)


class Exchanged(NamedTuple):
  """One exchange of a pytree: its mean, the state after it, and whether it was skipped.

  Attributes:
    means: the mean of the updates over the data axis (zeros if skipped).
    state: the exchange's state after the step.
    skipped: a boolean scalar, the same on every device: the step was skipped
      (:attr:`exchange_step.Stepped.skipped`); what the caller keeps per step
      (an optimizer's state) should be kept as it was.
  """

  means: optax.Updates
  state: TopKA2AState
  skipped: jax.Array


def update_state(options: Options, updates: optax.Updates, state: TopKA2AState,
                 extra_args: dict[str, Any]) -> Exchanged:
  """The transform's update: the mean of ``updates`` over the axis, and the state.

  Raises:
    ValueError: outside shard_map (said first), a state that does not match,
      or gradients already summed across the axis.
    TypeError: non-floating gradients or a state of another transform.
  """
  bound_axis_size(options.axis_name)
  tree = leaves_of(updates)
  paths, grads, treedef = tree.paths, tree.values, tree.structure
  check_floating(grads, paths, "gradient")
  given = given_specs(treedef, extra_args.get(PARAM_SPECS))
  plan, carried = planned(options, treedef, state, grads, paths, given,
                          extra_args.get(BACKWARD_SECONDS))
  check_per_device(grads, paths, options.axis_name)
  if not any(g.size for g in grads):
    return Exchanged(updates, state, jnp.bool_(False))
  bad = extra_args.get(NONFINITE)  # decided already by skip_nonfinite(...)
  others = layout.automatic_axes(jax.sharding.get_abstract_mesh(), options.axis)
  if not others:
    stepped = exchange_step.step(plan, grads, carried, bad)
  else:
    stepped = _step_on_shards(plan, others, grads, carried, bad, given)
  new = stepped.carried
  return Exchanged(tree.full.unflatten(stepped.means), TopKA2AState(
      treedef.unflatten(new.residuals), new.count, new.nonfinite_steps,
      None if new.factors is None else treedef.unflatten(new.factors)), stepped.skipped)


class Planned(NamedTuple):
  """A trace's plan, and the exchange's state checked against it, ready for a step.

  Attributes:
    plan: the trace's :class:`ExchangePlan`.
    carried: the state as the step takes it: one residual per leaf
      (``optax.MaskedNode()`` where none is kept), PowerSGD's factor per leaf
      (None for the other exchanges), and the two counts.
  """

  plan: ExchangePlan
  carried: exchange_step.Carried


def planned(options: Options, treedef: Any, state: TopKA2AState,
            grads: Sequence[jax.Array], paths: Sequence[str], given: Sequence[P | None],
            backward_seconds: float | None = None) -> Planned:
  """The trace's plan, and the state's residuals and factors checked against it.

  Args:
    options: the transform's options.
    treedef: the gradients' structure.
    state: the exchange's state.
    grads: the gradient leaves.
    paths: their paths.
    given: the parameters' specs passed through extra arguments, per leaf.
    backward_seconds: the step's estimate of its backward pass, or None.

  Returns:
    :class:`Planned`: the plan and the state the step carries.

  Raises:
    TypeError: a state of another transform.
    ValueError: a state made for other options, another model or another
      mesh, or not split per device.
  """
  others = layout.automatic_axes(jax.sharding.get_abstract_mesh(), options.axis)
  shapes = local_shapes(grads, given, others)
  plan = ExchangePlan.create(options, paths, shapes, backward_seconds)
  residuals = _checked_residuals(options.axis, plan.leaves, treedef, state, grads)
  return Planned(plan, exchange_step.Carried(
      residuals, _checked_factors(plan, treedef, state, grads), state.count,
      state.nonfinite_steps))


def _checked_factors(plan: ExchangePlan, treedef: Any, state: TopKA2AState,
                     grads: Sequence[jax.Array]) -> list[Any] | None:
  """The state's PowerSGD factors, one per leaf, checked against the plan; None unless PowerSGD.

  A leaf split over other mesh axes is a matrix per shard (its local shape),
  with one ``Q`` block per shard.

  Raises:
    ValueError: the state's factors do not match ``algorithm="powersgd"``
      and these gradients (made with other options, or for another model).
  """
  fix = ("The state was made with other options; re-create it with "
         "tx.init(params) for this transform.")
  if plan.rank is None:
    if state.factors is not None:
      raise ValueError(f"the state holds PowerSGD factors but the transform is not "
                       f"algorithm='powersgd'. {fix}")
    return None
  if state.factors is None:
    raise ValueError(f"algorithm='powersgd' needs the factors its init makes; the "
                     f"state has none. {fix}")
  factors = treedef.flatten_up_to(state.factors)
  for grad, leaf, factor in zip(grads, plan.leaves, factors):
    if not leaf.low_rank:
      if not isinstance(factor, optax.MaskedNode):
        raise ValueError(f"the state holds a PowerSGD factor for leaf {leaf.path}, "
                         f"which goes dense with these options. {fix}")
      continue
    m, n = sizes.matrix_shape(leaf.local_shape)
    pieces = grad.size // math.prod(leaf.local_shape)  # shards seen whole here
    expected = (pieces * n, sizes.leaf_rank(leaf.local_shape, plan.rank))
    if getattr(factor, "shape", None) != expected:
      raise ValueError(
          f"PowerSGD factor for leaf {leaf.path} has shape "
          f"{getattr(factor, 'shape', type(factor).__name__)}, expected {expected} "
          f"(its {m} x {n} matrix at rank {plan.rank}). {fix}")
  return factors


def _step_on_shards(plan: ExchangePlan, others: dict[Hashable, int], grads: list,
                    carried: exchange_step.Carried, bad: jax.Array | None,
                    given: Sequence[P | None]) -> exchange_step.Stepped:
  """``exchange_step.step`` in a nested shard_map over the other mesh axes.

  Each device then selects from, and keeps residuals for, its own shard of
  every leaf (a residual is shaped like its leaf, so one spec splits both);
  the exchange adds no collective over those axes.
  """
  specs = shard_specs(grads, given, others)
  blocks = exchange_step.Carried(
      [optax.MaskedNode() if isinstance(r, optax.MaskedNode)
       else layout.residual_block_spec(plan.options.axis, spec)
       for r, spec in zip(carried.residuals, specs)],
      None if carried.factors is None else [
          optax.MaskedNode() if isinstance(f, optax.MaskedNode) else layout.factor_spec(spec)
          for f, spec in zip(carried.factors, specs)],
      P(), P())

  def on_shards(grads, carried, bad):
    return exchange_step.step(plan, grads, carried, bad)

  run = jax.shard_map(
      on_shards, mesh=jax.sharding.get_abstract_mesh(), axis_names=set(others),
      in_specs=(specs, blocks, P()),
      out_specs=exchange_step.Stepped(specs, blocks, P()))
  return run(list(grads), carried._replace(residuals=list(carried.residuals)), bad)


def checked_residuals(options: Options, treedef: Any, state: TopKA2AState,
                      grads: Sequence[jax.Array], paths: Sequence[str],
                      given: Sequence[P | None]) -> list[Any]:
  """The state's residuals, one per gradient leaf, checked as :func:`planned` checks them.

  Without the bucket planner: for a transform that meets the state before
  its exchange does (``compress_updates``' inner step).

  Raises:
    TypeError, ValueError: as :func:`planned`.
  """
  others = layout.automatic_axes(jax.sharding.get_abstract_mesh(), options.axis)
  parts = leaf_plans(options, paths, local_shapes(grads, given, others))
  return _checked_residuals(options.axis, parts, treedef, state, grads)


def _checked_residuals(axis: DataAxis, parts: Sequence[LeafPlan], treedef: Any,
                       state: TopKA2AState, grads: Sequence[jax.Array]) -> list[Any]:
  """The state's residuals, one per gradient leaf, checked against the leaves' parts."""
  if not isinstance(state, TopKA2AState):
    raise TypeError(
        f"expected the TopKA2AState made by this transform's init, got "
        f"{type(state).__name__}")
  try:
    residuals = treedef.flatten_up_to(state.residuals)
  except (ValueError, TypeError) as error:
    raise ValueError(
        "the optimizer state does not match the gradients' pytree: was it "
        "initialised for another model? Re-create it with tx.init(params) "
        f"(topka2a built with mesh=...) or topka2a_jax.init(tx, params, mesh). "
        f"({error})") from None
  for grad, residual, leaf in zip(grads, residuals, parts):
    if leaf.keeps_residual:
      expected = residual_block_shape(axis, grad.shape)
      if getattr(residual, "shape", None) != expected:
        raise ValueError(_residual_shape_message(axis, leaf.path, residual, expected))
    elif not isinstance(residual, optax.MaskedNode):
      raise ValueError(
          f"the state holds a residual for leaf {leaf.path}, which these options "
          "send dense or without error feedback: the state was made with "
          "other options (min_size, algorithm or error_feedback). Re-create "
          "it with tx.init(params) for this transform.")
  return residuals


def _residual_shape_message(axis: DataAxis, path: str, residual: Any,
                            expected: tuple[int, ...]) -> str:
  """Why a residual of the wrong shape was refused, and what to do."""
  got = getattr(residual, "shape", None)
  whole = (got is not None and len(got) == len(expected) and expected
           and got[0] == expected[0] * axis.size() and got[1:] == expected[1:])
  return (
      f"residual for leaf {path} has shape "
      f"{got if got is not None else type(residual).__name__}, expected "
      f"{expected} on each device."
      + (" It came in whole, every device's block at once: nothing split "
         "it (a state closed over instead of passed through shard_map's "
         "in_specs, or jax.pmap, which maps a leading axis: use "
         "jax.shard_map)." if whole else "")
      + " Its residuals are per device: pass "
      "the state through shard_map with in_specs/out_specs from "
      "topka2a_jax.state_specs(opt_state), or let "
      "topka2a_jax.train_step place it; and make it for this model, "
      "these options and this mesh with tx.init(params) (topka2a built "
      "with mesh=...) or topka2a_jax.init. A state saved on another "
      "number of devices is resized by topka2a_jax.restore.")
