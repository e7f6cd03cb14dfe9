"""Placing the optimizer state on a mesh: residuals per device, the rest replicated.

Every device has its own error-feedback residuals, while every other piece
of optimizer state (Adam's moments, step counts) is the same on every device
of the data axis. :func:`init` builds that state as global arrays,
:func:`state_specs` describes it for a hand-written ``jax.shard_map``, and
:func:`check_chain` refuses the chains whose state could not be laid out so:
an exchange after a transform that keeps per-parameter state would leave
that state different on every device.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> tx = optax.chain(topka2a_jax.topka2a(0.01, min_size=0), optax.adam(1e-3))
  >>> opt_state = init(tx, {"w": jnp.zeros((4, 3))}, mesh)
  >>> specs = state_specs(opt_state)
  >>> specs[0].residuals["w"], specs[1][0].mu["w"]
  (P('data',), P())
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from topka2a_jax._src import layout
from topka2a_jax._src.arguments import checked_optimizer
from topka2a_jax._src.axis import DataAxis
from topka2a_jax._src.collectives.algorithms import DENSE
from topka2a_jax._src.layout import inner_specs, laid_out_for, replica_specs
from topka2a_jax._src.states import (
  REPLICA,
  RESIDUAL,
  SHARD,
  TopKA2AState,
  holds_exchange,
  map_per_device,
)
from topka2a_jax._src.transforms.clipping import warn_if_clipped_before_exchange
from topka2a_jax._src.transforms.following import EXCHANGE_FIRST


def _is_topka2a_state(node: Any) -> bool:
  return isinstance(node, TopKA2AState)


def _is_spec(node: Any) -> bool:
  return isinstance(node, P)


def _owner(state: Any, path: tuple) -> str:
  """The name of the innermost optimizer-state record on ``path``, e.g. ScaleByAdamState."""
  node, owner = state, type(state).__name__
  for key in path:
    if hasattr(node, "_fields") or hasattr(node, "__dataclass_fields__"):
      owner = type(node).__name__
    try:
      if isinstance(key, jax.tree_util.SequenceKey):
        node = node[key.idx]
      elif isinstance(key, jax.tree_util.GetAttrKey):
        node = getattr(node, key.name)
      elif isinstance(key, jax.tree_util.DictKey):
        node = node[key.key]
      else:
        break
    except (KeyError, IndexError, TypeError, AttributeError):
      break
  return owner


def check_chain(opt_state: Any, *, require_exchange: bool = False) -> None:
  """Refuses states whose exchange would not be the first thing in the chain.

  A transform that keeps state per parameter entry (momentum, Adam's moments,
  gradient accumulation) placed before :func:`topka2a_jax.topka2a` sees each
  device's own gradient, so its state differs from device to device, however
  the step checks types (``check_vma``).

  Args:
    opt_state: the chain's state (arrays or shapes).
    require_exchange: also refuse a state with no :class:`topka2a_jax.TopKA2AState`.

  Raises:
    ValueError: per-parameter state before the exchange, ``optax.MultiSteps``
      around or before it, more than one exchange, or (with
      ``require_exchange``) none.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> params = {"w": jnp.zeros(4)}  # a state made by hand: tx.init refuses the order too
    >>> late = (optax.adam(1e-3).init(params), topka2a_jax.topka2a(0.01, mesh=mesh).init(params))
    >>> check_chain(late)
    Traceback (most recent call last):
    ValueError: the optimizer keeps per-parameter state (ScaleByAdamState, at [0][0].mu['w'])
    before the topka2a exchange ...
  """
  with_paths = jax.tree_util.tree_flatten_with_path(opt_state,
                                                    is_leaf=_is_topka2a_state)[0]
  exchanges = [i for i, (_, leaf) in enumerate(with_paths) if _is_topka2a_state(leaf)]
  _refuse_multisteps_around_the_exchange(opt_state)
  if len(exchanges) > 1:
    raise ValueError(f"the optimizer holds {len(exchanges)} topka2a exchanges; "
                     "chain exactly one, first.")
  if not exchanges:
    if require_exchange:
      raise ValueError(
          "the optimizer holds no topka2a exchange, so nothing would average "
          "the gradients across devices. Chain one first: optax.chain("
          f"topka2a_jax.topka2a(density), ...) (algorithm={DENSE.name!r} for a "
          "dense baseline).")
    return
  for path, leaf in with_paths[: exchanges[0]]:
    dtype = getattr(leaf, "dtype", None)
    if (dtype is not None and jnp.issubdtype(dtype, jnp.floating)
        and len(getattr(leaf, "shape", ())) >= 1):
      raise ValueError(
          f"the optimizer keeps per-parameter state "
          f"({_owner(opt_state, path)}, at {jax.tree_util.keystr(path)}) before "
          "the topka2a exchange in the chain: that transform would run on each "
          "device's own gradient, and its state would drift apart between "
          f"devices. {EXCHANGE_FIRST}")


def _refuse_multisteps_around_the_exchange(opt_state: Any) -> None:
  """Refuses ``optax.MultiSteps`` that holds the exchange or comes before it.

  There it would add up each device's own gradients, in a state laid out as
  the same on every device. After the exchange it adds up the mean, the
  same everywhere: allowed, though it exchanges every call.
  """
  accumulates = lambda node: isinstance(node, optax.MultiStepsState)
  nodes = jax.tree.leaves(opt_state,
                          is_leaf=lambda node: accumulates(node) or _is_topka2a_state(node))
  exchanges = [i for i, node in enumerate(nodes) if _is_topka2a_state(node)]
  for i, node in enumerate(nodes):
    if accumulates(node) and (not exchanges or i < exchanges[0]
                              or holds_exchange(node)):
      raise ValueError(
          "the optimizer is wrapped in optax.MultiSteps around (or before) the "
          "topka2a exchange, where it would add up each device's own gradients in "
          "a state laid out as the same on every device. Accumulate one small "
          "batch a call with topka2a_jax.accumulate_gradients(<the optimizer>, "
          "every=N): one exchange per N calls, of one step's bytes; or within one "
          "call with topka2a_jax.train_step(..., micro_batches=N).")


def _residual_specs(residuals: Any, axis: DataAxis, param_specs: Any) -> Any:
  """The spec of every residual leaf: per device, split like its parameter.

  Raises:
    ValueError: the residuals were made for parameters of other leaves.
  """
  if param_specs is None:
    return jax.tree.map(lambda _: layout.residual_spec(axis), residuals)
  _check_made_for(residuals, param_specs)
  return jax.tree.map(
      lambda spec, residual: (residual if isinstance(residual, optax.MaskedNode)
                              else layout.residual_spec(axis, spec)),
      param_specs, residuals, is_leaf=_is_spec)


def _check_made_for(residuals: Any, param_specs: Any) -> None:
  """Raises ValueError, naming the leaves, unless ``residuals`` has the parameters' leaves."""
  def paths(tree: Any, is_leaf: Any) -> set[str]:
    return {jax.tree_util.keystr(path)
            for path, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}

  made = paths(residuals, lambda node: isinstance(node, optax.MaskedNode))
  given = paths(param_specs, _is_spec)
  if made == given:
    return
  missing, extra = sorted(made - given), sorted(given - made)
  said = "; ".join(part for part in (
      f"these parameters lack {', '.join(missing)}" if missing else "",
      f"they have {', '.join(extra)}, which it has not" if extra else "") if part)
  raise ValueError(
      f"the optimizer state was made for other parameters: {said}. Make the state for "
      "these parameters, topka2a_jax.init(tx, params, mesh) (or restore one saved "
      "for them); nothing was changed")


