"""The one-bit and few-bit exchanges against their float64 NumPy model: packing and bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sharded import on_each_device, per_device

import topka2a_jax
from topka2a_jax._src import sizes
from topka2a_jax._src.collectives import quantized, rotation
from topka2a_jax._src.collectives.algorithms import ALGORITHMS
from topka2a_jax.collectives import COLLECTIVES

QUANTIZING = sorted(name for name, entry in ALGORITHMS.items() if entry.quantizes)
WIDTHS = {"onebit": (1, 8, 4096), "onebit_4": (1, 4, 4096), "onebit_1": (1, 1, 4096),
          "quantized_4_8": (4, 8, 4096), "quantized_4_4": (4, 4, 4096),
          "quantized_2_8": (2, 8, 4096), "quantized_8_8": (8, 8, 4096),
          "quantized_8_4": (8, 4, 4096), "quantized_8_8_fine": (8, 8, 256),
          "rotated_4_8": (4, 8, 512), "rotated_4_4": (4, 4, 512),
          "rotated_1_1": (1, 1, 512)}
"""Bits per entry to the owners and back, and entries per scale, by exchange."""


def exchange(mesh, name, buffers, **options):
  fn = COLLECTIVES[name]
  return per_device(lambda b: fn(b, "data", 1.0, **options), mesh, buffers)


def float64_buffers(devices, length, seed):
  return np.random.default_rng(seed).normal(size=(devices, length))


@pytest.mark.parametrize("name", QUANTIZING)
@pytest.mark.parametrize("length", [1, 5, 8, 33, 257, 1001])
def test_one_step_matches_the_float64_model(mesh, name, length):
  # In float64 the model and the exchange round alike: only the scales
  # travel in float32, and the model rounds them so too.
  buffers = float64_buffers(8, length, seed=length)
  with jax.enable_x64():
    mean, unsent = exchange(mesh, name, buffers)
  want_mean, want_unsent = reference.ALGORITHMS[name](buffers, 1.0)
  scale = np.abs(buffers).max()
  np.testing.assert_allclose(mean, np.broadcast_to(want_mean, mean.shape), rtol=0,
                             atol=1e-12 * scale)
  np.testing.assert_allclose(unsent, want_unsent, rtol=0, atol=1e-12 * scale)


@pytest.mark.parametrize("name", QUANTIZING)
def test_ten_steps_of_error_feedback_match_the_model(mesh, name):
  """Worker and owner residuals carried over 10 steps, several chunks a shard."""
  rng = np.random.default_rng(1)
  grads = [rng.normal(size=(8, 3000)) for _ in range(10)]
  fn = COLLECTIVES[name]
  step = on_each_device(lambda g, r: fn(g + r, "data", 1.0, chunk=128), mesh)
  residual = want_residual = np.zeros((8, 3000))
  for grad in grads:
    with jax.enable_x64():
      mean, residual = step(grad, residual)
    want_mean, want_residual = reference.ALGORITHMS[name](grad + want_residual, 1.0,
                                                          chunk=128)
    np.testing.assert_allclose(mean[0], want_mean, rtol=0, atol=1e-11)
    np.testing.assert_allclose(residual, want_residual, rtol=0, atol=1e-11)
  assert np.abs(residual).max() > 0.01  # the test compared something owed


@pytest.mark.parametrize("name", QUANTIZING)
@pytest.mark.parametrize("length", [1, 7, 777])
def test_nothing_is_lost_and_every_device_gets_the_same_mean(mesh, name, length):
  buffers = np.random.default_rng(4).normal(size=(8, length)).astype(np.float32)
  mean, unsent = exchange(mesh, name, buffers)
  for device in range(1, 8):
    np.testing.assert_array_equal(mean[device], mean[0])
  np.testing.assert_allclose(8 * mean[0] + unsent.sum(0), buffers.sum(0), rtol=0,
                             atol=8 * 4e-7 * np.abs(buffers).sum(0).max())


def test_hand_computed_case():
  # 2 devices, 4 entries: shards of 32 entries (padded), so owner 0 holds all
  # four. Device 0 [1, -3, 2, 2] sends its signs times 2 (the mean magnitude)
  # and keeps [-1, -1, 0, 0]; device 1 [4, 2, -2, 0] sends [2, 2, -2, 2]
  # (zero counts as positive) and keeps [2, 0, 0, -2]. Owner 0 sums [4, 0, 0, 4].
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  buffers = np.array([[1, -3, 2, 2], [4, 2, -2, 0]], np.float32)
  mean, unsent = exchange(mesh, "onebit", buffers)
  # 8 bits back: [2, 0, 0, 2] is 127 steps of 2/127 and 0: exact.
  np.testing.assert_array_equal(mean[0], [2, 0, 0, 2])
  np.testing.assert_array_equal(unsent, [[-1, -1, 0, 0], [2, 0, 0, -2]])
  mean, unsent = exchange(mesh, "onebit_1", buffers)
  # 1 bit back: all four signs positive, times the mean magnitude 1; owner 0
  # keeps the rounding of the sum, [4, 0, 0, 4] - 2 * [1, 1, 1, 1].
  np.testing.assert_array_equal(mean[0], [1, 1, 1, 1])
  np.testing.assert_array_equal(unsent, [[-1 + 2, -1 - 2, -2, 2], [2, 0, 0, -2]])


@pytest.mark.parametrize("bits", quantized.BITS)
@pytest.mark.parametrize("length", [32, 64, 96, 4128])
def test_packing_round_trips(bits, length):
  codes = np.random.default_rng(bits).integers(0, 2 ** bits, size=(3, length))
  words = quantized.pack(jnp.asarray(codes, jnp.uint32), bits)
  assert words.shape == (3, length * bits // 32) and words.dtype == jnp.uint32
  np.testing.assert_array_equal(quantized.unpack(words, bits), codes)


@pytest.mark.parametrize("length", [1, 3, 8, 31, 33, 100])
def test_rows_that_are_no_multiple_of_32_are_padded_and_the_padding_sends_nothing(length):
  cut = sizes.chunking(length)
  assert cut.chunk % 32 == 0 and 0 <= cut.padded - length < 32
  rows = np.zeros((1, 1, cut.padded))
  rows[0, 0, :length] = np.arange(1, length + 1) * (-1.0) ** np.arange(length)
  valid = np.arange(cut.padded).reshape(rows.shape) < length
  for bits in quantized.BITS:
    words, scales = quantized.encode(jnp.asarray(rows, jnp.float32), bits, valid)
    decoded = np.asarray(quantized.decode(words, scales, bits, valid))[0, 0]
    assert not decoded[length:].any()  # padding decodes to zero
    # No code flips a sign (a few-bit code may round a small entry to zero).
    assert np.all(np.sign(decoded[:length]) * np.sign(rows[0, 0, :length]) >= 0)
    assert decoded[length - 1] != 0  # the largest entry survives any width
    if bits == 1:  # the scale is the mean magnitude of the real entries only
      assert float(scales[0, 0]) == pytest.approx((length + 1) / 2)


@pytest.mark.parametrize("length", [1, 4096, 4097, 12_500, 10**6 + 3])
def test_chunks_split_a_row_evenly(length):
  cut = sizes.chunking(length)
  assert cut.chunk <= sizes.CHUNK and cut.chunks == -(-length // sizes.CHUNK)
  assert 0 <= cut.padded - length < 32 * cut.chunks


def test_a_shard_of_one_entry_is_sent_exactly(mesh):
  # 225 entries on 8 devices: shards of 32, the last holding one real entry,
  # whose chunk's mean magnitude is its own: its sign and scale are the value
  # itself, in both phases.
  buffers = np.random.default_rng(2).normal(size=(8, 225)).astype(np.float32)
  mean, unsent = exchange(mesh, "onebit_1", buffers)
  assert mean.shape == (8, 225)
  np.testing.assert_allclose(mean[0, 224], buffers[:, 224].mean(), rtol=1e-6)
  np.testing.assert_allclose(unsent[:, 224], 0, atol=1e-6)


def test_a_skipped_step_sends_nothing(mesh):
  buffers = np.random.default_rng(3).normal(size=(8, 100)).astype(np.float32)
  mean, unsent = exchange(mesh, "onebit", buffers, send=jnp.asarray(False))
  np.testing.assert_array_equal(mean, 0.0)
  np.testing.assert_array_equal(unsent, buffers)


@pytest.mark.parametrize("name", QUANTIZING)
def test_bytes_on_the_wire_are_the_cost_models(mesh, name):
  length = 100_000
  fn = COLLECTIVES[name]
  run = jax.jit(jax.shard_map(lambda b: fn(b[0], "data", 1.0).mean, mesh=mesh,
                              in_specs=P("data"), out_specs=P()))
  buffers = jax.device_put(jnp.zeros((8, length)), NamedSharding(mesh, P("data")))
  sent = topka2a_jax.comm_report(run.lower(buffers)).total_bytes
  model = ALGORITHMS[name].cost(length, 8, 1.0).bytes
  assert sent == pytest.approx(model, rel=0.01)
  up, back, chunk = WIDTHS[name]
  if ALGORITHMS[name].codes.rotated:
    # Chunks of a power of two: 12,500 entries a shard cost least as 49 of
    # 256 (12,544 entries and 49 scales; 25 of 512 pad 300 entries).
    assert model == 7 * 49 * (256 * (up + back) / 8 + 2 * 4)
  else:
    assert model / length == pytest.approx(7 / 8 * (up + back + 2 * 32 / chunk) / 8,
                                           rel=0.01)


def test_its_bytes_do_not_grow_with_the_devices():
  per_device = [ALGORITHMS["onebit"].cost(10**7, devices, 1.0).bytes
                for devices in (2, 8, 64, 512)]
  # (P-1)/P of 1 + 8 bits per entry, plus two float32 scales per chunk of
  # at least 2048 entries and under 32 entries of padding per chunk (2% at
  # most): bounded whatever P, where TopkA's grows as P.
  assert max(per_device) < 1.02 * 9 / 8 * 10**7 and per_device == sorted(per_device)


def test_auto_before_plain_sgd_never_picks_a_quantizing_exchange():
  from topka2a_jax._src.planner.fusion import step_model
  model = step_model([10**7], 8, 0.01, network="eth1", min_size=0)
  assert not set(model.candidates("auto")) & set(QUANTIZING)


def test_the_transform_trains_with_it_and_needs_no_density(mesh, train_steps):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 16)).astype(np.float32)
  y = np.sin(x[:, :4])
  params = {"w": rng.normal(size=(16, 4)).astype(np.float32) / 4}
  loss = lambda p, b: jnp.mean((b[0] @ p["w"] - b[1]) ** 2)
  tx = topka2a_jax.compress_updates(optax.adam(1e-2), algorithm="onebit", min_size=0)
  history = train_steps(tx, mesh, loss, params, [(x, y)] * 30)
  assert history[-1][2] < 0.6 * history[0][2]
  state = history[-1][1]
  assert np.abs(state.exchange.residuals["w"]).max() > 0  # error fed back
  with pytest.raises(ValueError, match="density is required with algorithm='topka2a'"):
    topka2a_jax.topka2a(algorithm="topka2a")
  with pytest.raises(ValueError, match="sends signs and few-bit codes.*Drop value_dtype"):
    topka2a_jax.compress_updates(optax.adam(1e-2), algorithm="onebit",
                                 value_dtype=jnp.bfloat16)


def test_compress_updates_sends_signs_unless_given_a_density(mesh):
  """The default exchange of Adam's step, read off the compiled step's bytes."""
  params = {"w": jnp.zeros((4096, 8))}
  batch = jnp.ones((8, 4096))

  def sent(tx):
    step = topka2a_jax.train_step(lambda p, x: jnp.mean((x @ p["w"]) ** 2), tx, mesh)
    return topka2a_jax.comm_report(step.lower(params, tx.init(params), batch)).total_bytes

  signs = sent(topka2a_jax.compress_updates(optax.adam(1e-3), mesh=mesh))
  # Signs to the owners, means back in 4 bits.
  assert signs == pytest.approx(ALGORITHMS["onebit_4"].cost(4096 * 8, 8, 1.0).bytes,
                                rel=0.01)
  top_k = sent(topka2a_jax.compress_updates(optax.adam(1e-3), density=0.01, mesh=mesh))
  # 1% of 32,768 entries, 328 float32 values and uint16 indices, to 7 peers
  # (TopkA): 0.77x the signs' bytes.
  assert top_k == pytest.approx(7 * 328 * 6, rel=0.01)


@pytest.mark.parametrize("length", [32, 128, 512])
def test_the_rotation_is_the_models_matrix_and_its_inverse(length):
  chunks = np.random.default_rng(length).normal(size=(2, 3, length))
  forward, inverse = reference.rotation(length)
  with jax.enable_x64():
    rotated = np.asarray(rotation.rotate(jnp.asarray(chunks)))
    back = np.asarray(rotation.unrotate(jnp.asarray(rotated)))
  np.testing.assert_allclose(rotated, chunks @ forward.T, rtol=0, atol=1e-12)
  np.testing.assert_allclose(back, chunks @ (inverse @ forward).T, rtol=0, atol=1e-12)
  np.testing.assert_allclose(inverse @ forward, np.eye(length), atol=1e-12)


def test_a_rotated_code_keeps_a_chunk_with_an_outlier_in_4_bits(mesh):
  """One entry 50 times the others' scale: unrotated, it sets a step that rounds
  every other entry to zero; rotated first, their error is several times smaller."""
  row = np.random.default_rng(5).normal(size=8 * 512).astype(np.float32)
  row[::512] = 50.0  # one outlier a chunk
  same = np.tile(row, (8, 1))
  errors = {}
  for name in ("quantized_4_8", "rotated_4_8"):
    mean = exchange(mesh, name, same, chunk=512)[0][0]
    rest = np.arange(row.size) % 512 != 0
    errors[name] = np.sqrt(np.mean((mean[rest] - row[rest]) ** 2))
  assert errors["quantized_4_8"] == pytest.approx(1.0, rel=0.1)  # all rounded to 0
  assert errors["rotated_4_8"] < 0.3 * errors["quantized_4_8"]


def test_a_rotated_code_needs_chunks_of_a_power_of_two(mesh):
  with pytest.raises(ValueError, match="power of two.*try 512 or 256"):
    exchange(mesh, "rotated_4_8", np.ones((8, 1000), np.float32), chunk=384)
