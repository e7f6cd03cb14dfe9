"""A jit-level data-parallel training step: the shard_map is the library's.

Under plain ``jax.jit`` with sharded inputs, the partitioner all-reduces the
gradients densely before any optimizer sees them. :func:`train_step` owns
the part of the step that must be per device instead: a ``jax.shard_map``
manual over the data axis only (other mesh axes stay with the partitioner,
so a loss written for ``jax.jit`` runs as it is), per-device gradients
(over micro-batches if asked), the optimizer's update with the sparse
exchange, and the placement of parameters, state and batch on the mesh.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> def loss_fn(params, batch):
  ...   x, y = batch
  ...   return jnp.mean((x @ params["w"] - y) ** 2)
  >>> params = {"w": jnp.zeros((16, 4))}
  >>> tx = optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh), optax.adam(1e-3))
  >>> opt_state = tx.init(params)
  >>> step = train_step(loss_fn, tx, mesh)
  >>> params, opt_state, loss = step(params, opt_state,
  ...                                (jnp.ones((64, 16)), jnp.ones((64, 4))))
  >>> float(loss)
  1.0
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from topka2a_jax._src import layout
from topka2a_jax._src.arguments import checked_count, checked_optimizer
from topka2a_jax._src.axis import DataAxis, holds_tracer, per_device_blocks
from topka2a_jax._src.planner import compute
from topka2a_jax._src.runtime import watchdog
from topka2a_jax._src.states import local_params
from topka2a_jax._src.training import placement
from topka2a_jax._src.training.overlap import RoundsInFlight, local_state, overlapped_of
from topka2a_jax._src.transforms.clipping import warn_if_clipped_before_exchange
from topka2a_jax._src.transforms.extra_args import (
  ARRIVED,
  AT_LOCAL_PARAMS,
  BACKWARD_SECONDS,
  GRADIENT_AT,
  PARAM_SPECS,
)
from topka2a_jax._src.transforms.leaves import leaves_of

LossFn = Callable[..., Any]


def check_batch(batch: Any, num_devices: int, micro_batches: int,
                axis_name: Hashable) -> None:
  """Raises unless every batch leaf's leading axis splits over devices and micro-batches.

  Raises:
    ValueError: naming the leaf, its leading size and the multiple it needs.

  Example:
    >>> check_batch({"x": jnp.zeros((64, 3))}, 8, 4, "data")  # 64 = 8 * 4 * 2
    >>> check_batch({"x": jnp.zeros((60, 3))}, 8, 1, "data")
    Traceback (most recent call last):
    ValueError: batch leaf ['x'] has leading axis 60, which does not split evenly over 8 devices
    of 'data': it needs a multiple of 8. Drop or pad the remainder of the batch.
  """
  parts = num_devices * micro_batches
  for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
    shape = getattr(leaf, "shape", ())
    name = jax.tree_util.keystr(path) or "<root>"
    if not shape:
      raise ValueError(
          f"batch leaf {name} is a scalar; every batch leaf is split along its "
          f"leading axis over the {num_devices} devices of {axis_name!r}. Pass "
          "constants through loss_fn's closure instead.")
    if shape[0] % parts:
      per = (f"{num_devices} devices of {axis_name!r} x {micro_batches} "
             "micro-batches" if micro_batches > 1
             else f"{num_devices} devices of {axis_name!r}")
      raise ValueError(
          f"batch leaf {name} has leading axis {shape[0]}, which does not split "
          f"evenly over {per}: it needs a multiple of {parts}. Drop or pad the "
          "remainder of the batch.")


def check_step_options(mesh: Mesh, axis_name: Hashable, micro_batches: int,
                       donate: bool = True, has_aux: bool = False) -> DataAxis:
  """The data axis, parsed; raises unless it is on ``mesh`` and ``micro_batches`` an int >= 1.

  Example:
    >>> check_step_options(jax.make_mesh((8,), ("data",)), "batch", 1)
    Traceback (most recent call last):
    ValueError: mesh has no axis 'batch'; its axes are ('data',). Pass the data-parallel axis
    with axis_name=...
  """
  checked_count("micro_batches", micro_batches, 1)
  for name, value in (("donate", donate), ("has_aux", has_aux)):
    if not isinstance(value, bool):
      raise TypeError(f"{name} must be True or False, got {value!r}")
  axis = DataAxis.parse(axis_name)
  axis.check_on(mesh)
  return axis


def check_inputs(checked: set[Any], opt_state: Any, batch: Any, mesh: Mesh,
                 axis: DataAxis, micro_batches: int) -> None:
  """What a step checks before it traces: the chain order and the batch's split.

  The chain is checked once per state structure (``checked`` remembers them).

  Raises:
    ValueError: from ``placement.check_chain`` or
      :func:`check_batch`, naming the problem and the fix.

  Example:
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> check_inputs(set(), (), {"x": jnp.zeros((4, 3))}, mesh, DataAxis("data"), 2)
    Traceback (most recent call last):
    ValueError: the optimizer holds no topka2a exchange, so nothing would average the gradients
    across devices. Chain one first: optax.chain(topka2a_jax.topka2a(density), ...)
    (algorithm='dense' for a dense baseline).
  """
  structure = jax.tree.structure(opt_state)
  if structure not in checked:
    placement.check_chain(opt_state, require_exchange=True)
    checked.add(structure)
  check_batch(batch, axis.size(mesh), micro_batches, axis.name)


def device_key(key: jax.Array | None, axis_name: Hashable) -> jax.Array | None:
  """This device's random key: ``fold_in(key, index along the data axis)``."""
  if key is None:
    return None
  return jax.random.fold_in(key, lax.axis_index(axis_name))


