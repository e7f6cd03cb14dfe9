"""Placing the optimizer state on a mesh: residuals per device, the rest replicated.

Inside ``jax.shard_map`` each device has its own error-feedback residuals,
while every other piece of optimizer state (Adam's moments, step counts) is
the same everywhere. Outside, a per-device leaf of local shape ``(n,)`` is one
global array of shape ``(P * n,)`` sharded along the axis, and everything else
is replicated. These two helpers build and describe that layout, so users
need not know which leaves are which.

Example:
  >>> opt_state = init(tx, params, mesh)
  >>> specs = state_specs(opt_state)
  >>> step = jax.shard_map(f, mesh=mesh, in_specs=(P(), specs, P("data")),
  ...                      out_specs=(P(), specs))
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from topka2a_jax.transform import TopKA2AState


def _is_topka2a_state(node: Any) -> bool:
  return isinstance(node, TopKA2AState)


def state_specs(opt_state: optax.OptState, axis_name: Hashable = "data") -> Any:
  """The ``PartitionSpec`` of every optimizer-state leaf, for shard_map.

  Residuals of :func:`topka2a_jax.topka2a` (wherever it sits in a chain) are
  per device, ``P(axis_name)``; every other leaf is replicated, ``P()``.

  Args:
    opt_state: the state, global arrays or shapes (``jax.eval_shape`` works).
    axis_name: the data-parallel mesh axis the transform was built with.

  Returns:
    A pytree of ``PartitionSpec`` with the state's structure, for the step's
    ``in_specs`` and ``out_specs``.

  Example:
    >>> specs = state_specs(opt_state)
  """

  def spec_for(node: Any) -> Any:
    if _is_topka2a_state(node):
      return TopKA2AState(jax.tree.map(lambda _: P(axis_name), node.residuals),
                          count=P(), nonfinite_steps=P())
    return P()

  return jax.tree.map(spec_for, opt_state, is_leaf=_is_topka2a_state)


def init(
    tx: optax.GradientTransformation,
    params: optax.Params,
    mesh: Mesh,
    axis_name: Hashable = "data",
) -> optax.OptState:
  """Initial optimizer state as global arrays, laid out for ``mesh``.

  Per-device leaves start as the transform's local value on every device,
  sharded along ``axis_name``; the rest is replicated on the mesh.

  Args:
    tx: the optimizer, e.g. ``optax.chain(topka2a(0.01), optax.adam(1e-3))``.
    params: the model parameters (only their shapes and dtypes matter to
      :func:`topka2a_jax.topka2a`; other transforms may read the values).
      ``jax.ShapeDtypeStruct`` leaves stand for zeros.
    mesh: the device mesh of the training step.
    axis_name: the data-parallel mesh axis the transform was built with.

  Returns:
    The optimizer state, ready to pass to a shard_map step whose specs come
    from :func:`state_specs`.

  Raises:
    ValueError: the mesh has no axis ``axis_name``.

  Example:
    >>> opt_state = init(tx, params, jax.make_mesh((8,), ("data",)))
  """
  if axis_name not in mesh.axis_names:
    raise ValueError(
        f"mesh has no axis {axis_name!r}; its axes are {mesh.axis_names}. "
        "Pass the data-parallel axis with axis_name=..."
    )
  num_devices = mesh.shape[axis_name]
  specs = state_specs(jax.eval_shape(tx.init, params), axis_name)
  per_device = P(axis_name)

  leaves, treedef = jax.tree.flatten(params)
  abstract = [isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves]

  def build(concrete: list[jax.Array]) -> optax.OptState:
    given = iter(concrete)
    full = [jnp.zeros(leaf.shape, leaf.dtype) if is_abstract else next(given)
            for leaf, is_abstract in zip(leaves, abstract)]
    local = tx.init(treedef.unflatten(full))
    return jax.tree.map(
        lambda leaf, spec: jnp.tile(leaf, num_devices) if spec == per_device else leaf,
        local,
        specs,
    )

  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
  concrete = [leaf for leaf, is_abstract in zip(leaves, abstract) if not is_abstract]
  replicated = jax.device_put(concrete, NamedSharding(mesh, P()))
  return jax.jit(build, out_shardings=shardings)(replicated)