def _factor_specs(factors: Any, param_specs: Any) -> Any:
  """The spec of every PowerSGD factor: replicated, one block per parameter shard."""
  if factors is None or param_specs is None:
    return jax.tree.map(lambda _: P(), factors)
  return jax.tree.map(
      lambda spec, factor: (factor if isinstance(factor, optax.MaskedNode)
                            else layout.factor_spec(spec)),
      param_specs, factors, is_leaf=_is_spec)


def state_specs(opt_state: optax.OptState, axis_name: Hashable = "data",
                param_specs: Any = None) -> Any:
  """The ``PartitionSpec`` of every optimizer-state leaf, for shard_map.

  Residuals of :func:`topka2a_jax.topka2a` (wherever it sits in a chain) are
  per device (``layout.residual_spec``), and so is the inner
  state of :func:`topka2a_jax.sharded_optimizer` and of
  :func:`topka2a_jax.compress_updates`. With
  ``param_specs``, every part of the state shaped like the parameters (Adam's
  moments, momentum) is sharded like them. Everything else is replicated,
  ``P()``.

  Args:
    opt_state: the state, global arrays or shapes (``jax.eval_shape`` works).
    axis_name: the data-parallel mesh axis the transform was built with.
    param_specs: for parameters sharded over other mesh axes (a 2-D mesh),
      their ``PartitionSpec`` pytree; None when they are replicated.

  Returns:
    A pytree of ``PartitionSpec`` with the state's structure, for the step's
    ``in_specs`` and ``out_specs``.

  Raises:
    ValueError: the chain puts per-parameter state before the exchange
      (:func:`check_chain`), or ``param_specs`` split a parameter over
      ``axis_name``.

  Example:
    >>> mesh = jax.make_mesh((4, 2), ("data", "model"))
    >>> tx = optax.chain(topka2a_jax.topka2a(0.01, min_size=0), optax.adam(1e-3))
    >>> param_specs = {"w": P(None, "model")}
    >>> opt_state = init(tx, {"w": jnp.zeros((4, 6))}, mesh, param_specs=param_specs)
    >>> specs = state_specs(opt_state, param_specs=param_specs)
    >>> specs[0].residuals["w"], specs[1][0].mu["w"]
    (P('data', 'model'), P(None, 'model'))
  """
  axis = DataAxis.parse(axis_name)
  layout.check_laid_out_over(opt_state, axis, "state_specs")
  return specs_of(opt_state, axis, param_specs)


