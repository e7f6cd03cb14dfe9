"""Dense warm-up: pmean for the first steps, then sparse, in one compiled step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference
from cases import random_grads, residuals_of

import topka2a_jax


def run_counting_traces(exchange_steps, tx, mesh, grads_per_step):
  """The exchange_steps fixture, also returning how often the update traced."""
  traces = []

  def update(*args, **kwargs):
    traces.append(1)
    return tx.update(*args, **kwargs)

  counted = optax.GradientTransformationExtraArgs(tx.init, update)
  return exchange_steps(counted, mesh, grads_per_step), len(traces)


@pytest.mark.parametrize("algorithm", ["topka2a", "topka2a_sparse", "allgather"])
def test_warmup_is_dense_then_sparse_from_zero_residuals(mesh, algorithm, exchange_steps):
  tx = optax.chain(topka2a_jax.topka2a(0.1, algorithm=algorithm, min_size=0,
                                       fusion=1, warmup_steps=2))
  steps = [random_grads(seed) for seed in (61, 62, 63, 64)]
  history, traces = run_counting_traces(exchange_steps, tx, mesh, steps)
  assert traces == 1  # one compiled step switches at run time
  for grads, (updates, state) in zip(steps[:2], history[:2]):
    for k, g in grads.items():
      np.testing.assert_allclose(updates[k], np.broadcast_to(g.mean(0), g.shape),
                                 rtol=1e-5, atol=1e-6)
    assert all(not r.any() for r in residuals_of(state).values())
  residuals = {}  # sparsification starts from zero residuals
  for grads, (updates, state) in zip(steps[2:], history[2:]):
    want, residuals = reference.leafwise(algorithm, grads, residuals, 0.1)
    for k in grads:
      np.testing.assert_allclose(updates[k][5], want[k], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(residuals_of(state)[k], residuals[k],
                                 rtol=1e-5, atol=1e-5)
  assert [int(s[0].count) for _, s in history] == [1, 2, 3, 4]


@pytest.mark.parametrize("algorithm", ["onebit", "rotated_4_8"])
def test_warmup_is_dense_then_codes_from_zero_residuals(mesh, exchange_steps, algorithm):
  tx = optax.chain(topka2a_jax.topka2a(algorithm=algorithm, min_size=0, fusion=1,
                                       warmup_steps=2))
  steps = [random_grads(seed) for seed in (61, 62, 63, 64)]
  history, traces = run_counting_traces(exchange_steps, tx, mesh, steps)
  assert traces == 1
  for grads, (updates, state) in zip(steps[:2], history[:2]):
    for k, g in grads.items():
      np.testing.assert_allclose(updates[k], np.broadcast_to(g.mean(0), g.shape),
                                 rtol=1e-5, atol=1e-6)
    assert all(not r.any() for r in residuals_of(state).values())
  for k in steps[0]:  # then codes, from zero residuals: nothing lost
    sent = sum(updates[k][0].astype(np.float64) for updates, _ in history[2:])
    had = sum(grads[k].astype(np.float64).sum(0) for grads in steps[2:])
    owed = residuals_of(history[-1][1])[k].sum(0).reshape(had.shape)
    np.testing.assert_allclose(8 * sent + owed, had, rtol=0,
                               atol=1e-5 * np.abs(had).max())
    assert np.abs(owed).max() > 0


def test_warmup_zero_is_sparse_from_the_first_step(mesh, exchange_steps):
  tx = optax.chain(topka2a_jax.topka2a(0.1, algorithm="topka2a", min_size=0, fusion=1))
  grads = random_grads(65)
  [(updates, _)], _ = run_counting_traces(exchange_steps, tx, mesh, [grads])
  want, _ = reference.leafwise("topka2a", grads, {}, 0.1)
  np.testing.assert_allclose(updates["a"][0], want["a"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True])
def test_bad_warmup_steps_are_refused(bad):
  with pytest.raises((TypeError, ValueError), match="warmup_steps"):
    topka2a_jax.topka2a(0.1, warmup_steps=bad)


def test_after_the_counts_largest_value_the_warmup_does_not_come_back(mesh,
                                                                     exchange_steps):
  """A run past 2**31 applied steps stays sparse: ``count`` holds at its largest."""
  tx = topka2a_jax.topka2a(0.1, algorithm="topka2a", min_size=0, fusion=1,
                           warmup_steps=2)
  grads = random_grads(66)
  params = jax.tree.map(lambda g: jax.ShapeDtypeStruct(g.shape[1:], g.dtype), grads)
  state = topka2a_jax.init(tx, params, mesh)
  largest = np.iinfo(np.int32).max
  state = state._replace(count=jax.device_put(jnp.int32(largest - 1), state.count.sharding))
  history = exchange_steps(tx, mesh, [grads] * 3, state=state)
  for updates, _ in history:
    assert any(not np.allclose(updates[k][0], g.mean(0), atol=1e-6)
               for k, g in grads.items())  # sparse, not the warm-up's pmean
  assert [int(state.count) for _, state in history] == [largest] * 3
