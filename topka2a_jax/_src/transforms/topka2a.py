"""The optax transform: sparse mean of the gradients with error feedback.

``topka2a(density)`` goes first in an optax chain. Its update runs inside a
``jax.shard_map`` over the data axis, on per-device gradients, and replaces
the dense ``lax.pmean`` of the gradients:

1. per device, ``acc = grad + residual`` (error feedback);
2. the leaves of ``acc`` are fused into flat buckets (``planner/buckets.py``), small
   leaves apart, which go dense;
3. every bucket goes through its collective (``collectives/exchanges.py``), which
   returns the mean over the axis and what this device did not send;
4. ``residual = acc - sent`` is kept for the next step, so no gradient mass is
   lost, only delayed.

Steps 1-4 are ``error_feedback.py``, with its two run-time switches (non-finite
steps skipped everywhere, dense warm-up). Where the parameters are sharded
over other mesh axes that the partitioner handles (a shard_map manual over
the data axis only), the update runs them in a nested shard_map over those
axes, so that each device selects from, and keeps residuals for, its own
parameter shard only (``layout.py``).

:func:`topka2a_jax.train_step` and :func:`topka2a_jax.nnx_train_step` build
the shard_map for you.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> tx = optax.chain(topka2a(density=0.01, mesh=mesh), optax.adam(1e-3))
  >>> opt_state = tx.init({"w": jnp.zeros((64, 32))})  # per device, on mesh
  >>> opt_state[0].residuals["w"].sharding.spec
  P('data',)

References:
  Peng, Li, Shi, Li. The TopKA2A algorithm (shard-wise top-k, an AlltoAll
  to the shards' owners). In Proceedings of the 53rd International
  Conference on Parallel Processing (ICPP 2024). doi:10.1145/3673038.3673140.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from topka2a_jax._src import layout
from topka2a_jax._src.axis import (
  bound_axis_size,
  is_bound,
  is_varying,
  tracks_varying_axes,
)
from topka2a_jax._src.collectives import low_rank
from topka2a_jax._src.options import (
  DEFAULT_ALGORITHM,
  DEFAULT_MIN_SIZE,
  DEFAULT_SELECTION,
  Options,
)
from topka2a_jax._src.planner.cost import AUTO_NETWORK
from topka2a_jax._src.states import TopKA2AState
from topka2a_jax._src.transforms import error_feedback
from topka2a_jax._src.transforms.nonfinite import NONFINITE

PARAM_SPECS = "topka2a_param_specs"
"""Extra argument of the update: the parameters' ``PartitionSpec`` pytree.

:func:`topka2a_jax.train_step` passes it where the partitioner lays the
parameters out over other mesh axes and their types do not say how."""


BACKWARD_SECONDS = "topka2a_backward_seconds"
"""Extra argument of the update: the backward pass's estimated duration.

