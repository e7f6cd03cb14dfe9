"""Saving and restoring the training state with Orbax, on any number of devices.

The residuals are the part of sparse training that is easy to lose: they are
per device, so a checkpoint must hold every device's copy, and a restart on
another number of devices must leave the parameters owed what they were
(the residuals' sum over devices divided by the number of devices).
:func:`save` writes the whole state (parameters, optimizer state, residuals
of every device) with Orbax and a small description of the layout;
:func:`restore` reads it onto a mesh of any size along the data axis,
resizing the residuals with :func:`resize_residual` (over a pair of data
axes, whose devices keep slices, :func:`resize_slices`) so that what they
owe the parameters, their sum over devices divided by the number of
devices, is kept.

Example:
  >>> import tempfile
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> tx = optax.chain(topka2a_jax.topka2a(0.1, min_size=0, mesh=mesh), optax.sgd(0.1))
  >>> params = {"w": jnp.ones((4, 3))}
  >>> directory = tempfile.mkdtemp() + "/step_500"
  >>> save(directory, {"params": params, "opt_state": tx.init(params)}, mesh)
  >>> small = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  >>> small_tx = optax.chain(topka2a_jax.topka2a(0.1, min_size=0, mesh=small),
  ...                        optax.sgd(0.1))
  >>> state = restore(directory, {"params": params,
  ...                             "opt_state": small_tx.init(params)}, small)
  >>> state["opt_state"][0].residuals["w"].shape  # 4 blocks of (4, 3)
  (16, 3)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import stat
import warnings
from collections.abc import Hashable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from topka2a_jax._src.axis import DataAxis
from topka2a_jax._src.states import (
  CompressedUpdatesState,
  ShardedOptimizerState,
  TopKA2AState,
)

LAYOUT_FILE = "topka2a_layout.json"
"""Written beside Orbax's files: devices, axis, pytree structure, shapes, and
each leaf's fingerprint (:func:`fingerprint`)."""

MANIFEST_FILE = "topka2a_manifest.json"
"""Written last: the SHA-256 of every other file of the checkpoint, and of
itself (its ``"files"`` as written), so that any changed byte is found."""


RESIDUAL, SHARD, REPLICA = "residual", "shard", "replica"
"""How a per-device leaf is laid out: a residual (:func:`resize_residual`), a
shard of :func:`topka2a_jax.sharded_optimizer`'s state (:func:`reshard`), or
one device's copy of :func:`topka2a_jax.compress_updates`' optimizer state
(:func:`average_replicas`)."""


def _per_device(state: Any) -> list[str | bool]:
  """For every leaf of ``state``: RESIDUAL, SHARD, or False (replicated)."""
  def mark(node: Any) -> Any:
    if isinstance(node, TopKA2AState):
      return node._replace(residuals=jax.tree.map(lambda _: RESIDUAL, node.residuals),
                           count=False, nonfinite_steps=False,
                           factors=jax.tree.map(lambda _: False, node.factors))
    if isinstance(node, ShardedOptimizerState):
      return ShardedOptimizerState(mark(node.exchange),
                                   jax.tree.map(lambda _: SHARD, node.inner))
    if isinstance(node, CompressedUpdatesState):
      return CompressedUpdatesState(mark(node.exchange),
                                    jax.tree.map(lambda _: REPLICA, node.inner))
    return False

  kinds = (TopKA2AState, ShardedOptimizerState, CompressedUpdatesState)
  return jax.tree.leaves(jax.tree.map(mark, state,
                                      is_leaf=lambda node: isinstance(node, kinds)))


def _pieces(leaf: Any, axis: DataAxis) -> int:
  """How many blocks of a per-device leaf each data index holds (other mesh axes)."""
  sharding = getattr(leaf, "sharding", None)
  if not isinstance(sharding, NamedSharding) or not tuple(sharding.spec):
    return 1
  first = sharding.spec[0]
  axes = first if isinstance(first, tuple) else (first,)
  return math.prod(sharding.mesh.shape[a] for a in axes
                   if a is not None and a not in axis.names)


