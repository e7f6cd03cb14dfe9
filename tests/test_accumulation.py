"""accumulate_gradients: one small batch a call, one exchange every ``every`` calls.

References: the same optimizer given the whole batch in one call (every
device's share of it is the union of its shares of the small batches, so
the mean gradient is the same to float32 rounding); plain SGD on least
squares written out in NumPy (float64); and the exchange's bytes from the
cost model.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import resumable
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax
from topka2a_jax._src.planner.cost import exchange_cost

DEVICES, EVERY = 8, 4


def readme_problem():
  """The README's program: its loss, parameters and batch."""
  def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)

  params = {"w1": jax.random.normal(jax.random.key(0), (16, 256)) / 4,
            "w2": jax.random.normal(jax.random.key(1), (256, 4)) / 16}
  x = jax.random.normal(jax.random.key(2), (512, 16))
  return loss_fn, params, (x, jnp.sin(x[:, :4]))


def small_batches(batch, parts=EVERY):
  """``batch`` as ``parts`` small batches, each holding every device's next slice of
  its own share: over the calls each device sees the rows the whole call gives it."""
  def part(x, i):
    x = np.asarray(x)
    blocks = x.reshape(DEVICES, parts, -1, *x.shape[1:])
    return blocks[:, i].reshape(-1, *x.shape[1:])
  return [jax.tree.map(lambda x, i=i: part(x, i), batch) for i in range(parts)]


def copy(tree):
  return jax.tree.map(jnp.copy, tree)


OPTIMIZERS = {
    "8 bits, then Adam": lambda mesh, **dense: optax.chain(
        topka2a_jax.topka2a(0.01, mesh=mesh, **dense), optax.adam(1e-2)),
    "a top-k, then SGD": lambda mesh, **dense: optax.chain(
        topka2a_jax.topka2a(0.05, mesh=mesh, min_size=0, **dense), optax.sgd(0.5)),
    "compress_updates of adam": lambda mesh, **dense: topka2a_jax.compress_updates(
        optax.adam(1e-2), mesh=mesh, **dense),
    "sharded adam": lambda mesh, **dense: topka2a_jax.sharded_optimizer(
        optax.adam(1e-2), density=1.0, mesh=mesh, **dense),
    "local steps of adam": lambda mesh, **dense: topka2a_jax.local_steps(
        optax.adam(1e-2), every=2, mesh=mesh, **dense),
}


def whole_and_accumulated(make, mesh):
  """The README problem's parameters after 3 whole-batch steps of ``make()``, and after
  3 x 4 quarter-batch calls of ``accumulate_gradients(make(), 4)``."""
  loss_fn, params, batch = readme_problem()
  whole_tx, accumulated_tx = make(), topka2a_jax.accumulate_gradients(make(), every=EVERY)
  whole_step = topka2a_jax.train_step(loss_fn, whole_tx, mesh)
  accumulated_step = topka2a_jax.train_step(loss_fn, accumulated_tx, mesh)
  want, want_state = copy(params), whole_tx.init(params)
  got, got_state = copy(params), accumulated_tx.init(params)
  for _ in range(3):
    want, want_state, _ = whole_step(want, want_state, batch)
    for small in small_batches(batch):
      got, got_state, _ = accumulated_step(got, got_state, small)
  moved = max(float(jnp.abs(w - p).max()) for w, p in zip(jax.tree.leaves(want),
                                                             jax.tree.leaves(params)))
  assert moved > 1e-3  # else the comparison says nothing
  return [(np.asarray(w), np.asarray(g))
          for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got))]


def rounding(want):
  """A float32 tolerance for results of the parameters' scale after a few steps."""
  return 256 * np.finfo(np.float32).eps * float(np.abs(want).max())


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_four_calls_of_a_quarter_batch_are_one_call_of_the_whole(mesh, name):
  """Through a dense exchange, to float32 rounding, for every transform with an exchange."""
  make = lambda: OPTIMIZERS[name](mesh, algorithm="dense")
  for want, got in whole_and_accumulated(make, mesh):
    np.testing.assert_allclose(got, want, rtol=0, atol=rounding(want))


