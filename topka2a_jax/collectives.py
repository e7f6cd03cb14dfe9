"""Mean of a flat buffer across a mesh axis, dense or top-k sparse.

Each function here is called inside ``jax.shard_map`` on one device's 1-D
buffer and returns an :class:`Exchange`: the mean over the axis (identical on
every device, typed invariant along the axis) and what this device did not
send, which error feedback keeps for the next step.

* :func:`dense`: ``lax.pmean``, the reference.
* :func:`allgather` ("TopkA"): every device's top-k (value, global index) pairs
  are all-gathered and summed. Each device receives ``k * (P - 1)`` pairs,
  which grows with P.
* :func:`topka2a` (TopKA2A, ICPP 2024): shard-wise top-k, one AlltoAll to the
  shards' owners, a scatter-add there, and an AllGather of the dense shards.
  The volume no longer grows with P.

Example:
  >>> def step(grad):  # inside jax.shard_map over "data"
  ...   mean, unsent = topka2a(grad, "data", density=0.01)
  ...   return mean
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from topka2a_jax import wire
from topka2a_jax.axis import bound_axis_size
from topka2a_jax.selection import ShardLayout, sparse_count, top_magnitudes


class Exchange(NamedTuple):
  """Result of one collective on one device.

  Attributes:
    mean: the mean of every device's buffer as aggregated, shape ``(n,)``;
      bitwise identical on all devices of the axis.
    unsent: this device's buffer minus what it sent, shape ``(n,)``; adding
      it to the next step's gradient is error feedback.
  """

  mean: jax.Array
  unsent: jax.Array


def _check_buffer(buffer: jax.Array) -> None:
  if buffer.ndim != 1 or buffer.shape[0] == 0:
    raise ValueError(
        f"expected a non-empty 1-D buffer, got shape {buffer.shape}; flatten "
        "the gradient first (the optax transform does this for you)"
    )
  if not jnp.issubdtype(buffer.dtype, jnp.floating):
    raise TypeError(f"expected a floating buffer, got dtype {buffer.dtype}")


def _scatter_add_rows(
    length: int, indices: jax.Array, values: jax.Array
) -> jax.Array:
  """Sums sparse rows into a dense ``(length,)`` array, row 0 first.

  Indices are distinct within a row, so every row is a conflict-free scatter
  and the order of additions is fixed: the result is deterministic on every
  backend (a single scatter with duplicate indices is not on GPUs).
  """

  def add_row(row, dense):
    return dense.at[indices[row]].add(values[row], unique_indices=True)

  zeros = jnp.zeros_like(values, shape=(length,))  # same varying axes
  return lax.fori_loop(0, indices.shape[0], add_row, zeros)


def dense(buffer: jax.Array, axis_name: Hashable, density: float) -> Exchange:
  """The dense mean, ``lax.pmean``; sends everything, so nothing is unsent.

  Args:
    buffer: this device's 1-D floating buffer.
    axis_name: the mesh axis to average over.
    density: ignored; every entry is sent.

  Returns:
    The :class:`Exchange`.

  Example:
    >>> mean, unsent = dense(grad, "data", density=1.0)
  """
  del density
  _check_buffer(buffer)
  bound_axis_size(axis_name)
  return Exchange(lax.pmean(buffer, axis_name), jnp.zeros_like(buffer))


def allgather(buffer: jax.Array, axis_name: Hashable, density: float) -> Exchange:
  """TopkA: all-gather every device's top-k pairs and sum them everywhere.

  Each device selects ``k = ceil(density * n)`` entries of its whole buffer
  by magnitude and all-gathers them with their global indices (one message);
  every device then adds the ``P * k`` pairs into a dense buffer, in device
  order, and divides by ``P``.

  Args:
    buffer: this device's 1-D floating buffer of ``n`` elements.
    axis_name: the mesh axis to average over.
    density: fraction of entries to send, in (0, 1].

  Returns:
    The :class:`Exchange`.

  Example:
    >>> mean, unsent = allgather(grad, "data", density=0.01)
  """
  _check_buffer(buffer)
  num_devices = bound_axis_size(axis_name)
  length = buffer.shape[0]
  k = sparse_count(length, density)
  values, indices = top_magnitudes(buffer[None], k)
  gathered = lax.all_gather(
      wire.pack(values, indices), axis_name, tiled=True, to="invarying"
  )
  all_values, all_indices = wire.unpack(gathered, values.dtype, indices.dtype)
  total = _scatter_add_rows(length, all_indices, all_values)
  unsent = buffer.at[indices[0]].add(-values[0], unique_indices=True)
  return Exchange(total / num_devices, unsent)


def topka2a(buffer: jax.Array, axis_name: Hashable, density: float) -> Exchange:
  """TopKA2A: shard-wise top-k, AlltoAll to owners, AllGather of the shards.

  1. Pad the buffer to ``P`` equal contiguous shards; shard ``i`` is owned by
     device ``i``. Select the top ``ceil(k / P)`` of every shard by
     magnitude, so each (sender, owner) pair carries the same number of
     entries.
  2. One ``all_to_all`` sends shard ``i``'s values and shard-local indices to
     device ``i``.
  3. Each owner adds the ``P`` received pieces into a dense zero shard: the
     exact sum of everyone's selection for that shard.
  4. A tiled ``all_gather`` of the dense shards gives every device the whole,
     identical aggregate, divided by ``P``.

  Args:
    buffer: this device's 1-D floating buffer of ``n`` elements.
    axis_name: the mesh axis to average over.
    density: fraction of entries to send, in (0, 1].

  Returns:
    The :class:`Exchange`.

  Example:
    >>> mean, unsent = topka2a(grad, "data", density=0.01)
  """
  _check_buffer(buffer)
  num_devices = bound_axis_size(axis_name)
  layout = ShardLayout.create(buffer.shape[0], num_devices, density)
  shards = jnp.pad(buffer, (0, layout.padded_length - layout.length)).reshape(
      num_devices, layout.shard_length
  )
  values, indices = top_magnitudes(shards, layout.per_shard)
  received = lax.all_to_all(
      wire.pack(values, indices), axis_name, 0, 0, tiled=True
  )
  from_values, from_indices = wire.unpack(received, values.dtype, indices.dtype)
  owned = _scatter_add_rows(layout.shard_length, from_indices, from_values)
  gathered = lax.all_gather(
      owned / num_devices, axis_name, tiled=True, to="invarying"
  )
  owners = jnp.arange(num_devices)[:, None]
  unsent = shards.at[owners, indices].add(-values, unique_indices=True)
  return Exchange(gathered[: layout.length], unsent.reshape(-1)[: layout.length])


Collective = Callable[[jax.Array, Hashable, float], Exchange]

ALGORITHMS: dict[str, Collective] = {
    "dense": dense,
    "allgather": allgather,
    "topka2a": topka2a,
}
"""The collectives by the name the optax transform's ``algorithm=`` takes."""
