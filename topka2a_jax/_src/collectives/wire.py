"""What a sparse selection looks like on the wire: dtypes, and one message.

Values may travel narrower than they are accumulated (``value_dtype``, e.g.
bfloat16), and indices travel in the narrowest unsigned type that holds their
range: uint16 for up to 65,536 positions, else uint32. Sending values and
indices as two collectives would pay the per-message latency twice, so both
are bit-cast to bytes and concatenated row by row into one message; nothing
is converted on the way, so the receiver decodes the exact bits sent.

Example:
  >>> fmt = WireFormat.create(jnp.bfloat16, index_range=4096, fallback=jnp.float32)
  >>> values, indices = jnp.array([[1.5, -2.0]]), jnp.array([[7, 4095]])
  >>> packed = fmt.encode(values, indices)
  >>> packed.shape, packed.dtype  # 2 entries of 2 + 2 bytes
  ((1, 8), dtype('uint8'))
  >>> fmt.decode(packed, jnp.float32)
  (Array([[ 1.5, -2. ]], dtype=float32), Array([[   7, 4095]], dtype=int32))
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from topka2a_jax._src.sizes import index_dtype


def _to_bytes(x: jax.Array) -> jax.Array:
  """``(rows, k)`` of any dtype to ``(rows, k * itemsize)`` uint8."""
  as_bytes = lax.bitcast_convert_type(x, jnp.uint8)
  if x.dtype.itemsize == 1:
    as_bytes = as_bytes[..., None]
  return as_bytes.reshape(x.shape[0], -1)


def _from_bytes(raw: jax.Array, dtype: jnp.dtype) -> jax.Array:
  """Inverse of :func:`_to_bytes`."""
  itemsize = jnp.dtype(dtype).itemsize
  grouped = raw.reshape(raw.shape[0], -1, itemsize)
  if itemsize == 1:
    grouped = grouped[..., 0]
  return lax.bitcast_convert_type(grouped, dtype)


class WireFormat(NamedTuple):
  """The dtypes of values and indices in one sparse message.

  Attributes:
    value_dtype: dtype values travel in.
    index_dtype: unsigned dtype indices travel in.
  """

  value_dtype: jnp.dtype
  index_dtype: jnp.dtype

  @classmethod
  def create(
      cls,
      value_dtype: jnp.dtype | None,
      index_range: int,
      fallback: jnp.dtype,
  ) -> WireFormat:
    """The format for values of ``value_dtype`` (``fallback`` if None).

    Args:
      value_dtype: wire dtype of the values, or None to send them as they are.
      index_range: positions the indices address.
      fallback: the values' own dtype.

    Returns:
      The format.
    """
    values = jnp.dtype(fallback if value_dtype is None else value_dtype)
    return cls(values, index_dtype(index_range))

  def rounded(self, values: jax.Array) -> jax.Array:
    """``values`` as a receiver decodes them, in their own dtype."""
    return values.astype(self.value_dtype).astype(values.dtype)

  def encode_values(self, values: jax.Array) -> jax.Array:
    """Values alone, as unsigned integers of the wire dtype's width.

    Integers, not floats, so that XLA cannot move the narrowing conversion
    past the collective (it does for a float convert, and sends float32).
    """
    bits = jnp.dtype(f"uint{8 * self.value_dtype.itemsize}")
    return lax.bitcast_convert_type(values.astype(self.value_dtype), bits)

  def decode_values(self, bits: jax.Array, into: jnp.dtype) -> jax.Array:
    """Inverse of :meth:`encode_values`, widened to ``into``."""
    return lax.bitcast_convert_type(bits, self.value_dtype).astype(into)

  def encode(self, values: jax.Array, indices: jax.Array) -> jax.Array:
    """Packs ``(rows, k)`` values and indices into ``(rows, bytes)`` uint8."""
    return jnp.concatenate(
        [_to_bytes(values.astype(self.value_dtype)),
         _to_bytes(indices.astype(self.index_dtype))], axis=1)

  def decode(
      self, packed: jax.Array, into: jnp.dtype
  ) -> tuple[jax.Array, jax.Array]:
    """Splits an :meth:`encode` result into values (``into``) and int32 indices."""
    value_size = self.value_dtype.itemsize
    k = packed.shape[1] // (value_size + self.index_dtype.itemsize)
    values = _from_bytes(packed[:, : k * value_size], self.value_dtype)
    indices = _from_bytes(packed[:, k * value_size :], self.index_dtype)
    return values.astype(into), indices.astype(jnp.int32)
