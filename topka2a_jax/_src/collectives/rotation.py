"""A random-sign Walsh-Hadamard rotation of each chunk, before a few-bit code.

A few-bit code's step is its chunk's largest magnitude over its levels
(``quantized.py``); a gradient's heavy tail leaves most entries of a chunk on
zero or one level. Rotating each chunk first, ``y = H D x`` with ``D`` a fixed
diagonal of random signs and ``H`` the Walsh-Hadamard matrix of the chunk's
length ``b = 2**m``, spreads an outlier over the whole chunk, so that the
largest magnitude sits close to the typical one and the levels are used
(QuaRot, Ashkboos et al. 2024; THC, Li et al. 2024).

The rotation is linear and the same on every device (the signs come from a
fixed seed, so nothing travels and every device count rotates alike): the
owners add rotated codes as they add plain ones, and the sum is rotated
back once. ``H H = b I`` and ``D D = I``, so with the scalings split as powers
of two (exact in floating point)

    rotate(x) = 2**-ceil(m/2) H D x,    unrotate(y) = 2**-floor(m/2) D H y,

``unrotate(rotate(x)) == x`` up to the additions' rounding, which is
float32's on every backend (``_hadamard``).

Example:
  >>> x = jnp.zeros((1, 1, 64)).at[0, 0, 5].set(8.0)  # one outlier
  >>> y = rotate(x)
  >>> float(jnp.abs(y).max()), float(jnp.abs(y).min())  # spread evenly
  (1.0, 1.0)
  >>> bool(jnp.allclose(unrotate(y), x))
  True
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

SEED = 20240701
"""The seed of the signs ``D``: fixed, so that every device and every run rotate alike."""


@functools.cache
def signs(length: int) -> np.ndarray:
  """The diagonal ``D`` for chunks of ``length`` entries: ``length`` of -1.0 and +1.0.

  Example:
    >>> signs(8).tolist()
    [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 1.0, 1.0]
  """
  bits = np.random.default_rng(SEED).integers(0, 2, size=length)
  return np.where(bits == 1, -1.0, 1.0)


BLOCK = 128
"""The longest Walsh-Hadamard factor applied as one matrix product."""


@functools.cache
def _hadamard_matrix(length: int) -> np.ndarray:
  """Sylvester's ``H``: ``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``."""
  hadamard = np.ones((1, 1))
  while len(hadamard) < length:
    hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
  return hadamard


def _hadamard(x: jax.Array) -> jax.Array:
  """``H x`` along the last axis, a power of two long, in float32's full precision.

  ``H_{r b} = H_r (x) H_b``: each block of ``b <= BLOCK`` entries is one
  product with ``H_b`` (on CPUs a block of 64 costs a pass over memory, a
  whole chunk of 256 four), then butterflies of additions combine the ``r``
  blocks. HIGHEST keeps a matrix unit from rounding the sums to a narrower
  type; the products by +-1 are exact.
  """
  length = x.shape[-1]
  if length < 1 or length & (length - 1):
    raise ValueError(f"a rotated chunk must be a power of two long, got {length}")
  block = min(length, BLOCK)
  x = jnp.matmul(x.reshape(*x.shape[:-1], length // block, block),
                 jnp.asarray(_hadamard_matrix(block), x.dtype),
                 precision=jax.lax.Precision.HIGHEST)
  half = 1
  while half < length // block:  # butterflies across the blocks
    pairs = x.reshape(*x.shape[:-2], -1, 2, half, block)
    low, high = pairs[..., 0, :, :], pairs[..., 1, :, :]
    x = jnp.stack([low + high, low - high], axis=-3).reshape(x.shape)
    half *= 2
  return x.reshape(*x.shape[:-2], length)


def _log2(length: int) -> int:
  return length.bit_length() - 1


def rotate(chunked: jax.Array) -> jax.Array:
  """Each chunk (the last axis) times ``2**-ceil(m/2) H D``."""
  length = chunked.shape[-1]
  d = signs(length) * 2.0 ** (-_log2(length) // 2)  # +-2^-j: exact
  return _hadamard(chunked * jnp.asarray(d, chunked.dtype))


def unrotate(chunked: jax.Array) -> jax.Array:
  """The inverse of :func:`rotate`: each chunk times ``2**-floor(m/2) D H``.

  The power of two goes first, as in :func:`rotate`: the transform adds up
  a chunk's entries, whose sum could overflow before it is scaled down.
  """
  length = chunked.shape[-1]
  scale = jnp.asarray(2.0 ** -(_log2(length) // 2), chunked.dtype)  # exact
  return _hadamard(chunked * scale) * jnp.asarray(signs(length), chunked.dtype)
