"""compress_updates: Adam per device, its updates exchanged sparsely with error feedback.

References: a NumPy model (float64) of per-device Adam followed by the
exchange model of ``tests/reference.py`` applied to the updates; at density
1.0, a hand-written shard_map step in which every device runs
``optax.adam`` on its own gradient and ``lax.pmean`` averages the updates.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference
from cases import SHAPES, random_grads, residuals_of
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax

DEVICES = 8
# A large eps keeps the first steps (lr * g / (|g| + eps)) apart: with the
# default, every entry of the first step is lr in magnitude, all ties.
B1, B2, EPS, LR = 0.9, 0.999, 0.5, 0.1


def _scale(values):
  return max(1.0, float(np.abs(values).max()))


def _close(got, want, what):
  # float32 roundings of the update and the moments, at the values' scale.
  np.testing.assert_allclose(got, want, rtol=1e-5,
                             atol=64 * np.finfo(np.float32).eps * _scale(want),
                             err_msg=what)


class NumpyAdam:
  """optax.adam's update, per device, in float64 (Kingma and Ba, with bias correction)."""

  def __init__(self, shapes):
    self.mu = {k: np.zeros((DEVICES, *s)) for k, s in shapes.items()}
    self.nu = {k: np.zeros((DEVICES, *s)) for k, s in shapes.items()}
    self.count = 0

  def update(self, grads):
    self.count += 1
    steps = {}
    for k, g in grads.items():
      self.mu[k] = B1 * self.mu[k] + (1 - B1) * g
      self.nu[k] = B2 * self.nu[k] + (1 - B2) * g.astype(np.float64) ** 2
      m = self.mu[k] / (1 - B1 ** self.count)
      v = self.nu[k] / (1 - B2 ** self.count)
      steps[k] = -LR * m / (np.sqrt(v) + EPS)
    return steps


@pytest.mark.parametrize("algorithm", ["topka2a", "allgather"])
def test_ten_steps_match_the_numpy_model(mesh, exchange_steps, algorithm):
  tx = topka2a_jax.compress_updates(optax.adam(LR, b1=B1, b2=B2, eps=EPS), density=0.1,
                                    algorithm=algorithm, selection="exact",
                                    min_size=0, fusion=1)
  steps = [random_grads(seed) for seed in range(10)]
  adam, residuals = NumpyAdam(SHAPES), {}
  for i, (grads, (updates, state)) in enumerate(zip(steps, exchange_steps(tx, mesh,
                                                                            steps))):
    local = adam.update(grads)
    want, residuals = reference.leafwise(algorithm, local, residuals, 0.1)
    got_residuals = residuals_of((state.exchange,))
    for k in SHAPES:
      _close(updates[k], np.broadcast_to(want[k], updates[k].shape), f"step {i} {k}")
      _close(got_residuals[k], residuals[k], f"step {i} residual {k}")
      _close(np.asarray(state.inner[0].mu[k]), adam.mu[k], f"step {i} mu {k}")
      _close(np.asarray(state.inner[0].nu[k]), adam.nu[k], f"step {i} nu {k}")
    np.testing.assert_array_equal(np.asarray(state.inner[0].count), [i + 1] * DEVICES)


def test_a_dense_start_applies_the_mean_step_then_compresses(mesh, exchange_steps):
  """``warmup_steps=3``: the exact mean of the devices' Adam steps three times,
  nothing owed, then the sparse exchange from empty residuals (NumPy model)."""
  tx = topka2a_jax.compress_updates(optax.adam(LR, b1=B1, b2=B2, eps=EPS), density=0.1,
                                    algorithm="topka2a", selection="exact",
                                    min_size=0, fusion=1, warmup_steps=3)
  steps = [random_grads(seed) for seed in range(6)]
  adam, residuals = NumpyAdam(SHAPES), {}
  for i, (grads, (updates, state)) in enumerate(zip(steps, exchange_steps(tx, mesh,
                                                                            steps))):
    local = adam.update(grads)
    if i < 3:
      want = {k: v.mean(0) for k, v in local.items()}
    else:
      want, residuals = reference.leafwise("topka2a", local, residuals, 0.1)
    got_residuals = residuals_of((state.exchange,))
    for k in SHAPES:
      _close(updates[k], np.broadcast_to(want[k], updates[k].shape), f"step {i} {k}")
      _close(got_residuals[k], residuals.get(k, np.zeros_like(got_residuals[k])),
             f"step {i} residual {k}")


