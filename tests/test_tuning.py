"""The online threshold tuner: a synthetic cost, then real jitted steps."""

import math

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax
from topka2a_jax.tuning import tune_fusion


def test_binary_search_finds_the_minimum_of_a_valley():
  # Cost |log t - log 5000|: the best grid point is the one nearest 5000.
  best, timings = tune_fusion(lambda t: (lambda: t), 10, 10**7, points=64,
                              measure=lambda run: abs(math.log(run() / 5000)))
  grid = sorted({round(10 * 1e6 ** (j / 63)) for j in range(64)})
  assert best == min(grid, key=lambda t: abs(math.log(t / 5000)))
  assert len(timings) <= 2 + 2 * 6 + 2  # ends, two bisections of 64 points


def test_bad_ranges():
  with pytest.raises(ValueError, match="need 1 <= low <= high"):
    tune_fusion(lambda t: (lambda: None), 100, 10)
  with pytest.raises(ValueError, match="points must be at least 2"):
    tune_fusion(lambda t: (lambda: None), 1, 10, points=1)


def test_times_real_steps(mesh):
  params = {f"w{i}": jnp.ones((64, 64)) for i in range(4)}
  batch = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("data")))
  placed = jax.device_put(params, NamedSharding(mesh, P()))
  built = []

  def make_step(threshold):
    built.append(threshold)
    tx = optax.chain(topka2a_jax.topka2a(0.05, fusion=threshold, min_size=0),
                     optax.sgd(0.1))
    state = topka2a_jax.init(tx, params, mesh)
    specs = topka2a_jax.state_specs(state)

    def step(params, state, x):
      loss = lambda p: sum(jnp.sum(jnp.tanh(x @ w)) for w in p.values())
      grads = jax.grad(loss)(lax.pcast(params, "data", to="varying"))
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
                                out_specs=(P(), specs)))
    return lambda: run(placed, state, batch)

  best, timings = tune_fusion(make_step, 4096, 4 * 4096, points=4, repeats=2)
  assert best in timings and set(timings) == set(built)
  assert all(seconds > 0 for seconds in timings.values())
