"""The default selection against exact top-k on adversarial inputs.

``selection="auto"`` (the threshold search on CPUs and GPUs) must keep at
least 0.99 of exact top-k's magnitude mass on every input class, and every
nonzero entry where fewer than ``k`` are nonzero; through the transform,
what it leaves behind must still drain. Inputs are drawn by hypothesis
(bounded and derandomised) from generators of what real gradients hold:
exact-zero and constant backgrounds, fewer than ``k`` large entries at any
position, ties, power-of-two-wide matrices with large columns or rows,
outlier features, mixed scales across fused leaves, denormals.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import topka2a_jax
from topka2a_jax._src.collectives.selection import auto_magnitudes

LENGTH, K = 131_072, 132  # a TopKA2A shard of 1M entries at density 0.001 on 8
select = jax.jit(auto_magnitudes, static_argnums=1)


def background(rng, kind):
  if kind == "zeros":
    return np.zeros(LENGTH)
  if kind == "constant":
    return np.full(LENGTH, 0.25)
  return rng.standard_normal(LENGTH) * 1e-3


def draw_row(kind, seed, count, scale):
  """One row of ``LENGTH`` float32 entries of the input class ``kind``."""
  rng = np.random.default_rng(seed)
  if kind in ("zeros", "constant", "noise"):  # `count` large entries anywhere
    row = background(rng, kind)
    at = rng.choice(LENGTH, count, replace=False)
    row[at] = scale * rng.choice([-1.0, 1.0], count) * (1 + rng.random(count))
  elif kind == "tail":  # `count` large entries at the end, zeros before
    row = np.zeros(LENGTH)
    row[-count:] = scale
  elif kind == "ties":
    row = rng.choice([0.0, 0.5, -0.5, 2.0], LENGTH, p=[0.7, 0.2, 0.0999, 0.0001])
  elif kind in ("column", "row"):  # a power-of-two-wide matrix
    width = 2 ** int(rng.integers(6, 12))
    matrix = rng.standard_normal((LENGTH // width, width)) * 1e-2
    lines = rng.choice(width if kind == "column" else matrix.shape[0],
                       1 + count % 3, replace=False)
    if kind == "column":
      matrix[:, lines] *= 100 * scale
    else:
      matrix[lines] *= 100 * scale
    row = matrix.ravel()
  elif kind == "outlier features":  # a few columns of a 768-wide matrix
    matrix = rng.standard_normal((LENGTH // 768 + 1, 768))
    matrix[:, rng.choice(768, 6, replace=False)] *= 50
    row = matrix.ravel()[:LENGTH]
  elif kind == "mixed scales":  # fused leaves of very different scales
    sizes = rng.multinomial(LENGTH, np.ones(8) / 8)
    row = np.concatenate([rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 2)
                          for n in sizes])
  else:  # "denormals"
    row = rng.standard_normal(LENGTH) * 1e-39
    row[rng.choice(LENGTH, count, replace=False)] *= 1e3
  return row.astype(np.float32)


KINDS = ["zeros", "constant", "noise", "tail", "ties", "column", "row",
         "outlier features", "mixed scales", "denormals"]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(kind=st.sampled_from(KINDS), seed=st.integers(0, 2**16),
       count=st.integers(1, 2 * K), scale=st.sampled_from([1e-3, 1.0, 1e4]))
def test_auto_keeps_exact_top_k_mass(kind, seed, count, scale):
  row = draw_row(kind, seed, count, scale)
  rows = jnp.asarray(np.stack([row, row[::-1].copy()]))
  values, indices = map(np.asarray, select(rows, K))
  for r, (v, i) in enumerate(zip(values, indices)):
    assert len(np.unique(i)) == K and (i >= 0).all() and (i < LENGTH).all()
    np.testing.assert_array_equal(np.asarray(rows[r])[i], v)
  magnitudes = np.abs(np.asarray(rows, np.float64))
  exact = -np.sort(-magnitudes, axis=1)[:, :K].sum(1)
  kept = np.abs(values.astype(np.float64)).sum(1)
  assert (kept >= 0.99 * exact).all(), (kept / exact)
  nonzero = (magnitudes > 0).sum(1)
  for r in np.flatnonzero(nonzero <= K):  # fewer than k nonzero: all of them
    assert np.count_nonzero(values[r]) == nonzero[r]


@pytest.mark.slow
def test_few_large_entries_over_zeros_drain_through_the_transform(mesh, exchange_steps):
  # 50 entries of 1.0 at the end of a shard of zeros, every step, on every
  # device: each step, all of them must be sent, and what waits must drain.
  n = 8 * LENGTH
  grad = np.zeros((8, n), np.float32)
  grad[:, LENGTH - 50:LENGTH] = 1.0
  zeros = np.zeros_like(grad)
  tx = optax.chain(topka2a_jax.topka2a(0.001, algorithm="topka2a", min_size=0))
  history = exchange_steps(tx, mesh, [{"w": grad}] * 5 + [{"w": zeros}] * 3)
  for updates, _ in history[:5]:
    np.testing.assert_array_equal(updates["w"][0][LENGTH - 50:LENGTH], 1.0)
  owed = np.asarray(history[-1][1][0].residuals["w"])
  assert not owed.any()
  delivered = sum(updates["w"][0] for updates, _ in history)
  np.testing.assert_array_equal(delivered, 5 * grad[0])