def _reduce_over(leaf: jax.Array, axis: int | None, axis_name: Hashable | None):
  """Mean of a floating leaf, sum of an integer or boolean one."""
  floating = jnp.issubdtype(leaf.dtype, jnp.floating)
  if axis is not None:
    return jnp.mean(leaf, axis) if floating else jnp.sum(leaf, axis)
  return lax.pmean(leaf, axis_name) if floating else lax.psum(leaf, axis_name)


def reduce_metrics(aux: Any, axis_name: Hashable) -> Any:
  """Per-device metrics over the data axis: floats averaged, integers summed.

  With equal per-device batches, a per-device mean averages to the mean over
  the global batch and a per-device count sums to the global count.
  """
  return jax.tree.map(lambda leaf: _reduce_over(leaf, None, axis_name), aux)


def accumulated_gradients(
    fn: Callable[[Any, Any, Any, Any], tuple[tuple[jax.Array, Any, Any], Any]],
    params: Any, carry: Any, batch: Any, key: jax.Array | None,
    micro_batches: int) -> tuple[jax.Array, Any, Any, Any]:
  """One device's loss and gradient, over ``micro_batches`` slices of its batch.

  Args:
    fn: ``(params, carry, batch, key) -> ((loss, aux, carry), grads)``.
    params: the parameters to differentiate (per-device copies).
    carry: state threaded through the micro-batches (None, or a model's
      non-differentiated state).
    batch: this device's batch; its leading axis splits into contiguous
      micro-batches.
    key: this device's key, or None; micro-batch ``m`` gets ``fold_in(key, m)``.
    micro_batches: how many.

  Returns:
    ``(loss, grads, aux, carry)``: the mean loss and gradient over the
    micro-batches (gradients summed in order, in at least float32, then
    divided), the metrics averaged (floats) or summed (integers), and the
    carry after the last micro-batch.
  """
  keys = (None if key is None else
          jax.vmap(functools.partial(jax.random.fold_in, key))(jnp.arange(micro_batches)))
  sliced = jax.tree.map(lambda x: x.reshape(micro_batches, -1, *x.shape[1:]), batch)
  at = lambda tree, m: jax.tree.map(lambda x: x[m], tree)
  # The first micro-batch runs before the loop, so that the loop's carry has
  # the types (which axes vary) of real results.
  (loss, aux, carry), grads = fn(params, carry, at(sliced, 0),
                                 None if keys is None else keys[0])
  if micro_batches == 1:
    return loss, grads, aux, carry
  wide = lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32))

  def one(state, inputs):
    loss_sum, grad_sum, carry = state
    (loss, aux, carry), grads = fn(params, carry, *inputs)
    grad_sum = jax.tree.map(lambda total, g: total + wide(g), grad_sum, grads)
    return (loss_sum + wide(loss), grad_sum, carry), aux

  rest = jax.tree.map(lambda x: x[1:], (sliced, keys))
  (loss_sum, grad_sum, carry), auxes = lax.scan(
      one, (wide(loss), jax.tree.map(wide, grads), carry), rest)
  grads = jax.tree.map(lambda total, g: (total / micro_batches).astype(g.dtype),
                       grad_sum, grads)
  auxes = jax.tree.map(lambda first, more: jnp.concatenate([first[None], more]),
                       aux, auxes)
  aux = jax.tree.map(lambda leaf: _reduce_over(leaf, 0, None), auxes)
  return (loss_sum / micro_batches).astype(loss.dtype), grads, aux, carry