:func:`topka2a_jax.train_step` passes it, from XLA's cost analysis of the
compiled gradient (``_src/planner/compute.py``); an explicit
``backward_seconds=`` option wins over it."""


def holds_exchange(state: Any) -> bool:
  """Whether an optimizer state holds a :class:`topka2a_jax.TopKA2AState` anywhere.

  Example:
    >>> holds_exchange(optax.adam(1e-3).init({"w": jnp.zeros(2)}))
    False
  """
  is_exchange = lambda node: isinstance(node, TopKA2AState)
  return any(map(is_exchange, jax.tree.leaves(state, is_leaf=is_exchange)))


def topka2a(
    density: float | None = None,
    *,
    axis_name: Hashable = "data",
    mesh: Mesh | None = None,
    algorithm: str = DEFAULT_ALGORITHM,
    error_feedback: bool = True,
    min_size: int = DEFAULT_MIN_SIZE,
    fusion: int | str = "auto",
    network: Any = AUTO_NETWORK,
    backward_seconds: float | None = None,
    value_dtype: Any = None,
    selection: str = DEFAULT_SELECTION,
    warmup_steps: int = 0,
    skip_nonfinite: bool = True,
    rank: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Averages gradients across a mesh axis, sending only the top ``density``.

  Use it first in an optax chain. Its update runs inside a ``jax.shard_map``
  over ``axis_name`` on per-device gradients (:func:`topka2a_jax.train_step`
  and :func:`topka2a_jax.nnx_train_step` build that step; by hand,
  differentiate with respect to ``jax.lax.pcast(params, axis_name,
  to="varying")``). The updates it returns are the mean gradient across the
  axis, the scale of ``lax.pmean``, in each leaf's dtype and shape, bitwise
  identical on every device and typed invariant along the axis.

  Args:
    density: fraction of every bucket's entries each device sends, in (0, 1].
      1.0 sends everything and equals ``lax.pmean``. Leave it out only for
      ``algorithm="powersgd"``, ``"dense"`` or the ``"onebit"`` family,
      which ignore it.
    axis_name: the data-parallel mesh axis, or a pair ``(outer, inner)`` of
      them, e.g. ``("node", "local")``: then the planner prices every
      bucket both flat over all devices and two-level (reduced densely
      inside each node and exchanged between nodes, one slice per device;
      :func:`topka2a_jax.collectives.two_level`) on the two links
      (:func:`topka2a_jax.cost.cluster_cost`), and takes the cheaper. Each
      device then keeps the residual of its slice of every leaf only, 1/L of
      it for L devices per node.
    mesh: the mesh of the training step. With it, ``tx.init(params)`` (as
      ``nnx.Optimizer`` calls it) returns the state as global arrays laid out
      for the mesh: residuals per device, each holding its own parameter
      shard's, everything else replicated. Without it, ``init`` reads the
      mesh from the parameters' shardings.
    algorithm: ``"auto"`` (the default): each bucket takes the cheapest
      exchange under the cost model on ``network``, dense where compression
      does not pay (small buckets, fast links). Or one name in
      :data:`topka2a_jax.collectives.ALGORITHMS` for every large bucket: the
      paper's TopKA2A; its sparse-second-phase variant, O(k) volume; TopkA,
      whose volume grows with the number of devices; dense ``lax.pmean``,
      which ignores ``density``. Or ``"powersgd"``: every matrix leaf as a
      rank-``rank`` product in two all-reduces, vectors and small matrices
      dense (:func:`topka2a_jax.collectives.powersgd`): ``topka2a(algorithm="powersgd",
      rank=4)``. It ignores ``density``, and ``"auto"`` never picks it. Or
      ``"onebit"``: every entry's sign (one scale per chunk) to its shard's
      owner by AlltoAll, the owners' means back in 8 bits by AllGather,
      with error feedback on both phases (1-bit Adam's compressed
      all-reduce, :func:`topka2a_jax.collectives.onebit`); ``"onebit_4"``
      and ``"onebit_1"`` send the means back in 4 bits and 1 bit. They
      ignore ``density``, and ``"auto"`` never picks them.
    error_feedback: keep what was not sent and add it to the next step's
      gradient. Without it the unsent mass is dropped and accuracy suffers.
    min_size: leaves with fewer elements on a device go dense.
    fusion: leaves are fused, last first, into flat buckets of at least this
      many elements (a larger leaf gets a bucket of its own); ``"auto"``
      finds the threshold at trace time by binary search on the cost model's
      predicted step time (:func:`topka2a_jax.plan_fusion`).
    network: the link the cost model plans for: ``"auto"`` (the default:
      ``eth10`` between processes, ``nvlink`` among one process's
      accelerators; :func:`topka2a_jax.cost.detected_network`), a preset name
      (:data:`topka2a_jax.cost.NETWORKS`) or a measured :class:`topka2a_jax.cost.Network`.
      Used by ``fusion="auto"`` and ``algorithm="auto"``. For a pair of data
      axes it is the link between nodes, the one inside a node being
      ``"nvlink"``; or give both, ``network=(between, inside)``.
    backward_seconds: the backward pass's duration, which bucket exchanges
      overlap. By default :func:`topka2a_jax.train_step` estimates it from
      XLA's cost analysis of the compiled gradient against the device's rate
      (:data:`topka2a_jax.cost.DEVICES`); in a hand-written step, no overlap is
      assumed.
    value_dtype: dtype of the sparse values on the wire, e.g.
      ``jnp.bfloat16``; accumulation stays in float32 and the rounding stays
      in the residual. None sends float32. Indices always travel in the
      narrowest unsigned type that fits (uint16 for shards of up to 65,536).
    selection: ``"auto"`` (the default: the fastest for the backend,
      ``exchanges.auto_magnitudes``), ``"exact"`` top-k (a
      sort), ``"threshold"`` (a magnitude threshold found in a few passes,
      many times faster on large buckets; where it may keep less than 99%
      of exact top-k's magnitude mass, or miss a nonzero entry over a
      background of zeros, it sorts exactly instead) or ``"approx"`` (``lax.approx_max_k``).
    warmup_steps: exchange densely (``lax.pmean``) for this many applied
      steps, then sparsely. The switch happens at run time inside the one
      compiled step; the residuals are zero when sparsification begins.
    skip_nonfinite: when any device's gradient holds a NaN or an infinity,
      every device skips the step alike: zero updates, residuals and
      ``count`` untouched, ``nonfinite_steps`` incremented. A stateful
      optimizer later in the chain (momentum, Adam) would still move on zero
      updates; wrap the whole chain in :func:`topka2a_jax.skip_nonfinite` to
      skip it too (its decision is passed down, so the check runs once).
      False lets non-finite values through (and into the residuals).
    rank: the rank of ``algorithm="powersgd"`` (default
      ``low_rank.DEFAULT_RANK``, 4); refused with the others.
      A matrix goes low rank where its factors are at most half its size.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`topka2a_jax.TopKA2AState`.

  Raises:
    ValueError, TypeError: at construction for a bad argument; when tracing
      the update outside shard_map, for non-floating or already-summed
      gradients, or a state that does not match the gradients.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> tx = optax.chain(topka2a(density=0.01, mesh=mesh), optax.adam(1e-3))
    >>> opt_state = tx.init({"w": jnp.zeros((64, 32))})
    >>> opt_state[0].residuals["w"].shape
    (512, 32)
  """
  options = Options.create(
      density, axis_name=axis_name, mesh=mesh, algorithm=algorithm,
      error_feedback=error_feedback, min_size=min_size, fusion=fusion,
      network=network, backward_seconds=backward_seconds, value_dtype=value_dtype,
      selection=selection, warmup_steps=warmup_steps, skip_nonfinite=skip_nonfinite,
      rank=rank)

  def init_fn(params: optax.Params) -> TopKA2AState:
    return init_state(options, params)

  def update_fn(updates: optax.Updates, state: TopKA2AState,
                params: optax.Params | None = None,
                **extra_args: Any) -> tuple[optax.Updates, TopKA2AState]:
    del params
    return update_state(options, updates, state, extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _is_variable(node: Any) -> bool:
  """Whether ``node`` is a Flax NNX Variable (a leaf's box), without importing Flax."""
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(node, nnx.Variable)


def flatten(tree: Any) -> tuple[list[str], list[Any], Any, Any]:
  """Leaves of ``tree`` with their printable paths, and the tree's structure twice.

  A Flax ``Variable`` counts as one leaf, its value, so that a state built
  from ``nnx.state(model)`` mirrors the plain arrays updates arrive as.

  Returns:
    ``(paths, leaves, structure, full structure)``: the first structure has
    each ``Variable`` as a leaf (residuals and specs mirror it), the second
    rebuilds the tree as it came, ``Variable`` boxes included.
  """
  with_paths, structure = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=_is_variable)
  paths = [jax.tree_util.keystr(path) or "<root>" for path, _ in with_paths]
  leaves = [leaf.get_value() if _is_variable(leaf) else leaf for _, leaf in with_paths]
  full = jax.tree.structure(tree)
  return paths, leaves, structure, full if full.num_leaves == len(leaves) else structure


