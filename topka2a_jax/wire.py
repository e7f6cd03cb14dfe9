"""One message for a sparse selection: values and indices packed as bytes.

Sending values and indices as two collectives pays the per-message latency
twice. Bit-casting both to bytes and concatenating them row by row lets one
``all_to_all`` or ``all_gather`` carry both, whatever their dtypes; nothing is
converted, so the receiver gets the exact bits that were sent.

Example:
  >>> packed = pack(values, indices)          # (P, k * (4 + 4)) uint8
  >>> values2, indices2 = unpack(packed, values.dtype, indices.dtype)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


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


def pack(values: jax.Array, indices: jax.Array) -> jax.Array:
  """Packs a selection into one uint8 array, one row per destination.

  Args:
    values: ``(rows, k)`` selected values.
    indices: ``(rows, k)`` their positions.

  Returns:
    ``(rows, k * (values.itemsize + indices.itemsize))`` uint8.
  """
  return jnp.concatenate([_to_bytes(values), _to_bytes(indices)], axis=1)


def unpack(
    packed: jax.Array, value_dtype: jnp.dtype, index_dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
  """Splits what :func:`pack` made back into ``(values, indices)``.

  Args:
    packed: ``(rows, k * (value itemsize + index itemsize))`` uint8.
    value_dtype: dtype the values were packed from.
    index_dtype: dtype the indices were packed from.

  Returns:
    ``(values, indices)``, each ``(rows, k)``.
  """
  value_size = jnp.dtype(value_dtype).itemsize
  index_size = jnp.dtype(index_dtype).itemsize
  k = packed.shape[1] // (value_size + index_size)
  values = _from_bytes(packed[:, : k * value_size], value_dtype)
  indices = _from_bytes(packed[:, k * value_size :], index_dtype)
  return values, indices