def specs_of(opt_state: optax.OptState, axis: DataAxis, param_specs: Any = None) -> Any:
  """:func:`state_specs` for the library's own steps, which check the axis themselves
  (naming the step's axis and the transform's)."""
  check_chain(opt_state)
  _check_param_specs(param_specs, axis)
  params_structure = (None if param_specs is None else
                      jax.tree.structure(param_specs, is_leaf=_is_spec))

  def shaped_like_params(node: Any) -> bool:
    return (params_structure is not None and not _is_topka2a_state(node)
            and not isinstance(node, P)
            and jax.tree.structure(node) == params_structure
            and params_structure.num_leaves > 0)

  def per_device(kind: str, value: Any) -> Any:
    return SPECS[kind](value, axis, param_specs)

  def other(node: Any) -> Any:
    return param_specs if shaped_like_params(node) else P()

  return map_per_device(
      opt_state, per_device, other, is_leaf=shaped_like_params,
      # PowerSGD's Q: replicated, laid out like the parameters
      by_field={"factors": lambda value: _factor_specs(value, param_specs)})


def _shard_specs(shards: Any, axis: DataAxis, param_specs: Any) -> Any:
  """Specs of a sharded optimizer's state: split over the data axis, and like the parameters."""
  if param_specs is None:
    return jax.tree.map(lambda _: P(axis.name), shards)
  return inner_specs(shards, jax.tree.structure(param_specs, is_leaf=_is_spec),
                     jax.tree.leaves(param_specs, is_leaf=_is_spec), axis.name)


def _replica_specs(copies: Any, axis: DataAxis, param_specs: Any) -> Any:
  """Specs of per-device copies of an optimizer's state: one per data index."""
  if param_specs is None:
    return replica_specs(copies, axis, None, None)
  return replica_specs(copies, axis, jax.tree.structure(param_specs, is_leaf=_is_spec),
                       jax.tree.leaves(param_specs, is_leaf=_is_spec))


