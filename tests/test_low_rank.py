"""algorithm="powersgd": against a NumPy model of the paper, and every guarantee the others keep."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference
import resumable
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax
from topka2a_jax._src import sizes
from topka2a_jax._src.collectives import low_rank

DEVICES = 8
SHAPES = {"a": (64, 32), "b": (64, 32), "conv": (3, 3, 16, 32), "bias": (32,)}
"""Two matrices of one shape (one batched product), a kernel, and a vector (dense)."""
MATRICES = ("a", "b", "conv")


def random_grads(seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return {k: (scale * rng.normal(size=(DEVICES, *shape))).astype(np.float32)
          for k, shape in SHAPES.items()}


def per_device(global_array, shape):
  """A global residual, one block per device along dimension 0, as (P, *shape)."""
  return np.asarray(global_array, np.float64).reshape(DEVICES, *shape)


def as_matrices(array):
  """(P, *shape) -> (P, m, n): all axes but the last by the last."""
  return array.reshape(array.shape[0], -1, array.shape[-1])


@pytest.mark.parametrize("rank", [2, 1])
def test_ten_steps_match_the_paper(mesh, exchange_steps, rank):
  """Means, residuals and Q after each of 10 warm-started steps, against float64 NumPy."""
  tx = topka2a_jax.topka2a(algorithm="powersgd", rank=rank)
  steps = [random_grads(seed) for seed in range(10)]
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  start = topka2a_jax.init(tx, params, jax.make_mesh((DEVICES,), ("data",)))
  qs = {k: np.asarray(start.factors[k], np.float64) for k in MATRICES}
  errors = {k: np.zeros((DEVICES, *sizes.matrix_shape(SHAPES[k]))) for k in qs}
  for grads, (updates, state) in zip(steps, exchange_steps(tx, mesh, steps)):
    for k in MATRICES:
      mean, errors[k], qs[k] = reference.powersgd(as_matrices(grads[k]), errors[k], qs[k])
      scale = np.abs(mean).max()
      for device in range(DEVICES):  # float32 rounding of values of this scale
        np.testing.assert_allclose(as_matrices(updates[k])[device], mean,
                                   atol=2e-5 * scale, rtol=0)
      residuals = as_matrices(per_device(state.residuals[k], SHAPES[k]))
      np.testing.assert_allclose(residuals, errors[k], atol=2e-5 * np.abs(errors[k]).max())
      np.testing.assert_allclose(state.factors[k], qs[k], atol=2e-5 * np.abs(qs[k]).max())
    np.testing.assert_allclose(updates["bias"][0], grads["bias"].mean(0), atol=1e-6)
    assert isinstance(state.residuals["bias"], optax.MaskedNode)


def test_every_device_gets_the_same_update_bitwise(mesh, exchange_steps):
  tx = topka2a_jax.topka2a(algorithm="powersgd", rank=2)
  for updates, _ in exchange_steps(tx, mesh, [random_grads(seed) for seed in range(3)]):
    for k in SHAPES:
      for device in range(1, DEVICES):
        np.testing.assert_array_equal(updates[k][device], updates[k][0])


def _run_exchange(mesh, grads, residuals, qs):
  """low_rank.powersgd on (P, m, n) gradients and residuals, with replicated Q."""
  def one(grads, residuals, qs):
    accs = [g[0] + r[0] for g, r in zip(grads, residuals)]
    means, left, factors = low_rank.powersgd(accs, qs, "data")
    return means, [r[None] for r in left], factors
  run = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=(P("data"), P("data"), P()),
                              out_specs=(P(), P("data"), P())))
  per_device = NamedSharding(mesh, P("data"))
  return run(jax.device_put(grads, per_device), jax.device_put(residuals, per_device), qs)


def test_at_full_rank_the_update_is_the_dense_mean(mesh):
  """Rank min(m, n): every step's mean is lax.pmean of the gradient, nothing owed.

  A device's residual is the part of its matrix outside the mean's column
  space, so the residuals sum to zero over the devices.
  """
  shapes = [(12, 5), (5, 12)]
  qs = [low_rank.initial_factor(s, 5, i) for i, s in enumerate(shapes)]
  residuals = [np.zeros((DEVICES, *s), np.float32) for s in shapes]
  rng = np.random.default_rng(0)
  dense = jax.jit(jax.shard_map(lambda g: [jax.lax.pmean(x[0], "data") for x in g],
                                mesh=mesh, in_specs=P("data"), out_specs=P()))
  for _ in range(4):
    grads = [rng.normal(size=(DEVICES, *s)).astype(np.float32) for s in shapes]
    means, residuals, qs = _run_exchange(mesh, grads, residuals, qs)
    want_means = dense(jax.device_put(grads, NamedSharding(mesh, P("data"))))
    for grad, mean, want, left in zip(grads, means, want_means, residuals):
      scale = np.abs(grad).sum(0).max()  # of a sum over the devices, in float32
      np.testing.assert_allclose(mean, want, atol=1e-5 * scale / DEVICES)
      np.testing.assert_allclose(np.asarray(left).sum(0), 0, atol=1e-5 * scale)


def test_what_a_device_did_not_send_drains(mesh, exchange_steps):
  """After the gradients stop, the residuals' total drains and every step arrives."""
  tx = optax.chain(topka2a_jax.topka2a(algorithm="powersgd", rank=4),
                   optax.sgd(1.0))
  grads = random_grads(3)
  zeros = jax.tree.map(np.zeros_like, grads)
  history = exchange_steps(tx, mesh, [grads] * 3 + [zeros] * 60)
  exchange_state = history[-1][1][0]
  for k in MATRICES:
    owed = per_device(exchange_state.residuals[k], SHAPES[k]).sum(0)
    delivered = sum(updates[k][0].astype(np.float64) for updates, _ in history)
    scale = np.abs(grads[k]).sum(0).max()
    np.testing.assert_allclose(owed, 0, atol=1e-5 * scale)
    np.testing.assert_allclose(delivered, -3 * grads[k].mean(0), atol=1e-5 * scale)