def test_the_readme_program_accumulated_is_the_readme_program(mesh):
  """The README's optimizer as written (every entry in 8 bits before Adam): the same
  parameters to float32 rounding, but where the code rounds a mean that differs in its
  last bits to the next step of the code (at most 1 entry in 1000)."""
  compared = whole_and_accumulated(lambda: OPTIMIZERS["8 bits, then Adam"](mesh), mesh)
  entries = sum(want.size for want, _ in compared)
  off = sum(int((np.abs(got - want) > rounding(want)).sum()) for want, got in compared)
  assert off <= entries // 1000, f"{off} of {entries} entries differ beyond rounding"


def test_the_calls_between_change_nothing_but_the_sums(mesh):
  """Calls 1-3 leave the parameters and the wrapped state bitwise; the 4th is SGD on
  the mean gradient of all 4 x 8 slices, in NumPy."""
  rng = np.random.default_rng(0)
  w0 = rng.normal(size=(16, 4)).astype(np.float32)
  batches = [rng.normal(size=(DEVICES * 2, 16)).astype(np.float32) for _ in range(EVERY)]
  tx = topka2a_jax.accumulate_gradients(optax.chain(
      topka2a_jax.topka2a(algorithm="dense", mesh=mesh), optax.adam(0.1)), every=EVERY)
  loss = lambda p, x: jnp.mean((x @ p["w"] - 1.0) ** 2)
  step = topka2a_jax.train_step(loss, tx, mesh, donate=False)
  params = {"w": jnp.asarray(w0)}
  state = tx.init(params)
  for i, x in enumerate(batches):
    before_params, before_inner = params, state.inner
    params, state, _ = step(params, state, x)
    if i < EVERY - 1:
      chex.assert_trees_all_equal(params, before_params)
      chex.assert_trees_all_equal(state.inner, before_inner)
      assert int(state.step) == i + 1
  assert int(state.step) == 0 and int(state.inner[1][0].count) == 1
  x = np.concatenate(batches).astype(np.float64)
  grad = 2 * x.T @ (x @ w0 - 1.0) / (x.shape[0] * 4)
  # Adam's first step: -lr * g / (|g| + eps), eps = 1e-8.
  want = w0 - 0.1 * grad / (np.abs(grad) + 1e-8)
  np.testing.assert_allclose(np.asarray(params["w"]), want, rtol=0,
                             atol=16 * np.finfo(np.float32).eps * np.abs(w0).max())


def test_sgd_over_accumulated_steps_matches_numpy(mesh):
  """Plain SGD, a dense exchange: every accumulated step moves by lr times the mean
  gradient of its calls, from the parameters the step began at (NumPy, float64)."""
  rng = np.random.default_rng(1)
  w = np.zeros((16, 4))
  target = rng.normal(size=(16, 4))
  tx = topka2a_jax.accumulate_gradients(optax.chain(
      topka2a_jax.topka2a(algorithm="dense", mesh=mesh), optax.sgd(0.05)), every=3)
  loss = lambda p, x: jnp.mean((x @ p["w"] - x @ jnp.asarray(target, jnp.float32)) ** 2)
  step = topka2a_jax.train_step(loss, tx, mesh)
  params = {"w": jnp.zeros((16, 4))}
  state = tx.init(params)
  for _ in range(4):
    calls = [rng.normal(size=(DEVICES, 16)) for _ in range(3)]
    for x in calls:
      params, state, _ = step(params, state, x.astype(np.float32))
    x = np.concatenate(calls)
    w = w - 0.05 * 2 * x.T @ (x @ (w - target)) / (x.shape[0] * 4)
  np.testing.assert_allclose(np.asarray(params["w"]), w, rtol=0,
                             atol=64 * np.finfo(np.float32).eps * np.abs(w).max())


