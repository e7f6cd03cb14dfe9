"""A 2-D mesh: parameters sharded along "model", the batch along "data".

The transform exchanges only along "data", each device on its own parameter
shard; the result must equal the dense gradient of the whole model.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax

PARAM_SPECS = {"w": P(None, "model"), "b": P("model")}


def model_loss(params, x, t):
  """Sum over samples and output features: separable by feature."""
  return jnp.sum((jnp.tanh(x @ params["w"] + params["b"]) - t) ** 2)


@pytest.fixture(scope="module")
def mesh2d():
  return jax.make_mesh((4, 2), ("data", "model"))


@pytest.fixture(scope="module")
def problem():
  rng = np.random.default_rng(81)
  params = {"w": rng.normal(size=(16, 64)).astype(np.float32) / 4,
            "b": rng.normal(size=64).astype(np.float32)}
  x = rng.normal(size=(32, 16)).astype(np.float32)
  t = rng.normal(size=(32, 64)).astype(np.float32)
  return params, x, t


def sharded_step(mesh, tx, steps, problem):
  """Runs ``steps`` of tx on the 2-D mesh; returns updates of the last, params, state."""
  params, x, t = problem
  state = topka2a_jax.init(tx, params, mesh, param_specs=PARAM_SPECS)
  specs = topka2a_jax.state_specs(state, param_specs=PARAM_SPECS)
  batch_spec = P("data", "model")  # targets: rows by data, features by model

  def step(params, state, x, t):
    grads = jax.grad(model_loss)(lax.pcast(params, "data", to="varying"), x, t)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates

  run = jax.jit(jax.shard_map(
      step, mesh=mesh, in_specs=(PARAM_SPECS, specs, P("data"), batch_spec),
      out_specs=(PARAM_SPECS, specs, PARAM_SPECS)))
  params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s),
                                               PARAM_SPECS))
  x = jax.device_put(x, NamedSharding(mesh, P("data")))
  t = jax.device_put(t, NamedSharding(mesh, batch_spec))
  for _ in range(steps):
    params, state, updates = run(params, state, x, t)
  return jax.tree.map(np.asarray, updates), params, state


def dense_gradient(params, x, t):
  """The mean over the 4 data shards of each shard's gradient, on one device."""
  grads = [jax.grad(model_loss)(params, x[i * 8:(i + 1) * 8], t[i * 8:(i + 1) * 8])
           for i in range(4)]
  return jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *grads)


@pytest.mark.parametrize("algorithm", ["topka2a", "topka2a_sparse", "allgather",
                                       "dense"])
def test_density_one_on_a_2d_mesh_is_the_dense_gradient(mesh2d, problem, algorithm):
  tx = topka2a_jax.topka2a(1.0, algorithm=algorithm, min_size=0)
  updates, _, _ = sharded_step(mesh2d, tx, 1, problem)
  want = dense_gradient(*problem)
  for k in want:
    np.testing.assert_allclose(updates[k], want[k], rtol=1e-5, atol=1e-5)


def test_sparse_on_a_2d_mesh_loses_nothing(mesh2d, problem):
  tx = topka2a_jax.topka2a(0.1, min_size=0)
  updates, _, state = sharded_step(mesh2d, tx, 1, problem)
  want = dense_gradient(*problem)
  # One parameter-shaped block per data index, split over "model" like it.
  assert state.residuals["w"].sharding.spec == P("data", "model")
  assert state.residuals["b"].sharding.spec == P(("data", "model"))
  for k in ("w", "b"):
    owed = np.asarray(state.residuals[k]).reshape(4, *want[k].shape).sum(0)
    np.testing.assert_allclose(4 * updates[k] + owed, 4 * want[k], rtol=1e-4,
                               atol=1e-4)
    assert np.abs(owed).sum() > 0


@pytest.mark.parametrize("algorithm", ["onebit", "quantized_4_8", "rotated_4_8"])
def test_codes_on_a_2d_mesh_lose_nothing(mesh2d, problem, algorithm):
  """Codes of each device's shard of the parameters; every entry is sent."""
  tx = topka2a_jax.topka2a(algorithm=algorithm, min_size=0)
  updates, _, state = sharded_step(mesh2d, tx, 1, problem)
  want = dense_gradient(*problem)
  assert state.residuals["w"].sharding.spec == P("data", "model")
  for k in ("w", "b"):
    owed = np.asarray(state.residuals[k]).reshape(4, *want[k].shape).sum(0)
    np.testing.assert_allclose(4 * updates[k] + owed, 4 * want[k], rtol=1e-4,
                               atol=1e-4)
    assert np.abs(owed).sum() > 0


def test_adam_state_is_sharded_like_the_parameters(mesh2d, problem):
  tx = optax.chain(topka2a_jax.topka2a(0.1, min_size=0), optax.adam(1e-2))
  _, params, state = sharded_step(mesh2d, tx, 3, problem)
  assert state[1][0].mu["w"].sharding.spec == P(None, "model")
  assert params["w"].sharding.spec == P(None, "model")
  assert np.isfinite(np.asarray(params["w"])).all()


def test_nan_on_one_model_shard_skips_every_shard(mesh2d, problem):
  params, x, t = problem
  t = t.copy()
  t[9, 3] = np.nan  # data shard 1, model shard 0 only
  tx = topka2a_jax.topka2a(0.1, min_size=0)
  updates, _, state = sharded_step(mesh2d, tx, 1, (params, x, t))
  assert int(state.nonfinite_steps) == 1
  assert not any(u.any() for u in updates.values())
