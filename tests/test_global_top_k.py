"""gTop-k and Ok-Topk against their NumPy models, on 2 to 8 devices and over ten steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded import on_each_device, per_device

import topka2a_jax
from topka2a_jax._src.collectives import exchanges
from topka2a_jax._src.collectives.algorithms import ALGORITHMS
from topka2a_jax._src.collectives.registry import COLLECTIVES

GLOBAL = ["gtopk", "oktopk"]


def on_devices(count):
  return jax.make_mesh((count,), ("data",), devices=jax.devices()[:count])


def exchange(mesh, algorithm, buffers, density, **options):
  fn = COLLECTIVES[algorithm]
  return per_device(lambda b: tuple(fn(b, "data", density, **options)), mesh, buffers)


@pytest.mark.parametrize("algorithm", GLOBAL)
@pytest.mark.parametrize(("length", "density"),
                         [(1, 0.3), (13, 0.3), (64, 1.0), (1001, 0.01), (1001, 0.1)])
def test_matches_the_model_on_8_devices(mesh, algorithm, length, density):
  buffers = np.random.default_rng(length).normal(size=(8, length)).astype(np.float32)
  mean, unsent = exchange(mesh, algorithm, buffers, density)
  want_mean, want_unsent = reference.ALGORITHMS[algorithm](buffers, density)
  np.testing.assert_allclose(mean, np.broadcast_to(want_mean, mean.shape), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(unsent, want_unsent, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm", GLOBAL)
@pytest.mark.parametrize("devices", [2, 3, 6])
def test_matches_the_model_on_other_device_counts(algorithm, devices):
  # 3 and 6 are not powers of two: gTop-k's extra devices merge in first
  # and take the result back last.
  buffers = np.random.default_rng(devices).normal(size=(devices, 500)).astype(np.float32)
  mean, unsent = exchange(on_devices(devices), algorithm, buffers, 0.05)
  want_mean, want_unsent = reference.ALGORITHMS[algorithm](buffers, 0.05)
  for device in range(devices):
    np.testing.assert_array_equal(mean[device], mean[0])
  np.testing.assert_allclose(mean[0], want_mean, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(unsent, want_unsent, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm", GLOBAL)
@pytest.mark.parametrize("devices", [8, 6])
def test_ten_steps_of_error_feedback_follow_the_model(algorithm, devices):
  mesh = on_devices(devices)
  rng = np.random.default_rng(11)
  residual = np.zeros((devices, 300), np.float32)
  want_residual = np.zeros((devices, 300))
  fn = COLLECTIVES[algorithm]
  step = on_each_device(lambda g, r: tuple(fn(g + r, "data", 0.05)), mesh)
  for _ in range(10):
    grad = rng.normal(size=(devices, 300)).astype(np.float32)
    mean, residual = step(grad, residual)
    want_mean, want_residual = reference.ALGORITHMS[algorithm](grad + want_residual, 0.05)
    np.testing.assert_allclose(mean[0], want_mean, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(residual, want_residual, rtol=1e-4, atol=1e-5)


def test_gtopk_hand_computed_merge_drops_wait_with_the_groups_first_device():
  # 4 devices, 4 entries, k = 1, partial means over P = 4.
  # Round 0: devices 0 and 1 pick entry 0 (4 and 8): the merge keeps it.
  # Devices 2 and 3 pick entries 1 (-20) and 2 (16): the merge keeps -20
  # and 16 waits with device 2. Round 1: 12 against -20: -20 is kept, and
  # 12 (the sum of entry 0) waits with device 0.
  buffers = np.array([[4, 1, 0, 0], [8, 0, 1, 0], [0, -20, 0, 0], [0, 0, 16, 0]],
                     np.float32)
  mean, unsent = exchange(on_devices(4), "gtopk", buffers, 0.25)
  np.testing.assert_array_equal(mean[0], [0, -5, 0, 0])
  np.testing.assert_array_equal(unsent, [[12, 1, 0, 0], [0, 0, 1, 0],
                                         [0, 0, 16, 0], [0, 0, 0, 0]])


def test_oktopk_sends_each_owner_its_capacity_and_keeps_the_rest():
  # Every device's top 40 of 400 lie in the first tenth of the buffer on
  # device 0 only: its selection overflows one owner's capacity of
  # 2 * ceil(40 / 4) = 20 entries; the other 20 wait in its residual.
  rng = np.random.default_rng(5)
  buffers = rng.normal(size=(4, 400)).astype(np.float32) * 0.01
  buffers[0, :40] = np.arange(1, 41, dtype=np.float32)
  mean, unsent = exchange(on_devices(4), "oktopk", buffers, 0.1)
  want_mean, want_unsent = reference.oktopk(buffers, 0.1)
  np.testing.assert_allclose(mean[0], want_mean, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(unsent, want_unsent, rtol=1e-5, atol=1e-7)
  assert np.count_nonzero(unsent[0, :40]) >= 20
  np.testing.assert_allclose(4 * mean[0] + unsent.sum(0), buffers.sum(0), rtol=1e-6,
                             atol=1e-6)


@pytest.mark.parametrize(("algorithm", "devices"), [("gtopk", 8), ("gtopk", 6),
                                                    ("oktopk", 8)])
def test_compiled_bytes_are_the_cost_models(algorithm, devices):
  mesh, length = on_devices(devices), 100_000
  fn = COLLECTIVES[algorithm]
  run = jax.jit(jax.shard_map(lambda b: tuple(fn(b, "data", 0.01)), mesh=mesh,
                              in_specs=P("data"), out_specs=(P(), P("data"))))
  x = jax.device_put(np.ones(devices * length, np.float32), NamedSharding(mesh, P("data")))
  report = topka2a_jax.comm_report(run.lower(x))
  assert report.total_bytes == ALGORITHMS[algorithm].cost(length, devices, 0.01).bytes


def test_gtopk_rounds_grow_with_log2_of_the_devices():
  # 1% of 25M entries: 250,000 pairs of 8 bytes a round; then one slice of
  # ceil(k / P) pairs from each device.
  tree = {p: ALGORITHMS["gtopk"].phases(25_000_000, p, 0.01) for p in (2, 8, 6, 32)}
  assert {p: phases[0].messages for p, phases in tree.items()} == {2: 1, 8: 3, 6: 4, 32: 5}
  assert tree[8][0].bytes == 3 * 250_000 * 8
  assert tree[8][1].bytes == 7 * 31_250 * 8


@pytest.mark.parametrize("algorithm", GLOBAL)
def test_bfloat16_values_keep_their_rounding_in_the_residual(mesh, algorithm):
  buffers = np.random.default_rng(9).normal(size=(8, 1001)).astype(np.float32)
  mean, unsent = exchange(mesh, algorithm, buffers, 0.1, value_dtype=jnp.bfloat16)
  np.testing.assert_array_equal(mean[0], mean[0].astype(jnp.bfloat16).astype(np.float32))
  np.testing.assert_allclose(8 * mean[0] + unsent.sum(0), buffers.sum(0), rtol=1e-5,
                             atol=1e-5)


def test_oktopk_at_density_one_loses_nothing_and_misses_only_a_regions_excess(mesh):
  # 1000 entries on 8 devices, bins of 2: region 0 holds 63 bins, 126
  # positions, and its owner sends ceil(1000 / 8) = 125 of them.
  buffers = np.random.default_rng(2).normal(size=(8, 1000)).astype(np.float32)
  mean, unsent = exchange(mesh, "oktopk", buffers, 1.0)
  np.testing.assert_allclose(8 * mean[0] + unsent.sum(0), buffers.sum(0), rtol=1e-5,
                             atol=1e-5)
  missed = np.flatnonzero(~np.isclose(mean[0], buffers.mean(0), rtol=1e-5, atol=1e-6))
  assert 0 < len(missed) <= 8
  np.testing.assert_allclose(mean[0], reference.oktopk(buffers, 1.0)[0], rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize("algorithm", GLOBAL)
def test_ties_go_to_the_lower_index_as_in_the_model(mesh, algorithm):
  # Small integers: most magnitudes tie, at the devices and in every merge.
  buffers = np.random.default_rng(4).integers(-3, 4, size=(8, 200)).astype(np.float32)
  mean, unsent = exchange(mesh, algorithm, buffers, 0.1)
  want_mean, want_unsent = reference.ALGORITHMS[algorithm](buffers, 0.1)
  np.testing.assert_allclose(mean[0], want_mean, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(unsent, want_unsent, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("algorithm", GLOBAL)
def test_a_bfloat16_buffer_is_exchanged_like_the_model_to_its_rounding(mesh, algorithm):
  buffers = np.random.default_rng(6).normal(size=(8, 600)).astype(jnp.bfloat16)
  mean, unsent = exchange(mesh, algorithm, buffers, 0.05)
  assert mean.dtype == unsent.dtype == jnp.bfloat16
  for device in range(1, 8):
    np.testing.assert_array_equal(mean[device], mean[0])
  want_mean, _ = reference.ALGORITHMS[algorithm](buffers.astype(np.float32), 0.05)
  np.testing.assert_allclose(mean[0].astype(np.float32), want_mean, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("algorithm", GLOBAL)
def test_between_nodes_of_a_two_level_mesh_nothing_is_lost(algorithm):
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  rows = np.random.default_rng(8).normal(size=(8, 400)).astype(np.float32)
  outer = COLLECTIVES[algorithm]
  run = jax.jit(jax.shard_map(
      lambda row: tuple(x[None] for x in exchanges.two_level(
          row[0], ("node", "local"), 0.05, outer=outer)),
      mesh=mesh, in_specs=P(("node", "local")), out_specs=P(("node", "local"))))
  mean, unsent = map(np.asarray, run(jax.device_put(
      rows, NamedSharding(mesh, P(("node", "local"))))))
  for device in range(1, 8):
    np.testing.assert_array_equal(mean[device], mean[0])
  # Each device keeps the unsent part of its slice (100 entries) of its node's sum.
  owed = unsent.reshape(2, 400).sum(0)
  np.testing.assert_allclose(8 * mean[0] + owed, rows.sum(0), rtol=1e-5, atol=1e-5)
