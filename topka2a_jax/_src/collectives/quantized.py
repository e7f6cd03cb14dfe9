"""Signs and few-bit integers on the wire: chunk scales and bit packing.

Rows of values travel as one float32 scale per chunk of :data:`CHUNK`
entries and one code of ``bits`` bits per entry, packed ``32 / bits`` to a
uint32 word; scales and words go as one uint32 message (:func:`message`).

* ``bits=1``: the sign. A code is 1 for ``x >= 0``; it decodes to
  ``+scale`` or ``-scale``, with ``scale`` the mean magnitude of the chunk's
  entries (the ``c`` that makes ``c * sign(x)`` closest to ``x``).
* ``bits`` of 2, 4 or 8: symmetric integers ``-L .. L`` with
  ``L = 2**(bits-1) - 1``, rounded to nearest, ``scale = max |x| / L``.

Entries that ``valid`` marks False (padding) count in no scale and decode
to zero. Rows must hold a multiple of 32 entries (:func:`padded_length`).

Example:
  >>> x = jnp.array([[0.5, -1.0, 2.0, -0.25] + [0.0] * 28])
  >>> valid = np.arange(32)[None] < 4
  >>> words, scales = encode(x, 1, valid)
  >>> words.shape, float(scales[0, 0])  # 32 signs in one word; mean |x| of 4
  ((1, 1), 0.9375)
  >>> decode(words, scales, 1, valid)[0, :4]
  Array([ 0.9375, -0.9375,  0.9375, -0.9375], dtype=float32)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

CHUNK = 4096
"""Entries that share one scale: 4 bytes of scale per 4,096 codes (0.8% of a
1-bit message)."""

BITS = (1, 2, 4, 8)
"""The code widths :func:`encode` takes."""

WORD = 32
"""Bits per packed word."""


def padded_length(length: int) -> int:
  """``length`` rounded up to whole words of any code width: a multiple of 32."""
  return -(-length // WORD) * WORD


def chunks(length: int, chunk: int = CHUNK) -> int:
  """Scales a row of ``length`` entries carries: ``ceil(length / chunk)``."""
  return max(1, -(-length // chunk))


def message_words(length: int, bits: int, chunk: int = CHUNK) -> int:
  """uint32 words of one row's message: its codes, then its scales."""
  return padded_length(length) * bits // WORD + chunks(length, chunk)


def _check(rows: jax.Array, bits: int) -> None:
  if bits not in BITS:
    raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
  if rows.ndim != 2 or rows.shape[1] % WORD:
    raise ValueError(f"expected rows of a multiple of {WORD} entries, got shape "
                     f"{rows.shape}; pad them to padded_length(n)")


def _by_chunk(rows: jax.Array, chunk: int) -> jax.Array:
  """``(R, n)`` as ``(R, chunks, chunk)``, the last chunk zero-padded."""
  count = chunks(rows.shape[1], chunk)
  padded = jnp.pad(rows, ((0, 0), (0, count * chunk - rows.shape[1])))
  return padded.reshape(rows.shape[0], count, chunk)


def _spread(scales: jax.Array, length: int, chunk: int) -> jax.Array:
  """One scale per chunk, ``(R, chunks)``, as one per entry, ``(R, length)``."""
  return jnp.repeat(scales, chunk, axis=1, total_repeat_length=scales.shape[1] * chunk
                    )[:, :length]