def resolve_param_specs(params: Any, mesh: Mesh, axis: DataAxis,
                        given: Any = None) -> list[P | None]:
  """Each parameter's spec over the other mesh axes: given, read, or None (unknown).

  Raises:
    ValueError: a parameter split over the data axis.
  """
  tree = leaves_of(params)
  paths, leaves, treedef = tree.paths, tree.values, tree.structure
  given_leaves = ([None] * len(leaves) if given is None
                  else treedef.flatten_up_to(given))
  others = layout.automatic_axes(mesh, axis)
  specs = []
  for path, leaf, given_spec in zip(paths, leaves, given_leaves):
    spec = given_spec if given_spec is not None else layout.param_spec_of(leaf, mesh)
    layout.check_not_over_data(spec, axis, path)
    specs.append(None if spec is None else layout.restrict_spec(spec, leaf.shape,
                                                                others))
  return specs


def split_batch(batch: Any, mesh: Mesh, axis_name: Hashable) -> Any:
  """``batch`` laid out along ``axis_name`` (a no-op where it is already)."""
  return layout.constrain(batch, NamedSharding(mesh, P(axis_name)))


def _is_concrete(tree: Any) -> bool:
  return not holds_tracer(tree)


def _from_host_across_processes(inputs: Any, targets: Any) -> Any:
  """``inputs`` with every array on one device that goes to a mesh across processes
  as its host copy.

  An optimizer's ``init`` makes its scalars (Adam's count) on one device of
  each process; placed across processes as they are, they make arrays whose
  shards no process can read. From the host, every process gives its own
  copy, the same everywhere, and JAX places each process's part.
  """
  def from_host(target: NamedSharding, tree: Any) -> Any:
    if target.is_fully_addressable:
      return tree
    return jax.tree.map(
        lambda leaf: np.asarray(leaf) if isinstance(leaf, jax.Array) and isinstance(
            leaf.sharding, jax.sharding.SingleDeviceSharding) else leaf, tree)

  return jax.tree.map(from_host, targets, inputs)  # each target covers a subtree


def _placed_from_host(target: NamedSharding, tree: Any) -> Any:
  """``tree`` placed by ``target`` as ``jax.device_put`` places it, without the check
  that every process gave the same host values (a collective across processes);
  each process's part is cut from its own copy."""
  def placed(leaf: Any) -> Any:
    if isinstance(leaf, jax.Array):
      return jax.device_put(leaf, target)
    value = np.asarray(leaf)
    return jax.make_array_from_callback(value.shape, target, lambda index: value[index])

  return jax.tree.map(placed, tree)


def shardings(mesh: Mesh, axis: DataAxis, params: Any,
              specs: tuple[P, ...], opt_state: Any) -> tuple[Any, Any]:
  """Where the parameters and the optimizer state live on ``mesh``.

  Parameters are split by ``specs`` (one per leaf, over the other axes) and
  replicated over ``axis``; residuals are per device
  (:func:`topka2a_jax.state_specs`); state shaped like the parameters is split
  like them; the rest is replicated.
  """
  spec_tree = leaves_of(params).structure.unflatten(specs)
  named = lambda spec: NamedSharding(mesh, spec)
  is_spec = lambda node: isinstance(node, P)
  return (jax.tree.map(named, spec_tree, is_leaf=is_spec),
          jax.tree.map(named, placement.specs_of(opt_state, axis, spec_tree),
                       is_leaf=is_spec))


