"""The collectives against the NumPy model, on 8 (and 4, 1) emulated devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from jax import lax
from sharded import per_device

import topka2a_jax
from topka2a_jax._src.collectives import exchanges
from topka2a_jax._src.collectives.algorithms import ALGORITHMS as ENTRIES
from topka2a_jax._src.collectives.registry import COLLECTIVES

ALGORITHMS = sorted(ENTRIES)
SELECTING = sorted(name for name, entry in ENTRIES.items() if not entry.quantizes)
"""The exchanges of a density's selection; the quantizing ones are in test_onebit.py."""


def test_every_algorithm_has_its_collective_and_the_transform_takes_every_selection():
  assert sorted(COLLECTIVES) == ALGORITHMS
  assert sorted(topka2a_jax.collectives.SELECTIONS) == ["approx", "auto", "exact",
                                                         "threshold"]
  for name in topka2a_jax.collectives.SELECTIONS:
    topka2a_jax.topka2a(0.01, selection=name)
LENGTHS = [1, 5, 8, 13, 64, 1001]
DENSITIES = [0.01, 0.1, 0.3, 1.0]


def random_buffers(num_devices, length, seed=0):
  return np.random.default_rng(seed).normal(size=(num_devices, length)).astype(
      np.float32
  )


def exchange(mesh, algorithm, buffers, density):
  fn = COLLECTIVES[algorithm]
  return per_device(lambda b: fn(b, "data", density), mesh, buffers)


@pytest.mark.parametrize("algorithm", [name for name in SELECTING
                                       if name not in ("gtopk", "oktopk")])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("density", DENSITIES)