def _check_floating(leaves: Sequence[Any], paths: Sequence[str], what: str) -> None:
  for leaf, path in zip(leaves, paths):
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f"{what} leaf {path} has dtype {dtype}; topka2a exchanges floating "
          "gradients only. Keep integer and other non-float leaves out of the "
          "differentiated pytree, or skip them with optax.masked(...).")


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
  paths, leaves, treedef, _ = flatten(params)
  _check_floating(leaves, paths, "parameter")
  zero = jnp.zeros((), jnp.int32)
  if is_bound(options.axis_name):
    residuals = [
        jnp.zeros(residual_block_shape(options, leaf.shape),
                  error_feedback.residual_dtype(leaf.dtype))
        if options.keeps_residual(leaf.size, leaf.shape) else optax.MaskedNode()
        for leaf in leaves]
    return TopKA2AState(treedef.unflatten(residuals), zero, zero,
                        initial_factors(options, leaves, treedef))
  mesh = layout_mesh(options, leaves)
  if mesh is not None and not options.axis.on(mesh):
    raise ValueError(
        f"mesh has no axis {options.axis_name!r}; its axes are "
        f"{mesh.axis_names}. Build topka2a with the data-parallel axis: "
        "axis_name=...")
  if mesh is None:
    raise ValueError(
        f"topka2a does not know the mesh to lay its state out for: its "
        f"residuals are per device along {options.axis_name!r}. Build it with "
        f"topka2a(..., mesh=mesh), place the parameters on the mesh first "
        f"(jax.device_put(params, NamedSharding(mesh, P()))), or make the "
        f"state with topka2a_jax.init(tx, params, mesh).")
  return _global_state(options, mesh, paths, leaves, treedef)