class DataParallelStep:
  """The one step core behind :func:`train_step` and :func:`topka2a_jax.nnx_train_step`.

  Inside a ``jax.shard_map`` manual over the data axis, every device takes
  its gradient over its slice of the batch (over micro-batches if asked),
  the optimizer's update averages them through its exchange, and the
  parameters are updated identically everywhere. The jitted program's
  inputs are ``(params, carry, opt_state, keys, batch)``: ``carry`` is the
  model's state besides its parameters (None for a pure function), ``keys``
  its random keys. A subclass says only how its model is differentiated
  (:meth:`_gradient_fn`, :meth:`_estimate`), how its carry agrees across
  devices after the step (:meth:`_agreed`), and how its users' arguments
  map to those inputs.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> tx = optax.chain(topka2a_jax.topka2a(0.5, mesh=mesh), optax.sgd(0.1))
    >>> step = train_step(lambda p, x: jnp.sum(p["w"] * x), tx, mesh)
    >>> isinstance(step, DataParallelStep)
    True
  """

  def __init__(self, mesh: Mesh, *, axis: DataAxis, has_aux: bool,
               micro_batches: int, donate: bool):
    self._mesh, self._axis = mesh, axis
    self._has_aux, self._micro_batches = has_aux, micro_batches
    self._checked: set[Any] = set()  # state structures whose chain was checked
    self._warned: list[Any] = []  # the transforms checked for clipping, held
    self._backward: dict[Any, float] = {}
    # What the exchanges can hide behind: nothing where collectives run in line.
    self._overlaps = compute.device_of(mesh.devices.flat[0]).overlaps
    self._donate = donate
    self._jitted = jax.jit(self._run, static_argnames=("model", "tx", "specs", "backward",
                                                      "hand_over"),
                           donate_argnums=(0, 1, 2) if donate else ())
    self._flights: list[tuple[Any, RoundsInFlight | None]] = []  # by optimizer

  def _flight(self, tx: Any) -> RoundsInFlight | None:
    """The driver of ``tx``'s rounds in flight (``local_steps(..., overlap=...)``), or None."""
    for seen, flight in self._flights:
      if seen is tx:
        return flight
    overlapped = overlapped_of(tx)
    flight = None if overlapped is None else RoundsInFlight(self._mesh, self._axis, overlapped)
    self._flights.append((tx, flight))
    return flight

  def _step(self, inputs: tuple[Any, ...], static: dict[str, Any]) -> tuple[Any, ...]:
    """Runs the jitted step on placed ``inputs``; with rounds in flight, drives them.

    Returns the step's outputs: ``(params, carry, opt_state, loss[, metrics])``.
    """
    flight = self._flight(static["tx"])
    if flight is None:
      return self._jitted(*self._unaliased(inputs), None, hand_over=False, **static)
    params, opt_state = inputs[0], inputs[2]
    spec_tree = leaves_of(params).structure.unflatten(static["specs"])
    arrived, ends = flight.before(params, opt_state, spec_tree, static["backward"])
    out = self._jitted(*self._unaliased(inputs), arrived, hand_over=ends, **static)
    handed = out[-1] if ends else None
    out = out[:-1] if ends else out
    flight.after(out[2], ends, handed, spec_tree, static["backward"])
    return (*out[:3], *(jax.tree.map(_over_this_process, tree) for tree in out[3:]))

  def _lower(self, inputs: tuple[Any, ...], static: dict[str, Any]) -> jax.stages.Lowered:
    """The lowered step.

    With rounds in flight, the step and, in a branch taken where the step
    ends a round, the exchange it then dispatches as a program of its own:
    what a round sends, for :func:`topka2a_jax.comm_report`, as an in-line
    round's step holds it.
    """
    flight = self._flight(static["tx"])
    if flight is None:
      return self._jitted.lower(*inputs, None, hand_over=False, **static)
    spec_tree = leaves_of(inputs[0]).structure.unflatten(static["specs"])
    arrived, _ = flight.before(inputs[0], inputs[2], spec_tree, static["backward"])
    exchange = flight.program(local_state(inputs[2]), spec_tree, static["backward"])

    def step_and_its_round(*args: Any) -> tuple[Any, ...]:
      *out, handed = self._run(*args, hand_over=True, **static)
      ended = jnp.ravel(local_state(out[2]).step)[0] == 0
      nothing = lambda sent: jax.tree.map(lambda shape: jnp.zeros(shape.shape, shape.dtype),
                                          jax.eval_shape(exchange, *sent))
      return (*out, lax.cond(ended, lambda sent: exchange(*sent), nothing, handed))

    return jax.jit(step_and_its_round).lower(*inputs, arrived)

  def _unaliased(self, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """``inputs`` with a copy of every donated leaf whose buffer an earlier one holds.

    An optimizer may keep the parameters themselves in its state
    (``optax.contrib.prodigy``'s ``params0``); donating one buffer twice is
    refused by XLA, or crashes the process. The copy is made only where a
    buffer repeats, on the first step in practice (the step's outputs are
    new buffers).
    """
    if not self._donate:
      return inputs
    seen: set[Any] = set()

    def once(leaf: Any) -> Any:  # inside a caller's jit (nnx.jit), XLA sees the aliases
      if not isinstance(leaf, jax.Array) or holds_tracer([leaf]) or leaf.is_deleted():
        return leaf
      shards = leaf.addressable_shards
      shard = shards[0] if shards else None
      buffer = None if shard is None else (shard.device, shard.data.unsafe_buffer_pointer())
      if buffer is None or buffer not in seen:
        seen.add(buffer)
        return leaf
      return leaf.copy()

    return (*jax.tree.map(once, inputs[:3]), *inputs[3:])

  def settle(self) -> None:
    """Waits until the exchange of the round in flight has ended.

    With ``local_steps(..., overlap=...)`` across several processes, call it
    before a collective of your own across them (``multihost_utils``, an
    evaluation over sharded data): a collective issued while the exchange
    runs on its own stream may be paired with the wrong peers. The
    library's checkpoints wait by themselves. Returns at once otherwise.
    """
    for _, flight in self._flights:
      if flight is not None:
        flight.settle()

  def _gradient_fn(self, model: Any, keys: Any) -> tuple[Callable[..., Any], Any]:
    """On one device: ``(value_and_grad, key)`` for :func:`accumulated_gradients`."""
    raise NotImplementedError

  def _agreed(self, carry: Any) -> Any:
    """The carry after the step, the same on every device (as it is by default)."""
    return carry

  def _estimate(self, model: Any, params: Any, carry: Any, keys: Any,
                micro: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``(loss_and_grads, args)`` of one device's micro-batch, for the planner.

    ``params``, ``carry`` and ``micro`` come as shapes, ``keys`` as given.
    """
    raise NotImplementedError

  def _body(self, params, carry, opt_state, keys, batch, extra, arrived, *, model, tx, specs,
            backward, hand_over):
    axis = self._axis.name
    value_and_grad, key = self._gradient_fn(model, keys)
    # Each device's own parameters: the shared ones, or with local steps the
    # shared ones plus how far this device has moved in the round.
    local = local_params(lax.pcast(params, axis, to="varying"), opt_state)
    loss, grads, aux, carry = accumulated_gradients(
        value_and_grad, local, carry, batch, key, self._micro_batches)
    updates, opt_state = optax.with_extra_args_support(tx).update(
        grads, opt_state, params,
        **{**extra, PARAM_SPECS: specs, BACKWARD_SECONDS: backward,
           GRADIENT_AT: AT_LOCAL_PARAMS},
        **({} if arrived is None else {ARRIVED: arrived}))
    # Rounds in flight: no collective between round ends, where it would wait on the
    # wire behind the exchange; each device's loss and metrics, reduced on the host.
    loss_of, metrics_of = ((lax.pmean, reduce_metrics) if arrived is None
                           else (per_device_blocks, per_device_blocks))
    out = (optax.apply_updates(params, updates), self._agreed(carry), opt_state,
           loss_of(loss, axis))
    out = out + (metrics_of(aux, axis),) if self._has_aux else out
    if hand_over:  # the round just sent, in buffers of its own for its exchange
      local = local_state(opt_state)
      out = out + ((local.in_flight.sent, local.exchange),)
    return out

  def _run(self, params, carry, opt_state, keys, batch, extra, arrived, *, model, tx, specs,
           backward, hand_over):
    spec_tree = leaves_of(params).structure.unflatten(specs)
    state = placement.specs_of(opt_state, self._axis)
    out_specs = (P(), P(), state, P()) + ((P(),) if self._has_aux else ())
    arrived_specs = P()
    if arrived is not None:
      arrived_specs, handed_specs = self._flight(tx).specs(local_state(opt_state), spec_tree)
      each = P(self._axis.name)  # each device's loss and metrics
      out_specs = (P(), P(), state, each) + ((each,) if self._has_aux else ())
      out_specs = out_specs + ((handed_specs,) if hand_over else ())
    body = jax.shard_map(
        functools.partial(self._body, model=model, tx=tx, specs=spec_tree,
                          backward=backward, hand_over=hand_over),
        mesh=self._mesh,
        in_specs=(P(), P(), state, P(), P(self._axis.name), P(), arrived_specs),
        out_specs=out_specs, axis_names=set(self._axis.names))
    return body(params, carry, opt_state, keys,
                split_batch(batch, self._mesh, self._axis.name), extra, arrived)

  def _inputs(self, model: Any, tx: optax.GradientTransformation, params: Any,
              carry: Any, opt_state: Any, keys: Any, batch: Any,
              given_specs: Any, extra: dict[str, Any]
              ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The jitted step's inputs, checked and (when concrete) placed, and its static args."""
    check_inputs(self._checked, opt_state, batch, self._mesh, self._axis,
                 self._micro_batches)
    check_extra_args(extra)
    if not any(seen is tx for seen in self._warned):
      self._warned.append(tx)
      warn_if_clipped_before_exchange(tx)
    specs = resolve_param_specs(params, self._mesh, self._axis, given_specs)
    specs = tuple(P() if s is None else s for s in specs)  # unknown: whole
    inputs = (params, carry, opt_state, keys, batch, extra)
    if _is_concrete(inputs):
      replicated = NamedSharding(self._mesh, P())
      param_shardings, state_shardings = shardings(
          self._mesh, self._axis, params, specs, opt_state)
      targets = (param_shardings, replicated, state_shardings, replicated,
                 NamedSharding(self._mesh, P(self._axis.name)), replicated)
      inputs = _from_host_across_processes(inputs, targets)
      if self._flight(tx) is None or jax.process_count() == 1:
        inputs = jax.device_put(inputs, targets)
      else:  # rounds in flight: no collective beside the exchange (device_put's check)
        inputs = jax.tree.map(_placed_from_host, targets, inputs)
    backward = (self._backward_seconds(model, params, carry, keys, batch)
                if self._overlaps else 0.0)
    return inputs, {"model": model, "tx": tx, "specs": specs, "backward": backward}

  def _backward_seconds(self, model: Any, params: Any, carry: Any, keys: Any,
                        batch: Any) -> float:
    """The backward pass's estimated duration on one device, for the planner.

    XLA's cost analysis of one device's gradient over its micro-batches,
    against its device's rate (``compute.backward_seconds``);
    computed once per model and shapes of the inputs.
    """
    parts = self._axis.size(self._mesh) * self._micro_batches
    shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    micro = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] // parts, *x.shape[1:]), x.dtype),
        batch)
    shapes = jax.tree.map(shape, (params, carry, keys, micro))
    cache_key = (model, jax.tree.structure(shapes), tuple(
        (leaf.shape, str(leaf.dtype)) for leaf in jax.tree.leaves(shapes)))
    if cache_key not in self._backward:
      loss_and_grads, args = self._estimate(model, shapes[0], shapes[1], keys, micro)
      seconds, _ = compute.backward_seconds(
          loss_and_grads, *args, device=compute.device_of(self._mesh.devices.flat[0]))
      self._backward[cache_key] = seconds * self._micro_batches
    return self._backward[cache_key]


