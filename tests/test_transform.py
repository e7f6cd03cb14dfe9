"""The optax transform against the NumPy model, leaf by leaf and fused."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference
from cases import SHAPES, random_grads, residuals_of
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import topka2a_jax


def params_like(grads):
  return jax.tree.map(lambda g: jnp.zeros(g.shape[1:], g.dtype), grads)


@pytest.mark.parametrize("algorithm", ["topka2a", "allgather", "topka2a_sparse"])
def test_error_feedback_over_steps_matches_model(mesh, algorithm, exchange_steps):
  tx = optax.chain(topka2a_jax.topka2a(0.1, algorithm=algorithm, min_size=0,
                                       fusion=1))
  steps = [random_grads(seed) for seed in range(3)]
  residuals = {}
  for grads, (updates, state) in zip(steps, exchange_steps(tx, mesh, steps)):
    want, residuals = reference.leafwise(algorithm, grads, residuals, 0.1)
    for k in grads:
      np.testing.assert_allclose(updates[k], np.broadcast_to(want[k], updates[k].shape),
                                 rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(residuals_of(state)[k], residuals[k],
                                 rtol=1e-5, atol=1e-5)


def test_fused_bucket_is_the_leaves_in_reverse_order(mesh, exchange_steps):
  # One bucket holding c, b, a (flattened, last leaf first) goes through
  # TopKA2A as one buffer: its selection differs from the leaf-wise one.
  tx = topka2a_jax.topka2a(0.05, algorithm="topka2a", selection="exact", min_size=0,
                           fusion=10**6)
  grads = random_grads(11)
  [(updates, state)] = exchange_steps(optax.chain(tx), mesh, [grads])
  buffer = np.concatenate([grads[k].reshape(8, -1) for k in ("c", "b", "a")], 1)
  mean, unsent = reference.topka2a(buffer, 0.05)
  sizes = [grads[k][0].size for k in ("c", "b", "a")]
  for k, m, u in zip(("c", "b", "a"), np.split(mean, np.cumsum(sizes)[:-1]),
                     np.split(unsent, np.cumsum(sizes)[:-1], axis=1)):
    np.testing.assert_allclose(updates[k][3], m.reshape(SHAPES[k]), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(residuals_of(state)[k], u, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("algorithm", ["topka2a", "allgather", "dense", "auto",
                                       "topka2a_sparse"])
def test_density_one_equals_pmean(mesh, algorithm, exchange_steps):
  tx = optax.chain(topka2a_jax.topka2a(1.0, algorithm=algorithm, min_size=100,
                                       fusion=200))
  grads = random_grads(21)
  [(updates, _)] = exchange_steps(tx, mesh, [grads])
  for k, g in grads.items():
    np.testing.assert_allclose(updates[k], np.broadcast_to(g.mean(0), g.shape),
                               rtol=1e-5, atol=1e-6)


def test_dense_algorithm_is_pmean_at_any_density(mesh, exchange_steps):
  tx = optax.chain(topka2a_jax.topka2a(0.01, algorithm="dense"))
  grads = random_grads(22)
  [(updates, state)] = exchange_steps(tx, mesh, [grads])
  pmean = jax.jit(jax.shard_map(lambda g: lax.pmean(g, "data"), mesh=mesh,
                                in_specs=P("data"), out_specs=P("data")))
  for k, g in grads.items():
    placed = jax.device_put(g, jax.NamedSharding(mesh, P("data")))
    np.testing.assert_allclose(updates[k], np.asarray(pmean(placed)), rtol=1e-6)
  assert residuals_of(state) == {}


def test_replicas_are_bitwise_identical(mesh, exchange_steps):
  tx = optax.chain(topka2a_jax.topka2a(0.05, min_size=0))
  [(updates, _)] = exchange_steps(tx, mesh, [random_grads(23)])
  for u in updates.values():
    for device in range(1, 8):
      np.testing.assert_array_equal(u[device], u[0])


@pytest.mark.parametrize("algorithm, value_dtype", [
    ("topka2a", None), ("allgather", None), ("auto", None),
    ("topka2a_sparse", None), ("topka2a_sparse", jnp.bfloat16),
    ("topka2a", jnp.bfloat16)])
def test_nothing_is_lost_across_steps(mesh, algorithm, value_dtype, exchange_steps):
  tx = optax.chain(topka2a_jax.topka2a(0.02, algorithm=algorithm, min_size=0,
                                       value_dtype=value_dtype))
  steps = [random_grads(seed) for seed in (31, 32, 33)]
  old = {k: np.zeros((8, g[0].size)) for k, g in steps[0].items()}
  for grads, (updates, state) in zip(steps, exchange_steps(tx, mesh, steps)):
    new = residuals_of(state)
    for k, g in grads.items():
      had = g.reshape(8, -1).sum(0) + old[k].sum(0)
      kept = 8 * updates[k][0].reshape(-1) + new[k].sum(0)
      np.testing.assert_allclose(kept, had, rtol=1e-5, atol=1e-5)
    old = new


def test_bfloat16_residuals_lose_only_their_own_rounding(mesh, exchange_steps):
  tx = optax.chain(topka2a_jax.topka2a(0.02, min_size=0, residual_dtype=jnp.bfloat16))
  steps = [random_grads(seed) for seed in (34, 35, 36)]
  history = exchange_steps(tx, mesh, steps)
  old = {k: np.zeros((8, g[0].size)) for k, g in steps[0].items()}
  for grads, (updates, state) in zip(steps, history):
    assert {r.dtype for r in jax.tree.leaves(state[0].residuals)} == {jnp.dtype(jnp.bfloat16)}
    new = residuals_of(state)
    for k, g in grads.items():
      had = g.reshape(8, -1).sum(0) + old[k].sum(0)
      kept = 8 * updates[k][0].reshape(-1) + new[k].astype(np.float64).sum(0)
      rounding = 8 * np.abs(new[k]).max() * 2.0**-8  # one bfloat16 rounding a device
      np.testing.assert_allclose(kept, had, rtol=0, atol=rounding + 1e-5)
    old = {k: v.astype(np.float64) for k, v in new.items()}
  full = topka2a_jax.init(optax.chain(topka2a_jax.topka2a(0.02, min_size=0)),
                          {k: jnp.zeros(s) for k, s in SHAPES.items()}, mesh)
  assert sum(r.nbytes for r in jax.tree.leaves(history[0][1][0].residuals)) * 2 == sum(
      r.nbytes for r in jax.tree.leaves(full[0].residuals))


@pytest.mark.parametrize("make", [
    lambda: topka2a_jax.compress_updates(optax.adam(1e-2), density=0.05, min_size=0,
                                         residual_dtype=jnp.bfloat16),
    lambda: topka2a_jax.sharded_optimizer(optax.adam(1e-2), density=0.05, min_size=0,
                                          residual_dtype=jnp.bfloat16)])
def test_every_transform_takes_residual_dtype_and_keeps_it(make, mesh, train_steps):
  params = {"w": jnp.ones((64, 8)), "b": jnp.zeros((8,))}
  loss = lambda p, x: jnp.mean((x @ p["w"] + p["b"] - 1.0) ** 2)
  batches = [jax.random.normal(jax.random.key(i), (16, 64)) for i in range(3)]
  history = train_steps(make(), mesh, loss, params, batches)
  for _, state, _ in history:
    assert {r.dtype for r in jax.tree.leaves(state.exchange.residuals)} == {jnp.dtype(jnp.bfloat16)}
  assert history[-1][2] < history[0][2]


def test_small_leaves_go_dense_without_residual(mesh, exchange_steps):
  shapes = {"bias": (10,), "kernel": (40, 40)}
  tx = optax.chain(topka2a_jax.topka2a(0.01))  # default min_size=1024
  grads = random_grads(41, shapes)
  [(updates, state)] = exchange_steps(tx, mesh, [grads])
  np.testing.assert_allclose(updates["bias"][0], grads["bias"].mean(0), rtol=1e-6)
  assert isinstance(state[0].residuals["bias"], optax.MaskedNode)
  assert state[0].residuals["kernel"].shape == (8 * 40, 40)  # a block per device


def test_without_error_feedback_nothing_is_kept(mesh, exchange_steps):
  tx = optax.chain(topka2a_jax.topka2a(0.1, algorithm="topka2a", min_size=0,
                                       fusion=1, error_feedback=False))
  steps = [random_grads(seed) for seed in (51, 52)]
  for grads, (updates, state) in zip(steps, exchange_steps(tx, mesh, steps)):
    want, _ = reference.leafwise("topka2a", grads, {}, 0.1)
    for k in grads:
      np.testing.assert_allclose(updates[k][0], want[k], rtol=1e-5, atol=1e-6)
    assert jax.tree.leaves(state[0].residuals) == []


def test_keeps_each_leafs_dtype_and_shape(mesh, exchange_steps):
  grads = random_grads(61)
  grads["b"] = grads["b"].astype(jnp.bfloat16)
  tx = optax.chain(topka2a_jax.topka2a(0.1, min_size=0, fusion=10**6))
  [(updates, state)] = exchange_steps(tx, mesh, [grads])
  assert updates["b"].dtype == jnp.bfloat16 and updates["a"].dtype == np.float32
  assert {k: u.shape[1:] for k, u in updates.items()} == SHAPES
  # Residuals stay float32, so nothing is rounded away.
  assert state[0].residuals["b"].dtype == jnp.float32
  had = grads["b"].astype(np.float32).sum(0)
  kept = 8 * updates["b"][0].astype(np.float32) + residuals_of(state)["b"].sum(0)
  np.testing.assert_allclose(kept, had, rtol=2e-2, atol=2e-2)


def test_flax_model_parameters(mesh, exchange_steps):
  class Model(nnx.Module):

    def __init__(self, rngs):
      self.embed = nnx.Embed(50, 16, rngs=rngs)
      self.conv = nnx.Conv(16, 32, kernel_size=(3,), rngs=rngs)
      self.norm = nnx.LayerNorm(32, rngs=rngs)
      self.head = nnx.Linear(32, 10, rngs=rngs)

  params = nnx.state(Model(nnx.Rngs(0)), nnx.Param)
  leaves, treedef = jax.tree.flatten(params)
  rng = np.random.default_rng(7)
  stacked = treedef.unflatten(
      [rng.normal(size=(8, *x.shape)).astype(np.float32) for x in leaves])
  tx = optax.chain(topka2a_jax.topka2a(1.0, min_size=100), optax.sgd(1.0))
  [(updates, _)] = exchange_steps(tx, mesh, [stacked])
  for got, g in zip(jax.tree.leaves(updates), jax.tree.leaves(stacked)):
    np.testing.assert_allclose(got[0], -g.mean(0), rtol=1e-5, atol=1e-6)


def test_state_specs_mark_residuals_per_device(mesh):
  tx = optax.chain(topka2a_jax.topka2a(0.1, min_size=100), optax.adam(1e-3))
  params = {"big": jnp.zeros((20, 20)), "small": jnp.zeros(3)}
  state = topka2a_jax.init(tx, params, mesh, axis_name="data")
  specs = topka2a_jax.state_specs(state)
  assert specs[0].residuals == {"big": P("data"), "small": optax.MaskedNode()}
  assert jax.tree.leaves(specs[1]) == [P()] * len(jax.tree.leaves(state[1]))
  assert state[0].residuals["big"].sharding.spec == P("data")
  assert state[1][0].mu["big"].sharding.is_fully_replicated
  assert topka2a_jax.state_specs(jax.eval_shape(lambda: state)) == specs


def test_one_device_mesh_trains(train_steps):
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  tx = optax.chain(topka2a_jax.topka2a(0.1, min_size=0, mesh=mesh), optax.sgd(0.1))
  history = train_steps(tx, mesh, lambda p, x: jnp.sum(p["w"] ** 2 * x),
                        {"w": jnp.ones((40,))}, [jnp.ones((1, 40))] * 50)
  # Every weight decays, the unsent ones through the residual.
  assert np.abs(history[-1][0]["w"]).max() < 0.5


@pytest.mark.parametrize("selection", ["threshold", "approx", "auto"])
@pytest.mark.parametrize("algorithm", ["topka2a", "topka2a_sparse", "allgather"])
def test_every_selection_loses_nothing(mesh, algorithm, selection, exchange_steps):
  # 160,000 elements: 20,000 per shard, enough for threshold selection.
  shapes = {"w": (400, 400)}
  tx = optax.chain(topka2a_jax.topka2a(0.01, algorithm=algorithm,
                                       selection=selection))
  steps = [random_grads(seed, shapes) for seed in (71, 72)]
  old = np.zeros((8, 160_000))
  for grads, (updates, state) in zip(steps, exchange_steps(tx, mesh, steps)):
    new = residuals_of(state)["w"]
    had = grads["w"].reshape(8, -1).sum(0) + old.sum(0)
    np.testing.assert_allclose(8 * updates["w"][0].reshape(-1) + new.sum(0), had,
                               rtol=1e-5, atol=1e-5)
    for device in range(1, 8):
      np.testing.assert_array_equal(updates["w"][device], updates["w"][0])
    old = new


def test_init_accepts_shapes_alone(mesh):
  tx = optax.chain(topka2a_jax.topka2a(0.1, min_size=0), optax.adam(1e-3))
  shapes = {"w": jax.ShapeDtypeStruct((30, 40), jnp.float32)}
  state = topka2a_jax.init(tx, shapes, mesh)
  concrete = topka2a_jax.init(tx, {"w": jnp.zeros((30, 40))}, mesh)
  chex.assert_trees_all_equal(state, concrete)
  assert state[0].residuals["w"].sharding.spec == P("data")


def test_state_shapes_come_from_eval_shape_without_allocating(mesh):
  # What checkpoint restores and benchmarks do: trace init, allocate nothing.
  params = {"w": jax.ShapeDtypeStruct((30, 40), jnp.float32)}
  told = optax.chain(topka2a_jax.topka2a(0.1, min_size=0, mesh=mesh), optax.adam(1e-3))
  plain = optax.chain(topka2a_jax.topka2a(0.1, min_size=0), optax.adam(1e-3))
  concrete = topka2a_jax.init(plain, {"w": jnp.zeros((30, 40))}, mesh)
  for shapes in (jax.eval_shape(told.init, params),
                 jax.eval_shape(lambda: topka2a_jax.init(plain, params, mesh))):
    assert jax.tree.structure(shapes) == jax.tree.structure(concrete)
    assert [(s.shape, s.dtype) for s in jax.tree.leaves(shapes)] == [
        (c.shape, c.dtype) for c in jax.tree.leaves(concrete)]