def test_density_one_is_the_mean_of_every_devices_adam_step(mesh, exchange_steps):
  inner = optax.adam(LR)
  tx = topka2a_jax.compress_updates(inner, density=1.0, min_size=0)
  steps = [random_grads(seed) for seed in range(5)]
  params = jax.tree.map(lambda g: jnp.zeros(g.shape[1:]), steps[0])

  def by_hand(grads, state):
    local = jax.tree.map(lambda g: g[0], grads)
    updates, state = inner.update(local, jax.tree.map(lambda s: s[0], state))
    mean = jax.tree.map(lambda u: lax.pmean(u, "data")[None], updates)
    return mean, jax.tree.map(lambda s: s[None], state)

  run = jax.jit(jax.shard_map(by_hand, mesh=mesh, in_specs=P("data"),
                              out_specs=(P("data"), P("data"))))
  per_device = NamedSharding(mesh, P("data"))
  state = jax.device_put(jax.tree.map(lambda x: jnp.broadcast_to(x, (DEVICES, *x.shape)),
                                      inner.init(params)), per_device)
  for grads, (updates, _) in zip(steps, exchange_steps(tx, mesh, steps)):
    want, state = run(jax.device_put(grads, per_device), state)
    for k in SHAPES:
      _close(updates[k], np.asarray(want[k]), k)


def test_what_a_device_did_not_send_drains(mesh, exchange_steps):
  """SGD's updates: after the gradients stop, every owed entry arrives."""
  tx = topka2a_jax.compress_updates(optax.sgd(1.0), density=0.05, algorithm="topka2a",
                                    min_size=0)
  grads = random_grads(3)
  zeros = jax.tree.map(np.zeros_like, grads)
  history = exchange_steps(tx, mesh, [grads] * 3 + [zeros] * 60)
  owed = residuals_of((history[-1][1].exchange,))
  assert not any(v.any() for v in owed.values())
  for k in SHAPES:
    delivered = sum(updates[k][0] for updates, _ in history)
    _close(delivered, -3 * grads[k].mean(0), k)


def test_a_non_finite_step_leaves_every_devices_optimizer_state(mesh, exchange_steps):
  tx = topka2a_jax.compress_updates(optax.adam(0.1), density=0.5, min_size=0)
  good = random_grads(0)
  bad = jax.tree.map(np.copy, good)
  bad["a"][3, 0, 5] = np.nan
  (_, first), (skipped_updates, skipped), (_, after) = exchange_steps(
      tx, mesh, [good, bad, good])
  for k in SHAPES:
    np.testing.assert_array_equal(skipped_updates[k], 0)
  chex.assert_trees_all_equal(skipped.inner, first.inner)
  chex.assert_trees_all_equal(skipped.exchange.residuals, first.exchange.residuals)
  assert int(skipped.exchange.nonfinite_steps) == 1
  assert int(skipped.exchange.count) == 1 and int(after.exchange.count) == 2
  assert np.isfinite(np.asarray(after.inner[0].mu["a"])).all()


