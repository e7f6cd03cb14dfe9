"""PowerSGD: every large matrix leaf sent as a rank-r product, in two all-reduces.

``topka2a(density, algorithm="powersgd", rank=r)`` exchanges each matrix
leaf this way (Vogels, Karimireddy and Jaggi, 2019), inside ``shard_map`` on
one device's leaves; vectors and matrices too small to gain go dense:

1. ``M = grad + residual``, the leaf as a matrix: all axes but the last by
   the last (a Flax kernel, ``(..., in, out)``, is the rest by out-channels);
2. ``P = mean over devices of M Q`` (the first all-reduce), with ``Q`` the
   previous step's (warm start);
3. ``P`` orthonormalised column by column (Gram-Schmidt);
4. ``Q = mean over devices of M^T P`` (the second all-reduce);
5. the mean is ``P Q^T``; the residual is ``M - P Q_local^T``, what this
   device's own product did not carry (the paper's error feedback), and
   ``Q`` is kept for the next step.

Every ``P`` of the step travels in one all-reduce, every ``Q`` in another,
so a step pays two latency terms however many matrices it has. The
residuals sum to what the means lack: ``P * mean + sum of residuals`` is
the sum of the devices' ``M``, so nothing is lost, only delayed.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> grads = jax.device_put(jax.random.normal(jax.random.key(0), (8, 6, 5)),
  ...                        NamedSharding(mesh, P("data")))
  >>> q = initial_factor((6, 5), rank=5, position=0)
  >>> @jax.jit
  ... @jax.shard_map(mesh=mesh, in_specs=(P("data"), P()),
  ...                out_specs=(P(), P("data")))
  ... def full_rank(grad, q):
  ...   (mean,), (residual,), _ = powersgd([grad[0]], [q], "data")
  ...   return mean, residual[None]
  >>> mean, residuals = full_rank(grads, q)  # rank 5 of 6 x 5: exact
  >>> bool(jnp.allclose(mean, grads.mean(0), atol=1e-5))
  True

References:
  Vogels, Karimireddy, Jaggi. "PowerSGD: Practical Low-Rank Gradient
  Compression for Distributed Optimization". NeurIPS 2019 (Algorithms 1
  and 2).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from topka2a_jax._src.sizes import leaf_rank, matrix_shape

DEFAULT_RANK = 4
"""``algorithm="powersgd"`` with no ``rank=``: the rank PyTorch's PowerSGD hook
users run most and this repo's link benchmark measures."""

FACTOR_SEED = 0
"""The seed of every initial ``Q``: the same on every device and process."""


def initial_factor(shape: Sequence[int], rank: int, position: int) -> jax.Array:
  """The first ``Q`` of the leaf at ``position``: standard normal, ``(n, rank)`` float32.

  Drawn from :data:`FACTOR_SEED` and the leaf's position, so that every
  device and process starts from the same ``Q``.
  """
  _, n = matrix_shape(shape)
  key = jax.random.fold_in(jax.random.key(FACTOR_SEED), position)
  return jax.random.normal(key, (n, leaf_rank(shape, rank)), jnp.float32)


def orthogonalize(columns: jax.Array) -> jax.Array:
  """Gram-Schmidt on the last axis: orthonormal columns, a zero column left zero.

  Args:
    columns: ``(..., m, r)``.

  Example:
    >>> p = orthogonalize(jnp.array([[3.0, 1.0], [4.0, 1.0]]))
    >>> bool(jnp.allclose(p.T @ p, jnp.eye(2), atol=1e-6))
    True
  """
  done: list[jax.Array] = []
  for j in range(columns.shape[-1]):
    column = columns[..., j]
    for previous in done:
      column = column - jnp.sum(previous * column, -1, keepdims=True) * previous
    norm = jnp.sqrt(jnp.sum(column * column, -1, keepdims=True))
    done.append(column / jnp.where(norm > 0, norm, 1))
  return jnp.stack(done, -1)


def _mean_of_pieces(pieces: Sequence[jax.Array], axis_name: Hashable) -> list[jax.Array]:
  """``lax.pmean`` of every piece, in one all-reduce of their concatenation."""
  flat = lax.pmean(jnp.concatenate([piece.ravel() for piece in pieces]), axis_name)
  sizes = [piece.size for piece in pieces]
  starts = [0, *itertools.accumulate(sizes)]
  return [flat[start:start + size].reshape(piece.shape)
          for start, size, piece in zip(starts, sizes, pieces)]


def powersgd(accumulators: Sequence[jax.Array], factors: Sequence[jax.Array],
             axis_name: Hashable) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
  """One PowerSGD step of this device's matrices: means, residuals, next factors.

  Matrices of one shape are stacked, so that each shape's products are one
  batched matmul; all ``P`` go in one all-reduce, all ``Q`` in another.

  Args:
    accumulators: this device's ``grad + residual`` per leaf, any shape of
      two or more axes, float32 or float64.
    factors: each leaf's ``Q``, ``(n, r)``, identical on every device.
    axis_name: the data axis.

  Returns:
    ``(means, residuals, factors)``, leaf by leaf: the means shaped like the
    leaves and identical on every device; the residuals, ``M - P Q_local^T``;
    the new ``Q``.
  """
  groups: dict[tuple[tuple[int, ...], Any], list[int]] = {}
  for i, (m, q) in enumerate(zip(accumulators, factors)):
    groups.setdefault((m.shape, q.shape, m.dtype), []).append(i)
  members = list(groups.values())
  matrices = [jnp.stack([accumulators[i].reshape(matrix_shape(accumulators[i].shape))
                         for i in group]) for group in members]
  qs = [jnp.stack([factors[i].astype(matrices[g].dtype) for i in group])
        for g, group in enumerate(members)]
  ps = _mean_of_pieces([jnp.einsum("bmn,bnr->bmr", m, q)
                        for m, q in zip(matrices, qs)], axis_name)
  ps = [orthogonalize(p) for p in ps]
  local_qs = [jnp.einsum("bmn,bmr->bnr", m, p) for m, p in zip(matrices, ps)]
  mean_qs = _mean_of_pieces(local_qs, axis_name)
  means: list[Any] = [None] * len(accumulators)
  residuals: list[Any] = [None] * len(accumulators)
  new_factors: list[Any] = [None] * len(accumulators)
  for group, m, p, q_local, q in zip(members, matrices, ps, local_qs, mean_qs):
    mean = jnp.einsum("bmr,bnr->bmn", p, q)
    left = m - jnp.einsum("bmr,bnr->bmn", p, q_local)
    for j, i in enumerate(group):
      shape = accumulators[i].shape
      means[i] = mean[j].reshape(shape)
      residuals[i] = left[j].reshape(shape)
      new_factors[i] = q[j].astype(factors[i].dtype)
  return means, residuals, new_factors
