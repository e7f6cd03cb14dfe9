"""Error feedback at work: a small MLP trained with sparse gradients.

A fixed synthetic task: a 2-layer teacher network with noisy labels, learnt
by a 3-layer MLP from minibatches on 8 devices. Minibatch noise is what makes
dropping the unsent gradient hurt: without error feedback the consistently
small but useful gradient entries never get through.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax

STEPS, BATCH_PER_DEVICE = 400, 32


def mlp(params, x):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  h = jnp.tanh(h @ params["w2"] + params["b2"])
  return h @ params["w3"]


def mse(params, x, y):
  return jnp.mean((mlp(params, x) - y) ** 2)


@functools.cache
def task():
  keys = jax.random.split(jax.random.key(0), 8)
  teacher_in = jax.random.normal(keys[0], (32, 64)) / 32**0.5
  teacher_out = jax.random.normal(keys[1], (64, 8)) / 8
  truth = lambda x: jnp.tanh(x @ teacher_in) @ teacher_out  # noqa: E731
  x = jax.random.normal(keys[2], (8192, 32))
  y = truth(x) + 0.3 * jax.random.normal(keys[3], (8192, 8))
  x_test = jax.random.normal(keys[4], (2048, 32))
  params = {
      "w1": jax.random.normal(keys[5], (32, 128)) / 32**0.5, "b1": jnp.zeros(128),
      "w2": jax.random.normal(keys[6], (128, 128)) / 128**0.5, "b2": jnp.zeros(128),
      "w3": jax.random.normal(keys[7], (128, 8)) / 128**0.5,
  }
  return params, (x, y), (x_test, truth(x_test))


@functools.cache
def held_out_loss_after_training(**options):
  mesh = jax.make_mesh((8,), ("data",))
  params, (x, y), (x_test, y_test) = task()
  tx = optax.chain(topka2a_jax.topka2a(0.05, min_size=1000, **options),
                   optax.adam(3e-3))
  state = topka2a_jax.init(tx, params, mesh)
  specs = topka2a_jax.state_specs(state)

  def step(params, state, x, y, i):
    batch = (i * BATCH_PER_DEVICE + jnp.arange(BATCH_PER_DEVICE)) % x.shape[0]
    local = lax.pcast(params, "data", to="varying")
    grads = jax.grad(mse)(local, x[batch], y[batch])
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  run = jax.jit(jax.shard_map(step, mesh=mesh,
                              in_specs=(P(), specs, P("data"), P("data"), P()),
                              out_specs=(P(), specs)))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  x, y = jax.device_put((x, y), NamedSharding(mesh, P("data")))
  for i in range(STEPS):
    params, state = run(params, state, x, y, jnp.int32(i))
    jax.block_until_ready(params)  # one step in flight: see the README
  return float(mse(params, x_test, y_test))


@pytest.mark.parametrize("algorithm", ["topka2a", "allgather"])
def test_sparse_training_stays_close_to_dense(algorithm):
  dense = held_out_loss_after_training(algorithm="dense")
  sparse = held_out_loss_after_training(algorithm=algorithm)
  initial = float(mse(task()[0], *task()[2]))
  assert sparse < 0.3 * initial
  assert sparse < 1.25 * dense


def test_error_feedback_clearly_helps():
  with_feedback = held_out_loss_after_training(algorithm="topka2a")
  without = held_out_loss_after_training(algorithm="topka2a", error_feedback=False)
  assert without > 1.15 * with_feedback
