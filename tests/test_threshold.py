"""Threshold selection: captured mass, ties, and the collectives using it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from sharded import per_device

from topka2a_jax._src.collectives import exchanges, packed_flags, threshold
from topka2a_jax._src.collectives.registry import COLLECTIVES
from topka2a_jax._src.collectives.threshold import threshold_magnitudes
from topka2a_jax._src.collectives.top_k import top_magnitudes

ROWS, LENGTH = 4, 200_000


def inputs(kind, seed=0, length=LENGTH):
  rng = np.random.default_rng(seed)
  if kind == "gaussian":
    x = rng.standard_normal((ROWS, length))
  elif kind == "student-t":
    x = rng.standard_t(3, (ROWS, length))
  elif kind == "gradient-like":
    # Layers of 5,000 entries whose scales span orders of magnitude, some
    # nearly dead: what a fused bucket of gradients looks like.
    scales = np.exp(rng.normal(0.0, 2.0, (ROWS, -(-length // 5000))))
    x = rng.standard_normal((ROWS, length)) * np.repeat(scales, 5000, axis=1)[:, :length]
  return jnp.asarray(x.astype(np.float32))


def check_valid(rows, values, indices, k):
  indices = np.asarray(indices)
  assert indices.shape == (rows.shape[0], k)
  assert ((indices >= 0) & (indices < rows.shape[1])).all()
  assert all(len(np.unique(row)) == k for row in indices)
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(rows), indices, 1),
                                values)


@pytest.mark.parametrize("kind", ["gaussian", "student-t", "gradient-like"])
@pytest.mark.parametrize("density", [0.001, 0.01, 0.05])
# 200,000 is split into groups that tile it; 200,003 has no divisor near the
# group size, so its last entries join the groups as a leftover.
@pytest.mark.parametrize("length", [LENGTH, LENGTH + 3])
def test_captures_99_percent_of_exact_mass(kind, density, length):
  # At density 0.05 a group holds two entries; where the strided groups pair
  # two large layers, the search alone keeps 98.4% of the mass of
  # ("gradient-like", 0.05, LENGTH + 3), and the exact sort takes over.
  rows = inputs(kind, length=length)
  k = int(density * length)
  values, indices = jax.jit(threshold_magnitudes, static_argnums=1)(rows, k)
  check_valid(rows, values, indices, k)
  exact, _ = top_magnitudes(rows, k)
  assert float(jnp.sum(jnp.abs(values))) >= 0.99 * float(jnp.sum(jnp.abs(exact)))


@pytest.mark.slow
@pytest.mark.parametrize("fill", ["zeros", "ones and minus ones", "few values"])
def test_ties_give_exactly_k_distinct_valid_indices(fill):
  rng = np.random.default_rng(1)
  if fill == "zeros":
    rows = np.zeros((ROWS, LENGTH), np.float32)
  elif fill == "ones and minus ones":
    rows = rng.choice([-1.0, 1.0], (ROWS, LENGTH)).astype(np.float32)
  else:
    rows = rng.choice([0.0, 0.5, -2.0], (ROWS, LENGTH), p=[0.9, 0.09, 0.01])
    rows = rows.astype(np.float32)
  k = 2000
  values, indices = threshold_magnitudes(jnp.asarray(rows), k)
  check_valid(rows, values, indices, k)
  if fill != "few values":  # every entry ties: any k are the top k
    exact, _ = top_magnitudes(jnp.asarray(rows), k)
    np.testing.assert_array_equal(np.abs(values).sum(1), np.abs(exact).sum(1))


@pytest.mark.parametrize("sample", ["too small", "too large"])
def test_a_misleading_sample_still_gives_k_to_2k_candidates(sample):
  # The bound comes from every stride-th group key; here those keys alone
  # are 0 (the bound lets every key through) or the largest (too few get
  # through), so only the counting passes' bisection finds a bound that works.
  rng = np.random.default_rng(3)
  groups, k = 40_000, 2_000
  keys = rng.integers(1, 2**30, (ROWS, groups)).astype(np.int32)
  stride = groups // threshold.SAMPLE_SIZE
  sampled = keys[:, ::stride].shape
  keys[:, ::stride] = (0 if sample == "too small"
                       else rng.integers(2**30, 2**31 - 1, sampled))
  bound, count, words = threshold._candidates(jnp.asarray(keys), k, 2 * k)
  want = (keys >= np.asarray(bound)[:, None]).sum(1)
  np.testing.assert_array_equal(count, want)
  assert ((want >= k) & (want <= 2 * k)).all()
  flags = np.unpackbits(np.asarray(words).view(np.uint8), axis=1,
                        bitorder="little")[:, :groups]
  np.testing.assert_array_equal(flags, keys >= np.asarray(bound)[:, None])


@pytest.mark.parametrize("groups", [40_000, 40_013])  # whole words of flags, or not
def test_fewer_than_k_nonzero_keys_make_every_group_a_candidate(groups):
  # A background of exact zeros (embedding rows absent from the batch): the
  # sample sees only the few nonzero keys, no bound above 0 lets k through,
  # so every group is a candidate, and its flags end at the last group.
  rng = np.random.default_rng(6)
  k = 2_000
  keys = np.zeros((ROWS, groups), np.int32)
  stride = groups // threshold.SAMPLE_SIZE
  keys[:, : 1_000 * stride : stride] = rng.integers(1, 2**31 - 1, (ROWS, 1_000))
  bound, count, words = threshold._candidates(jnp.asarray(keys), k, 2 * k)
  np.testing.assert_array_equal(bound, 0)
  np.testing.assert_array_equal(count, groups)
  bits = np.unpackbits(np.asarray(words).view(np.uint8), axis=1, bitorder="little")
  np.testing.assert_array_equal(bits, np.broadcast_to(np.arange(bits.shape[1]) < groups,
                                                      bits.shape))


def test_first_set_matches_numpy():
  rng = np.random.default_rng(4)
  flags = (rng.random((ROWS, 5000)) < rng.random((ROWS, 1))).astype(np.int32)
  flags[0] = 0
  flags[0, [3, 31, 32, 33, 4999]] = 1  # word edges
  m = 5
  got = np.asarray(packed_flags.first_set(packed_flags.pack(jnp.asarray(flags)), m))
  for row, positions in zip(flags, got):
    np.testing.assert_array_equal(positions, np.flatnonzero(row)[:m])


@pytest.mark.parametrize(("rows", "length", "m"), [
    (1, 70, 7), (4, 5000, 5), (4, 5000, 300), (8, 28_864, 14_426)])
def test_set_positions_takes_each_set_in_turn_like_numpy(rows, length, m):
  rng = np.random.default_rng(length + m)
  which = rng.choice(3, (rows, length), p=[0.6, 0.15, 0.25])  # none, first, second
  which[0, :64] = [1, 2] * 32  # word edges, the sets interleaved
  first, second = ((which == s).astype(np.int32) for s in (1, 2))
  got = np.asarray(jax.jit(packed_flags.set_positions, static_argnums=1)(
      [jnp.asarray(first), jnp.asarray(second)], m))
  assert got.shape == (rows, m)
  for row in range(rows):
    want = np.concatenate([np.flatnonzero(first[row]), np.flatnonzero(second[row])])
    np.testing.assert_array_equal(got[row, :len(want)], want[:m])


@pytest.mark.parametrize(("length", "bound"), [
    (1, 32), (127, 32), (128, 32), (129, 32), (5000, 1), (16_385, 32),
    (300_000, 32),  # three levels of blocks
    (600_000, 32),  # 32 x 600,000 reaches 2^24: the cumulative sum
])
def test_running_sum_is_numpys_cumsum(length, bound):
  rng = np.random.default_rng(length)
  counts = rng.integers(0, bound + 1, (2, length)).astype(np.int32)
  counts[1] = bound  # every entry at the bound: the largest sums
  got = jax.jit(packed_flags.running_sum, static_argnums=1)(jnp.asarray(counts), bound)
  np.testing.assert_array_equal(np.asarray(got), np.cumsum(counts, axis=1))


@pytest.mark.parametrize(("length", "smallest", "want"), [
    (200_000, 5, 5),  # divides
    (6_250_000, 5, 5),
    (200_004, 5, 6),  # 5 does not, 6 does
    (200_003, 5, 5),  # nothing up to 7 divides: 5 with a leftover
    (1_000_000, 32, 32),
    (1_000_001, 32, 32),  # never above 32
])
def test_group_size_prefers_a_divisor_a_little_larger(length, smallest, want):
  assert threshold._group_size(length, smallest) == want


def test_small_or_dense_rows_are_exact():
  rows = inputs("gaussian")[:, :5000]
  for k in (10, 2000):
    got = threshold_magnitudes(rows, k)
    want = top_magnitudes(rows, k)
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["allgather", "topka2a", "topka2a_sparse"])
def test_collectives_with_threshold_selection_lose_nothing(mesh, algorithm):
  buffers = np.random.default_rng(2).standard_normal((8, 300_001)).astype(np.float32)
  fn = COLLECTIVES[algorithm]
  mean, unsent = per_device(
      lambda b: fn(b, "data", 0.01, selection="threshold"), mesh, buffers)
  for device in range(1, 8):
    np.testing.assert_array_equal(mean[device], mean[0])
  np.testing.assert_allclose(8 * mean[0] + unsent.sum(0), buffers.sum(0),
                             rtol=1e-5, atol=1e-5)
  # Close to the exact algorithm's result.
  want, _ = reference.ALGORITHMS[algorithm](buffers, 0.01)
  assert np.abs(mean[0]).sum() >= 0.97 * np.abs(want).sum()


def test_unknown_selection_is_named():
  with pytest.raises(ValueError, match="unknown selection 'fast'"):
    exchanges.topka2a(np.ones(8, np.float32), "data", 0.1, selection="fast")
