"""local_steps(..., overlap=...): each round's exchange runs beside the next round's steps.

References: a NumPy model (float64) of local SGD on per-device least squares
with outer SGD with momentum, the round's mean applied a round late, under
the delayed rule (the next round starts from the shared parameters without
the round in flight), the eager one (each device also moves at once by the
outer step of its own pseudo-gradient over the device count; Kale et al.,
arXiv 2502.12996) and the own one (by the outer step of its whole
pseudo-gradient), written out by hand; and checkpoints restored with a
round in flight, whose mean must move the shared parameters once.
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import resumable
from cases import nnx_against_functional
from flax import nnx

import topka2a_jax

DEVICES, ROWS = 8, 16
LR, OUTER_LR, OUTER_MOMENTUM = 0.05, 0.7, 0.9


def _least_squares(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] - y) ** 2)


def _close(got, want, what):
  scale = max(1.0, float(np.abs(want).max()))
  np.testing.assert_allclose(got, want, rtol=1e-5,
                             atol=64 * np.finfo(np.float32).eps * scale, err_msg=what)


def _model(x, y, rule, every, rounds):
  """The shared parameters after every step, NumPy float64."""
  shared, trace = np.zeros((12, 3)), np.zeros((12, 3))
  start = np.zeros((DEVICES, 12, 3))  # each device's offset at its round's start
  local, in_flight, history = shared + start, None, []
  parts = [(x[d * ROWS:(d + 1) * ROWS].astype(np.float64),
            y[d * ROWS:(d + 1) * ROWS].astype(np.float64)) for d in range(DEVICES)]
  for _ in range(rounds):
    for i in range(every):
      for d, (xs, ys) in enumerate(parts):
        local[d] = local[d] - LR * 2 * xs.T @ (xs @ local[d] - ys) / ys.size
      if i < every - 1:
        history.append(shared.copy())
    pseudo = shared + start - local  # where each device's round started, minus its end
    if in_flight is not None:
      trace = OUTER_MOMENTUM * trace + in_flight.mean(0)
      shared = shared - OUTER_LR * trace
    in_flight = pseudo
    if rule != "delayed":  # eager: its share of the mean; own: its whole round
      share = pseudo / DEVICES if rule == "eager" else pseudo
      start = -OUTER_LR * (OUTER_MOMENTUM * trace + share)
    else:
      start = np.zeros_like(start)
    local = shared + start
    history.append(shared.copy())
  return history


@pytest.mark.parametrize("every", [3, 1])
@pytest.mark.parametrize("rule", ["eager", "own", "delayed"])
def test_the_late_rules_match_the_numpy_model_step_by_step(mesh, rule, every):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(DEVICES * ROWS, 12)).astype(np.float32)
  y = rng.normal(size=(DEVICES * ROWS, 3)).astype(np.float32)
  tx = topka2a_jax.local_steps(
      optax.sgd(LR), every=every, outer=optax.sgd(OUTER_LR, momentum=OUTER_MOMENTUM),
      algorithm="dense", overlap=rule, mesh=mesh)
  step = topka2a_jax.train_step(_least_squares, tx, mesh)
  params = {"w": jnp.zeros((12, 3))}
  state = tx.init(params)
  rounds = 4 if every > 1 else 6
  for i, want in enumerate(_model(x, y, rule, every, rounds)):
    params, state, _ = step(params, state, (x, y))
    _close(np.asarray(params["w"]), want, f"step {i}")
  assert int(state.in_flight.rounds) == rounds and bool(state.in_flight.pending)
  assert int(state.exchange.count) == rounds - 1  # the last round is still in flight


def test_the_exchange_runs_on_its_own_thread_while_the_next_steps_run(mesh):
  """The step that ends a round hands it over and returns before its exchange ends:
  the steps of the next round are dispatched while the exchange program runs on
  the library's exchange thread."""
  tx = topka2a_jax.local_steps(optax.sgd(LR), every=2, algorithm="dense", overlap=True,
                               mesh=mesh)
  step = topka2a_jax.train_step(_least_squares, tx, mesh)
  params, batch = {"w": jnp.zeros((12, 3))}, (jnp.ones((DEVICES * ROWS, 12)),
                                               jnp.ones((DEVICES * ROWS, 3)))
  state = tx.init(params)
  threads = set()
  flight = step._flight(tx)
  program = flight.program

  def recording(*args):
    made = program(*args)
    return lambda *inputs: (threads.add(threading.current_thread().name), made(*inputs))[1]

  flight.program = recording
  for _ in range(6):
    params, state, _ = step(params, state, batch)
  assert threads == {next(iter(threads))} and threads.pop().startswith("topka2a-round-exchange")


