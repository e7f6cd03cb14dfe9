"""Signs and few-bit integers on the wire: chunk scales and bit packing.

Rows of values travel in chunks: one float32 scale per chunk and one code of
``bits`` bits per entry, packed ``32 / bits`` to a uint32 word; scales and
words go as one uint32 message (:func:`message`). The arrays are chunked,
``(rows, chunks, chunk)``, so that a scale meets its entries by
broadcasting, with no pass to spread it (``sizes.chunking`` picks the chunks).

* ``bits=1``: the sign. A code is 1 for ``x >= 0``; it decodes to
  ``+scale`` or ``-scale``, with ``scale`` the mean magnitude of the chunk's
  entries (the ``c`` that makes ``c * sign(x)`` closest to ``x``).
* ``bits`` of 2, 4 or 8: symmetric integers ``-L .. L`` with
  ``L = 2**(bits-1) - 1``, rounded to nearest, ``scale = max |x| / L``.

Entries that ``valid`` marks False (padding) count in no scale and decode
to zero; ``valid=None`` means every entry is real.

Example:
  >>> x = jnp.array([0.5, -1.0, 2.0, -0.25] + [0.0] * 28).reshape(1, 1, 32)
  >>> valid = jnp.arange(32).reshape(1, 1, 32) < 4
  >>> words, scales = encode(x, 1, valid)
  >>> words.shape, float(scales[0, 0])  # 32 signs in one word; mean |x| of 4
  ((1, 1, 1), 0.9375)
  >>> decode(words, scales, 1, valid)[0, 0, :4]
  Array([ 0.9375, -0.9375,  0.9375, -0.9375], dtype=float32)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from topka2a_jax._src.sizes import WORD, Chunking

BITS = (1, 2, 4, 8)
"""The code widths :func:`encode` takes."""

def _check(chunked: jax.Array, bits: int) -> None:
  if bits not in BITS:
    raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
  if chunked.ndim != 3 or chunked.shape[2] % WORD:
    raise ValueError(f"expected (rows, chunks, chunk) with chunk a multiple of "
                     f"{WORD}, got shape {chunked.shape}")


def encode(chunked: jax.Array, bits: int, valid: jax.Array | None = None
           ) -> tuple[jax.Array, jax.Array]:
  """Codes packed into words, and one float32 scale per chunk.

  The codes are computed in the values' dtype (at least float32) against the
  float32 scales that travel, so that :func:`decode` gives back exactly the
  values the codes were rounded to.

  Args:
    chunked: ``(R, C, K)`` floating, ``K`` a multiple of 32.
    bits: code width, one of :data:`BITS`.
    valid: booleans broadcastable to ``chunked``, False for padding; None
      when every entry is real.

  Returns:
    ``(words, scales)``: ``(R, C, K * bits / 32)`` uint32, ``(R, C)`` float32.
  """
  _check(chunked, bits)
  dtype = jnp.promote_types(chunked.dtype, jnp.float32)
  x = chunked.astype(dtype)
  if valid is not None:
    x = jnp.where(valid, x, jnp.zeros((), dtype))
  if bits == 1:
    counted = (x.shape[2] if valid is None else
               jnp.maximum(jnp.sum(jnp.broadcast_to(valid, x.shape), axis=2), 1))
    # The sum of a chunk's magnitudes, scaled by a power of two at least
    # its length so that it cannot overflow (a plain sum of 4,096 float32
    # magnitudes does from 8e34 on); scaling by powers of two rounds alike.
    shrink = 2.0 ** -math.ceil(math.log2(x.shape[2]))
    scales = (jnp.sum(jnp.abs(x) * shrink, axis=2) / counted / shrink).astype(jnp.float32)
    return pack((x >= 0).astype(jnp.uint32), bits), scales
  levels = 2 ** (bits - 1) - 1
  scales = (jnp.max(jnp.abs(x), axis=2) / levels).astype(jnp.float32)
  scale = scales.astype(dtype)[..., None]
  ratio = x / jnp.where(scale > 0, scale, jnp.ones((), dtype))
  codes = jnp.clip(jnp.round(ratio), -levels, levels) + levels
  return pack(codes.astype(jnp.uint32), bits), scales


def decode(words: jax.Array, scales: jax.Array, bits: int,
           valid: jax.Array | None = None, dtype: jnp.dtype = jnp.float32
           ) -> jax.Array:
  """The values :func:`encode`'s ``(words, scales)`` stand for, ``(R, C, K)`` of ``dtype``."""
  codes = unpack(words, bits).astype(dtype)  # arithmetic, not a select: faster on CPUs
  scale = scales.astype(dtype)[..., None]
  levels = 2 ** (bits - 1) - 1 if bits > 1 else 0.5  # a sign code is 0 or 1
  values = (codes - levels) * (scale / levels if bits == 1 else scale)
  return values if valid is None else jnp.where(valid, values, jnp.zeros((), dtype))


def pack(codes: jax.Array, bits: int) -> jax.Array:
  """Codes below ``2**bits``, ``(..., n)``, as ``(..., n * bits / 32)`` uint32 words.

  Code ``j`` of a word sits at bits ``[j * bits, (j + 1) * bits)``.
  """
  per_word = WORD // bits
  grouped = codes.astype(jnp.uint32).reshape(*codes.shape[:-1], -1, per_word)
  shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
  return jnp.sum(grouped << shifts, axis=-1, dtype=jnp.uint32)


def unpack(words: jax.Array, bits: int) -> jax.Array:
  """Inverse of :func:`pack`: ``(..., n)`` uint32 codes."""
  per_word = WORD // bits
  shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
  codes = (words[..., None] >> shifts) & jnp.uint32(2 ** bits - 1)
  return codes.reshape(*words.shape[:-1], -1)


def message(words: jax.Array, scales: jax.Array) -> jax.Array:
  """Words ``(R, C, W)`` and scales ``(R, C)`` as one ``(R, C * (W + 1))`` uint32 message."""
  bits = lax.bitcast_convert_type(scales, jnp.uint32)[..., None]
  return jnp.concatenate([words, bits], axis=2).reshape(words.shape[0], -1)


def split(received: jax.Array, cut: Chunking, bits: int) -> tuple[jax.Array, jax.Array]:
  """Inverse of :func:`message`, for rows cut as ``cut``."""
  grouped = received.reshape(received.shape[0], cut.chunks, -1)
  return (grouped[..., :-1],
          lax.bitcast_convert_type(grouped[..., -1], jnp.float32))
