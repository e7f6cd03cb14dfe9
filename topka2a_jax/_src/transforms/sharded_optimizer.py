"""The optimizer after TopKA2A's owner phase: its state sharded over the data axis.

TopKA2A's first phase is a sparse reduce-scatter: device ``i`` ends with the
sum of every device's selection for shard ``i`` of a buffer. The plain chain
``optax.chain(topka2a(...), inner)`` then all-gathers the mean gradient and
runs ``inner`` (Adam, momentum, ...) on the whole of it on every device.
:func:`sharded_optimizer` runs ``inner`` on the owned shard only and
all-gathers the resulting updates instead: the same bytes on the wire, and
the optimizer's state and work divided by the number of devices (ZeRO stages
1 and 2, with sparse gradients). A few-bit exchange's first phase
(:func:`topka2a_jax.collectives.codes_to_owners`) leaves owners such a shard
too: every entry coded in a few bits, summed exactly at its owner.

Per device and leaf of ``n`` entries, the shard is entries ``[i m, (i + 1) m)``
of the flattened leaf, zero-padded to ``P m`` with ``m = ceil(n / P)``. The
inner transform sees it shaped ``(1, ..., 1, m)``, with as many dimensions
as the leaf (a scalar's shard is ``()``), so masks that test ``ndim`` (no
weight decay on biases and scales) decide as they would on the whole leaf.
Every leaf that keeps a residual is its own TopKA2A bucket (so its owned
shard is its own slice); the others go through one dense reduce-scatter.
The exchange is the step every transform runs
(``exchange_step.step``), ended at the owners (``OWNERS``):
its clip to the wire's range, warm-up, residuals and skips are the chain's.
Where the parameters are split over other mesh axes (a ``("data", "model")``
mesh), each device shards its own piece of them, as
:func:`topka2a_jax.topka2a` keeps residuals for its piece (``layout.inner_specs``).

Only element-wise inner transforms give the same updates as the plain chain;
those that reduce over a leaf or over all of them (global-norm clipping,
trust ratios, factored moments) are refused at construction.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> tx = sharded_optimizer(optax.adam(1e-3), density=0.01, mesh=mesh)
  >>> opt_state = tx.init({"w": jnp.zeros((1000, 16))})
  >>> opt_state.inner[0].mu["w"].shape  # one (1, 2000) shard per device
  (8, 1, 2000)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from topka2a_jax._src import layout
from topka2a_jax._src.arguments import checked_optimizer, keywords_after_inner
from topka2a_jax._src.axis import (
  bound_axis_size,
  grouped_by_varying_axes,
  per_device_blocks,
)
from topka2a_jax._src.buffers import split_by_widths
from topka2a_jax._src.collectives.algorithms import ALGORITHMS, AUTO, DENSE, TOPKA2A
from topka2a_jax._src.options import Options
from topka2a_jax._src.states import ShardedOptimizerState, TopKA2AState
from topka2a_jax._src.transforms import exchange_step
from topka2a_jax._src.transforms.bucket_exchange import OWNERS
from topka2a_jax._src.transforms.clipping import transform_names
from topka2a_jax._src.transforms.exchange_plan import ExchangePlan
from topka2a_jax._src.transforms.exchange_state import (
  init_state,
  layout_mesh,
  planned,
)
from topka2a_jax._src.transforms.extra_args import NONFINITE, PARAM_SPECS
from topka2a_jax._src.transforms.following import Followers, for_follower
from topka2a_jax._src.transforms.leaves import (
  check_per_device,
  given_specs,
  leaves_of,
  shard_specs,
)
from topka2a_jax._src.transforms.marks import marked
from topka2a_jax._src.transforms.nonfinite import (
  step_is_bad,
)
from topka2a_jax._src.transforms.per_device import own_shard, per_device_shards, shaped_shard
from topka2a_jax._src.transforms.signatures import (
  ShardedOptimizerOptions,
  Unpack,
  refuse_options,
  takes_options,
)

OWNER_SHARD_ALGORITHMS = (AUTO, TOPKA2A.name, DENSE.name, *(
    name for name, entry in ALGORITHMS.items() if entry.quantizes))
"""The exchanges whose first phase leaves each owner its summed shard."""

OWNER_PHASE_FORMS = (TOPKA2A.name, DENSE.name)
"""What ``algorithm="auto"`` weighs per leaf by default: TopKA2A's owner phase or a
reduce-scatter; before an adaptive or momentum optimizer, the forms of
:data:`topka2a_jax.cost.AUTO_FORMS` that have an owner phase."""

NOT_TAKEN = {
    "fusion": "every sparse leaf is its own bucket, exchanged by its own owner phase",
    "backward_seconds": "its plan is per leaf and prices no overlap",
    "rank": "PowerSGD leaves no owner a summed shard",
    "follows": "it runs inner itself, and its form follows inner",
}
"""Options of :func:`topka2a_jax.topka2a` that :func:`sharded_optimizer` refuses, and why."""

NOT_ELEMENT_WISE = (
    "clip_by_global_norm", "scale_by_trust_ratio", "lamb", "lars",
    "adaptive_grad_clip", "scale_by_factored_rms", "adafactor", "scale_by_novograd",
    "novograd", "centralize", "normalize_by_update_norm", "scale_by_sm3", "sm3",
    "scale_by_param_block_norm", "scale_by_param_block_rms", "scale_by_lbfgs",
    "lbfgs", "scale_by_polyak", "polyak_sgd", "per_example_global_norm_clip",
)
"""optax transforms whose update of an entry reads other entries."""


def check_element_wise(inner: optax.GradientTransformation) -> None:
  """Refuses an inner transform that reads more than one entry per update.

  Raises:
    ValueError: naming the transform and what to do instead.
  """
  found = sorted(set(transform_names(inner.update)) & set(NOT_ELEMENT_WISE))
  if found:
    raise ValueError(
        f"sharded_optimizer runs the inner transform on each device's shard of "
        f"every parameter, but {', '.join(found)} reduces over whole "
        "parameters or over all of them, which a shard does not hold. Use "
        "optax.chain(topka2a_jax.topka2a(...), inner) for it, or an "
        "element-wise transform (sgd, momentum, adam, adamw, lion).")


@keywords_after_inner("density")
@takes_options(ShardedOptimizerOptions, docs={
    "axis_name": "the data-parallel mesh axis (one: the state is sharded over it).",
    "algorithm": (
        "``\"auto\"`` (each leaf the cheapest under the cost model of the forms "
        "that keep ``inner``'s quality: before Adam's family ``\"quantized_8_8_fine\"`` "
        "or dense, before momentum ``\"quantized_4_8\"`` or dense, else TopKA2A or "
        "dense; :data:`topka2a_jax.cost.AUTO_FORMS`), "
        "``\"topka2a\"``, ``\"dense\"`` (a reduce-scatter), or a few-bit exchange "
        "(``\"quantized_8_8\"``, ``\"onebit\"``, ...): every entry in its first "
        "width to the owner, whose sum is exact; the updates come back whole, "
        "so the second width does not apply. ``\"allgather\"``, "
        "``\"topka2a_sparse\"`` and ``\"powersgd\"`` leave owners no summed shard."),
    "skip_nonfinite": (
        "a non-finite gradient on any device skips the step everywhere, leaving "
        "``inner``'s state as it was."),
})
def sharded_optimizer(inner: optax.GradientTransformation, *, density: float | None = None,
                      **options: Unpack[ShardedOptimizerOptions]
                      ) -> optax.GradientTransformationExtraArgs:
  """``optax.chain(topka2a(density), inner)`` with ``inner``'s state sharded.

  Each device runs ``inner`` on the shard of every parameter it owns in
  TopKA2A's first phase and all-gathers the updates: the plain chain's
  bytes on the wire, ``1/P`` of its optimizer state and work per device.

  Args:
    inner: an element-wise optax transform (sgd, momentum, adam, adamw with
      masks, lion, schedules); it gets the mean gradient's shards and, where
      it asks, the parameters' shards.
    density: fraction of every sparse leaf each device sends, in (0, 1];
      not needed with a few-bit ``algorithm``, which sends every entry.
    **options: the options of :func:`topka2a_jax.topka2a` but ``fusion``,
      ``backward_seconds`` and ``rank``, below.

  Every sparse leaf is its own bucket (so it takes no ``fusion``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`topka2a_jax.ShardedOptimizerState`; its updates are ``inner``'s, whole and
    identical on every device.

  Raises:
    ValueError: an algorithm without an owner phase, an inner transform that
      is not element-wise, or a bad option (as :func:`topka2a_jax.topka2a`).

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> tx = sharded_optimizer(optax.sgd(0.1, momentum=0.9), density=0.1, mesh=mesh)
    >>> params = {"w": jnp.ones((64, 4))}
    >>> step = topka2a_jax.train_step(lambda p, x: jnp.sum(x @ p["w"]), tx, mesh)
    >>> params, opt_state, loss = step(params, tx.init(params), jnp.ones((8, 64)))
    >>> opt_state.inner[0].trace["w"].shape  # 256 entries: 32 on each device
    (8, 1, 32)
  """
  checked_optimizer("inner", inner)
  refuse_options("sharded_optimizer", options, NOT_TAKEN)
  algorithm = options.get("algorithm", AUTO)
  if algorithm not in OWNER_SHARD_ALGORITHMS:
    raise ValueError(
        f"sharded_optimizer runs the optimizer where TopKA2A's first phase "
        f"leaves each device its summed shard; algorithm={algorithm!r} has no "
        f"such phase. Choose one of {', '.join(map(repr, OWNER_SHARD_ALGORITHMS))}.")
  checked = Options.create(density, caller="sharded_optimizer", **options)
  if checked.axis.is_pair:
    raise ValueError(
        f"sharded_optimizer shards over one data axis; axis_name={checked.axis.name!r} is "
        "a pair. Use optax.chain(topka2a_jax.topka2a(..., axis_name=...), inner) "
        "for the two-level exchange.")
  check_element_wise(inner)
  # "auto" plans for the optimizer it runs, as topka2a plans for the one
  # after it: 8 bits before Adam's family, 4 bits up before momentum.
  checked = for_follower(checked, Followers((inner.update,), True), set())
  # Each sparse leaf its own bucket, so that what a device owns is a slice of it.
  checked = dataclasses.replace(checked, fusion=1, auto_forms=tuple(
      name for name in checked.auto_forms or OWNER_PHASE_FORMS
      if name in OWNER_SHARD_ALGORITHMS))

  def init_fn(params: optax.Params) -> ShardedOptimizerState:
    return ShardedOptimizerState(init_state(checked, params), per_device_shards(
        checked, inner.init, params, layout_mesh(checked, jax.tree.leaves(params)),
        "sharded_optimizer", WHY_NOT_AN_EXCHANGE))

  def update_fn(updates: optax.Updates, state: ShardedOptimizerState,
                params: optax.Params | None = None, **extra_args: Any):
    return _update(checked, inner, updates, state, params, extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, marked(update_fn, checked.axis_name))


WHY_NOT_AN_EXCHANGE = ("the shards it gets are averaged already (to exchange the optimizer's "
                       "updates instead, use compress_updates(optax.adam(...), density) alone)")
"""Why ``inner`` may not exchange by itself, for the refusal."""


def _gather(shards: Sequence[jax.Array], shapes: Sequence[tuple[int, ...]],
            axis_name: Hashable, num_devices: int) -> list[jax.Array]:
  """Whole leaves from every device's shards: one all-gather per kind of shard.

  Shards of one dtype that vary over the same mesh axes travel together.
  """
  whole: list[Any] = [None] * len(shards)
  for members in grouped_by_varying_axes(shards, key=lambda shard: shard.dtype):
    widths = [shards[i].size for i in members]
    gathered = lax.all_gather(jnp.concatenate([jnp.ravel(shards[i]) for i in members]),
                              axis_name, tiled=True, to="invarying")
    rows = gathered.reshape(num_devices, sum(widths))
    for i, part in zip(members, split_by_widths(rows, widths, axis=1)):
      whole[i] = part.reshape(-1)[: math.prod(shapes[i])].reshape(shapes[i])
  return whole


def _step(plan: ExchangePlan, inner: optax.GradientTransformation, treedef: Any,
          grads: list, carried: exchange_step.Carried, param_leaves: list | None,
          inner_state: Any, bad: jax.Array | None
          ) -> tuple[list, exchange_step.Carried, Any]:
  """One device's step on its pieces of the parameters (manual over every axis).

  The exchange is the transforms' one step (:func:`exchange_step.step`),
  ended at the owners: the clip to the wire, warm-up, the residuals and the
  skips (a non-finite gradient anywhere, or shards that overflow) are
  those of :func:`topka2a_jax.topka2a`. Where it skips, ``inner`` gets
  zeros and its state stays as it was.
  """
  num_devices = bound_axis_size(plan.options.axis.name)
  stepped = exchange_step.step(plan, grads, carried, bad, end=OWNERS)
  shards = stepped.means
  mean = treedef.unflatten([shaped_shard(s.astype(g.dtype), g.ndim)
                            for s, g in zip(shards, grads)])
  own_params = None if param_leaves is None else treedef.unflatten(
      [own_shard(p, num_devices, plan.options.axis.name) for p in param_leaves])
  own_state = jax.tree.map(lambda x: x[0], inner_state)
  out, new_state = inner.update(mean, own_state, own_params)
  out = treedef.flatten_up_to(out)
  if bad is not None:  # the step's exchange decided whether it skipped
    out = [jnp.where(stepped.skipped, jnp.zeros_like(u), u) for u in out]
    new_state = exchange_step.held_where(stepped.skipped, own_state, new_state)
  whole = _gather(out, [g.shape for g in grads], plan.options.axis.name, num_devices)
  return whole, stepped.carried, per_device_blocks(new_state, plan.options.axis.name)


def _update(options: Options, inner: optax.GradientTransformation, updates: Any,
            state: ShardedOptimizerState, params: Any, extra_args: dict[str, Any]):
  """The per-device update, nested over the other mesh axes where they are automatic."""
  bound_axis_size(options.axis_name)
  tree = leaves_of(updates)
  paths, grads, treedef, full = tree.paths, tree.values, tree.structure, tree.full
  if not isinstance(state, ShardedOptimizerState):
    raise TypeError(f"expected the ShardedOptimizerState made by this transform's "
                    f"init, got {type(state).__name__}")
  given = extra_args.get(PARAM_SPECS)
  plan, carried = planned(options, treedef, state.exchange, grads, paths,
                          given_specs(treedef, given))
  check_per_device(grads, paths, options.axis_name)
  param_leaves = None if params is None else leaves_of(params).values
  bad = step_is_bad(extra_args.get(NONFINITE), grads, options.axis_name, options.skip_nonfinite)
  step = functools.partial(_step, plan, inner, treedef)
  others = layout.automatic_axes(jax.sharding.get_abstract_mesh(), options.axis)
  if others:  # each device on its piece of every parameter, as topka2a does
    specs = shard_specs(grads, given_specs(treedef, given), others)
    inner_in = layout.inner_specs(state.inner, treedef, specs, None)
    carried_in = exchange_step.Carried(specs, None, P(), P())
    step = jax.shard_map(
        step, mesh=jax.sharding.get_abstract_mesh(), axis_names=set(others),
        in_specs=(specs, carried_in, specs, inner_in, P()),
        out_specs=(specs, carried_in, inner_in))
  whole, new, inner_state = step(grads, carried, param_leaves, state.inner, bad)
  return full.unflatten(whole), ShardedOptimizerState(
      TopKA2AState(treedef.unflatten(new.residuals), new.count, new.nonfinite_steps),
      inner_state)
