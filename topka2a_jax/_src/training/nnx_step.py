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

from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from topka2a_jax._src.axis import DataAxis, is_varying
from topka2a_jax._src.runtime import watchdog
from topka2a_jax._src.training.step import DataParallelStep, check_step_options


def _agreed_leaf(leaf: jax.Array, axis_name: Hashable) -> jax.Array:
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


class NnxTrainStep(DataParallelStep):
  """The step :func:`nnx_train_step` builds.

  ``step(model, optimizer, batch)`` updates ``model`` and ``optimizer`` in
  place and returns the loss (and the metrics with ``has_aux=True``). The
  core is ``step.DataParallelStep``'s; this class splits the
  model into its parameters, random keys and other state (the carry) and
  merges them back.
  """

  def __init__(self, loss_fn: Callable[..., Any], mesh: Mesh, *,
               axis: DataAxis, has_aux: bool, micro_batches: int, donate: bool):
    super().__init__(mesh, axis=axis, has_aux=has_aux,
                     micro_batches=micro_batches, donate=donate)
    self._loss_fn = loss_fn

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

  def _gradient_fn(self, model, keys):
    graphdef, wrt = model
    return self._value_and_grad(graphdef, wrt, _device_keys(keys, self._axis.name)), None

  def _agreed(self, carry):
    return jax.tree.map(lambda leaf: _agreed_leaf(leaf, self._axis.name), carry)

  def _estimate(self, model, params, rest, keys, micro):
    graphdef, wrt = model
    value_and_grad = self._value_and_grad(graphdef, wrt, keys)

    def loss_and_grads(params, rest, micro):
      (loss, _, _), grads = value_and_grad(params, rest, micro, None)
      return loss, grads

    return loss_and_grads, (params, rest, micro)

  def _prepare(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any,
               kwargs: dict[str, Any]):
    """The pure inputs of the jitted step, checked and (when concrete) placed."""
    wrt = optimizer.wrt
    graphdef, params, keys, rest = nnx.split(model, wrt, nnx.RngKey, ...)
    return self._inputs((graphdef, wrt), optimizer.tx, nnx.as_pure(params),
                        nnx.as_pure(rest), nnx.as_pure(optimizer.opt_state),
                        nnx.as_pure(keys), batch, _annotated_specs(params),
                        nnx.as_pure(kwargs))

  def __call__(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any,
               **kwargs: Any) -> Any:
    """One step; ``model`` and ``optimizer`` are updated in place.

    ``kwargs`` (arrays) go to ``optimizer.tx.update``, as
    ``nnx.Optimizer.update`` passes them. The optimizer's state and
    ``step`` are written as that method writes them (with its ``graph``);
    ``tests/test_nnx.py`` holds the two steps to the same result.

    Returns:
      The loss averaged over the devices, and the metrics with ``has_aux``.

    Raises:
      ValueError: a batch that does not split over the devices, a parameter
        sharded over the data axis, or an optimizer whose chain lacks a
        topka2a exchange or keeps per-parameter state before it.
    """
    inputs, static = self._prepare(model, optimizer, batch, kwargs)
    new_params, new_rest, new_opt_state, *out = self._step(inputs, static)
    watchdog.watch(out[0])
    nnx.update(model, new_params, new_rest)
    nnx.update(optimizer.opt_state, nnx.state(new_opt_state, graph=optimizer.graph))
    optimizer.step[...] += 1
    return tuple(out) if self._has_aux else out[0]

  def lower(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: Any,
            **kwargs: Any) -> jax.stages.Lowered:
    """The lowered step, e.g. for :func:`topka2a_jax.comm_report`.

    With ``local_steps(..., overlap=...)`` it also holds the round's exchange,
    which the step dispatches as a program of its own, in a branch taken where
    a round ends: ``comm_report(...).step_bytes(every)`` counts a round's bytes
    as for rounds in line.
    """
    inputs, static = self._prepare(model, optimizer, batch, kwargs)
    return self._lower(inputs, static)


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
  axis = check_step_options(mesh, axis_name, micro_batches, donate, has_aux)
  return NnxTrainStep(loss_fn, mesh, axis=axis, has_aux=has_aux,
                      micro_batches=micro_batches, donate=donate)