def test_a_non_finite_step_leaves_residuals_and_factors(mesh, exchange_steps):
  tx = topka2a_jax.topka2a(algorithm="powersgd", rank=2)
  good = random_grads(0)
  bad = jax.tree.map(np.copy, good)
  bad["a"][5, 3, 1] = np.inf
  (_, first), (skipped_updates, skipped), (_, after) = exchange_steps(
      tx, mesh, [good, bad, good])
  for k in SHAPES:
    np.testing.assert_array_equal(skipped_updates[k], 0)
  chex.assert_trees_all_equal(skipped.residuals, first.residuals)
  chex.assert_trees_all_equal(skipped.factors, first.factors)
  assert int(skipped.nonfinite_steps) == 1 and int(after.count) == 2
  assert all(np.isfinite(np.asarray(f)).all() for f in jax.tree.leaves(after.factors))


def test_dense_warm_up_empties_the_residuals_and_keeps_q(mesh, exchange_steps):
  """Step 1 dense (the exact mean), step 2 PowerSGD from empty residuals and the first Q."""
  tx = topka2a_jax.topka2a(algorithm="powersgd", rank=2, warmup_steps=1)
  steps = [random_grads(0), random_grads(1)]
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  start = topka2a_jax.init(tx, params, jax.make_mesh((DEVICES,), ("data",)))
  (warm, warm_state), (second, _) = exchange_steps(tx, mesh, steps)
  for k in ("a", "conv"):
    np.testing.assert_allclose(warm[k][0], steps[0][k].mean(0), atol=1e-6)
    np.testing.assert_array_equal(warm_state.residuals[k], 0)
    np.testing.assert_array_equal(warm_state.factors[k], start.factors[k])
    mean, _, _ = reference.powersgd(as_matrices(steps[1][k]), 0.0,
                                    np.asarray(start.factors[k], np.float64))
    np.testing.assert_allclose(as_matrices(second[k])[0], mean,
                               atol=2e-5 * np.abs(mean).max())


def test_compressing_the_optimizers_step_with_powersgd(mesh, exchange_steps):
  """compress_updates(sgd(1), algorithm="powersgd"): the negated PowerSGD mean."""
  tx = topka2a_jax.compress_updates(optax.sgd(1.0), algorithm="powersgd", rank=2)
  steps = [random_grads(seed) for seed in range(3)]
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
  start = topka2a_jax.init(tx, params, jax.make_mesh((DEVICES,), ("data",)))
  q = np.asarray(start.exchange.factors["a"], np.float64)
  errors = np.zeros((DEVICES, *SHAPES["a"]))
  for grads, (updates, _) in zip(steps, exchange_steps(tx, mesh, steps)):
    mean, errors, q = reference.powersgd(-grads["a"], errors, q)
    np.testing.assert_allclose(updates["a"][0], mean, atol=2e-5 * np.abs(mean).max())


