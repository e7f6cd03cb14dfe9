"""A checkpoint's integrity: each array's fingerprint, each file's SHA-256.

:func:`fingerprint` digests an array where it lives, so a restore can check
every array it reads back against the one saved; :func:`write_manifest`
records the SHA-256 of every file a save wrote, and :func:`verify` checks a
directory against it without reading any array. Nothing outside the
checkpoint's directory is read: links and special files are refused
(:func:`listed_files`).

Example:
  >>> import tempfile
  >>> directory = Path(tempfile.mkdtemp())
  >>> _ = (directory / "state.bin").write_bytes(b"0123")
  >>> write_manifest(directory)
  >>> verify(directory)
  >>> _ = (directory / "state.bin").write_bytes(b"0124")
  >>> verify(directory)
  Traceback (most recent call last):
  ValueError: checkpoint file .../state.bin is corrupted: its SHA-256 differs from the one
  saved. Restore an intact copy; nothing was loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

MANIFEST_FILE = "topka2a_manifest.json"
"""Written last: the SHA-256 of every other file of the checkpoint, and of
itself (its ``"files"`` as written), so that any changed byte is found."""


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


def leaf_fingerprints(leaves: list[Any]) -> list[int]:
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
      a directory (a checkpoint holds only what :func:`topka2a_jax.checkpoint.save` wrote, and
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
  """Writes the SHA-256 of every file under ``directory`` (last, once all are written).

  The manifest is written beside its final name and renamed into place, so
  a seal cut short (a full disk, a killed process) leaves no manifest, never
  a partial one: the step then restores as an unsealed one does, its
  arrays still checked against their fingerprints.
  """
  files = {name: _digest(directory / name) for name in listed_files(directory)}
  listed = json.dumps(files, sort_keys=True)
  partial = directory / f".{MANIFEST_FILE}.partial"
  try:
    partial.write_text(json.dumps(
        {"files": files, "self": hashlib.sha256(listed.encode()).hexdigest()}))
    os.replace(partial, directory / MANIFEST_FILE)
  finally:
    partial.unlink(missing_ok=True)


def read_json(path: Path, what: str) -> Any:
  """A JSON file of the checkpoint, or a ValueError that names it."""
  try:
    return json.loads(path.read_bytes().decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as error:
    raise ValueError(f"the checkpoint's {what} {path} is corrupted ({error}); "
                     "restore an intact copy. Nothing was loaded.") from None


def verify(directory: str | Path) -> None:
  """Checks every file of a checkpoint against its manifest.

  ``directory`` is what :func:`topka2a_jax.checkpoint.save` wrote, or one step of a
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
    >>> topka2a_jax.checkpoint.save(directory, {"w": jnp.ones(4)}, mesh)
    >>> verify(directory)
    >>> with (directory / "topka2a_layout.json").open("r+b") as f:
    ...   _ = f.write(b"X")
    >>> verify(directory)
    Traceback (most recent call last):
    ValueError: checkpoint file .../topka2a_layout.json is corrupted: its SHA-256 differs from
    the one saved. Restore an intact copy; nothing was loaded.
  """
  directory = Path(directory).absolute()
  found = listed_files(directory)  # first: no link is followed, the manifest's included
  manifest = read_json(directory / MANIFEST_FILE, "manifest")
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