SPECS: dict[str, Callable[[Any, DataAxis, Any], Any]] = {
    RESIDUAL: _residual_specs,
    SHARD: _shard_specs,
    REPLICA: _replica_specs,
}
"""Every kind of per-device state (:data:`topka2a_jax._src.states.PER_DEVICE`)
and how its specs are made from ``(value, axis, param_specs)``: the
placement side of ``checkpointing/resize.py``'s ``RULES``."""


def _check_param_specs(param_specs: Any, axis: DataAxis) -> None:
  if param_specs is None:
    return
  with_paths = jax.tree_util.tree_flatten_with_path(param_specs, is_leaf=_is_spec)[0]
  for path, spec in with_paths:
    layout.check_not_over_data(spec, axis, jax.tree_util.keystr(path))


def _is_traced(leaf: Any) -> bool:
  return isinstance(leaf, jax.core.Tracer)


def init(
    tx: optax.GradientTransformation,
    params: optax.Params,
    mesh: Mesh,
    axis_name: Hashable = "data",
    param_specs: Any = None,
) -> optax.OptState:
  """Initial optimizer state as global arrays, laid out for ``mesh``.

  The parameters are placed on the mesh (replicated, or split by
  ``param_specs``) and ``tx.init`` runs on them, so every
  :func:`topka2a_jax.topka2a` in ``tx`` lays its residuals out per device, and
  state shaped like the parameters is split like them; the rest is
  replicated. Transforms built with ``mesh=`` need none of this:
  ``tx.init(params)`` does the same.

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
    The optimizer state, ready for :func:`topka2a_jax.train_step` or for a
    shard_map step whose specs come from :func:`state_specs` (with the same
    ``param_specs``).

  Raises:
    ValueError: the mesh has no axis ``axis_name``; ``param_specs`` do not
      match the parameters or split them over ``axis_name``; the chain puts
      per-parameter state before the exchange (:func:`check_chain`).

  Example:
    >>> tx = optax.chain(topka2a_jax.topka2a(0.01, min_size=0), optax.adam(1e-3))
    >>> opt_state = init(tx, {"w": jnp.zeros((4, 3))}, jax.make_mesh((8,), ("data",)))
    >>> opt_state[0].residuals["w"].shape  # one (4, 3) block per device
    (32, 3)
  """
  checked_optimizer("tx", tx)
  axis = DataAxis.parse(axis_name)
  axis.check_on(mesh)
  warn_if_clipped_before_exchange(tx)
  leaves, treedef = jax.tree.flatten(params)
  spec_leaves = ([P()] * len(leaves) if param_specs is None
                 else jax.tree.leaves(param_specs, is_leaf=_is_spec))
  if len(spec_leaves) != len(leaves):
    raise ValueError(f"param_specs has {len(spec_leaves)} PartitionSpecs for "
                     f"{len(leaves)} parameter leaves; give one per parameter")
  _check_param_specs(param_specs, axis)
  placed = treedef.unflatten(
      [_placed(leaf, NamedSharding(mesh, spec)) for leaf, spec in zip(leaves, spec_leaves)])
  with laid_out_for(mesh):
    state = tx.init(placed)
  check_chain(state)
  replicated = NamedSharding(mesh, P())
  return jax.tree.map(
      lambda leaf: leaf if _is_traced(leaf) or _on(leaf, mesh)
      else jax.device_put(leaf, replicated), state)


def _placed(leaf: Any, sharding: NamedSharding) -> jax.Array:
  """``leaf`` on the mesh; zeros made there for a ``jax.ShapeDtypeStruct``."""
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return jax.jit(lambda: jnp.zeros(leaf.shape, leaf.dtype), out_shardings=sharding)()
  if _is_traced(leaf):
    return layout.constrain(leaf, sharding)
  return jax.device_put(leaf, sharding)


def _on(leaf: Any, mesh: Mesh) -> bool:
  sharding = getattr(leaf, "sharding", None)
  return isinstance(sharding, NamedSharding) and sharding.mesh == mesh
