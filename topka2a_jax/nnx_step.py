"""Flax NNX: the training step for an ``nnx.Optimizer``, model updated in place.

NNX users write ``loss, grads = nnx.value_and_grad(loss_fn)(model, batch)``
and ``optimizer.update(model, grads)`` inside an ``nnx.jit`` step. Under
plain jit those gradients are already all-reduced;
:func:`nnx_train_step` is the drop-in replacement for those two lines that
computes them per device and averages them with the optimizer's sparse
exchange (:func:`topka2a_jax.train_step` for NNX models). Flax is imported
only by this module.

Per device, the model's random streams (``nnx.Rngs``: dropout) are folded
with the device's index along the data axis, so each device draws its own
masks, the same on every run; the model's other state (batch statistics)
is averaged over the data axis after the step.

Example:
  >>> from flax import nnx
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> model = nnx.Linear(16, 4, rngs=nnx.Rngs(0))
  >>> tx = optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh), optax.adam(1e-3))
  >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  >>> def loss_fn(model, batch):
  ...   x, y = batch
  ...   return jnp.mean((model(x) - y) ** 2)
  >>> train = topka2a_jax.nnx_train_step(loss_fn, mesh)
  >>> @nnx.jit
  ... def step(model, optimizer, batch):
  ...   return train(model, optimizer, batch)  # for value_and_grad + update
  >>> loss = step(model, optimizer, (jnp.ones((64, 16)), jnp.zeros((64, 4))))
  >>> int(optimizer.step[...])
  1
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from topka2a_jax import compute, placement
from topka2a_jax.axis import axis_names, is_varying, mesh_axis_size
from topka2a_jax.step import (
    accumulated_gradients,
    check_inputs,
    check_step_options,
    reduce_metrics,
    resolve_param_specs,
    shardings,
    split_batch,
)
from topka2a_jax.transform import BACKWARD_SECONDS, PARAM_SPECS, flatten


def _agreed(leaf: jax.Array, axis_name: Hashable) -> jax.Array:
  """Model state after the step, the same on every device of the axis.

  Floating state that differs per device (batch statistics) is averaged;
  other state that differs (a counter) takes the largest value.
  """
  if not is_varying(leaf, axis_name):
    return leaf
  if jnp.issubdtype(leaf.dtype, jnp.floating):
    return lax.pmean(leaf, axis_name)
  return lax.pmax(leaf, axis_name)


def _annotated_specs(params: nnx.State) -> Any:
  """The parameters' specs from their ``nnx.with_partitioning`` annotations.

  Inside ``nnx.jit`` on automatic axes the arrays cannot say how they are
  split; the annotations can. None where a parameter has none.
  """
  is_variable = lambda node: isinstance(node, nnx.Variable)

  def spec(variable: nnx.Variable) -> P | None:
    names = variable.get_metadata().get("out_sharding")
    return None if names is None else P(*names)

  return jax.tree.map(spec, params, is_leaf=is_variable)


def _device_keys(keys: Any, axis_name: Hashable) -> Any:
  """The model's random keys folded with this device's index along the axis."""
  index = lax.axis_index(axis_name)
  return jax.tree.map(lambda key: jax.random.fold_in(key, index), keys)


class NnxTrainStep:
  """The step :func:`nnx_train_step` builds.

  ``step(model, optimizer, batch)`` updates ``model`` and ``optimizer`` in
  place and returns the loss (and the metrics with ``has_aux=True``).
  """

  def __init__(self, loss_fn: Callable[..., Any], mesh: Mesh, *,
               axis_name: Hashable, has_aux: bool, micro_batches: int, donate: bool):
    self._loss_fn, self._mesh, self._axis_name = loss_fn, mesh, axis_name
    self._has_aux, self._micro_batches = has_aux, micro_batches
    self._checked: set[Any] = set()
    self._backward: dict[Any, float] = {}
    self._jitted = jax.jit(
        self._run, static_argnames=("graphdef", "tx", "wrt", "specs", "backward"),
        donate_argnums=(0, 1, 2) if donate else ())

  def _value_and_grad(self, graphdef, wrt, keys):
    """``(params, rest, batch, key) -> ((loss, aux, rest), grads)`` of the model."""

    def value_and_grad(params, rest, micro, _):
      def loss(params):
        model = nnx.merge(graphdef, params, keys, rest)
        out = self._loss_fn(model, micro)
        value, aux = out if self._has_aux else (out, None)
        _, _, _, new_rest = nnx.split(model, wrt, nnx.RngKey, ...)
        return value, (aux, nnx.as_pure(new_rest))
      (value, (aux, new_rest)), grads = jax.value_and_grad(loss, has_aux=True)(params)
      return (value, aux, new_rest), grads

    return value_and_grad

  def _body(self, params, rest, opt_state, keys, batch, *, graphdef, tx, wrt, specs,
            backward):
    axis = self._axis_name
    value_and_grad = self._value_and_grad(graphdef, wrt, _device_keys(keys, axis))
    local = lax.pcast(params, axis, to="varying")
    loss, grads, aux, rest = accumulated_gradients(
        value_and_grad, local, rest, batch, None, self._micro_batches)
    updates, opt_state = optax.with_extra_args_support(tx).update(
        grads, opt_state, params, **{PARAM_SPECS: specs, BACKWARD_SECONDS: backward})
    out = (optax.apply_updates(params, updates),
           jax.tree.map(lambda leaf: _agreed(leaf, axis), rest), opt_state,
           lax.pmean(loss, axis))
    return out + (reduce_metrics(aux, axis),) if self._has_aux else out

  def _run(self, params, rest, opt_state, keys, batch, *, graphdef, tx, wrt, specs,
           backward):
    spec_tree = flatten(params)[2].unflatten(specs)
    state = placement.state_specs(opt_state, self._axis_name)
    out_specs = (P(), P(), state, P()) + ((P(),) if self._has_aux else ())
    body = jax.shard_map(
        functools.partial(self._body, graphdef=graphdef, tx=tx, wrt=wrt,
                          specs=spec_tree, backward=backward),
        mesh=self._mesh, in_specs=(P(), P(), state, P(), P(self._axis_name)),
        out_specs=out_specs, axis_names=set(axis_names(self._axis_name)))
    return body(params, rest, opt_state, keys,
                split_batch(batch, self._mesh, self._axis_name))

  def _prepare(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any):
    """The pure inputs of the jitted step, checked and (when concrete) placed."""
    wrt = optimizer.wrt
    graphdef, params, keys, rest = nnx.split(model, wrt, nnx.RngKey, ...)
    opt_state = nnx.as_pure(optimizer.opt_state)
    check_inputs(self._checked, opt_state, batch, self._mesh, self._axis_name,
                 self._micro_batches)
    read = resolve_param_specs(params, self._mesh, self._axis_name,
                               _annotated_specs(params))
    specs = tuple(P() if s is None else s for s in read)
    params, keys, rest = nnx.as_pure(params), nnx.as_pure(keys), nnx.as_pure(rest)
    inputs = (params, rest, opt_state, keys, batch)
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(inputs)):
      replicated = NamedSharding(self._mesh, P())
      param_shardings, state_shardings = shardings(
          self._mesh, self._axis_name, params, specs, opt_state)
      inputs = jax.device_put(inputs, (
          param_shardings, replicated, state_shardings, replicated,
          NamedSharding(self._mesh, P(self._axis_name))))
    backward = self._backward_seconds(graphdef, wrt, params, rest, keys, batch)
    return inputs, {"graphdef": graphdef, "tx": optimizer.tx, "wrt": wrt,
                    "specs": specs, "backward": backward}

  def _backward_seconds(self, graphdef, wrt, params, rest, keys, batch) -> float:
    """The backward pass's estimate (:func:`topka2a_jax.compute.backward_seconds`)."""
    parts = mesh_axis_size(self._mesh, self._axis_name) * self._micro_batches
    shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    micro = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] // parts, *x.shape[1:]), x.dtype),
        batch)
    args = jax.tree.map(shape, (params, rest, micro))
    cache_key = (graphdef, jax.tree.structure(args), tuple(
        (leaf.shape, str(leaf.dtype)) for leaf in jax.tree.leaves(args)))
    if cache_key not in self._backward:
      value_and_grad = self._value_and_grad(graphdef, wrt, keys)

      def loss_and_grads(params, rest, micro):
        (loss, _, _), grads = value_and_grad(params, rest, micro, None)
        return loss, grads

      seconds, _ = compute.backward_seconds(
          loss_and_grads, *args, device=compute.device_of(self._mesh.devices.flat[0]))
      self._backward[cache_key] = seconds * self._micro_batches
    return self._backward[cache_key]

  def __call__(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any) -> Any:
    """One step; ``model`` and ``optimizer`` are updated in place.

    Returns:
      The loss averaged over the devices, and the metrics with ``has_aux``.

    Raises:
      ValueError: a batch that does not split over the devices, a parameter
        sharded over the data axis, or an optimizer whose chain lacks a
        topka2a exchange or keeps per-parameter state before it.
    """
    inputs, static = self._prepare(model, optimizer, batch)
    new_params, new_rest, new_opt_state, *out = self._jitted(*inputs, **static)
    nnx.update(model, new_params, new_rest)
    nnx.update(optimizer.opt_state, nnx.state(new_opt_state))
    optimizer.step[...] += 1
    return tuple(out) if self._has_aux else out[0]

  def lower(self, model: nnx.Module, optimizer: nnx.Optimizer,
            batch: Any) -> jax.stages.Lowered:
    """The lowered step, e.g. for :func:`topka2a_jax.comm_report`."""
    inputs, static = self._prepare(model, optimizer, batch)
    return self._jitted.lower(*inputs, **static)