@pytest.mark.parametrize("algorithm", ["dense", "rotated_4_4"])
def test_comm_report_counts_the_round_the_step_dispatches(mesh, algorithm):
  """The overlapped step's program holds no exchange; its lowered report holds the
  round's, spread over the round as an in-line round's is (the same collectives)."""
  params, batch = {"w": jnp.zeros((64, 3))}, (jnp.ones((DEVICES * ROWS, 64)),
                                               jnp.ones((DEVICES * ROWS, 3)))
  reports = {}
  for overlap in (False, True):
    tx = topka2a_jax.local_steps(optax.adam(LR), every=4, algorithm=algorithm, min_size=0,
                                 overlap=overlap, mesh=mesh)
    step = topka2a_jax.train_step(_least_squares, tx, mesh)
    reports[overlap] = topka2a_jax.comm_report(step.lower(params, tx.init(params), batch))
  exchanged = lambda report: sorted((row.kind, row.count, row.bytes)
                                    for row in report.collectives if row.in_branch)
  assert exchanged(reports[True]) and exchanged(reports[True]) == exchanged(reports[False])
  assert reports[True].step_bytes(4) <= reports[False].step_bytes(4)  # no per-step loss mean


def test_a_hand_written_step_is_told_to_use_the_training_steps(mesh):
  tx = topka2a_jax.local_steps(optax.sgd(LR), every=1, algorithm="dense", overlap="eager")
  state = topka2a_jax.init(tx, {"w": jnp.zeros(4)}, mesh)
  specs = topka2a_jax.state_specs(state)
  run = jax.jit(jax.shard_map(
      lambda g, s, p: tx.update(jax.lax.pcast(g, "data", to="varying"), s, p,
                                topka2a_gradient_at="local_params"), mesh=mesh,
      in_specs=(jax.P(), specs, jax.P()), out_specs=(jax.P(), specs)))
  with pytest.raises(ValueError, match=r"overlap=.*drive it with topka2a_jax.train_step or "
                     r"nnx_train_step.*runs local_steps without overlap"):
    run({"w": jnp.ones(4)}, state, {"w": jnp.zeros(4)})


def test_overlap_is_refused_with_the_inner_state_averaged_and_bad_values_named():
  with pytest.raises(ValueError, match="average_inner_state=True.*in line.*Leave one"):
    topka2a_jax.local_steps(optax.adam(1e-3), overlap=True, average_inner_state=True)
  with pytest.raises(ValueError, match=r"overlap must be False, True, 'eager', 'own' or "
                                       r"'delayed'; got 'late'"):
    topka2a_jax.local_steps(optax.adam(1e-3), overlap="late")


@pytest.mark.parametrize("rule", ["eager", "delayed"])
@pytest.mark.parametrize("new", [8, 4, 3])
def test_a_round_in_flight_at_a_save_is_applied_once_after_the_restore(tmp_path, rule, new):
  """Saved just after a round's end on 8 devices (its exchange in flight), restored onto
  ``new`` with gradients of zero: the next round's end moves the shared parameters by the
  outer step of the saved round's mean pseudo-gradient, and the round after by nothing."""
  mesh = resumable_mesh(8)
  tx = topka2a_jax.local_steps(optax.sgd(0.1), every=2, algorithm="dense", overlap=rule)
  state = resumable.train(resumable.fresh(mesh, tx), mesh, range(4), tx)
  flight = state["opt_state"].in_flight
  assert int(state["opt_state"].step) == 0 and bool(flight.pending)
  at_save = {k: np.asarray(v, np.float64) for k, v in state["params"].items()}
  mean = {k: np.asarray(s, np.float64).mean(0) for k, s in flight.sent.items()}
  assert max(np.abs(m).max() for m in mean.values()) > 1e-3  # else the test is void
  topka2a_jax.save(tmp_path / "ckpt", state, mesh)
  mesh = resumable_mesh(new)
  restored = topka2a_jax.restore(tmp_path / "ckpt", resumable.fresh(mesh, tx), mesh)
  step = topka2a_jax.train_step(_zero_loss, tx, mesh)  # a new step: nothing of the old
  params, opt_state = restored["params"], restored["opt_state"]
  for i in range(2):
    params, opt_state, _ = step(params, opt_state, resumable.batch(i))
  # outer sgd(1.0): the saved round's mean, once (under the eager rule it replaces
  # each device's own share, which its local parameters held)
  for k, moved_to in params.items():
    np.testing.assert_allclose(np.asarray(moved_to, np.float64), at_save[k] - mean[k],
                               rtol=0, atol=16 * np.finfo(np.float32).eps)
  after_one = {k: np.asarray(v, np.float64) for k, v in params.items()}
  for i in range(2):
    params, opt_state, _ = step(params, opt_state, resumable.batch(i))
  # the round after the restore went nowhere from where it started: nothing more
  for k, moved_to in params.items():
    np.testing.assert_array_equal(np.asarray(moved_to, np.float64), after_one[k])
  assert int(opt_state.exchange.count) == 3


