"""The devices' mean in 8 bits an entry, each entry kept to its own size.

The few-bit codes (``quantized.py``) space their levels evenly up to each
chunk's largest magnitude: an entry far below it comes back as zero. That is
right for a gradient, whose rounding error feedback keeps, and wrong for an
optimizer's state, which is sent once and not owed: a second moment many
decades below its chunk's largest would come back as zero, and Adam would
divide by it. :func:`relative_mean` sends each entry as the float8 (e4m3)
code of its signed square root over its chunk's largest root: 3 bits of
mantissa and 4 of exponent, so each entry keeps about 1 part in 8 of itself
down to 2**-29 of its chunk's largest magnitude (fewer digits below, zero
under about 2**-35).

:func:`topka2a_jax.local_steps` with ``average_inner_state=True`` averages
the inner optimizer's state arrays with it at every round's end.
"""

from __future__ import annotations

from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from topka2a_jax._src.axis import DataAxis, bound_axis_size
from topka2a_jax._src.buffers import padded_rows
from topka2a_jax._src.sizes import ceil_div

CHUNK = 512
"""Entries that share one scale: 4 bytes of scale per 512 codes (0.8%)."""

_TOP = 448.0
"""float8_e4m3fn's largest finite value: a chunk's largest root is coded as it."""


def _encode(values: jax.Array) -> jax.Array:
  """``(..., CHUNK)`` values as one message: each chunk's uint8 codes of the
  entries' signed roots, then its float32 scale as 4 bytes, ``(..., CHUNK + 4)``."""
  roots = jnp.sign(values) * jnp.sqrt(jnp.abs(values))
  scale = jnp.abs(roots).max(-1, keepdims=True)
  codes = (roots / jnp.where(scale > 0, scale, 1.0) * _TOP).astype(jnp.float8_e4m3fn)
  return jnp.concatenate([lax.bitcast_convert_type(codes, jnp.uint8),
                          lax.bitcast_convert_type(scale, jnp.uint8)[..., 0, :]], axis=-1)


def _decode(message: jax.Array) -> jax.Array:
  """The values of :func:`_encode`'s message, ``(..., CHUNK)`` in float32."""
  codes, scale = message[..., :CHUNK], message[..., CHUNK:]
  roots = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)
  roots = roots / _TOP * lax.bitcast_convert_type(scale, jnp.float32)[..., None]
  return jnp.sign(roots) * roots * roots


def _flat_mean(buffer: jax.Array, axis_name: Hashable) -> jax.Array:
  """:func:`relative_mean` over one mesh axis: AlltoAll to owners, AllGather back."""
  devices = bound_axis_size(axis_name)
  length = buffer.shape[0]
  width = ceil_div(ceil_div(length, devices), CHUNK) * CHUNK  # a shard of whole chunks
  rows = jnp.pad(buffer.astype(jnp.float32), (0, devices * width - length))
  sent = _encode(rows.reshape(devices, width // CHUNK, CHUNK))
  received = lax.all_to_all(sent, axis_name, 0, 0)  # row i: device i's codes of my shard
  mean = _encode(_decode(received).mean(0))  # this device's shard's mean, coded
  gathered = lax.all_gather(mean, axis_name, tiled=True, to="invarying")
  return _decode(gathered).reshape(-1)[:length].astype(buffer.dtype)


def relative_mean(buffer: jax.Array, axis_name: Hashable) -> jax.Array:
  """The mean of every device's ``buffer``, each entry to about 1 part in 8 of itself.

  Called inside ``jax.shard_map``. TopKA2A's structure with a code of
  relative precision: the buffer is cut into one shard per device, in
  chunks of :data:`CHUNK` entries; each entry goes as the float8 code of
  its signed square root over its chunk's largest (one float32 scale a
  chunk) to the shard's owner (one AlltoAll); the owner averages the
  decoded entries, codes its shard's mean the same way, and one AllGather
  gives every device the same mean. About 8 bits an entry each way, as an
  8-bit all-reduce. Nothing is fed back: what the codes round off is lost,
  so use it for state, not for a gradient.

  Over a pair of axes ``("node", "local")``, the devices of a node first
  average exactly (a reduce-scatter inside the node), each device takes
  its slice across nodes in the code, and the means are gathered inside
  the node.

  Args:
    buffer: this device's 1-D floating buffer.
    axis_name: the mesh axis to average over, or a pair ``(outer, inner)``.

  Returns:
    The mean, ``buffer``'s shape and dtype, the same on every device. Each
    rounding keeps an entry within ``(1 + 1/16) ** 2 - 1`` (12.9%) of
    itself, where it is at least 2**-29 of its chunk's largest magnitude
    (fewer digits below, zero under about 2**-35); after the two, each
    mean is within 27% of the devices' mean magnitude there, so of the mean
    itself where the devices' entries share a sign (a second moment's do).

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> sizes = 10.0 ** -jnp.arange(8.0)  # 1, 0.1, ..., 1e-7 in one chunk
    >>> rows = jax.device_put(jnp.tile(sizes, (8, 1)), NamedSharding(mesh, P("data")))
    >>> mean = jax.jit(jax.shard_map(lambda row: relative_mean(row[0], "data"), mesh=mesh,
    ...                              in_specs=P("data"), out_specs=P()))(rows)
    >>> bool(jnp.all(jnp.abs(mean / sizes - 1) < 0.13))  # one rounding: the same rows
    True
  """
  axis = DataAxis.parse(axis_name)
  if not axis.is_pair:
    return _flat_mean(buffer, axis.name)
  outer, inner = axis.names
  per_node = bound_axis_size(inner)
  length = buffer.shape[0]
  node_mean = lax.psum_scatter(padded_rows(buffer.astype(jnp.float32), per_node), inner,
                               scatter_dimension=0, tiled=True)[0] / per_node
  mean = lax.all_gather(_flat_mean(node_mean, outer), inner, tiled=True, to="invarying")
  return mean[:length].astype(buffer.dtype)
