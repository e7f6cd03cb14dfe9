"""State that each device keeps of its own: an optimizer's copy, or its shards.

:func:`topka2a_jax.compress_updates` and :func:`topka2a_jax.local_steps`
run an optimizer on every device's own gradient, so its state (and, for
local steps, the local parameters) differs from device to device. Here it
is made once per device: inside ``shard_map`` as this device's block, or
outside as global arrays, every leaf ``(P, *shape)`` split along dimension
0 by the data axis and like its parameter over other mesh axes
(``layout.replica_specs``). :data:`topka2a_jax._src.states.REPLICA` names
this kind of state for the specs, the checkpoints and a restore onto
another device count (every device then starts from the mean of the copies).

:func:`topka2a_jax.sharded_optimizer` runs its optimizer on the shard of the
mean each device owns, so its state is made of those shards
(:func:`per_device_shards`; ``1/P`` of every leaf on each device).

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> options = Options.create(None, algorithm="dense", mesh=mesh)
  >>> state = per_device_state(options, optax.adam(1e-3).init, {"w": jnp.zeros(4)},
  ...                          mesh, "my_transform")
  >>> state[0].mu["w"].shape
  (8, 4)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from topka2a_jax._src import layout
from topka2a_jax._src.axis import bound_axis_size, holds_tracer, is_bound, per_device_blocks
from topka2a_jax._src.buffers import padded_rows
from topka2a_jax._src.caller import user_stacklevel
from topka2a_jax._src.options import Options
from topka2a_jax._src.sizes import ceil_div
from topka2a_jax._src.states import holds_exchange
from topka2a_jax._src.transforms.leaves import leaves_of


def per_device_state(options: Options, make: Callable[[optax.Params], Any],
                     params: optax.Params, mesh: Mesh | None, transform: str) -> Any:
  """``make(params)``, one copy per device: this device's block inside shard_map,
  else global arrays on the mesh.

  Args:
    options: the transform's options (its axis and mesh).
    make: builds one device's state from the parameters (an optimizer's
      ``init``).
    params: the parameters (arrays or shapes).
    mesh: the mesh to lay the copies out for outside shard_map
      (``exchange_state.layout_mesh``; the exchange's init has refused None).
    transform: the transform's name, for its errors.

  Raises:
    ValueError: the state holds an exchange of this library's (an optimizer
      given to ``transform`` that exchanges by itself).
  """
  tree = leaves_of(params)
  leaves, treedef = tree.values, tree.structure
  if is_bound(options.axis_name):
    return per_device_blocks(without_exchange(make(params), transform), options.axis_name)
  others = layout.automatic_axes(mesh, options.axis)
  specs = [layout.restrict_spec(layout.param_spec_of(leaf, mesh), leaf.shape, others)
           for leaf in leaves]
  devices = options.axis.size(mesh)
  with layout.laid_out_for(mesh):  # an exchange inside is refused, not asked for a mesh
    one = without_exchange(make(params), transform)
  shardings = jax.tree.map(
      lambda spec: NamedSharding(mesh, spec),
      layout.replica_specs(one, options.axis, treedef, specs),
      is_leaf=lambda node: isinstance(node, P))

  def copies(state: Any) -> Any:
    return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (devices, *x.shape)),
                        state)

  if holds_tracer(one):
    return jax.tree.map(layout.constrain, copies(one), shardings)
  return jax.jit(copies, out_shardings=shardings)(one)


def shard_length(size: int, num_devices: int) -> int:
  """Entries of a ``size``-entry leaf each of ``num_devices`` owns: ``ceil(size / P)``."""
  return ceil_div(size, num_devices)


def shard_shape(entries: int, ndim: int) -> tuple[int, ...]:
  """The shape an optimizer sees a shard of ``entries`` in: ``ndim`` dimensions."""
  return () if ndim == 0 else (1,) * (ndim - 1) + (entries,)


def shaped_shard(flat_shard: jax.Array, ndim: int) -> jax.Array:
  """A 1-D shard shaped with ``ndim`` dimensions for the optimizer (:func:`shard_shape`)."""
  return flat_shard.reshape(shard_shape(flat_shard.size, ndim))


def own_shard(leaf: jax.Array, num_devices: int, axis_name: Hashable) -> jax.Array:
  """Inside shard_map: this device's shard of a whole ``leaf``, entries
  ``[i m, (i + 1) m)`` of it flattened, shaped for the optimizer."""
  rows = padded_rows(jnp.ravel(leaf), num_devices)
  return shaped_shard(lax.dynamic_index_in_dim(rows, lax.axis_index(axis_name),
                                               keepdims=False), leaf.ndim)


def per_device_shards(options: Options, make: Callable[[optax.Params], Any],
                      params: optax.Params, mesh: Mesh | None, transform: str,
                      why: str) -> Any:
  """``make`` of the shards each device owns of ``params`` (:func:`own_shard`), per
  device: this device's block inside shard_map, else global arrays on the mesh.

  The state of an optimizer that runs on the owners' shards of the mean
  (:func:`topka2a_jax.sharded_optimizer`): ``1/P`` of each leaf per device.

  Args:
    options: the transform's options (its axis and mesh).
    make: builds one device's state from its shards (an optimizer's ``init``).
    params: the parameters (arrays or shapes).
    mesh: the mesh to lay the state out for outside shard_map.
    transform: the transform's name, for its errors.
    why: why ``make``'s state may not hold an exchange (:func:`without_exchange`).
  """
  tree = leaves_of(params)
  leaves, treedef = tree.values, tree.structure

  def blocks(*leaves: jax.Array) -> Any:
    num_devices = bound_axis_size(options.axis_name)
    shards = [own_shard(leaf, num_devices, options.axis_name) for leaf in leaves]
    state = without_exchange(make(treedef.unflatten(shards)), transform, why)
    return per_device_blocks(state, options.axis_name)

  if is_bound(options.axis_name):
    return blocks(*leaves)
  others = layout.automatic_axes(mesh, options.axis)
  specs = [layout.restrict_spec(layout.param_spec_of(leaf, mesh), leaf.shape, others)
           for leaf in leaves]
  num_devices = options.axis.size(mesh)
  shards = [jax.ShapeDtypeStruct(shard_shape(shard_length(
      math.prod(layout.local_shape(leaf.shape, spec, others)), num_devices),
      leaf.ndim), leaf.dtype) for leaf, spec in zip(leaves, specs)]
  with layout.laid_out_for(mesh):  # an exchange inside is refused, not asked for a mesh
    local = without_exchange(jax.eval_shape(make, treedef.unflatten(shards)), transform,
                             why)
  out_specs = layout.inner_specs(
      jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *x.shape), x.dtype), local),
      treedef, specs, options.axis_name)
  made = jax.jit(jax.shard_map(blocks, mesh=mesh, in_specs=tuple(specs),
                               out_specs=out_specs))
  values = [jnp.zeros(leaf.shape, leaf.dtype) if isinstance(leaf, jax.ShapeDtypeStruct)
            else leaf for leaf in leaves]
  return made(*jax.device_put(values, [NamedSharding(mesh, s) for s in specs]))


def zeros_in_float32(params: optax.Params) -> optax.Params:
  """Zeros shaped like ``params``, in at least float32: a fresh offset or sum per device."""
  return jax.tree.map(
      lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params)


class Counters(NamedTuple):
  """A round's counters, int32 scalars the same on every device.

  Attributes:
    step: steps taken in the round so far.
    every: the round's length.
  """

  step: jax.Array
  every: jax.Array


def counters(every: int, mesh: Mesh | None, leaves: list[Any]) -> Counters:
  """A round's step (0) and length ``every``, replicated over ``mesh``.

  Made in place on the mesh, as the exchange's counts are: a scalar on one
  device would have to be placed on every process's devices.
  """
  def made() -> Counters:
    return Counters(jnp.zeros((), jnp.int32), jnp.asarray(every, jnp.int32))

  if mesh is None or holds_tracer(leaves):
    return made()
  return jax.jit(made, out_shardings=NamedSharding(mesh, P()))()


def warn_if_a_zero_step_is_not_finite(inner: optax.GradientTransformationExtraArgs,
                                      params: optax.Params, transform: str) -> None:
  """Warns where ``inner``'s state is float16 and its step on a zero gradient is not finite.

  Adam's ``eps`` of 1e-8 is 0 in float16, so its step is 0 / 0 wherever a
  moment is zero: every such step would be skipped, silently but for the
  ``nonfinite_steps`` count. Nothing is checked while tracing.
  """
  if holds_tracer(jax.tree.leaves(params)):
    return
  state = jax.eval_shape(inner.init, params)
  if not any(getattr(leaf, "dtype", None) == jnp.float16 for leaf in jax.tree.leaves(state)):
    return
  zeros = jax.tree.map(jnp.zeros_like, params)
  steps, _ = jax.jit(inner.update)(zeros, inner.init(params), params)
  if all(bool(jnp.all(jnp.isfinite(step))) for step in jax.tree.leaves(steps)):
    return
  warnings.warn(
      f"{transform}: the inner optimizer's state is float16 and its step on a "
      "zero gradient is not finite (Adam's eps=1e-8 is 0 in float16): every step "
      "whose moments hold a zero would be skipped, counted in nonfinite_steps. "
      "Give it an eps float16 holds (optax.adam(lr, eps=1e-4)), or keep the "
      "parameters or the optimizer's state in float32.", stacklevel=user_stacklevel())


def without_exchange(state: Any, transform: str,
                     why: str = "it exchanges what the inner optimizer makes itself") -> Any:
  """``state``, the inner optimizer's, unless it holds an exchange of its own.

  Every transform that runs an optimizer on each device (its own gradient,
  or its shards of the mean) refuses one that exchanges by itself.

  Raises:
    ValueError: naming ``transform``, ``why`` it exchanges already, and the fix.
  """
  if holds_exchange(state):
    raise ValueError(
        f"{transform}'s inner optimizer holds a topka2a exchange (topka2a, "
        "sharded_optimizer, compress_updates, local_steps or accumulate_gradients) "
        f"of its own, where {why}. Pass the plain optimizer: "
        f"{transform}(optax.adam(...), ...).")
  return state