class TrainStep(DataParallelStep):
  """The step :func:`train_step` builds: call it, or lower it for inspection.

  ``step(params, opt_state, batch, key=None)`` returns ``(params, opt_state,
  loss)``, plus the metrics with ``has_aux=True``.
  """

  def __init__(self, loss_fn: LossFn, tx: optax.GradientTransformation, mesh: Mesh,
               *, axis: DataAxis, has_aux: bool, micro_batches: int,
               param_specs: Any, donate: bool):
    checked_optimizer("tx", tx)
    super().__init__(mesh, axis=axis, has_aux=has_aux,
                     micro_batches=micro_batches, donate=donate)
    warn_if_clipped_before_exchange(tx)
    self._warned.append(tx)
    self._loss_fn, self._tx, self._param_specs = loss_fn, tx, param_specs
    self._states_checked: set[tuple[Any, Any]] = set()

  def _value_and_grad(self, params, carry, batch, key):
    args = (batch,) if key is None else (batch, key)
    if self._has_aux:
      (loss, aux), grads = jax.value_and_grad(self._loss_fn, has_aux=True)(params, *args)
    else:
      loss, grads = jax.value_and_grad(self._loss_fn)(params, *args)
      aux = None
    return (loss, aux, carry), grads

  def _gradient_fn(self, model, keys):
    return self._value_and_grad, device_key(keys, self._axis.name)

  def _estimate(self, model, params, carry, key, micro):
    def loss_and_grads(params, batch, *key):
      (loss, _, _), grads = self._value_and_grad(params, None, batch, *key or (None,))
      return loss, grads

    shape = () if key is None else (jax.ShapeDtypeStruct(key.shape, key.dtype),)
    return loss_and_grads, (params, micro) + shape

  def _prepare(self, params, opt_state, batch, key, extra_args):
    self._check_state_is_txs(params, opt_state)
    return self._inputs(None, self._tx, params, None, opt_state, key, batch,
                        self._param_specs, extra_args)

  def _check_state_is_txs(self, params: Any, opt_state: Any) -> None:
    """Refuses a state that ``tx.init(params)`` would not make (another optimizer's).

    Compares the pytrees' structures (their types and fields), read from
    ``tx.init`` on the parameters' shapes, once for each structure of inputs.

    Raises:
      TypeError: naming both structures' first difference and the fix.
    """
    seen = (jax.tree.structure(params), jax.tree.structure(opt_state))
    if seen in self._states_checked:
      return
    try:
      with warnings.catch_warnings(), placement.laid_out_for(self._mesh):
        warnings.simplefilter("ignore")  # said by the user's own init already
        made = jax.tree.structure(jax.eval_shape(self._tx.init, params))
    except Exception:  # noqa: BLE001 -- the step's own trace says what is wrong
      return
    wanted, given = _outline(made), _outline(seen[1])
    if wanted != given:  # other parameters, same optimizer: the exchange names them
      shown = lambda text: text if len(text) <= 200 else text[:197] + "..."
      raise TypeError(
          "opt_state is not the state of the optimizer this step was built with: "
          f"tx.init(params) makes {shown(wanted)}, the step was given {shown(given)}. "
          "Pass the state tx.init(params) returned (or that a restore of it "
          "returned), or build the step with the optimizer that made it")
    self._states_checked.add(seen)

  def backward_seconds(self, params: Any, batch: Any,
                       key: jax.Array | None = None) -> float:
    """The backward pass's estimated duration on one device, for the planner.

    XLA's cost analysis of one device's gradient over its micro-batches,
    against its device's rate (``compute.backward_seconds``);
    computed once per shape of the inputs.
    """
    return self._backward_seconds(None, params, None, key, batch)

  def __call__(self, params: Any, opt_state: Any, batch: Any,
               key: jax.Array | None = None, **extra_args: Any) -> tuple[Any, ...]:
    """One step: ``(params, opt_state, loss)``, plus the metrics with ``has_aux``.

    ``extra_args`` (arrays) go to ``tx.update`` as optax's extra arguments,
    the same on every device, as ``nnx.Optimizer.update`` passes its keyword
    arguments.
    """
    _check_not_donated(params, opt_state)
    inputs, static = self._prepare(params, opt_state, batch, key, extra_args)
    new_params, _, new_opt_state, *out = self._step(inputs, static)
    watchdog.watch(out[0])
    return (new_params, new_opt_state, *out)

  def lower(self, params: Any, opt_state: Any, batch: Any,
            key: jax.Array | None = None, **extra_args: Any) -> jax.stages.Lowered:
    """The lowered step, e.g. for :func:`topka2a_jax.comm_report`.

    With ``local_steps(..., overlap=...)`` it also holds the round's exchange,
    which the step dispatches as a program of its own, in a branch taken where
    a round ends: ``comm_report(...).step_bytes(every)`` counts a round's bytes
    as for rounds in line.
    """
    inputs, static = self._prepare(params, opt_state, batch, key, extra_args)
    return self._lower(inputs, static)