def fingerprint(leaf: jax.Array) -> jax.Array:
  """A uint32 digest of an array's bytes that changes with any one byte.

  Byte ``j`` counts ``b_j * m_j`` modulo 2^32 with an odd ``m_j``: a byte
  that changes by ``d`` (``0 < |d| < 256``) moves the sum by ``d * m_j``,
  never a multiple of 2^32. Computed where the array lives, on every
  process alike, without gathering it.

  Example:
    >>> int(fingerprint(jnp.zeros(3))) == int(fingerprint(jnp.zeros(3).at[1].set(1e-38)))
    False
  """
  data = jnp.ravel(leaf)
  if data.dtype == jnp.bool_:
    data = data.astype(jnp.uint8)
  raw = jnp.ravel(jax.lax.bitcast_convert_type(data, jnp.uint8)).astype(jnp.uint32)
  position = jnp.arange(raw.size, dtype=jnp.uint32)
  odd = position * jnp.uint32(2654435761) * jnp.uint32(2) + jnp.uint32(1)
  return jnp.sum(raw * odd, dtype=jnp.uint32)


_fingerprints = jax.jit(lambda leaves: [fingerprint(leaf) for leaf in leaves])


def _leaf_fingerprints(leaves: list[Any]) -> list[int]:
  """Every leaf's :func:`fingerprint` as a Python int, one program per device set."""
  groups: dict[Any, list[int]] = {}
  for i, leaf in enumerate(leaves):
    devices = getattr(getattr(leaf, "sharding", None), "device_set", None)
    groups.setdefault(frozenset(d.id for d in devices or ()), []).append(i)
  found = [0] * len(leaves)
  for members in groups.values():
    digests = _fingerprints([leaves[i] for i in members])
    for i, digest in zip(members, digests):
      found[i] = int(jax.device_get(digest.addressable_shards[0].data))
  return found


LAYOUT_VERSION = 2
"""The layout description's format: 2 since it always holds fingerprints."""


def describe(state: Any, mesh: Mesh, axis_name: Hashable | DataAxis = "data"
             ) -> dict[str, Any]:
  """What :func:`restore` needs to read ``state`` onto another mesh, as JSON.

  The devices along the data axis, the pytree's structure, every leaf's
  path, shape, dtype and layout (per device or replicated), and every
  leaf's :func:`fingerprint`.
  """
  layout = _layout(state, mesh, DataAxis.parse(axis_name))
  layout["fingerprints"] = _leaf_fingerprints(jax.tree.leaves(state))
  layout["version"] = LAYOUT_VERSION
  return layout


def _layout(state: Any, mesh: Mesh, axis: DataAxis) -> dict[str, Any]:
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(state)
  return {
      "devices": axis.size(mesh),
      "per_node": axis.per_node(mesh),
      "axis_name": str(axis.name),
      "structure": str(treedef),
      "leaves": [
          {"path": jax.tree_util.keystr(path), "shape": list(leaf.shape),
           "dtype": str(leaf.dtype), "per_device": per_device,
           "pieces": _pieces(leaf, axis) if per_device == RESIDUAL else 1}
          for (path, leaf), per_device in zip(with_paths, _per_device(state))
      ],
  }


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


