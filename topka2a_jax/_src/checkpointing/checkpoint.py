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

import json
import math
import shutil
import warnings
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from topka2a_jax._src.axis import DataAxis
from topka2a_jax._src.checkpointing.integrity import (
  MANIFEST_FILE,
  leaf_fingerprints,
  listed_files,
  read_json,
  verify,
  write_manifest,
)
from topka2a_jax._src.checkpointing.resize import RULES, Devices
from topka2a_jax._src.runtime import in_flight
from topka2a_jax._src.states import (
  RESIDUAL,
  AccumulatedGradientsState,
  LocalStepsState,
  map_per_device,
)

LAYOUT_FILE = "topka2a_layout.json"
"""Written beside Orbax's files: devices, axis, pytree structure, shapes, and
each leaf's fingerprint (``integrity.fingerprint``)."""

LAYOUT_VERSION = 2
"""The layout description's format: devices, axis, structure, and every leaf's
path, shape, dtype, per-device kind and fingerprint."""


def _kinds(state: Any) -> list[str | bool]:
  """For every leaf of ``state``: its kind of per-device state, or False (replicated)."""
  return jax.tree.leaves(map_per_device(
      state, lambda kind, value: jax.tree.map(lambda _: kind, value),
      lambda _: False))


def _pieces(leaf: Any, axis: DataAxis) -> int:
  """How many blocks of a per-device leaf each data index holds (other mesh axes)."""
  sharding = getattr(leaf, "sharding", None)
  if not isinstance(sharding, NamedSharding) or not tuple(sharding.spec):
    return 1
  first = sharding.spec[0]
  axes = first if isinstance(first, tuple) else (first,)
  return math.prod(sharding.mesh.shape[a] for a in axes
                   if a is not None and a not in axis.names)


def describe(state: Any, mesh: Mesh, axis_name: Hashable | DataAxis = "data"
             ) -> dict[str, Any]:
  """What :func:`restore` needs to read ``state`` onto another mesh, as JSON.

  The devices along the data axis, the pytree's structure, every leaf's
  path, shape, dtype and layout (per device or replicated), and every
  leaf's :func:`integrity.fingerprint`.

  Raises:
    ValueError: ``state`` holds no array, or a leaf that is not one (a
      Python number), named.
  """
  _check_arrays(state)
  layout = _description(state, mesh, DataAxis.parse(axis_name))
  layout["fingerprints"] = leaf_fingerprints(jax.tree.leaves(state))
  layout["version"] = LAYOUT_VERSION
  return layout


def _check_arrays(state: Any) -> None:
  """Raises ValueError unless ``state`` is a non-empty pytree of JAX arrays."""
  with_paths = jax.tree_util.tree_flatten_with_path(state)[0]
  if not with_paths:
    raise ValueError(f"the state to save holds no array (got {type(state).__name__}); "
                     "pass the training state, e.g. {\"params\": params, "
                     "\"opt_state\": opt_state}. Nothing was written")
  for path, leaf in with_paths:
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      raise ValueError(
          f"the state's leaf {jax.tree_util.keystr(path)} is a {type(leaf).__name__}, "
          "not a JAX array: a checkpoint stores arrays placed on the mesh. Make it one "
          "(jnp.asarray(value)) or keep it outside the saved state. Nothing was written")


def _description(state: Any, mesh: Mesh, axis: DataAxis) -> dict[str, Any]:
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
          for (path, leaf), per_device in zip(with_paths, _kinds(state))
      ],
  }


def stored_tree(state: Any) -> Any:
  """``state`` as Orbax stores it: every 0-element leaf as None.

  Orbax refuses arrays without elements; they carry no data, and
  :func:`restore_laid_out` rebuilds them from ``like``.
  """
  leaves, treedef = jax.tree.flatten(state)
  return treedef.unflatten([None if not math.prod(leaf.shape) else leaf
                            for leaf in leaves])