@pytest.mark.parametrize("old, new", [(8, 4), (4, 8)])
def test_restart_on_another_device_count_keeps_q_and_what_is_owed(
    tmp_path, old, new):
  tx = optax.chain(topka2a_jax.topka2a(algorithm="powersgd", rank=4),
                   optax.adam(1e-2))
  before_mesh = jax.make_mesh((old,), ("data",), devices=jax.devices()[:old])
  after_mesh = jax.make_mesh((new,), ("data",), devices=jax.devices()[:new])
  before = resumable.train(resumable.fresh(before_mesh, tx), before_mesh, range(3), tx)
  topka2a_jax.save(tmp_path / "ckpt", before, before_mesh)
  after = topka2a_jax.restore(tmp_path / "ckpt", resumable.fresh(after_mesh, tx),
                              after_mesh)
  was = np.asarray(before["opt_state"][0].residuals["w"], np.float64)
  now = np.asarray(after["opt_state"][0].residuals["w"], np.float64)
  assert np.abs(was).sum() > 0
  # What is owed, the sum over devices over their number: exact for a
  # power-of-two ratio.
  np.testing.assert_array_equal(now.reshape(new, 40, 30).sum(0) / new,
                                was.reshape(old, 40, 30).sum(0) / old)
  chex.assert_trees_all_equal(after["opt_state"][0].factors,
                              before["opt_state"][0].factors)
  assert after["opt_state"][0].factors["w"].shape == (30, 4)
  resumable.train(after, after_mesh, range(3, 5), tx)  # and training goes on


def test_errors_name_the_option_and_the_fix(mesh):
  with pytest.raises(ValueError, match="density is required with algorithm='auto'"):
    topka2a_jax.compress_updates(optax.adam(1e-3), algorithm="auto")
  with pytest.raises(ValueError, match="density is required with algorithm='topka2a'"):
    topka2a_jax.compress_updates(optax.adam(1e-3), algorithm="topka2a")
  with pytest.raises(ValueError, match="rank=4 sets the rank of algorithm='powersgd'"):
    topka2a_jax.topka2a(0.01, rank=4)
  with pytest.raises(ValueError, match="rank must be at least 1"):
    topka2a_jax.topka2a(algorithm="powersgd", rank=0)
  with pytest.raises(ValueError, match="runs over one data axis"):
    topka2a_jax.topka2a(algorithm="powersgd", axis_name=("node", "local"))
  with pytest.raises(ValueError, match="Drop value_dtype"):
    topka2a_jax.topka2a(algorithm="powersgd", value_dtype=jnp.bfloat16)
  # A state made by a top-k transform, given to a PowerSGD step.
  params = jax.device_put({"w": jnp.zeros((64, 32))}, NamedSharding(mesh, P()))
  top_k = optax.chain(topka2a_jax.topka2a(0.01), optax.sgd(0.1))
  low = optax.chain(topka2a_jax.topka2a(algorithm="powersgd"), optax.sgd(0.1))
  step = topka2a_jax.train_step(lambda p, x: jnp.sum(x @ p["w"]), low, mesh)
  with pytest.raises(ValueError, match="needs the factors its init makes"):
    step(params, top_k.init(params), jnp.ones((8, 64)))


def test_the_compiled_step_sends_what_the_cost_model_says(mesh):
  """comm_report of a whole train_step: two all-reduces of the factors, one of the rest."""
  shapes = {"w": (256, 64), "conv": (3, 3, 16, 64), "b": (64,), "small": (8, 8)}
  params = jax.device_put({k: jnp.zeros(s) for k, s in shapes.items()},
                          NamedSharding(mesh, P()))
  tx = optax.chain(topka2a_jax.topka2a(algorithm="powersgd", rank=4),
                   optax.sgd(0.1))
  loss = lambda p, x: sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(p)) * jnp.sum(x)
  step = topka2a_jax.train_step(loss, tx, mesh)
  report = topka2a_jax.comm_report(step.lower(params, tx.init(params), jnp.ones((8, 2))))
  # By hand: P is 256x4 and 144x4, Q 64x4 twice; dense: 64 + 64 floats.
  ring = 2 * (DEVICES - 1) / DEVICES * 4
  factors = (256 * 4 + 144 * 4) + (64 * 4 + 64 * 4)
  step_scalars = 2  # the mean loss, and whether any device's gradient is non-finite
  assert report.bytes_of("all-reduce") == pytest.approx(
      ring * (factors + 64 + 64 + step_scalars))
  predicted = topka2a_jax.cost.low_rank_step(list(shapes.values()), DEVICES, 4)
  assert predicted.cost.bytes == pytest.approx(ring * (factors + 128))