def _over_this_process(each: jax.Array) -> jax.Array:
  """Each device's value (a global array ``(P, ...)``) reduced over this process's
  devices, on one of them: floats averaged, integers and booleans summed.

  No collective runs: every process gets its own devices' reduction.
  """
  shards = [shard.data for shard in each.addressable_shards]
  device = next(iter(shards[0].devices()))
  rows = jnp.concatenate([jax.device_put(shard, device) for shard in shards])
  return _reduce_over(rows, 0, None)


def check_extra_args(extra: dict[str, Any]) -> None:
  """Refuses extra arguments the step cannot carry to ``tx.update``, saying why.

  Raises:
    ValueError: a name the library passes itself (``topka2a_...``).
    TypeError: a value that is not arrays: the arguments enter the jitted
      step as its inputs.
  """
  for name, value in extra.items():
    if name.startswith("topka2a_"):
      raise ValueError(f"extra argument {name!r}: names starting 'topka2a_' are "
                       "the library's own (the training step passes them); rename it")
    for leaf in jax.tree.leaves(value):
      if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, bool)):
        raise TypeError(
            f"extra argument {name!r} holds a {type(leaf).__name__}; the step "
            "passes extra arguments to tx.update as inputs of its jitted "
            "computation, so they must be arrays or numbers")