def _loss(params, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def _problem(steps=6):
  rng = np.random.default_rng(7)
  params = {"w1": rng.normal(size=(16, 256)).astype(np.float32) / 4,
            "w2": rng.normal(size=(256, 4)).astype(np.float32) / 16}
  batches = [(x, np.sin(x[:, :4])) for x in
             (rng.normal(size=(64, 16)).astype(np.float32) for _ in range(steps))]
  return params, batches


def test_train_step_keeps_replicas_identical_and_learns(mesh, train_steps):
  params, batches = _problem(40)
  tx = topka2a_jax.compress_updates(optax.adam(1e-2), density=0.01, min_size=0)
  history = train_steps(tx, mesh, _loss, params, batches)
  losses = [float(loss) for _, _, loss in history]
  assert losses[-1] < 0.5 * losses[0]
  inner = history[-1][1].inner[0].mu["w1"]
  assert inner.shape == (DEVICES, 16, 256)
  assert not np.array_equal(inner[0], inner[1])  # each device's own moments


def test_restored_on_fewer_devices_every_device_starts_from_the_mean(tmp_path):
  params, batches = _problem()
  big = jax.make_mesh((8,), ("data",))
  small = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])

  def fresh(mesh):
    tx = topka2a_jax.compress_updates(optax.adam(1e-2), density=0.05, mesh=mesh, min_size=0,
                                      algorithm="topka2a")
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    return tx, {"params": placed, "opt_state": tx.init(placed)}

  tx, state = fresh(big)
  step = topka2a_jax.train_step(_loss, tx, big, donate=False)
  p, s = state["params"], state["opt_state"]
  for batch in batches[:3]:
    p, s, _ = step(p, s, batch)
  topka2a_jax.save(tmp_path / "ckpt", {"params": p, "opt_state": s}, big)
  small_tx, like = fresh(small)
  back = topka2a_jax.restore(tmp_path / "ckpt", like, small)
  restored = back["opt_state"]
  for field in ("mu", "nu"):
    old = np.asarray(getattr(s.inner[0], field)["w1"], np.float64)
    new = np.asarray(getattr(restored.inner[0], field)["w1"])
    assert new.shape == (4, 16, 256)
    for device in range(4):
      _close(new[device], old.mean(0), f"{field} of device {device}")
  np.testing.assert_array_equal(np.asarray(restored.inner[0].count), [3] * 4)
  owed = lambda state: np.asarray(state.exchange.residuals["w1"], np.float64).reshape(
      -1, 16, 256).sum(0)
  _close(owed(restored) / 4, owed(s) / 8, "what is owed, per device")
  small_step = topka2a_jax.train_step(_loss, small_tx, small, donate=False)
  p, s2 = back["params"], restored
  for batch in batches[3:]:
    p, s2, loss = small_step(p, s2, batch)
  assert np.isfinite(float(loss)) and int(s2.exchange.count) == 6


def test_parameters_split_over_a_model_axis(train_steps):
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  params, batches = _problem()
  specs = {"w1": P(None, "model"), "w2": P("model", None)}
  tx = topka2a_jax.compress_updates(optax.adam(1e-2), density=0.05, min_size=0)
  placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
  state = tx.init(placed)
  assert state.inner[0].mu["w1"].sharding.spec == P("data", None, "model")
  step = topka2a_jax.train_step(_loss, tx, mesh, donate=False)
  losses = []
  for batch in batches:
    placed, state, loss = step(placed, state, batch)
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  assert placed["w1"].sharding.is_equivalent_to(NamedSharding(mesh, specs["w1"]), 2)


def test_through_nnx_optimizer(mesh):
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(32, 8, rngs=nnx.Rngs(0))
  tx = topka2a_jax.compress_updates(optax.adam(1e-2), density=0.05, mesh=mesh, min_size=16)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  train = topka2a_jax.nnx_train_step(lambda m, x: jnp.mean(jnp.sin(m(x))), mesh)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 32)), jnp.float32)
  losses = [float(train(model, optimizer, x)) for _ in range(5)]
  assert losses[-1] < losses[0]


def test_skip_nonfinite_and_comm_report(mesh):
  params, batches = _problem(1)
  tx = topka2a_jax.skip_nonfinite(topka2a_jax.compress_updates(
      optax.adam(1e-2), density=0.01, min_size=0, algorithm="topka2a"))
  placed = jax.device_put(params, NamedSharding(mesh, P()))
  step = topka2a_jax.train_step(_loss, tx, mesh, donate=False)
  state = topka2a_jax.init(tx, params, mesh)
  report = topka2a_jax.comm_report(step.lower(placed, state, batches[0]))
  assert report.bytes_of("all-to-all") > 0
  nan_batch = (batches[0][0] * np.nan, batches[0][1])
  _, skipped, _ = step(placed, state, nan_batch)
  assert int(skipped.nonfinite_steps) == 1
  chex.assert_trees_all_equal(skipped.inner_state.inner, state.inner_state.inner)


