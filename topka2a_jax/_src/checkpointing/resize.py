"""Resizing per-device state onto another number of devices.

Every exchange applies the mean over the devices of what they send, so a
residual owes the parameters its sum over devices divided by their number:
a restart on another device count keeps exactly that
(:func:`resize_residual`; over a pair of data axes, whose devices keep
slices, :func:`resize_slices`). A sharded optimizer's state is laid out
anew (:func:`reshard`), and per-device copies of an optimizer's state
start from their mean (:func:`average_replicas`). :data:`RULES` says, for
each kind of per-device state, what it was saved as and how it is resized:
the one place :mod:`topka2a_jax.checkpoint` reads both from.

Example:
  >>> resize_residual(jnp.array([1.0, 2.0, 3.0, 4.0]), 2, 4)  # 2 devices onto 4
  Array([2., 4., 6., 8., 0., 0., 0., 0.], dtype=float32)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from topka2a_jax._src.states import REPLICA, RESIDUAL, SHARD


class Devices(NamedTuple):
  """Where per-device residuals live: ``nodes`` of ``per_node`` devices.

  ``per_node`` is None for one data axis (each device a node, residuals
  shaped like the parameter), or ``L`` for a pair of data axes (each device
  keeps one of L slices).
  """

  nodes: int
  per_node: int | None

  @classmethod
  def of(cls, layout: dict[str, Any]) -> Devices:
    per_node = layout.get("per_node")
    return cls(layout["devices"] // (per_node or 1), per_node)


def reshard(leaf: jax.Array, shape: tuple[int, ...], pieces: int = 1) -> jax.Array:
  """One leaf of :func:`topka2a_jax.sharded_optimizer`'s state, laid out anew.

  A leaf holds one block per device along dimension 0. A parameter's shard
  is entries ``[i m, (i + 1) m)`` of the flattened parameter, so the blocks in
  order are the parameter's entries, then padding: the first entries carry
  over and the rest is zeros. A block of one value (a step count, or a
  scalar parameter's shard) carries device 0's to every device; on the others
  it stands for padding, whose state no real entry reads. Where the
  parameter is split over other mesh axes into ``pieces``, each piece's shards
  lie side by side along the last dimension and are laid out anew apiece.

  Args:
    leaf: the saved global array, ``(old devices, ..., pieces * old m)``.
    shape: its shape on the new mesh, ``(new devices, ..., pieces * new m)``.
    pieces: how many pieces of the parameter the last dimension holds.

  Returns:
    The global array of ``shape``.

  Example:
    >>> reshard(jnp.arange(8.0).reshape(4, 1, 2), (2, 1, 3))[:, 0]  # 7 entries
    Array([[0., 1., 2.],
           [3., 4., 5.]], dtype=float32)
  """
  if leaf.ndim == 1:
    return jnp.broadcast_to(leaf[0], shape)
  old, new = leaf.shape[0], shape[0]
  by_piece = leaf.reshape(old, pieces, -1).transpose(1, 0, 2).reshape(pieces, -1)
  size = new * (shape[-1] // pieces)
  kept = min(by_piece.shape[1], size)
  laid = jnp.zeros((pieces, size), leaf.dtype).at[:, :kept].set(by_piece[:, :kept])
  return laid.reshape(pieces, new, -1).transpose(1, 0, 2).reshape(shape)


def average_replicas(leaf: jax.Array, devices: int) -> jax.Array:
  """Per-device copies of an optimizer's state, ``(old, ...)``, for ``devices``.

  Each device's copy (Adam's moments of its own gradients) is its own, and
  no device of a new layout corresponds to an old one, so every new device
  starts from the mean of the old copies: for moments, those of the mean
  gradient. Integer leaves (step counts) are the same on every device and
  are taken from the first.

  Example:
    >>> average_replicas(jnp.array([[1.0, 2.0], [3.0, 6.0]]), 3)
    Array([[2., 4.],
           [2., 4.],
           [2., 4.]], dtype=float32)
  """
  if jnp.issubdtype(leaf.dtype, jnp.inexact):
    with jax.enable_x64():
      one = jnp.mean(leaf.astype(jnp.promote_types(leaf.dtype, jnp.float64)),
                     axis=0).astype(leaf.dtype)
  else:
    one = leaf[0]
  return jnp.broadcast_to(one[None], (devices, *leaf.shape[1:]))


def saved_shape(shape: list[int], old: int, new: int) -> list[int]:
  """A per-device residual's global shape on ``old`` devices, from that on ``new``."""
  return [shape[0] // new * old, *shape[1:]]


def saved_slices_shape(saved: list[int], shape: list[int], old: Devices,
                        new: Devices, pieces: int) -> list[int]:
  """The saved shape, if slices of the same parameter shards could make it.

  A shard of ``n`` entries has slices of ``ceil(n / L)``: the saved and the
  wanted slice widths must both come from one ``n``.
  """
  old_blocks = old.nodes * old.per_node * pieces
  new_width = shape[0] // (new.nodes * new.per_node * pieces)
  if len(saved) != 1 or saved[0] % old_blocks:
    return shape
  old_width = saved[0] // old_blocks
  lowest = max((old_width - 1) * old.per_node, (new_width - 1) * new.per_node) + 1
  highest = min(old_width * old.per_node, new_width * new.per_node)
  return list(saved) if lowest <= highest else shape


def owed_rows(rows: jax.Array, blocks: int, scale: float) -> jax.Array:
  """Per-device rows of what is owed, ``(old, n)``, laid out as ``blocks`` rows.

  Every exchange applies the mean over the devices of what they send, so a
  residual owes the parameters its sum over devices divided by their number.
  Keeping that on another device count means multiplying the sum by
  ``scale`` (new devices / old). The rows are scaled in float64. Growing
  keeps each old device's row and puts the rows' float32 rounding, summed,
  on the first new device; shrinking adds the rows up and stores the total
  as a float32 pair (rounded total on row 0, its rounding error on row 1).
  Either way the float64 sum over rows is ``scale`` times the old one
  whenever it has at most 48 significant bits, which sums of float32
  residuals of similar scale have; with one row (or as many rows as before)
  only the rounded total fits.

  Args:
    rows: one row per old device (or node), the residual's dtype.
    blocks: rows wanted.
    scale: the factor on the sum over rows.

  Returns:
    ``(blocks, n)``, the same dtype.
  """
  old, dtype = rows.shape[0], rows.dtype
  with jax.enable_x64():
    wide = rows.astype(jnp.promote_types(dtype, jnp.float64)) * scale
    if blocks >= old:
      high = wide.astype(dtype)
      low = jnp.sum(wide - high.astype(wide.dtype), axis=0)
      if blocks == old:  # no spare row: the rounding joins row 0
        return high.at[0].set((wide[0] + low).astype(dtype))
      zeros = jnp.zeros((blocks - old - 1, rows.shape[1]), dtype)
      return jnp.concatenate([high, low.astype(dtype)[None], zeros])
    total = jnp.sum(wide, axis=0)
    high = total.astype(dtype)
    low = (total - high.astype(wide.dtype)).astype(dtype)
  parts = [high, low][:blocks]
  parts += [jnp.zeros_like(high)] * (blocks - len(parts))
  return jnp.stack(parts)


def resize_residual(residual: jax.Array, old_devices: int,
                    new_devices: int) -> jax.Array:
  """One per-device residual, ``(old * d0, ...)``, laid out for ``new`` devices.

  What the residuals owe the parameters is their sum over devices divided
  by the number of devices (every step applies the mean of what is sent),
  so that is what is kept: the new residuals sum to ``new / old`` times the
  old ones (:func:`owed_rows` says how, to float32's rounding or better).
  Training that goes on after the restore delivers to the parameters what
  the uninterrupted run would have.

  Args:
    residual: the global array, device ``i``'s block at rows
      ``[i * d0, (i+1) * d0)``, as :func:`topka2a_jax.state_specs` lays it out.
    old_devices: devices the residual was made on.
    new_devices: devices it is for.

  Returns:
    The global array of shape ``(new_devices * d0, ...)``, same dtype.

  Example:
    >>> resize_residual(jnp.arange(8.0), 4, 2)  # 4 devices of 2 entries onto 2
    Array([6., 8., 0., 0.], dtype=float32)
  """
  if residual.ndim < 1 or residual.shape[0] % old_devices:
    raise ValueError(f"a residual of shape {residual.shape} is not "
                     f"{old_devices} equal per-device blocks")
  block = (residual.shape[0] // old_devices, *residual.shape[1:])
  rows = owed_rows(residual.reshape(old_devices, -1), new_devices,
                   new_devices / old_devices)
  return rows.reshape(new_devices * block[0], *block[1:])


def resize_slices(residual: jax.Array, old: Devices, new: Devices, length: int,
                  pieces: int = 1) -> jax.Array:
  """One residual kept as slices (a pair of data axes), laid out for ``new``.

  Device ``j`` of a node keeps slice ``j`` of its parameter shard, so a node's
  L slices side by side are what that node owes. They are cut anew into the
  new node size's slices (only padding zeros are dropped or added), and the
  nodes are then resized as devices are by :func:`resize_residual`: their
  sum over nodes, divided by all the devices, is what the parameters are
  owed, and it is kept.

  Args:
    residual: the global 1-D array: per node, per device, per piece of the
      parameter (other mesh axes), one slice.
    old: the nodes and devices per node it was made on.
    new: those it is for.
    length: the new global length (from the new state's shape).
    pieces: shards of the parameter over other mesh axes.

  Returns:
    The global array of ``length`` entries, same dtype.

  Example:
    >>> owed = jnp.arange(1.0, 7.0)  # 1 node of 2 devices: slices [1 2 3], [4 5 6]
    >>> resize_slices(owed, Devices(1, 2), Devices(1, 3), 6)  # 3 slices of 2, x 3/2
    Array([1.5, 3. , 4.5, 6. , 7.5, 9. ], dtype=float32)
    >>> resize_slices(owed, Devices(1, 2), Devices(2, 1), 12)  # 2 nodes of 1
    Array([1., 2., 3., 4., 5., 6., 0., 0., 0., 0., 0., 0.], dtype=float32)
  """
  (old_nodes, old_per_node), (new_nodes, new_per_node) = old, new
  new_width = length // (new_nodes * new_per_node * pieces)
  owed = residual.reshape(old_nodes, old_per_node, pieces, -1).transpose(0, 2, 1, 3)
  owed = owed.reshape(old_nodes, pieces, -1)
  cut = new_per_node * new_width
  owed = jnp.pad(owed[..., :cut], ((0, 0), (0, 0), (0, max(0, cut - owed.shape[-1]))))
  scale = new_nodes * new_per_node / (old_nodes * old_per_node)
  per_node = owed_rows(owed.reshape(old_nodes, -1), new_nodes, scale)
  return per_node.reshape(new_nodes, pieces, new_per_node, new_width).transpose(
      0, 2, 1, 3).reshape(-1)


class Rule(NamedTuple):
  """How one kind of per-device state is restored onto another device count.

  Each reads a leaf's description (``shape``, and ``pieces``: blocks per
  data index over other mesh axes) from the checkpoint's layout.

  Attributes:
    saved_shape: ``(saved leaf, wanted leaf, saved devices, old, new) ->``
      the global shape the wanted leaf had when saved on the old devices.
    resize: ``(loaded leaf, wanted leaf, old, new, its sharding) ->`` the
      leaf laid out for the new devices.
  """

  saved_shape: Callable[[dict[str, Any], dict[str, Any], int, Devices, Devices],
                        list[int]]
  resize: Callable[[jax.Array, dict[str, Any], Devices, Devices, NamedSharding],
                   jax.Array]


def _residual_saved_shape(was: dict[str, Any], want: dict[str, Any], devices: int,
                          old: Devices, new: Devices) -> list[int]:
  del devices
  if new.per_node is not None:
    return saved_slices_shape(was["shape"], list(want["shape"]), old, new, want["pieces"])
  return saved_shape(list(want["shape"]), old.nodes, new.nodes)


def _residual_resized(leaf: jax.Array, want: dict[str, Any], old: Devices, new: Devices,
                      sharding: NamedSharding) -> jax.Array:
  if new.per_node is not None:
    return jax.jit(resize_slices, static_argnums=(1, 2, 3, 4), out_shardings=sharding)(
        leaf, old, new, want["shape"][0], want["pieces"])
  return jax.jit(resize_residual, static_argnums=(1, 2), out_shardings=sharding)(
      leaf, old.nodes, new.nodes)


def _replica_saved_shape(was: dict[str, Any], want: dict[str, Any], devices: int,
                         old: Devices, new: Devices) -> list[int]:
  del was, old, new
  return [devices, *want["shape"][1:]]  # (devices, *shape): one copy each


def _replica_resized(leaf: jax.Array, want: dict[str, Any], old: Devices, new: Devices,
                     sharding: NamedSharding) -> jax.Array:
  del old, new
  return jax.jit(average_replicas, static_argnums=1, out_shardings=sharding)(
      leaf, want["shape"][0])


def _shard_saved_shape(was: dict[str, Any], want: dict[str, Any], devices: int,
                       old: Devices, new: Devices) -> list[int]:
  del devices, new  # (devices, 1, ..., 1, entries per device)
  shape = want["shape"]
  return [old.nodes, *shape[1:-1], was["shape"][-1]] if len(shape) > 1 else [old.nodes]


def _shard_resized(leaf: jax.Array, want: dict[str, Any], old: Devices, new: Devices,
                   sharding: NamedSharding) -> jax.Array:
  del old, new
  spec = tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))
  last = () if leaf.ndim < 2 or spec[-1] is None else (
      spec[-1] if isinstance(spec[-1], tuple) else (spec[-1],))
  pieces = math.prod(sharding.mesh.shape[axis] for axis in last)
  return jax.jit(reshard, static_argnums=(1, 2), out_shardings=sharding)(
      leaf, tuple(want["shape"]), pieces)


RULES: dict[str, Rule] = {
    RESIDUAL: Rule(_residual_saved_shape, _residual_resized),
    REPLICA: Rule(_replica_saved_shape, _replica_resized),
    SHARD: Rule(_shard_saved_shape, _shard_resized),
}
"""Every kind of per-device state (:data:`topka2a_jax._src.states.PER_DEVICE`)
and its restore rule: residuals keep what they owe, optimizer copies start
from their mean, a sharded optimizer's state is re-sharded."""
