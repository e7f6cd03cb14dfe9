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


def _axes_of(specs: Any) -> list[Hashable]:
  """Mesh axes named anywhere in a pytree of PartitionSpecs, in first-seen order."""
  axes: list[Hashable] = []
  for spec in jax.tree.leaves(specs, is_leaf=lambda node: isinstance(node, P)):
    for entry in spec:
      for axis in entry if isinstance(entry, tuple) else (entry,):
        if axis is not None and axis not in axes:
          axes.append(axis)
  return axes


def residual_spec(axis_name: Hashable = "data", param_specs: Any = None) -> P:
  """The ``PartitionSpec`` of every residual: one part per device.

  With replicated parameters a residual is split along ``axis_name``. With
  parameters sharded over other mesh axes (``param_specs``), each device
  keeps the residual of its own parameter shard, so the residual is split
  along ``axis_name`` and every axis the parameters are sharded over.

  Args:
    axis_name: the data-parallel mesh axis.
    param_specs: the parameters' ``PartitionSpec`` pytree, or None.

  Returns:
    The spec, e.g. ``P("data")`` or ``P(("data", "model"))``.

  Example:
    >>> residual_spec("data", {"w": P(None, "model")})  # P(("data", "model"))
  """
  others = [axis for axis in _axes_of(param_specs) if axis != axis_name]
  return P((axis_name, *others)) if others else P(axis_name)


def state_specs(opt_state: optax.OptState, axis_name: Hashable = "data",
                param_specs: Any = None) -> Any:
  """The ``PartitionSpec`` of every optimizer-state leaf, for shard_map.

  Residuals of :func:`topka2a_jax.topka2a` (wherever it sits in a chain) are
  per device (:func:`residual_spec`). With ``param_specs``, every part of the
  state shaped like the parameters (Adam's moments, momentum) is sharded like
  them. Everything else is replicated, ``P()``.

  Args:
    opt_state: the state, global arrays or shapes (``jax.eval_shape`` works).
    axis_name: the data-parallel mesh axis the transform was built with.
    param_specs: for parameters sharded over other mesh axes (a 2-D mesh),
      their ``PartitionSpec`` pytree; None when they are replicated.

  Returns:
    A pytree of ``PartitionSpec`` with the state's structure, for the step's
    ``in_specs`` and ``out_specs``.

  Example:
    >>> specs = state_specs(opt_state)
  """
  per_device = residual_spec(axis_name, param_specs)
  params_structure = (None if param_specs is None else
                      jax.tree.structure(param_specs,
                                         is_leaf=lambda node: isinstance(node, P)))

  def shaped_like_params(node: Any) -> bool:
    return (params_structure is not None and not _is_topka2a_state(node)
            and not isinstance(node, P)
            and jax.tree.structure(node) == params_structure
            and params_structure.num_leaves > 0)

  def spec_for(node: Any) -> Any:
    if _is_topka2a_state(node):
      return TopKA2AState(jax.tree.map(lambda _: per_device, node.residuals),
                          count=P(), nonfinite_steps=P())
    if shaped_like_params(node):
      return param_specs
    return P()

  return jax.tree.map(
      spec_for, opt_state,
      is_leaf=lambda node: _is_topka2a_state(node) or shaped_like_params(node))


def init(
    tx: optax.GradientTransformation,
    params: optax.Params,
    mesh: Mesh,
    axis_name: Hashable = "data",
    param_specs: Any = None,
) -> optax.OptState:
  """Initial optimizer state as global arrays, laid out for ``mesh``.

  The state is made inside ``jax.shard_map``, so every device initialises
  from its own parameter shard; per-device leaves come out split along the
  mesh (:func:`state_specs`), the rest replicated or sharded like the
  parameters.

  Args:
    tx: the optimizer, e.g. ``optax.chain(topka2a(0.01), optax.adam(1e-3))``.
    params: the model parameters (only their shapes and dtypes matter to
      :func:`topka2a_jax.topka2a`; other transforms may read the values).
      ``jax.ShapeDtypeStruct`` leaves stand for zeros.
    mesh: the device mesh of the training step.
    axis_name: the data-parallel mesh axis the transform was built with.
    param_specs: the parameters' ``PartitionSpec`` pytree when they are
      sharded over other mesh axes (a 2-D mesh); None when replicated.

  Returns:
    The optimizer state, ready to pass to a shard_map step whose specs come
    from :func:`state_specs` (with the same ``param_specs``).

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
  in_specs = P() if param_specs is None else param_specs
  specs = state_specs(jax.eval_shape(tx.init, params), axis_name, param_specs)

  leaves, treedef = jax.tree.flatten(params)
  abstract = [isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves]
  init_per_device = jax.shard_map(tx.init, mesh=mesh, in_specs=(in_specs,),
                                  out_specs=specs)

  def build(concrete: list[jax.Array]) -> optax.OptState:
    given = iter(concrete)
    full = [jnp.zeros(leaf.shape, leaf.dtype) if is_abstract else next(given)
            for leaf, is_abstract in zip(leaves, abstract)]
    return init_per_device(treedef.unflatten(full))

  spec_leaves = [P()] * len(leaves) if param_specs is None else jax.tree.leaves(
      param_specs, is_leaf=lambda node: isinstance(node, P))
  if len(spec_leaves) != len(leaves):
    raise ValueError(f"param_specs has {len(spec_leaves)} PartitionSpecs for "
                     f"{len(leaves)} parameter leaves; give one per parameter")
  placed = [jax.device_put(leaf, NamedSharding(mesh, spec))
            for leaf, spec, is_abstract in zip(leaves, spec_leaves, abstract)
            if not is_abstract]
  return jax.jit(build)(placed)