def test_the_exchange_runs_once_per_accumulated_step_with_one_steps_bytes(mesh):
  """The compiled call holds the exchange of the whole model once, in the branch the
  every-th call takes: per call, 1/every of the whole-batch step's bytes."""
  loss_fn, params, batch = readme_problem()
  plain = optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh), optax.adam(1e-2))
  accumulated = topka2a_jax.accumulate_gradients(
      optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh), optax.adam(1e-2)), every=EVERY)
  reports = {}
  for name, tx, x in (("plain", plain, batch),
                      ("accumulated", accumulated, small_batches(batch)[0])):
    step = topka2a_jax.train_step(loss_fn, tx, mesh)
    reports[name] = topka2a_jax.comm_report(step.lower(params, tx.init(params), x))
  in_branch = sum(row.bytes for row in reports["accumulated"].collectives if row.in_branch)
  entries = 16 * 256 + 256 * 4
  flag = 2 * (DEVICES - 1) / DEVICES * 4  # one int32 all-reduce: is the gradient finite?
  assert in_branch == exchange_cost("quantized_8_8_fine", entries, DEVICES, 1.0).bytes + flag
  every_call = reports["accumulated"].total_bytes - in_branch  # the loss's mean
  assert every_call == flag
  assert reports["plain"].total_bytes == pytest.approx(in_branch + every_call)
  assert reports["accumulated"].step_bytes(EVERY) == pytest.approx(
      in_branch / EVERY + every_call)


def test_nnx_train_step_accumulates_as_one_call_of_the_whole_batch(mesh):
  """nnx.Optimizer holding accumulate_gradients: 4 quarter calls, one whole call's model."""
  nnx = pytest.importorskip("flax.nnx")

  def make():
    return nnx.Sequential(nnx.Linear(16, 64, rngs=nnx.Rngs(0)), nnx.tanh,
                          nnx.Linear(64, 4, rngs=nnx.Rngs(1)))

  def loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)

  _, _, batch = readme_problem()
  train = topka2a_jax.nnx_train_step(loss, mesh)
  whole, accumulated = make(), make()
  whole_optimizer = nnx.Optimizer(whole, optax.chain(
      topka2a_jax.topka2a(mesh=mesh), optax.adam(1e-2)), wrt=nnx.Param)
  accumulated_optimizer = nnx.Optimizer(accumulated, topka2a_jax.accumulate_gradients(
      optax.chain(topka2a_jax.topka2a(mesh=mesh), optax.adam(1e-2)), every=EVERY),
      wrt=nnx.Param)
  for _ in range(2):
    train(whole, whole_optimizer, batch)
    for small in small_batches(batch):
      train(accumulated, accumulated_optimizer, small)
  want = nnx.as_pure(nnx.state(whole, nnx.Param))
  got = nnx.as_pure(nnx.state(accumulated, nnx.Param))
  eps = np.finfo(np.float32).eps
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0,
                               atol=256 * eps * float(jnp.abs(w).max()))


def test_multisteps_after_the_exchange_is_allowed_and_averages_the_means(mesh):
  """optax.MultiSteps after the exchange adds up the mean, the same on every device:
  allowed (it exchanges every call); the parameters are SGD on the calls' mean."""
  rng = np.random.default_rng(2)
  tx = optax.chain(topka2a_jax.topka2a(algorithm="dense", mesh=mesh),
                   optax.MultiSteps(optax.sgd(0.1), EVERY))
  loss = lambda p, x: jnp.mean((x @ p["w"] - 1.0) ** 2)
  step = topka2a_jax.train_step(loss, tx, mesh)
  params = {"w": jnp.zeros((16, 4))}
  state = tx.init(params)
  calls = [rng.normal(size=(DEVICES, 16)) for _ in range(EVERY)]
  for x in calls:
    params, state, _ = step(params, state, x.astype(np.float32))
  x = np.concatenate(calls)
  want = -0.1 * 2 * x.T @ (x @ np.zeros((16, 4)) - 1.0) / (x.shape[0] * 4)
  np.testing.assert_allclose(np.asarray(params["w"]), want, rtol=0,
                             atol=16 * np.finfo(np.float32).eps * np.abs(want).max())