def _outline(structure: Any) -> str:
  """An optimizer state's structure in words: the types of its states, outermost
  first, whatever parameters they hold (the nodes inside a state are not named)."""
  def named(node: Any) -> str:
    if isinstance(node, (tuple, list)) and not hasattr(node, "_fields"):
      return f"({', '.join(map(named, node))})"
    return type(node).__name__

  return named(jax.tree.unflatten(structure, [0] * structure.num_leaves))


def _deleted(leaf: Any) -> bool:
  """Whether ``leaf`` is an array whose buffer is gone (traced values have none)."""
  return (isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)
          and leaf.is_deleted())


def _check_not_donated(params: Any, opt_state: Any) -> None:
  """Raises, naming donation, if an input's buffer was given to an earlier step."""
  for what, tree in (("parameter", params), ("optimizer state", opt_state)):
    if not any(map(_deleted, jax.tree.leaves(tree))):
      continue
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if _deleted(leaf):
        raise ValueError(
            f"{what} {jax.tree_util.keystr(path)} was donated to an earlier call "
            "of this step (train_step donates its inputs by default, so that "
            "the new state can reuse their memory): pass the arrays that call "
            "returned, or build the step with donate=False to keep the inputs")


def train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axis_name: Hashable = "data",
    has_aux: bool = False,
    micro_batches: int = 1,
    param_specs: Any = None,
    donate: bool = True,
) -> TrainStep:
  """Builds a jitted data-parallel training step around ``tx``'s sparse exchange.

  The step runs ``loss_fn`` on each device's slice of the batch, inside a
  ``jax.shard_map`` manual over ``axis_name`` only: other mesh axes (a
  ``"model"`` axis the parameters are sharded over) stay with the
  partitioner, so ``loss_fn`` is written as for ``jax.jit``. The gradients
  are per device; ``tx`` (a chain that starts with
  :func:`topka2a_jax.topka2a`) averages them sparsely, and the parameters
  are updated identically everywhere. Each device selects from, and keeps
  residuals for, only its own shard of every parameter, read from the
  parameters' shardings (or ``param_specs``).

  Args:
    loss_fn: ``loss_fn(params, batch)`` returning a scalar, or ``(loss,
      metrics)`` with ``has_aux=True``; ``loss_fn(params, batch, key)`` when
      the step is called with a key.
    tx: the optimizer, e.g. ``optax.chain(topka2a(0.01, mesh=mesh),
      optax.adam(1e-3))``.
    mesh: the device mesh; its axis ``axis_name`` splits the batch.
    axis_name: the data-parallel axis (the one ``topka2a`` was built with),
      or the pair of axes it was built with; the batch splits over both.
    has_aux: ``loss_fn`` returns ``(loss, metrics)``. The step returns the
      metrics over the data axis: floating leaves averaged, integer and
      boolean leaves summed (a mean or a count over the global batch).
    micro_batches: each device's batch is split into this many contiguous
      micro-batches; their gradients are summed in order and divided by
      their number, then exchanged once (one exchange per step, like
      PyTorch DDP's ``no_sync``).
    param_specs: the parameters' ``PartitionSpec`` pytree over the other mesh
      axes. Not needed when the step is called with arrays placed on the
      mesh, nor on meshes with explicit axes: their shardings say it. Inside
      a larger ``jax.jit`` on automatic axes, pass it, else each device
      exchanges whole parameters (correct, with more work).
    donate: donate the incoming parameters' and state's buffers.

  Returns:
    A :class:`TrainStep`: ``step(params, opt_state, batch, key=None)`` returns
    ``(params, opt_state, loss)`` (and the metrics); ``loss`` is the mean over
    the devices of each one's loss where it took its gradient: with
    :func:`topka2a_jax.local_steps`, at its own local parameters, not at the
    shared ``params`` the step returns (evaluate those with ``loss_fn``
    itself to know how the shared parameters do); with ``local_steps(...,
    overlap=...)``, over this process's devices only, and the metrics too, so
    that no collective runs between round ends. With a ``key``, device
    ``i`` calls ``loss_fn`` with ``fold_in(fold_in(key, i), m)`` for
    micro-batch ``m``: different on every device, the same on every run.
    Concrete inputs are placed on the mesh first (batch split along its
    leading axis over ``axis_name``).

  Raises:
    ValueError: at call, for a batch that does not split evenly, parameters
      sharded over ``axis_name``, or a chain without a topka2a exchange or
      with per-parameter state before it.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> def loss_fn(params, batch, key):  # with a key: dropout
    ...   keep = jax.random.bernoulli(key, 0.9, batch.shape)
    ...   return jnp.mean((batch * keep / 0.9) @ params["w"]), {"kept": jnp.sum(keep)}
    >>> tx = optax.chain(topka2a_jax.topka2a(0.1, mesh=mesh), optax.sgd(0.1))
    >>> params = {"w": jnp.ones((32, 2))}
    >>> step = train_step(loss_fn, tx, mesh, has_aux=True, micro_batches=2)
    >>> opt_state = tx.init(params)
    >>> for i in range(3):
    ...   params, opt_state, loss, metrics = step(
    ...       params, opt_state, jnp.ones((64, 32)), jax.random.key(i))
    >>> int(metrics["kept"]) <= 64 * 32  # a count over the global batch
    True
  """
  axis = check_step_options(mesh, axis_name, micro_batches, donate, has_aux)
  return TrainStep(loss_fn, tx, mesh, axis=axis, has_aux=has_aux,
                   micro_batches=micro_batches, param_specs=param_specs,
                   donate=donate)