def test_matches_numpy_model(mesh, algorithm, length, density):
  # gTop-k and Ok-Topk: a shorter matrix in test_global_top_k.py.
  buffers = random_buffers(8, length, seed=length)
  mean, unsent = exchange(mesh, algorithm, buffers, density)
  want_mean, want_unsent = reference.ALGORITHMS[algorithm](buffers, density)
  np.testing.assert_allclose(mean, np.broadcast_to(want_mean, mean.shape),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(unsent, want_unsent, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_replicas_are_bitwise_identical(mesh, algorithm):
  buffers = random_buffers(8, 1001, seed=3)
  mean, _ = exchange(mesh, algorithm, buffers, 0.1)
  for device in range(1, 8):
    np.testing.assert_array_equal(mean[device], mean[0])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("density", [0.01, 0.2])
def test_nothing_is_lost(mesh, algorithm, density):
  # What the devices sent, summed (P * mean), plus what they kept is exactly
  # what they had.
  buffers = random_buffers(8, 777, seed=4)
  mean, unsent = exchange(mesh, algorithm, buffers, density)
  np.testing.assert_allclose(
      8 * mean[0] + unsent.sum(0), buffers.sum(0), rtol=1e-5, atol=1e-5
  )


@pytest.mark.parametrize("algorithm", [name for name in SELECTING if name != "oktopk"])
def test_density_one_equals_pmean(mesh, algorithm):
  # Ok-Topk's owners send a fixed count from regions balanced to a bin
  # (test_global_top_k.py).
  buffers = random_buffers(8, 333, seed=5)
  mean, unsent = exchange(mesh, algorithm, buffers, 1.0)
  pmean = per_device(lambda b: lax.pmean(b, "data"), mesh, buffers)
  np.testing.assert_allclose(mean, pmean, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(unsent, 0.0)


def test_dense_equals_pmean_at_any_density(mesh):
  buffers = random_buffers(8, 100, seed=6)
  mean, _ = exchange(mesh, "dense", buffers, 0.01)
  pmean = per_device(lambda b: lax.pmean(b, "data"), mesh, buffers)
  np.testing.assert_array_equal(mean, pmean)


def test_sparse_sends_only_its_share(mesh):
  # 1000 elements at 1% on 8 devices: 10 entries, 2 per shard, 16 per device.
  buffers = random_buffers(8, 1000, seed=7)
  _, unsent = exchange(mesh, "topka2a", buffers, 0.01)
  assert ((unsent == 0) & (buffers != 0)).sum(axis=1).tolist() == [16] * 8
  _, unsent = exchange(mesh, "allgather", buffers, 0.01)
  assert ((unsent == 0) & (buffers != 0)).sum(axis=1).tolist() == [10] * 8


def test_hand_computed_case():
  # 2 devices, 4 elements, density 0.5: k = 2, one entry from each 2-element
  # shard. Device 0 has [1, -3 | 2, 0.5]: sends -3 to owner 0 and 2 to owner 1.
  # Device 1 has [4, 1 | -1, 6]: sends 4 to owner 0 and 6 to owner 1.
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  buffers = np.array([[1, -3, 2, 0.5], [4, 1, -1, 6]], np.float32)
  mean, unsent = exchange(mesh, "topka2a", buffers, 0.5)
  np.testing.assert_array_equal(mean[0], [2.0, -1.5, 1.0, 3.0])
  np.testing.assert_array_equal(unsent, [[1, 0, 0, 0.5], [0, 1, -1, 0]])


def test_hand_computed_sparse_second_phase():
  # As above, the owners hold [4, -3] and [2, 6]. Each sends its top 1 (4 and
  # 6) and keeps the rest (-3 and 2) in its own residual.
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  buffers = np.array([[1, -3, 2, 0.5], [4, 1, -1, 6]], np.float32)
  mean, unsent = exchange(mesh, "topka2a_sparse", buffers, 0.5)
  np.testing.assert_array_equal(mean[0], [2.0, 0.0, 0.0, 3.0])
  np.testing.assert_array_equal(unsent, [[1, -3, 0, 0.5], [0, 1, 1, 0]])


@pytest.mark.parametrize("num_devices", [1, 4])
@pytest.mark.parametrize("algorithm", SELECTING)
def test_other_axis_sizes(algorithm, num_devices):
  mesh = jax.make_mesh((num_devices,), ("data",), devices=jax.devices()[:num_devices])
  buffers = random_buffers(num_devices, 50, seed=num_devices)
  mean, unsent = exchange(mesh, algorithm, buffers, 0.2)
  want_mean, want_unsent = reference.ALGORITHMS[algorithm](buffers, 0.2)
  np.testing.assert_allclose(mean[0], want_mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(unsent, want_unsent, rtol=1e-6, atol=1e-7)


def test_unbound_axis_is_named():
  with pytest.raises(ValueError, match="axis name 'data' is not bound"):
    exchanges.topka2a(np.ones(8, np.float32), "data", 0.1)


@pytest.mark.parametrize("shape", [(), (2, 3), (0,)])
def test_rejects_non_flat_buffers(mesh, shape):
  with pytest.raises(ValueError, match="1-D buffer"):
    exchanges.topka2a(np.ones(shape, np.float32), "data", 0.1)


@pytest.mark.parametrize("algorithm", ["allgather", "topka2a", "topka2a_sparse"])
def test_bfloat16_values_keep_their_rounding_in_the_residual(mesh, algorithm):
  buffers = random_buffers(8, 1001, seed=9)
  fn = COLLECTIVES[algorithm]
  mean, unsent = per_device(
      lambda b: fn(b, "data", 0.1, value_dtype=jnp.bfloat16), mesh, buffers)
  want_mean, _ = reference.ALGORITHMS[algorithm](buffers, 0.1)
  np.testing.assert_allclose(mean[0], want_mean, rtol=1e-2, atol=1e-2)
  for device in range(1, 8):
    np.testing.assert_array_equal(mean[device], mean[0])
  if algorithm != "allgather":  # sent as bfloat16 sums, divided by P = 8
    np.testing.assert_array_equal(
        mean[0], mean[0].astype(jnp.bfloat16).astype(np.float32))
  # Yet nothing is lost: the rounding stayed in the residuals.
  np.testing.assert_allclose(8 * mean[0] + unsent.sum(0), buffers.sum(0),
                             rtol=1e-5, atol=1e-5)