def nnx_train_step(
    loss_fn: Callable[..., Any],
    mesh: Mesh,
    *,
    axis_name: Hashable = "data",
    has_aux: bool = False,
    micro_batches: int = 1,
    donate: bool = True,
) -> NnxTrainStep:
  """Builds the data-parallel training step of an NNX model and ``nnx.Optimizer``.

  It stands for ``nnx.value_and_grad(loss_fn)(model, batch)`` followed by
  ``optimizer.update(model, grads)``, with per-device gradients averaged by
  the optimizer's :func:`topka2a_jax.topka2a` exchange; call it at top level
  or inside an ``nnx.jit`` step. The optimizer's ``tx`` starts with a
  ``topka2a`` built with ``mesh=mesh`` (so that ``nnx.Optimizer``'s
  ``tx.init`` lays the residuals out per device).

  Args:
    loss_fn: ``loss_fn(model, batch)`` returning a scalar, or ``(loss,
      metrics)`` with ``has_aux=True``.
    mesh: the device mesh; its axis ``axis_name`` splits the batch, other axes
      are left to the partitioner (parameters sharded over them keep their
      sharding, and each device exchanges its own shard). The split is read
      from each parameter's array at top level, and from its
      ``nnx.with_partitioning`` annotation inside ``nnx.jit``.
    axis_name: the data-parallel axis.
    has_aux: ``loss_fn`` returns metrics too; they come back averaged over
      the devices (floats) or summed (integers).
    micro_batches: gradient accumulation: each device's batch is split into
      this many micro-batches, one exchange per step.
    donate: donate the model's and optimizer's old buffers (they are
      replaced in place).

  Returns:
    An :class:`NnxTrainStep`: ``step(model, optimizer, batch)`` returns the
    loss (and metrics) and updates both in place, as ``optimizer.update``
    does (``optimizer.step`` counts the steps).

  Example:
    >>> from flax import nnx
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> model = nnx.Sequential(nnx.Linear(16, 32, rngs=nnx.Rngs(0)),
    ...                        nnx.BatchNorm(32, rngs=nnx.Rngs(0)))
    >>> tx = optax.chain(topka2a_jax.topka2a(0.05, mesh=mesh), optax.sgd(0.1))
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    >>> train = nnx_train_step(lambda model, x: jnp.mean(model(x) ** 2), mesh,
    ...                        micro_batches=2)
    >>> loss = train(model, optimizer, jnp.ones((64, 16)))  # at top level too
    >>> model.layers[1].mean.shape  # batch statistics, averaged over devices
    (32,)
  """
  check_step_options(mesh, axis_name, micro_batches)
  return NnxTrainStep(loss_fn, mesh, axis_name=axis_name, has_aux=has_aux,
                      micro_batches=micro_batches, donate=donate)