def test_an_inner_optimizer_with_an_exchange_is_refused(mesh):
  params = {"w": jnp.zeros((64, 4))}
  nested = topka2a_jax.compress_updates(
      optax.chain(topka2a_jax.topka2a(0.01), optax.adam(1e-3)), density=0.01, mesh=mesh)
  with pytest.raises(ValueError, match="holds a topka2a exchange"):
    nested.init(params)
  sharded = topka2a_jax.sharded_optimizer(
      topka2a_jax.compress_updates(optax.adam(1e-3), density=0.01), density=0.01, mesh=mesh)
  with pytest.raises(ValueError, match="inner optimizer holds a topka2a exchange"):
    sharded.init(params)


def test_adam_before_the_exchange_names_compress_updates(mesh):
  tx = optax.chain(optax.adam(1e-3), topka2a_jax.topka2a(0.01, mesh=mesh))
  params, batches = _problem(1)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  step = topka2a_jax.train_step(_loss, tx, mesh)
  with pytest.raises(ValueError, match="compress_updates"):
    step(params, tx.init(params), batches[0])


def test_auto_never_takes_an_exchange_that_holds_back(mesh):
  # 8M updates on the slow link: the gradient's "auto" takes TopKA2A-sparse.
  from topka2a_jax._src.options import Options
  from topka2a_jax._src.transforms.exchange_plan import ExchangePlan

  def buckets(whole_selection):
    options = dataclasses.replace(Options.create(0.01, network="eth1"),
                                  whole_selection=whole_selection)
    plan = ExchangePlan.create(options, ["w"], [(8_000_000,)])
    return [bucket for _, bucket in plan.buckets([jnp.zeros(8_000_000)], 8)]

  gradient, updates = buckets(False), buckets(True)
  assert [b.algorithm for b in gradient] == ["topka2a_sparse"]
  assert [b.algorithm for b in updates] in (["topka2a"], ["allgather"])


def test_frozen_variance_adam_is_adam_of_the_mean_until_it_freezes(mesh, exchange_steps):
  lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
  tx = topka2a_jax.frozen_variance_adam(lr, 0.05, freeze_after=4, min_size=0,
                                        algorithm="topka2a")
  steps = [random_grads(seed) for seed in range(6)]
  history = exchange_steps(tx, mesh, steps)
  mu = {k: 0.0 for k in SHAPES}
  nu = {k: 0.0 for k in SHAPES}
  for t, (grads, (updates, _)) in enumerate(zip(steps[:4], history), 1):
    for k, g in grads.items():  # optax.adam on the mean gradient, in float64
      mean = g.astype(np.float64).mean(0)
      mu[k] = b1 * mu[k] + (1 - b1) * mean
      nu[k] = b2 * nu[k] + (1 - b2) * mean ** 2
      want = -lr * (mu[k] / (1 - b1 ** t)) / (np.sqrt(nu[k] / (1 - b2 ** t)) + eps)
      _close(updates[k], np.broadcast_to(want, updates[k].shape), f"step {t} {k}")
  frozen = [np.asarray(state[1].nu["a"]) for _, state in history[3:]]
  np.testing.assert_array_equal(frozen[0], frozen[-1])  # frozen after step 4
  assert all(np.isfinite(updates["a"]).all() for updates, _ in history)


def test_entries_the_warm_up_never_saw_get_bounded_steps(mesh, exchange_steps):
  # An embedding row absent from every warm-up batch: v is 0 there at the
  # freeze, and without the floor its first step would be lr * m / eps.
  lr = 0.01
  tx = topka2a_jax.frozen_variance_adam(lr, 1.0, freeze_after=3, min_size=0)
  seen = random_grads(0)
  seen["b"][:, 0] = 0.0
  later = random_grads(1)
  later["b"][:, 0] = 5.0
  history = exchange_steps(tx, mesh, [seen] * 3 + [later])
  first = history[-1][0]["b"][0, 0]
  assert 0 < -first < 100 * lr


def test_frozen_variance_adam_trains_through_a_donating_step(mesh, train_steps):
  params, batches = _problem(8)
  tx = topka2a_jax.frozen_variance_adam(1e-2, 0.05, freeze_after=3, min_size=0)
  history = train_steps(tx, mesh, _loss, params, batches, donate=True)
  losses = [float(loss) for _, _, loss in history]
  assert losses[-1] < losses[0] and np.isfinite(losses).all()