def test_a_non_finite_call_skips_its_accumulated_step_and_the_next_one_trains(mesh):
  """A NaN in one call: the accumulated step is skipped everywhere and counted; the
  sums start again, so the next accumulated step is the SGD of its own calls."""
  tx = topka2a_jax.accumulate_gradients(optax.chain(
      topka2a_jax.topka2a(algorithm="dense", mesh=mesh, skip_nonfinite=True),
      optax.sgd(0.1)), every=2)
  loss = lambda p, x: jnp.mean((x @ p["w"] - 1.0) ** 2)
  step = topka2a_jax.train_step(loss, tx, mesh)
  params = {"w": jnp.zeros((16, 4))}
  state = tx.init(params)
  bad = np.ones((DEVICES, 16), np.float32)
  bad[3, 5] = np.nan
  good = np.ones((DEVICES, 16), np.float32)
  for x in (good, bad):
    params, state, _ = step(params, state, x)
  assert float(jnp.abs(params["w"]).max()) == 0.0
  assert int(state.inner[0].nonfinite_steps) == 1 and int(state.step) == 0
  for x in (good, good):
    params, state, _ = step(params, state, x)
  # d/dw mean((x @ w - 1)^2) at w = 0, x all ones: -2 * 1 / 4 per entry.
  np.testing.assert_allclose(np.asarray(params["w"]), np.full((16, 4), 0.05), rtol=1e-6)


def test_a_hand_written_shard_map_accumulates_with_state_specs(mesh):
  """tx.update inside the user's own shard_map, state laid out by state_specs."""
  tx = topka2a_jax.accumulate_gradients(optax.chain(
      topka2a_jax.topka2a(algorithm="dense", mesh=mesh), optax.sgd(1.0)), every=2)
  params = {"w": jnp.zeros(4)}
  state = topka2a_jax.init(tx, params, mesh)
  specs = topka2a_jax.state_specs(state)

  def update(grads, state, params):
    updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, params)
    return optax.apply_updates(params, updates), state

  run = jax.jit(jax.shard_map(update, mesh=mesh, in_specs=(P("data"), specs, P()),
                              out_specs=(P(), specs)))
  rng = np.random.default_rng(3)
  calls = [rng.normal(size=(DEVICES, 4)).astype(np.float32) for _ in range(2)]
  for grads in calls:
    params, state = run(
        {"w": jax.device_put(grads, NamedSharding(mesh, P("data")))}, state, params)
  np.testing.assert_allclose(np.asarray(params["w"]),
                             -np.mean(np.concatenate(calls), 0), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("new", [8, 4])
def test_restored_mid_accumulation_the_step_takes_the_mean_gradient_so_far(tmp_path, new):
  """Saved after 2 of 4 calls on 8 devices, restored onto ``new`` and given 2 zero
  gradients: plain SGD moves by lr times the saved sums' mean over devices / 4."""
  tx = topka2a_jax.accumulate_gradients(optax.chain(
      topka2a_jax.topka2a(algorithm="dense"), optax.sgd(0.1)), every=4)
  mesh = resumable_mesh(8)
  state = resumable.train(resumable.fresh(mesh, tx), mesh, range(2), tx)
  assert int(state["opt_state"].step) == 2
  at_save = {k: np.asarray(v, np.float64) for k, v in state["params"].items()}
  owed = {k: -0.1 * np.asarray(s, np.float64).mean(0) / 4
          for k, s in state["opt_state"].grads.items()}
  assert max(np.abs(o).max() for o in owed.values()) > 1e-3  # else the test is void
  topka2a_jax.save(tmp_path / "ckpt", state, mesh)
  mesh = resumable_mesh(new)
  restored = topka2a_jax.restore(tmp_path / "ckpt", resumable.fresh(mesh, tx), mesh)
  step = topka2a_jax.train_step(lambda p, x: 0.0 * jnp.sum(p["w"]), tx, mesh)
  params, opt_state = restored["params"], restored["opt_state"]
  for i in range(2):
    params, opt_state, _ = step(params, opt_state, resumable.batch(i))
  assert int(opt_state.step) == 0 and int(opt_state.inner[0].count) == 1
  for k, moved_to in params.items():
    np.testing.assert_allclose(np.asarray(moved_to, np.float64), at_save[k] + owed[k],
                               rtol=0, atol=8 * np.finfo(np.float32).eps)


def test_a_checkpoint_restored_into_another_every_is_refused(tmp_path):
  """Saved 2 calls into 4; rebuilt with every=8: refused, naming both; the right one loads."""
  mesh = resumable_mesh(8)

  def tx(every):
    return topka2a_jax.accumulate_gradients(optax.chain(
        topka2a_jax.topka2a(algorithm="dense"), optax.sgd(0.1)), every=every)

  state = resumable.train(resumable.fresh(mesh, tx(4)), mesh, range(2), tx(4))
  topka2a_jax.save(tmp_path / "ckpt", state, mesh)
  with pytest.raises(ValueError, match=r"saved by accumulate_gradients\(\.\.\., every=4\) "
                     r"and is restored into the state of accumulate_gradients\(\.\.\., "
                     r"every=8\).*2 calls in.*Build the optimizer with every=4"):
    topka2a_jax.restore(tmp_path / "ckpt", resumable.fresh(mesh, tx(8)), mesh)
  restored = topka2a_jax.restore(tmp_path / "ckpt", resumable.fresh(mesh, tx(4)), mesh)
  assert int(restored["opt_state"].step) == 2


def resumable_mesh(devices):
  return jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])