def test_a_restore_onto_the_same_devices_goes_on_as_if_never_stopped(tmp_path):
  mesh = resumable_mesh(8)
  tx = topka2a_jax.local_steps(optax.sgd(0.1), every=2, algorithm="dense", overlap="eager")
  state = resumable.train(resumable.fresh(mesh, tx), mesh, range(3), tx)
  topka2a_jax.save(tmp_path / "ckpt", state, mesh)
  straight = resumable.train(state, mesh, range(3, 8), tx)
  restored = topka2a_jax.restore(tmp_path / "ckpt", resumable.fresh(mesh, tx), mesh)
  resumed = resumable.train(restored, mesh, range(3, 8), tx)
  for got, want in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def resumable_mesh(devices):
  return jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])


def _zero_loss(params, x):
  return 0.0 * resumable.loss(params, x)


def test_the_steps_between_round_ends_do_not_wait_for_the_exchange(mesh):
  """The exchange of a round waits, on its thread, until the next round's first two
  steps have returned with their results: had they waited for it, it would never
  have been released (it gives up after a minute, and says so)."""
  tx = topka2a_jax.local_steps(optax.sgd(LR), every=3, algorithm="dense", overlap=True,
                               mesh=mesh)
  step = topka2a_jax.train_step(_least_squares, tx, mesh)
  params, batch = {"w": jnp.zeros((12, 3))}, (jnp.ones((DEVICES * ROWS, 12)),
                                               jnp.ones((DEVICES * ROWS, 3)))
  state = tx.init(params)
  flight = step._flight(tx)
  program, gates, waited = flight.program, [threading.Event() for _ in range(3)], []

  def held_back(*args):
    made = program(*args)

    def run(*inputs):
      waited.append(gates[len(waited)].wait(60))  # the exchange of round len(waited)
      return made(*inputs)

    return run

  flight.program = held_back
  for round_ in range(3):
    for _ in range(2):  # the round's steps before its end
      params, state, _ = step(params, state, batch)
      jax.block_until_ready((params, state))
    if round_:
      gates[round_ - 1].set()  # only now may the last round's exchange run
    params, state, _ = step(params, state, batch)  # ends the round: needs the last one's mean
    jax.block_until_ready(params)
  gates[-1].set()  # the last round's exchange: nothing waits for it
  assert waited[:2] == [True, True], "a step between round ends waited for the exchange"


def test_nnx_train_step_drives_the_rounds_as_train_step_does(mesh):
  """Five steps of rounds of two through nnx.Optimizer equal train_step's, bitwise;
  inside nnx.jit, where the exchange cannot be a program of its own, it is refused."""
  model, optimizer, train, state, batch = nnx_against_functional(
      lambda: topka2a_jax.local_steps(optax.adam(1e-2), every=2, overlap=True, mesh=mesh,
                                      min_size=0), mesh, 5)
  assert int(state.exchange.count) == 1  # the first round's mean, applied at the second's end
  with pytest.raises(ValueError, match="call the training step at top level, not inside "
                     "jax.jit or nnx.jit"):
    nnx.jit(train)(model, optimizer, batch)