def save(directory: str | Path, state: Any, mesh: Mesh,
         axis_name: Hashable = "data") -> None:
  """Writes the whole training state, every device's residuals included.

  Each leaf's :func:`integrity.fingerprint` goes into the layout description, and a
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
  layout = describe(state, mesh, axis)  # a state it cannot save is refused first
  in_flight.settle()  # no exchange on its own stream while the barriers below run
  _claim(directory)
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(directory / "state", stored_tree(state))
    if jax.process_count() > 1:  # every process's files are written
      multihost_utils.sync_global_devices(f"topka2a_jax.save {directory} written")
    if jax.process_index() == 0:
      (directory / LAYOUT_FILE).write_text(json.dumps(layout, indent=1))
      write_manifest(directory)
  except BaseException:
    if jax.process_index() == 0:  # the directory is this call's own: see _claim
      shutil.rmtree(directory, ignore_errors=True)
    raise


def _claim(directory: Path) -> None:
  """Creates ``directory`` for this save alone, or raises FileExistsError.

  Process 0 creates it with one ``mkdir``, which fails if anything (another
  job's save among them) made it first; every process learns the outcome
  before any writes. A save therefore only ever removes a directory that it
  created itself.
  """
  created = True
  if jax.process_index() == 0:
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
      directory.mkdir()
    except FileExistsError:
      created = False
  if jax.process_count() > 1:
    created = bool(multihost_utils.broadcast_one_to_all(np.int32(created)))
  if not created:
    raise FileExistsError(
        f"{directory} exists; save each checkpoint to a new directory (nothing was "
        "written)" + ("" if (directory / MANIFEST_FILE).is_file() else
                      ". It has no manifest: another job's save in progress, or one "
                      "cut short; if no job writes it, remove it and save again"))


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
    warnings.warn(f"{directory} has no {MANIFEST_FILE}: its files cannot be checked "
                  "(an older topka2a_jax saved it, or the save was cut short after "
                  "its arrays were written); its arrays' fingerprints still are",
                  stacklevel=2)
  saved = read_json(directory / LAYOUT_FILE, "layout description")

  def read(targets: Any) -> Any:
    with ocp.StandardCheckpointer() as checkpointer:
      return checkpointer.restore(directory / "state", targets)

  return restore_laid_out(saved, naming_read_errors(directory, read), like, mesh, axis,
                          directory)


def naming_read_errors(directory: Path, read: Callable[..., Any]) -> Callable[..., Any]:
  """``read``, whose Orbax and TensorStore errors become a ValueError that names ``directory``.

  Example:
    >>> def read():
    ...   raise KeyError("key")
    >>> naming_read_errors(Path("/ckpt/3"), read)()
    Traceback (most recent call last):
    ValueError: /ckpt/3 cannot be read: KeyError: 'key'. A file of the step is ...
  """
  def named(*args: Any, **kwargs: Any) -> Any:
    try:
      return read(*args, **kwargs)
    except Exception as error:
      first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
      raise ValueError(
          f"{directory} cannot be read: {type(error).__name__}: {first}. A file "
          "of the step is missing or damaged (topka2a_jax.checkpoint.verify names "
          "it when the step has its manifest); restore another step or an intact "
          "copy. Nothing was loaded.") from error

  return named


def restore_laid_out(saved: dict[str, Any], read: Any, like: Any, mesh: Mesh,
                     axis: DataAxis, where: Any) -> Any:
  """Reads a state described by ``saved`` through ``read(targets)``, laid out like ``like``.

  Checks the configuration before reading, every array's fingerprint after,
  and resizes the per-device leaves when the device count changed.
  """
  wanted = _description(like, mesh, axis)
  old, new = Devices.of(saved), Devices.of(wanted)
  _check_same_configuration(saved, wanted, where)
  targets = []
  for leaf, described, was in zip(jax.tree.leaves(like), wanted["leaves"],
                                  saved["leaves"]):
    if not math.prod(leaf.shape):
      targets.append(None)  # stored as None: see stored_tree
    elif described["per_device"] and old != new:
      # Read whole on every device, then resized to the new layout.
      targets.append(jax.ShapeDtypeStruct(tuple(was["shape"]), leaf.dtype,
                                          sharding=NamedSharding(mesh, P())))
    else:
      targets.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                          sharding=leaf.sharding))
  treedef = jax.tree.structure(like)
  read_back = treedef.flatten_up_to(read(treedef.unflatten(targets)))
  loaded = treedef.unflatten([
      jax.device_put(np.zeros(leaf.shape, leaf.dtype), leaf.sharding)
      if target is None else got
      for leaf, target, got in zip(jax.tree.leaves(like), targets, read_back)])
  _check_fingerprints(loaded, saved, where)
  _check_round_lengths(loaded, like, where)
  if old == new:
    return loaded
  shardings = [leaf.sharding for leaf in jax.tree.leaves(like)]
  resized = [
      _resized(leaf, described, old, new, sharding)
      for leaf, described, sharding in zip(jax.tree.leaves(loaded),
                                           wanted["leaves"], shardings)
  ]
  return treedef.unflatten(resized)


ROUNDS = {
    LocalStepsState: (
        "local_steps",
        "its round ({step} steps in) and its offsets belong to rounds of the saved length"),
    AccumulatedGradientsState: (
        "accumulate_gradients",
        "its sums ({step} calls in) belong to accumulations of the saved length"),
}
"""The states made for a length of ``every``: the transform's name, and what of
the saved state belongs to that length."""


def _check_round_lengths(loaded: Any, like: Any, where: Any) -> None:
  """Raises where a state of :data:`ROUNDS` was saved for another ``every``.

  Only where ``like`` holds the length as a value (a state from
  ``tx.init``); a ``jax.ShapeDtypeStruct`` holds none.
  """
  def rounds(tree: Any) -> list[Any]:
    is_round = lambda node: type(node) in ROUNDS
    return [node for node in jax.tree.leaves(tree, is_leaf=is_round) if is_round(node)]

  value = lambda scalar: int(np.asarray(scalar.addressable_data(0)))
  for got, want in zip(rounds(loaded), rounds(like)):
    if not isinstance(want.every, jax.Array) or isinstance(want.every, jax.core.Tracer):
      continue
    saved_every, wanted_every = value(got.every), value(want.every)
    if saved_every != wanted_every:
      name, owned = ROUNDS[type(want)]
      raise ValueError(
          f"the checkpoint in {where} was saved by {name}(..., every={saved_every}) "
          f"and is restored into the state of {name}(..., every={wanted_every}): "
          f"{owned.format(step=value(got.step))}. Build the optimizer with "
          f"every={saved_every} to resume this run; nothing was loaded.")


def _resized(leaf: jax.Array, described: dict[str, Any], old: Devices, new: Devices,
             sharding: Any) -> jax.Array:
  """A loaded leaf on ``new`` devices, as its kind's :data:`resize.RULES` asks."""
  kind = described["per_device"]
  return RULES[kind].resize(leaf, described, old, new, sharding) if kind else leaf


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
  found = leaf_fingerprints(jax.tree.leaves(loaded))
  for got, want, described in zip(found, saved["fingerprints"], saved["leaves"]):
    if got != want:
      raise ValueError(
          f"the checkpoint in {directory} is corrupted: leaf {described['path']} "
          "reads back other bytes than were saved. Restore an intact copy; "
          "nothing was returned.")


def _first_difference(saved: dict[str, Any], wanted: dict[str, Any]) -> str:
  """Where two layouts' pytrees part: the leaves only one has, or the first node."""
  def paths(layout):
    return [leaf["path"] for leaf in layout["leaves"]]

  def listed(found):
    return ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")

  only_saved = [p for p in paths(saved) if p not in set(paths(wanted))]
  only_wanted = [p for p in paths(wanted) if p not in set(paths(saved))]
  if only_saved or only_wanted:
    return (f"leaves only in the checkpoint: {listed(only_saved) or 'none'}; only "
            f"in the state to restore into: {listed(only_wanted) or 'none'}")
  old, new = saved["structure"], wanted["structure"]
  at = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
  start = max(0, at - 60)
  return (f"the same leaves in other containers; they part at ...{old[start:at + 60]}... "
          f"(saved) against ...{new[start:at + 60]}... (wanted)")


def _check_same_configuration(saved: dict[str, Any], wanted: dict[str, Any],
                              directory: Any) -> None:
  """Raises unless the saved state is the same pytree as the wanted one."""
  fix = ("Restore into a state made for the same model and topka2a options "
         "(density aside); nothing was loaded.")
  if saved["structure"] != wanted["structure"]:
    raise ValueError(f"the checkpoint in {directory} holds another pytree: "
                     f"{_first_difference(saved, wanted)}. {fix}")
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
    kind = want["per_device"]
    shape = (RULES[kind].saved_shape(was, want, saved["devices"], old, new) if kind
             else list(want["shape"]))
    if was["dtype"] != want["dtype"] or was["shape"] != shape:
      raise ValueError(
          f"leaf {want['path']} was saved as {was['dtype']}{was['shape']} on "
          f"{saved['devices']} devices; the state to restore into holds "
          f"{want['dtype']}{want['shape']} on {wanted['devices']}, which on "
          f"{saved['devices']} devices would have been saved as "
          f"{want['dtype']}{shape}. {fix}")