def initial_factors(options: Options, leaves: Sequence[Any], treedef: Any) -> Any:
  """Each low-rank leaf's first ``Q``, ``optax.MaskedNode()`` elsewhere; None unless PowerSGD."""
  if not options.is_low_rank:
    return None
  return treedef.unflatten([
      low_rank.initial_factor(leaf.shape, options.rank, position)
      if options.sends_low_rank(leaf.shape) else optax.MaskedNode()
      for position, leaf in enumerate(leaves)])


def residual_block_shape(options: Options, shape: Sequence[int]) -> tuple[int, ...]:
  """One device's residual for its ``shape``-d shard, inside ``shard_map``.

  Shaped like the shard (``(1,)`` for a scalar) over one data axis; over a
  pair, the device's slice of it (``layout.residual_slice``).
  """
  per_node = options.axis.per_node()
  if per_node is not None:
    return (layout.residual_slice(math.prod(shape), per_node),)
  return tuple(shape) or (1,)


def _global_state(options: Options, mesh: Mesh, paths: Sequence[str],
                  leaves: Sequence[Any], treedef: Any) -> TopKA2AState:
  """Zero residuals as global arrays, each split like its parameter."""
  num_devices = options.axis.size(mesh)
  per_node = options.axis.per_node(mesh)
  others = layout.automatic_axes(mesh, options.axis)
  tracing = any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)
  residuals: list[Any] = [optax.MaskedNode()] * len(leaves)
  kept, shapes, shardings, factors = [], [], [], []
  for i, (leaf, path) in enumerate(zip(leaves, paths)):
    given = layout.param_spec_of(leaf, mesh)
    layout.check_not_over_data(given, options.axis, path)
    spec = layout.restrict_spec(given, leaf.shape, others)
    local_shape = layout.local_shape(leaf.shape, spec, others)
    local_size = math.prod(local_shape)
    if options.sends_low_rank(local_shape):
      factors.append((i, local_shape, math.prod(leaf.shape) // max(local_size, 1),
                      NamedSharding(mesh, layout.factor_spec(spec))))
    if options.keeps_residual(local_size, local_shape):
      kept.append(i)
      shapes.append(jax.ShapeDtypeStruct(
          layout.residual_shape(leaf.shape, num_devices, per_node=per_node,
                                pieces=math.prod(leaf.shape) // local_size),
          error_feedback.residual_dtype(leaf.dtype)))
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


def update_state(options: Options, updates: optax.Updates, state: TopKA2AState,
                 extra_args: dict[str, Any]) -> tuple[optax.Updates, TopKA2AState]:
  """The transform's update: the mean of ``updates`` over the axis, and the state.

  Raises:
    ValueError: outside shard_map (said first), a state that does not match,
      or gradients already summed across the axis.
    TypeError: non-floating gradients or a state of another transform.
  """
  bound_axis_size(options.axis_name)
  if options.backward_seconds is None and BACKWARD_SECONDS in extra_args:
    options = dataclasses.replace(options,
                                  backward_seconds=extra_args[BACKWARD_SECONDS])
  paths, grads, treedef, full = flatten(updates)
  _check_floating(grads, paths, "gradient")
  residuals = matching_residuals(options, treedef, state, grads, paths,
                                  extra_args.get(PARAM_SPECS))
  check_per_device(grads, paths, options.axis_name)
  if not any(g.size for g in grads):
    return updates, state
  bad = extra_args.get(NONFINITE)  # decided already by skip_nonfinite(...)
  carries = with_factors(options, treedef, state, grads, paths, residuals,
                         _local_shapes(grads, given_specs(treedef, extra_args.get(
                             PARAM_SPECS)), layout.automatic_axes(
                                 jax.sharding.get_abstract_mesh(), options.axis)))
  others = layout.automatic_axes(jax.sharding.get_abstract_mesh(), options.axis)
  if not others:
    means, new, count, skipped = error_feedback.step(
        options, grads, carries, state.count, state.nonfinite_steps, bad)
  else:
    means, new, count, skipped = _step_on_shards(
        options, others, grads, carries, state, bad,
        given_specs(treedef, extra_args.get(PARAM_SPECS)))
  new, factors = without_factors(options, treedef, new)
  return full.unflatten(means), TopKA2AState(treedef.unflatten(new), count, skipped,
                                             factors)


def with_factors(options: Options, treedef: Any, state: TopKA2AState,
                 grads: Sequence[jax.Array], paths: Sequence[str], residuals: list[Any],
                 local_shapes: Sequence[tuple[int, ...]]) -> list[Any]:
  """Every low-rank leaf's residual and ``Q`` as one :class:`low_rank.Carry`.

  A leaf split over other mesh axes is a matrix per shard (its
  ``local_shapes``), with one ``Q`` block per shard.

  Raises:
    ValueError: the state's factors do not match ``algorithm="powersgd"``
      and these gradients (made with other options, or for another model).
  """
  fix = ("The state was made with other options; re-create it with "
         "tx.init(params) for this transform.")
  if not options.is_low_rank:
    if state.factors is not None:
      raise ValueError(f"the state holds PowerSGD factors but algorithm="
                       f"{options.algorithm!r}. {fix}")
    return residuals
  if state.factors is None:
    raise ValueError(f"algorithm='powersgd' needs the factors its init makes; the "
                     f"state has none. {fix}")
  factors = treedef.flatten_up_to(state.factors)
  carries = []
  for grad, path, residual, factor, shape in zip(grads, paths, residuals, factors,
                                                 local_shapes):
    if not options.sends_low_rank(shape):
      if not isinstance(factor, optax.MaskedNode):
        raise ValueError(f"the state holds a PowerSGD factor for leaf {path}, which "
                         f"goes dense with these options. {fix}")
      carries.append(residual)
      continue
    m, n = low_rank.matrix_shape(shape)
    pieces = grad.size // math.prod(shape)  # shards seen whole here (automatic axes)
    expected = (pieces * n, low_rank.leaf_rank(shape, options.rank))
    if getattr(factor, "shape", None) != expected:
      raise ValueError(
          f"PowerSGD factor for leaf {path} has shape "
          f"{getattr(factor, 'shape', type(factor).__name__)}, expected {expected} "
          f"(its {m} x {n} matrix at rank {options.rank}). {fix}")
    carries.append(low_rank.Carry(residual, factor))
  return carries


def without_factors(options: Options, treedef: Any, carries: list[Any]
                    ) -> tuple[list[Any], Any]:
  """The residuals and the factors' pytree (None unless PowerSGD), from :func:`with_factors`."""
  if not options.is_low_rank:
    return carries, None
  is_carry = lambda node: isinstance(node, low_rank.Carry)
  residuals = [c.residual if is_carry(c) else c for c in carries]
  factors = [c.factor if is_carry(c) else optax.MaskedNode() for c in carries]
  return residuals, treedef.unflatten(factors)


def given_specs(treedef: Any, specs: Any) -> list[P | None]:
  """The parameters' specs passed as :data:`PARAM_SPECS`, one per leaf, or Nones."""
  if specs is None:
    return [None] * treedef.num_leaves
  return treedef.flatten_up_to(specs)


def shard_specs(grads: Sequence[jax.Array], given: Sequence[P | None],
                others: dict[Hashable, int]) -> list[P]:
  """How each gradient leaf splits over ``others``: its type, the given spec, or whole."""
  mesh = jax.sharding.get_abstract_mesh()
  specs = []
  for grad, spec in zip(grads, given):
    typed = layout.param_spec_of(grad, mesh)
    specs.append(layout.restrict_spec(typed if typed is not None else spec,
                                      grad.shape, others))
  return specs


def _step_on_shards(options: Options, others: dict[Hashable, int],
                    grads: list, residuals: list, state: TopKA2AState,
                    bad: jax.Array | None, given: Sequence[P | None]):
  """``error_feedback.step`` in a nested shard_map over the other mesh axes.

  Each device then selects from, and keeps residuals for, its own shard of
  every leaf (a residual is shaped like its leaf, so one spec splits both);
  the exchange adds no collective over those axes.
  """
  specs = shard_specs(grads, given, others)
  blocks = [layout.residual_block_spec(options.axis, spec) for spec in specs]
  blocks = [low_rank.Carry(block if not isinstance(r.residual, optax.MaskedNode)
                           else optax.MaskedNode(), layout.factor_spec(spec))
            if isinstance(r, low_rank.Carry) else block
            for block, spec, r in zip(blocks, specs, residuals)]

  def on_shards(grads, residuals, count, skipped, bad):
    return error_feedback.step(options, grads, residuals, count, skipped, bad)

  run = jax.shard_map(
      on_shards, mesh=jax.sharding.get_abstract_mesh(), axis_names=set(others),
      in_specs=(specs, blocks, P(), P(), P()), out_specs=(specs, blocks, P(), P()))
  return run(list(grads), list(residuals), state.count, state.nonfinite_steps, bad)


def matching_residuals(options: Options, treedef: Any, state: TopKA2AState,
                       grads: Sequence[jax.Array], paths: Sequence[str],
                       param_specs: Any) -> list[Any]:
  """The state's residuals, one per gradient leaf, checked against the grads."""
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
  others = layout.automatic_axes(jax.sharding.get_abstract_mesh(), options.axis)
  local_shapes = _local_shapes(grads, given_specs(treedef, param_specs), others)
  for grad, residual, path, shape in zip(grads, residuals, paths, local_shapes):
    if options.keeps_residual(math.prod(shape), shape):
      expected = residual_block_shape(options, grad.shape)
      if getattr(residual, "shape", None) != expected:
        shape = getattr(residual, "shape", None)
        whole = (shape is not None and len(shape) == len(expected) and expected
                 and shape[0] == expected[0] * options.axis.size()
                 and shape[1:] == expected[1:])
        raise ValueError(
            f"residual for leaf {path} has shape "
            f"{getattr(residual, 'shape', type(residual).__name__)}, expected "
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
    elif not isinstance(residual, optax.MaskedNode):
      raise ValueError(
          f"the state holds a residual for leaf {path}, which these options "
          "send dense or without error feedback: the state was made with "
          "other options (min_size, algorithm or error_feedback). Re-create "
          "it with tx.init(params) for this transform.")
  return residuals


def _local_shapes(grads: Sequence[jax.Array], given: Sequence[P | None],
                  others: dict[Hashable, int]) -> list[tuple[int, ...]]:
  """The shape of each leaf on one device, after the split over ``others``."""
  if not others:
    return [tuple(g.shape) for g in grads]
  specs = shard_specs(grads, given, others)
  return [tuple(layout.local_shape(grad.shape, spec, others))
          for grad, spec in zip(grads, specs)]


def check_per_device(grads: Sequence[jax.Array], paths: Sequence[str],
                     axis_name: Hashable) -> None:
  """Rejects gradients that JAX already summed across the axis."""
  if not grads or not tracks_varying_axes(axis_name):
    return
  for grad, path in zip(grads, paths):
    if not is_varying(grad, axis_name):
      raise ValueError(
          f"gradient leaf {path} is identical on every device of "
          f"{axis_name!r} (typed invariant along it), so it was already "
          "summed across devices: jax.grad adds a dense psum when it "
          "differentiates with respect to replicated parameters inside "
          "shard_map. Differentiate with respect to per-device copies: "
          f"jax.grad(loss)(jax.lax.pcast(params, {axis_name!r}, "
          "to='varying'), batch), or let topka2a_jax.train_step do it.")
