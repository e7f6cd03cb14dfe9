"""The online threshold tuner: a synthetic cost, then real jitted steps."""

import math

import jax.numpy as jnp
import optax
import pytest

import topka2a_jax
from topka2a_jax._src.planner.tuning import tune_fusion


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


@pytest.mark.slow
def test_times_real_steps(mesh):
  params = {f"w{i}": jnp.ones((64, 64)) for i in range(4)}
  batch = jnp.ones((64, 64))
  built = []

  def loss(params, x):
    return sum(jnp.sum(jnp.tanh(x @ w)) for w in params.values())

  def make_step(threshold):
    built.append(threshold)
    tx = optax.chain(topka2a_jax.topka2a(0.05, fusion=threshold, min_size=0,
                                         mesh=mesh), optax.sgd(0.1))
    step = topka2a_jax.train_step(loss, tx, mesh, donate=False)
    state = tx.init(params)
    return lambda: step(params, state, batch)

  best, timings = tune_fusion(make_step, 4096, 4 * 4096, points=4, repeats=2)
  assert best in timings and set(timings) == set(built)
  assert all(seconds > 0 for seconds in timings.values())