def encode(rows: jax.Array, bits: int, valid: jax.Array,
           chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
  """Codes packed into words, and one float32 scale per chunk.

  The codes are computed in the rows' dtype (at least float32) against the
  float32 scales that travel, so that :func:`decode` gives back exactly the
  values the codes were rounded to.

  Args:
    rows: ``(R, n)`` floating, ``n`` a multiple of 32.
    bits: code width, one of :data:`BITS`.
    valid: ``(R, n)`` booleans (or broadcastable to them): False for padding.
    chunk: entries per scale.

  Returns:
    ``(words, scales)``: ``(R, n * bits / 32)`` uint32, ``(R, chunks)`` float32.
  """
  _check(rows, bits)
  dtype = jnp.promote_types(rows.dtype, jnp.float32)
  x = jnp.where(valid, rows.astype(dtype), jnp.zeros((), dtype))
  magnitude = _by_chunk(jnp.abs(x), chunk)
  if bits == 1:
    counted = _by_chunk(jnp.broadcast_to(jnp.asarray(valid, dtype), x.shape), chunk)
    scales = (magnitude.sum(-1) / jnp.maximum(counted.sum(-1), 1)).astype(jnp.float32)
    codes = (x >= 0).astype(jnp.uint32)
  else:
    levels = 2 ** (bits - 1) - 1
    scales = (magnitude.max(-1) / levels).astype(jnp.float32)
    spread = _spread(scales, x.shape[1], chunk).astype(dtype)
    ratio = jnp.where(spread > 0, x / jnp.where(spread > 0, spread, 1), 0)
    codes = (jnp.clip(jnp.round(ratio), -levels, levels) + levels).astype(jnp.uint32)
  return pack(codes, bits), scales


def decode(words: jax.Array, scales: jax.Array, bits: int, valid: jax.Array,
           chunk: int = CHUNK, dtype: jnp.dtype = jnp.float32) -> jax.Array:
  """The values :func:`encode`'s ``(words, scales)`` stand for, ``(R, n)`` of ``dtype``."""
  length = words.shape[1] * WORD // bits
  codes = unpack(words, bits)
  spread = _spread(scales, length, chunk).astype(dtype)
  if bits == 1:
    values = jnp.where(codes == 1, spread, -spread)
  else:
    levels = 2 ** (bits - 1) - 1
    values = (codes.astype(jnp.int32) - levels).astype(dtype) * spread
  return jnp.where(valid, values, jnp.zeros((), dtype))


def pack(codes: jax.Array, bits: int) -> jax.Array:
  """``(R, n)`` codes below ``2**bits`` as ``(R, n * bits / 32)`` uint32 words.

  Code ``j`` of a word sits at bits ``[j * bits, (j + 1) * bits)``.
  """
  per_word = WORD // bits
  grouped = codes.astype(jnp.uint32).reshape(codes.shape[0], -1, per_word)
  shifts = (jnp.arange(per_word, dtype=jnp.uint32) * bits)
  return jnp.sum(grouped << shifts, axis=-1, dtype=jnp.uint32)


def unpack(words: jax.Array, bits: int) -> jax.Array:
  """Inverse of :func:`pack`: ``(R, n)`` uint32 codes."""
  per_word = WORD // bits
  shifts = jnp.arange(per_word, dtype=jnp.uint32) * bits
  mask = jnp.uint32(2 ** bits - 1)
  codes = (words[..., None] >> shifts) & mask
  return codes.reshape(words.shape[0], -1)


def message(words: jax.Array, scales: jax.Array) -> jax.Array:
  """Words and scales as one ``(R, words + chunks)`` uint32 message (one collective)."""
  return jnp.concatenate([words, lax.bitcast_convert_type(scales, jnp.uint32)], axis=1)


def split(received: jax.Array, length: int, bits: int,
          chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
  """Inverse of :func:`message` for rows of ``length`` entries."""
  code_words = length * bits // WORD
  return (received[:, :code_words],
          lax.bitcast_convert_type(received[:, code_words:], jnp.float32))


def wire_bytes(length: int, bits: int, chunk: int = CHUNK) -> int:
  """Bytes of one row's message of ``length`` entries (codes and scales)."""
  return 4 * message_words(length, bits, chunk)


def bits_per_entry(bits: int, chunk: int = CHUNK) -> float:
  """Bits on the wire per entry of a long row: the codes and the scales' share."""
  return bits + 32 / chunk

