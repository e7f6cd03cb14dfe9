"""Property-based tests: random pytrees, dtypes, densities, algorithms, devices.

For every drawn case one jitted step runs twice from zero residuals, and:
nothing is lost (the mean times P plus the residuals left on the devices is
the sum of the gradients), every device holds the same update bitwise, a
second compilation and run agree bitwise, and density 1.0 equals the plain
mean. Examples are
bounded and derandomised, so CI runs the same cases every time.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import topka2a_jax

DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16, "float16": np.float16}
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}

leaf_shapes = st.lists(st.integers(1, 6), min_size=0, max_size=3).map(tuple)
cases = st.fixed_dictionaries({
    "shapes": st.lists(leaf_shapes, min_size=1, max_size=4),
    "dtype": st.sampled_from(sorted(DTYPES)),
    "density": st.one_of(st.just(1.0), st.floats(0.001, 1.0)),
    "algorithm": st.sampled_from(["topka2a", "topka2a_sparse", "allgather",
                                  "dense", "auto"]),
    "selection": st.sampled_from(["exact", "threshold"]),
    "fusion": st.sampled_from([1, 64, "auto"]),
    "devices": st.sampled_from([1, 2, 3, 4, 8]),
    "seed": st.integers(0, 2**16),
})


def step_twice(exchange_steps, case):
  """One step from zero residuals, compiled and run twice.

  Returns:
    The gradients, and per run the updates (per device) and the residuals
    (per device, flat).
  """
  devices = case["devices"]
  mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
  rng = np.random.default_rng(case["seed"])
  dtype = DTYPES[case["dtype"]]
  grads = {f"leaf{i}": rng.standard_t(3, size=(devices, *shape)).astype(dtype)
           for i, shape in enumerate(case["shapes"])}
  tx = optax.chain(topka2a_jax.topka2a(
      case["density"], algorithm=case["algorithm"], selection=case["selection"],
      fusion=case["fusion"], min_size=0))
  runs = []
  for _ in range(2):
    [(updates, state)] = exchange_steps(tx, mesh, [grads])
    residuals = {k: np.asarray(v, np.float64).reshape(devices, -1)
                 for k, v in state[0].residuals.items()
                 if not isinstance(v, optax.MaskedNode)}
    runs.append((updates, residuals))
  return grads, runs


@pytest.mark.slow
@settings(max_examples=20, deadline=None, derandomize=True)
@given(cases)
def test_nothing_lost_replicas_identical_deterministic(exchange_steps, case):
  grads, [(updates, residuals), (again, residuals_again)] = step_twice(
      exchange_steps, case)
  devices, tolerance = case["devices"], TOLERANCE[case["dtype"]]
  for k, g in grads.items():
    update = updates[k]
    np.testing.assert_array_equal(again[k], update)  # deterministic
    np.testing.assert_array_equal(update, np.broadcast_to(update[0], update.shape))
    total = g.astype(np.float64).reshape(devices, -1).sum(0)
    scale = np.abs(total).max(initial=0.0) + 1.0
    sent = devices * update[0].astype(np.float64).reshape(-1)
    kept = residuals.get(k, np.zeros((devices, g[0].size))).sum(0)
    np.testing.assert_allclose(sent + kept, total, atol=tolerance * scale * devices)
    if case["density"] == 1.0 or case["algorithm"] == "dense":
      np.testing.assert_allclose(update[0].astype(np.float64).reshape(-1),
                                 total / devices,
                                 atol=tolerance * scale)
  for k, r in residuals.items():
    np.testing.assert_array_equal(residuals_again[k], r)