def _shard_blocks(array, spec_dim, pieces):
  """The blocks of ``array`` (P, *shape) that ``pieces`` model shards hold along ``spec_dim``."""
  return np.split(np.asarray(array, np.float64), pieces, axis=1 + spec_dim)


def test_on_a_2d_mesh_each_parameter_shard_is_its_own_matrix():
  """shard_map over data and model: every shard's block against the paper, Q per shard."""
  mesh_2d = jax.make_mesh((4, 2), ("data", "model"))
  specs = {"w": P(None, "model"), "v": P("model", None)}
  shapes = {"w": (32, 64), "v": (128, 16)}
  tx = topka2a_jax.topka2a(algorithm="powersgd", rank=2)
  state = topka2a_jax.init(tx, {k: jnp.zeros(s) for k, s in shapes.items()}, mesh_2d,
                           param_specs=specs)
  state_specs = topka2a_jax.state_specs(state, param_specs=specs)
  assert state.factors["w"].shape == (2 * 32, 2)  # one (32, 2) block per shard
  grad_specs = {k: P("data", *spec) for k, spec in specs.items()}

  def step(grads, state):
    updates, state = tx.update({k: g[0] for k, g in grads.items()}, state)
    return {k: u[None] for k, u in updates.items()}, state

  run = jax.jit(jax.shard_map(step, mesh=mesh_2d, in_specs=(grad_specs, state_specs),
                              out_specs=(grad_specs, state_specs)))
  rng = np.random.default_rng(4)
  dims = {"w": 1, "v": 0}  # the dimension "model" splits
  qs = {k: np.split(np.asarray(state.factors[k], np.float64), 2) for k in shapes}
  errors = {k: [0.0, 0.0] for k in shapes}
  for _ in range(3):
    grads = {k: rng.normal(size=(4, *s)).astype(np.float32) for k, s in shapes.items()}
    placed = {k: jax.device_put(g, NamedSharding(mesh_2d, grad_specs[k]))
              for k, g in grads.items()}
    updates, state = run(placed, state)
    for k in shapes:
      got = _shard_blocks(updates[k], dims[k], 2)
      for j, block in enumerate(_shard_blocks(grads[k], dims[k], 2)):
        mean, errors[k][j], qs[k][j] = reference.powersgd(block, errors[k][j], qs[k][j])
        np.testing.assert_allclose(got[j][0], mean, atol=2e-5 * np.abs(mean).max())


def test_train_step_on_a_2d_mesh_with_automatic_model_axis():
  """train_step, parameters split over an automatic "model" axis: per-shard PowerSGD."""
  mesh_2d = jax.make_mesh((4, 2), ("data", "model"),
                          axis_types=(jax.sharding.AxisType.Auto,) * 2)
  specs = {"w": P(None, "model"), "b": P("model")}
  rng = np.random.default_rng(2)
  params = {"w": rng.normal(size=(32, 64)).astype(np.float32) / 4,
            "b": rng.normal(size=64).astype(np.float32) / 4}
  x = rng.normal(size=(16, 32)).astype(np.float32)

  def loss(p, x):
    return jnp.sum(jnp.sin(x @ p["w"] + p["b"]))

  tx = optax.chain(topka2a_jax.topka2a(algorithm="powersgd", rank=2, min_size=0),
                   optax.sgd(1.0))
  placed = {k: jax.device_put(v, NamedSharding(mesh_2d, specs[k]))
            for k, v in params.items()}
  state = tx.init(placed)
  assert state[0].factors["w"].sharding.spec == P("model")
  q = np.split(np.asarray(state[0].factors["w"], np.float64), 2)
  new, state, _ = topka2a_jax.train_step(loss, tx, mesh_2d)(placed, state, x)
  # Every device's own gradient (4 rows of x each), by plain jax.grad.
  grads = np.stack([np.asarray(jax.grad(loss)(params, x[4 * d:4 * d + 4])["w"])
                    for d in range(4)])
  moved = np.asarray(new["w"], np.float64) - params["w"]
  for j, block in enumerate(np.split(grads, 2, axis=2)):
    mean, _, _ = reference.powersgd(block, 0.0, q[j])
    np.testing.assert_allclose(np.split(moved, 2, axis=1)[j], -mean,
                               atol=2e-5 * np.abs(mean).max() + 1e-6)