def _saved_shape(shape: list[int], old: int, new: int) -> list[int]:
  """A per-device residual's global shape on ``old`` devices, from that on ``new``."""
  return [shape[0] // new * old, *shape[1:]]


def _saved_slices_shape(saved: list[int], shape: list[int], old: Devices,
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


def _digest(path: Path) -> str:
  """The SHA-256 of a file, read in pieces."""
  sha = hashlib.sha256()
  with path.open("rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      sha.update(block)
  return sha.hexdigest()


def listed_files(directory: Path) -> list[str]:
  """Every file under ``directory`` but the manifest, as sorted relative paths.

  Raises:
    ValueError: an entry is a symbolic link, or neither a regular file nor
      a directory (a checkpoint holds only what :func:`save` wrote, and
      nothing outside its directory is read).
  """
  found = []
  for root, directories, names in os.walk(directory):
    for name in [*directories, *names]:
      path = Path(root) / name
      mode = path.lstat().st_mode
      kind = ("a symbolic link" if stat.S_ISLNK(mode) else None if
              stat.S_ISDIR(mode) or stat.S_ISREG(mode) else "not a regular file")
      if kind:
        raise ValueError(f"checkpoint entry {path} is {kind}: a checkpoint holds "
                         "only the regular files save wrote, and nothing outside "
                         "its directory is read. Restore an intact copy; nothing "
                         "was loaded.")
      if stat.S_ISREG(mode) and path.name != MANIFEST_FILE:
        found.append(str(path.relative_to(directory)))
  return sorted(found)


def write_manifest(directory: Path) -> None:
  """Writes the SHA-256 of every file under ``directory`` (last, once all are written)."""
  files = {name: _digest(directory / name) for name in listed_files(directory)}
  listed = json.dumps(files, sort_keys=True)
  (directory / MANIFEST_FILE).write_text(json.dumps(
      {"files": files, "self": hashlib.sha256(listed.encode()).hexdigest()}))


def _read_json(path: Path, what: str) -> Any:
  """A JSON file of the checkpoint, or a ValueError that names it."""
  try:
    return json.loads(path.read_bytes().decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as error:
    raise ValueError(f"the checkpoint's {what} {path} is corrupted ({error}); "
                     "restore an intact copy. Nothing was loaded.") from None


def verify(directory: str | Path) -> None:
  """Checks every file of a checkpoint against its manifest.

  ``directory`` is what :func:`save` wrote, or one step of a
  :class:`topka2a_jax.CheckpointManager` (``root / str(step)``).

  Raises:
    ValueError: naming the first file that is missing, added, or whose
      SHA-256 differs from the one saved (a corrupted or partial copy), a
      corrupted manifest, or an entry that is a symbolic link or not a
      regular file (nothing outside the directory is read).

  Example:
    >>> import tempfile
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> directory = Path(tempfile.mkdtemp()) / "ckpt"
    >>> save(directory, {"w": jnp.ones(4)}, mesh)
    >>> verify(directory)
    >>> with (directory / LAYOUT_FILE).open("r+b") as f:
    ...   _ = f.write(b"X")
    >>> verify(directory)
    Traceback (most recent call last):
    ValueError: checkpoint file .../topka2a_layout.json is corrupted: its SHA-256 differs from the one saved. Restore an intact copy; nothing was loaded.
  """
  directory = Path(directory).absolute()
  found = listed_files(directory)  # first: no link is followed, the manifest's included
  manifest = _read_json(directory / MANIFEST_FILE, "manifest")
  files = manifest.get("files") if isinstance(manifest, dict) else None
  listed = json.dumps(files, sort_keys=True)
  if (not isinstance(files, dict)
      or manifest.get("self") != hashlib.sha256(listed.encode()).hexdigest()):
    raise ValueError(f"the checkpoint's manifest {directory / MANIFEST_FILE} is "
                     "corrupted: its digest does not match what it lists. Restore "
                     "an intact copy; nothing was loaded.")
  for name in sorted(set(files) | set(found)):
    if name not in found:
      problem = "is missing"
    elif name not in files:
      problem = "was not written by save (the copy holds an extra file)"
    elif _digest(directory / name) != files[name]:
      problem = "is corrupted: its SHA-256 differs from the one saved"
    else:
      continue
    raise ValueError(f"checkpoint file {directory / name} {problem}. Restore an "
                     "intact copy; nothing was loaded.")


def save(directory: str | Path, state: Any, mesh: Mesh,
         axis_name: Hashable = "data") -> None:
  """Writes the whole training state, every device's residuals included.

  Each leaf's :func:`fingerprint` goes into the layout description, and a
  manifest of every file's SHA-256 is written last, so :func:`restore`
  refuses a corrupted or partial copy. A save that fails removes what it
  wrote, so that it can be retried into the same directory.

  Args:
    directory: a new directory (it must not exist; nothing is overwritten).
    state: any pytree of global arrays holding the optimizer state of
      :func:`topka2a_jax.topka2a`, e.g. ``{"params": ..., "opt_state": ...}``.
    mesh: the mesh the state lives on.
    axis_name: the data-parallel mesh axis, or a pair of them.

  Raises:
    FileExistsError: ``directory`` exists.

  Example:
    >>> import tempfile
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> tx = topka2a_jax.topka2a(0.1, min_size=0, mesh=mesh)
    >>> save(tempfile.mkdtemp() + "/ckpt", {"opt_state": tx.init(jnp.ones(5))}, mesh)
  """
  import orbax.checkpoint as ocp

  axis = DataAxis.parse(axis_name)
  axis.check_on(mesh)
  directory = Path(directory).absolute()
  exists = directory.exists()
  if jax.process_count() > 1:  # every process looks before any writes
    multihost_utils.sync_global_devices(f"topka2a_jax.save {directory}")
  if exists:
    raise FileExistsError(f"{directory} exists; save each checkpoint to a new "
                          "directory (nothing was written)")
  layout = describe(state, mesh, axis)
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(directory / "state", state)
    if jax.process_count() > 1:  # every process's files are written
      multihost_utils.sync_global_devices(f"topka2a_jax.save {directory} written")
    if jax.process_index() == 0:
      (directory / LAYOUT_FILE).write_text(json.dumps(layout, indent=1))
      write_manifest(directory)
  except BaseException:
    if jax.process_index() == 0:
      shutil.rmtree(directory, ignore_errors=True)
    raise


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


def restore(directory: str | Path, like: Any, mesh: Mesh,
            axis_name: Hashable = "data") -> Any:
  """Reads a state written by :func:`save` onto ``mesh``, of any size.

  Args:
    directory: what :func:`save` wrote.
    like: the same pytree laid out for ``mesh`` (arrays or
      ``jax.ShapeDtypeStruct`` with shardings), e.g. a fresh
      ``{"params": params, "opt_state": topka2a_jax.init(tx, params, mesh)}``;
      its structure, shapes and shardings are those of the result.
    mesh: the mesh to restore onto; its data axis may have a different size
      from the saved one, and the residuals are resized
      (:func:`resize_residual`, :func:`resize_slices`).
    axis_name: the data-parallel mesh axis, or the pair ``(outer, inner)``
      the state was saved with (either may change size).

  Returns:
    The state, placed like ``like``.

  Raises:
    FileNotFoundError: no checkpoint written by :func:`save` there.
    ValueError: a file of the checkpoint is missing, added or corrupted
      (:func:`verify`), or an array read back differs from the one saved
      (naming its path); the checkpoint holds another model or
      configuration (pytree structure, shapes or dtypes differ from
      ``like``'s), or was saved on one data axis and is restored onto a
      pair (or the other way round). Nothing is returned.

  Example:
    >>> import tempfile
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> tx = topka2a_jax.topka2a(0.1, min_size=0, mesh=mesh)
    >>> directory = tempfile.mkdtemp() + "/ckpt"
    >>> save(directory, {"opt_state": tx.init(jnp.ones(5))}, mesh)
    >>> like = {"opt_state": tx.init(jnp.ones(5))}
    >>> restore(directory, like, mesh)["opt_state"].residuals.shape
    (40,)
  """
  import orbax.checkpoint as ocp

  axis = DataAxis.parse(axis_name)
  axis.check_on(mesh)
  directory = Path(directory).absolute()
  if not (directory / LAYOUT_FILE).is_file():
    raise FileNotFoundError(f"{directory} holds no checkpoint written by "
                            f"topka2a_jax.save (no {LAYOUT_FILE})")
  if (directory / MANIFEST_FILE).is_file():
    verify(directory)
  else:
    listed_files(directory)  # no link, no special file, even without a manifest
    warnings.warn(f"{directory} has no {MANIFEST_FILE} (saved by an older "
                  "topka2a_jax): its files cannot be checked", stacklevel=2)
  saved = _read_json(directory / LAYOUT_FILE, "layout description")

  def read(targets: Any) -> Any:
    with ocp.StandardCheckpointer() as checkpointer:
      return checkpointer.restore(directory / "state", targets)

  return restore_laid_out(saved, read, like, mesh, axis, directory)


def restore_laid_out(saved: dict[str, Any], read: Any, like: Any, mesh: Mesh,
                     axis: DataAxis, where: Any) -> Any:
  """Reads a state described by ``saved`` through ``read(targets)``, laid out like ``like``.

  Checks the configuration before reading, every array's fingerprint after,
  and resizes the per-device leaves when the device count changed.
  """
  wanted = _layout(like, mesh, axis)
  old, new = Devices.of(saved), Devices.of(wanted)
  _check_same_configuration(saved, wanted, where)
  targets = []
  for leaf, described, was in zip(jax.tree.leaves(like), wanted["leaves"],
                                  saved["leaves"]):
    if described["per_device"] and old != new:
      # Read whole on every device, then resized to the new layout.
      targets.append(jax.ShapeDtypeStruct(tuple(was["shape"]), leaf.dtype,
                                          sharding=NamedSharding(mesh, P())))
    else:
      targets.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                          sharding=leaf.sharding))
  treedef = jax.tree.structure(like)
  loaded = read(treedef.unflatten(targets))
  _check_fingerprints(loaded, saved, where)
  if old == new:
    return loaded
  shardings = [leaf.sharding for leaf in jax.tree.leaves(like)]
  resized = [
      _resized(leaf, described, old, new, sharding)
      for leaf, described, sharding in zip(jax.tree.leaves(loaded),
                                           wanted["leaves"], shardings)
  ]
  return treedef.unflatten(resized)


def _resized(leaf: jax.Array, described: dict[str, Any], old: Devices, new: Devices,
             sharding: Any) -> jax.Array:
  """A loaded leaf on ``new`` devices, as its kind of layout asks."""
  if described["per_device"] == RESIDUAL and new.per_node is not None:
    return jax.jit(resize_slices, static_argnums=(1, 2, 3, 4), out_shardings=sharding)(
        leaf, old, new, described["shape"][0], described["pieces"])
  if described["per_device"] == RESIDUAL:
    return jax.jit(resize_residual, static_argnums=(1, 2), out_shardings=sharding)(
        leaf, old.nodes, new.nodes)
  if described["per_device"] == REPLICA:
    return jax.jit(average_replicas, static_argnums=1, out_shardings=sharding)(
        leaf, described["shape"][0])
  if described["per_device"] == SHARD:
    spec = tuple(sharding.spec) + (None,) * (leaf.ndim - len(sharding.spec))
    last = () if leaf.ndim < 2 or spec[-1] is None else (
        spec[-1] if isinstance(spec[-1], tuple) else (spec[-1],))
    pieces = math.prod(sharding.mesh.shape[axis] for axis in last)
    return jax.jit(reshard, static_argnums=(1, 2), out_shardings=sharding)(
        leaf, tuple(described["shape"]), pieces)
  return leaf


def _check_fingerprints(loaded: Any, saved: dict[str, Any], directory: Any) -> None:
  """Raises unless every array read back has the fingerprint it was saved with.

  A layout of this version (:data:`LAYOUT_VERSION`) always holds them: one
  without is refused. An older version's, written before fingerprints,
  restores with a warning.
  """
  if "fingerprints" not in saved:
    if saved.get("version", 1) >= LAYOUT_VERSION:
      raise ValueError(
          f"the checkpoint in {directory} is corrupted: its layout description "
          f"({LAYOUT_FILE}) lacks the arrays' fingerprints, which this version "
          "always writes, so its arrays cannot be checked. Restore an intact "
          "copy; nothing was returned.")
    warnings.warn(f"the checkpoint in {directory} was written by an older "
                  "topka2a_jax, without the arrays' fingerprints: its arrays "
                  "cannot be checked", stacklevel=3)
    return
  found = _leaf_fingerprints(jax.tree.leaves(loaded))
  for got, want, described in zip(found, saved["fingerprints"], saved["leaves"]):
    if got != want:
      raise ValueError(
          f"the checkpoint in {directory} is corrupted: leaf {described['path']} "
          "reads back other bytes than were saved. Restore an intact copy; "
          "nothing was returned.")


def _check_same_configuration(saved: dict[str, Any], wanted: dict[str, Any],
                              directory: Any) -> None:
  """Raises unless the saved state is the same pytree as the wanted one."""
  fix = ("Restore into a state made for the same model and topka2a options "
         "(density aside); nothing was loaded.")
  if saved["structure"] != wanted["structure"]:
    raise ValueError(f"the checkpoint in {directory} holds another pytree: "
                     f"saved {saved['structure']}, wanted "
                     f"{wanted['structure']}. {fix}")
  old, new = Devices.of(saved), Devices.of(wanted)
  if (old.per_node is None) != (new.per_node is None):
    def kind(devices):
      return ("one data axis" if devices.per_node is None
              else "a pair of data axes (node, local)")
    raise ValueError(
        f"the checkpoint in {directory} was saved with {kind(old)} "
        f"({saved.get('axis_name')}), and is restored onto {kind(new)} "
        f"({wanted['axis_name']}): over a pair every device keeps a slice of "
        "each residual, over one axis the whole of it. Restore onto the kind "
        "of data axis it was saved with; nothing was loaded.")
  for was, want in zip(saved["leaves"], wanted["leaves"]):
    shape = list(want["shape"])
    if want["per_device"] == RESIDUAL and new.per_node is not None:
      shape = _saved_slices_shape(was["shape"], shape, old, new, want["pieces"])
    elif want["per_device"] == RESIDUAL:
      shape = _saved_shape(shape, old.nodes, new.nodes)
    elif want["per_device"] == REPLICA:  # (devices, *shape): one copy each
      shape = [saved["devices"], *shape[1:]]
    elif want["per_device"] == SHARD:  # (devices, 1, ..., 1, entries per device)
      shape = ([old.nodes, *shape[1:-1], was["shape"][-1]] if len(shape) > 1
               else [old.nodes])
    if was["dtype"] != want["dtype"] or was["shape"] != shape:
      raise ValueError(
          f"leaf {want['path']} was saved as {was['dtype']}{was['shape']} on "
          f"{saved['devices']} devices; the state to restore into holds "
          f"{want['dtype']}{want['shape']} on {wanted['devices']}, which on "
          f"{saved['devices']} devices would have been saved as "
          f"{want['dtype']}{shape}. {fix}")
