"""Local steps' rounds in flight: each round's exchange runs beside the next round's steps.

With ``local_steps(..., overlap=...)`` the training step's program holds no
exchange. At a round's end it hands the round's pseudo-gradients over, and
:class:`RoundsInFlight` dispatches their exchange as a program of its own
from a thread of its own: a separate execution stream, so that on a host
whose collectives run in line with compute (XLA:CPU) the exchange runs while
the next round's steps compute. The mean it delivers goes into the step
that ends that next round, which alone waits for it; every other step gets
placeholders of the same shapes, ready at once. Where the exchange runs on
each kind of host: ``docs/layout.md``, "Rounds in flight".

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> tx = topka2a_jax.local_steps(optax.sgd(0.01), every=2, overlap="delayed", mesh=mesh)
  >>> step = topka2a_jax.train_step(lambda p, x: jnp.mean((x @ p["w"] - 1) ** 2), tx, mesh)
  >>> params = {"w": jnp.zeros((16, 1))}
  >>> state = tx.init(params)
  >>> for _ in range(4):  # two rounds: the first round's mean is applied at the second's end
  ...   params, state, loss = step(params, state, jnp.ones((8, 16)))
  >>> int(state.in_flight.rounds), bool(params["w"][0, 0] > 0)
  (2, True)
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from topka2a_jax._src.axis import DataAxis, holds_tracer
from topka2a_jax._src.runtime import in_flight
from topka2a_jax._src.states import LocalStepsState
from topka2a_jax._src.training import placement
from topka2a_jax._src.transforms.clipping import held
from topka2a_jax._src.transforms.extra_args import BACKWARD_SECONDS, PARAM_SPECS, RoundArrived
from topka2a_jax._src.transforms.local_steps import OVERLAPPED, Overlapped


def overlapped_of(tx: Any) -> Overlapped | None:
  """The :class:`Overlapped` record of the overlapped ``local_steps`` in ``tx``, or None."""
  found = [getattr(update, OVERLAPPED) for update in held(tx)
           if callable(update) and hasattr(update, OVERLAPPED)]
  return found[0] if found else None


def local_state(opt_state: Any) -> LocalStepsState:
  """The one ``local_steps`` state in ``opt_state`` (wrappers' states around it included)."""
  is_local = lambda node: isinstance(node, LocalStepsState)
  return next(node for node in jax.tree.leaves(opt_state, is_leaf=is_local) if is_local(node))


def _is_spec(node: Any) -> bool:
  return isinstance(node, P)


def _value(scalar: jax.Array) -> int:
  """A replicated scalar's value, read from this process's copy."""
  return int(np.asarray(scalar.addressable_data(0)))


class RoundsInFlight:
  """Dispatches each round's exchange and hands its mean to the step that needs it.

  The training step calls :meth:`before` with the state it is given (whether
  this step ends a round, and what to pass as ``topka2a_arrived``) and
  :meth:`after` with the state it returns. The rounds' counters are read
  from the devices only where the state is not the one the last step
  returned, or where a step that should have ended a round did not (a step
  skipped as not finite), so the steps between rounds do not wait for one
  another.

  Args:
    mesh: the training mesh.
    axis: its data axis.
    overlapped: the record of the optimizer's ``local_steps``.
  """

  def __init__(self, mesh: Mesh, axis: DataAxis, overlapped: Overlapped):
    self._mesh, self._axis, self._overlapped = mesh, axis, overlapped
    self._pool = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix="topka2a-round-exchange")
    self._programs: dict[Any, Any] = {}
    self._in_flight: tuple[int, concurrent.futures.Future] | None = None
    self._known: tuple[Any, int, int, bool] | None = None  # (state's step array, counters)
    self._placeholders: dict[Any, RoundArrived] = {}
    in_flight.register(self)

  def settle(self) -> None:
    """Returns once the exchange of the round in flight has ended (at once if none)."""
    if self._in_flight is not None:
      jax.block_until_ready(self._in_flight[1].result())

  def program(self, local: LocalStepsState, spec_tree: Any, backward: float) -> Any:
    """The jitted exchange of a round's pseudo-gradients, for these layouts.

    ``spec_tree``: the parameters' specs over the other mesh axes, as the step's.
    """
    key = (jax.tree.structure(local), jax.tree.structure(spec_tree, is_leaf=_is_spec),
           tuple(jax.tree.leaves(spec_tree, is_leaf=_is_spec)), backward)
    if key not in self._programs:
      state_specs = placement.specs_of(local, self._axis, spec_tree)
      exchange = functools.partial(self._overlapped.exchange,
                                   **{PARAM_SPECS: spec_tree, BACKWARD_SECONDS: backward})
      self._programs[key] = jax.jit(jax.shard_map(
          exchange, mesh=self._mesh,
          in_specs=(state_specs.in_flight.sent, state_specs.exchange),
          out_specs=RoundArrived(spec_tree, state_specs.exchange, P()),
          axis_names=set(self._axis.names)))
    return self._programs[key]

  def specs(self, local: LocalStepsState, spec_tree: Any) -> tuple[Any, Any]:
    """The specs of :class:`RoundArrived` and of a round handed over, inside the step."""
    state_specs = placement.specs_of(local, self._axis, spec_tree)
    return (RoundArrived(spec_tree, state_specs.exchange, P()),
            (state_specs.in_flight.sent, state_specs.exchange))

  def _placeholder(self, local: LocalStepsState, params: Any) -> RoundArrived:
    """Zeros shaped and laid out as a round's arrival: what the other steps are given."""
    key = (jax.tree.structure(local), tuple(
        (leaf.shape, str(leaf.dtype), leaf.sharding) for leaf in jax.tree.leaves(params)))
    if key not in self._placeholders:
      zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
      shardings = RoundArrived(
          jax.tree.map(lambda leaf: leaf.sharding, params),
          jax.tree.map(lambda leaf: leaf.sharding, local.exchange),
          NamedSharding(self._mesh, P()))
      self._placeholders[key] = jax.jit(
          lambda p, e: RoundArrived(zeros(p), zeros(e), jnp.bool_(False)),
          out_shardings=shardings)(params, local.exchange)
    return self._placeholders[key]

  def before(self, params: Any, opt_state: Any, spec_tree: Any,
             backward: float) -> tuple[RoundArrived, bool]:
    """``(arrived, ends)``: what this step is given as the round in flight's mean,
    and whether it ends a round (then it hands its round over)."""
    local = local_state(opt_state)
    if holds_tracer([local.step]):
      raise ValueError(
          "local_steps(overlap=...) runs each round's exchange as a program of its own, "
          "beside the step's: call the training step at top level, not inside jax.jit or "
          "nnx.jit (or build local_steps without overlap to trace it into a larger program)")
    if self._known is not None and self._known[0] is local.step:
      _, step, rounds, pending = self._known
    else:
      step, rounds = _value(local.step), _value(local.in_flight.rounds)
      pending = bool(_value(local.in_flight.pending))
    self._known = (None, step, rounds, pending)
    ends = step + 1 >= int(self._overlapped.lengths.at(jnp.asarray(rounds)))
    if not (ends and pending):
      return self._placeholder(local, params), ends
    if self._in_flight is None or self._in_flight[0] != rounds:
      # A state this step did not hand over (restored, or another's): its round
      # in flight is exchanged now, from copies, so that its mean is applied once.
      copies = jax.tree.map(jnp.copy, (local.in_flight.sent, local.exchange))
      self._dispatch(rounds, local, spec_tree, backward, copies)
    return self._in_flight[1].result(), ends

  def after(self, opt_state: Any, ends: bool, handed: Any, spec_tree: Any,
            backward: float) -> None:
    """Dispatches the round ``handed`` over, where the step ended one."""
    local = local_state(opt_state)
    _, step, rounds, pending = self._known
    if not ends:
      self._known = (local.step, step + 1, rounds, pending)
      return
    if _value(local.in_flight.rounds) != rounds + 1:  # skipped: read anew next time
      self._known = None
      return
    self._dispatch(rounds + 1, local, spec_tree, backward, handed)
    self._known = (local.step, 0, rounds + 1, True)

  def _dispatch(self, rounds: int, local: LocalStepsState, spec_tree: Any,
                backward: float, handed: Any) -> None:
    program = self.program(local, spec_tree, backward)
    self._in_flight = (rounds, self._pool.submit(program, *handed))