@pytest.mark.parametrize("call, error, match", [
    (lambda mesh: topka2a_jax.accumulate_gradients(optax.sgd(0.1), every=0), ValueError,
     "every must be at least 1"),
    (lambda mesh: topka2a_jax.accumulate_gradients(optax.sgd(0.1), every=2.0), TypeError,
     "every must be an int"),
    (lambda mesh: topka2a_jax.accumulate_gradients(optax.adam, every=2), TypeError,
     "inner must be an optax.GradientTransformation"),
    (lambda mesh: topka2a_jax.accumulate_gradients(optax.adam(1e-3), every=2).init(
        {"w": jnp.zeros(4)}), ValueError,
     r"holds no topka2a exchange.*accumulate_gradients\(optax.chain\(topka2a_jax.topka2a"),
    (lambda mesh: topka2a_jax.accumulate_gradients(optax.chain(topka2a_jax.topka2a(0.01),
                                                               optax.sgd(0.1)), every=2).init(
        {"w": jnp.zeros(4)}), ValueError,
     r"topka2a does not know the mesh .* Build it with topka2a\(\.\.\., mesh=mesh\)"),
    (lambda mesh: topka2a_jax.accumulate_gradients(topka2a_jax.accumulate_gradients(
        optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh), optax.sgd(0.1)), every=2),
        every=2).init({"w": jnp.zeros(4)}), ValueError,
     "wraps another accumulate_gradients.*Use one, with every= the product of the two"),
], ids=["every-0", "every-float", "factory", "no-exchange", "no-mesh", "nested"])
def test_bad_arguments_are_refused_naming_the_fix(mesh, call, error, match):
  with pytest.raises(error, match=match):
    call(mesh)


@pytest.mark.parametrize("wrapper", ["accumulate_gradients", "local_steps"])
def test_an_optimizer_after_a_whole_optimizer_is_refused_naming_the_fix(mesh, wrapper):
  """``chain(local_steps(adam), adam)`` diverged and ``chain(accumulate_gradients(topka2a),
  adam)`` stepped Adam on every call's zeros, both in silence: the README program refuses
  them at ``init`` and, where ``init`` went another way, at the step."""
  loss_fn, params, batch = readme_problem()
  whole = {"accumulate_gradients": lambda: topka2a_jax.accumulate_gradients(
               topka2a_jax.topka2a(0.01, mesh=mesh), every=EVERY),
           "local_steps": lambda: topka2a_jax.local_steps(optax.adam(1e-2), mesh=mesh)}
  fix = {"accumulate_gradients": r"accumulate_gradients\(optax.chain\(topka2a_jax.topka2a",
         "local_steps": r"local_steps\(optax.adam\(...\), outer=...\), and use it alone"}
  tx = optax.chain(whole[wrapper](), optax.adam(1e-2))
  match = rf"{wrapper}\(...\) must be the whole optimizer, yet its chain runs scale_by_adam .*"
  with pytest.raises(ValueError, match=match + fix[wrapper]):
    tx.init(params)
  state = (whole[wrapper]().init(params), optax.adam(1e-2).init(params))
  with pytest.raises(ValueError, match=match + fix[wrapper]):
    topka2a_jax.train_step(loss_fn, tx, mesh)(copy(params), state, batch)
