"""Claims on a manager's steps: one job's step is never replaced by another's.

Orbax's manager saves a step with ``force=True``, which removes a step
directory already there. Two jobs on one root (a job started twice, or a
second run pointed at the first one's root) could each check that a step
is new, and then the later save would delete the earlier's finished step
while both reported success. Before Orbax touches a step,
:class:`topka2a_jax.CheckpointManager` claims it here: process 0 creates
``<root>/.topka2a_claims/<step>`` with ``O_CREAT | O_EXCL``, which succeeds
for one job only, and writes who claimed it; every process learns the
outcome before anything is written.

A claim stays after its save. The manager that made it may retry its own
step (a save that failed). Another manager may take a step over only where
the claim is abandoned: nothing of the step is on disk, neither the step
nor Orbax's temporary directory, and either the claim is older than
:data:`ABANDONED_AFTER_SECONDS` (by the file system's own clock) or the
process that made it is gone from this host, as after a job killed during a
save and restarted (its new manager removes Orbax's leftovers).

A takeover is exclusive too: it creates the claim's next generation,
``<step>~1``, ``<step>~2``..., with ``O_CREAT | O_EXCL``, so of two jobs that
find one claim abandoned exactly one wins; nothing is ever overwritten. The
step's latest generation is its claim.

Only regular files are claims. A link, a directory, a FIFO or anything
else in their place is refused unread, with its path and how to clear it;
nothing is opened through a link, and nothing outside the root is read or
written.

Example:
  >>> import tempfile
  >>> root = Path(tempfile.mkdtemp())
  >>> first, second = new_token(), new_token()
  >>> claim(root, 1, first) is None  # claimed
  True
  >>> claim(root, 1, first) is None  # its own claim again: a retry
  True
  >>> "claimed by" in claim(root, 1, second)  # another job's: refused, with why
  True
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import socket
import stat
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

CLAIMS = ".topka2a_claims"
"""The folder of a root that holds its steps' claims."""

ABANDONED_AFTER_SECONDS = 120.0
"""How old a claim with nothing of its step on disk must be to be taken over."""

_LARGEST_RECORD = 4096
"""Bytes read of a claim at most: a record is about 120."""

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
"""A claim is read without following a link and without waiting on a FIFO."""


def new_token() -> str:
  """A token naming one manager's claims."""
  return uuid.uuid4().hex


def claim(root: Path, step: int, token: str) -> str | None:
  """Claims ``step`` of ``root`` for the manager of ``token``; None, or why not.

  Call it on one process (process 0) and share the outcome.

  Returns:
    None when the step is this manager's: newly claimed, claimed by it
    before, or taken over from an abandoned claim; else a sentence naming
    the job that holds it, or the entry in the way, and what to do.
  """
  folder = root / CLAIMS
  problem = _folder_problem(folder)
  if problem is not None:
    return problem
  for _ in range(100):  # each pass either decides or sees a newer generation
    generations = _generations(folder, step)
    latest = max(generations, default=None)
    path = folder / _name(step, 0 if latest is None else latest + 1)
    if latest is not None:
      held = folder / _name(step, latest)
      record, problem = _read(held)
      if problem is not None:
        return problem
      if record is None:
        continue  # taken over and removed since it was listed: list again
      if record.get("token") == token:
        return None
      why = _abandoned(root, folder, step, held, record)
      if why is None:
        return _refusal(step, root, held, record)
    try:
      descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY
                           | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except FileExistsError:
      continue  # another job claimed or took it over first: read its claim
    except OSError as error:
      return _unwritable(folder, error)
    with os.fdopen(descriptor, "w") as file:
      json.dump({"token": token, "host": socket.gethostname(), "pid": os.getpid(),
                 "time": time.time()}, file)
    if latest is not None:
      _remove(folder / _name(step, generation) for generation in generations)
    return None
  return (f"step {step} of {root}: its claims in {folder} kept changing while this job "
          "read them; another job is saving to this root")


def remove_claims(root: Path, keep: Iterable[int], below: int) -> None:
  """Removes the claims of every step under ``below`` not in ``keep`` (steps gone).

  A manager only adds steps after the latest on disk, so such a claim can
  never be used again. Odd entries are left for their own message.
  """
  folder, keep = root / CLAIMS, set(keep)
  try:
    names = os.listdir(folder)
  except OSError:
    return
  for name in names:
    parsed = _parse(name)
    if parsed is not None and parsed[0] < below and parsed[0] not in keep:
      _remove([folder / name])


def _name(step: int, generation: int) -> str:
  return str(step) if generation == 0 else f"{step}~{generation}"


def _parse(name: str) -> tuple[int, int] | None:
  """``(step, generation)`` of a claim's file name, or None for another name."""
  match = re.fullmatch(r"(\d+)(?:~(\d+))?", name)
  return None if match is None else (int(match[1]), int(match[2] or 0))


def _generations(folder: Path, step: int) -> list[int]:
  """The generations of ``step``'s claim in ``folder``."""
  return [parsed[1] for parsed in map(_parse, os.listdir(folder))
          if parsed is not None and parsed[0] == step]


def _folder_problem(folder: Path) -> str | None:
  """Why ``folder`` cannot hold claims, or None once it is a directory (made if need be)."""
  try:
    folder.mkdir(parents=True, exist_ok=True)
  except FileExistsError:
    pass
  except OSError as error:
    return _unwritable(folder, error)
  kind = _kind(folder)
  if kind == "a directory":
    return None
  return (f"{folder} is {kind}, not the directory of this root's step claims: "
          "something other than topka2a_jax put it there. Nothing was written; "
          f"remove it (rm {folder}) and save again")


def _kind(path: Path) -> str:
  """What ``path`` is, in words, without following a link."""
  try:
    mode = os.lstat(path).st_mode
  except FileNotFoundError:
    return "missing"
  for test, words in ((stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file"),
                      (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                      (stat.S_ISSOCK, "a socket")):
    if test(mode):
      return words
  return "a device file"


def _read(path: Path) -> tuple[dict | None, str | None]:
  """A claim's record (``{}`` where it is empty or not JSON; None where it is
  gone), or why it cannot be one."""
  try:
    descriptor = os.open(path, _OPEN_FLAGS)
  except FileNotFoundError:
    return None, None
  except OSError as error:
    if error.errno in (errno.ELOOP, errno.EMLINK) or _kind(path) != "a regular file":
      return {}, _odd(path)
    return {}, (f"{path} cannot be read ({error.strerror}): a claim on this step that "
                "this job cannot judge. Nothing was written; give the job read access "
                f"to it, or remove it (rm {path}) once no other job saves to this root")
  try:
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
      return {}, _odd(path)
    text = os.read(descriptor, _LARGEST_RECORD)
  finally:
    os.close(descriptor)
  try:
    record = json.loads(text)
  except ValueError:
    return {}, None
  return (record if isinstance(record, dict) else {}), None


def _odd(path: Path) -> str:
  return (f"{path} is {_kind(path)}, not a claim file: something other than topka2a_jax "
          "put it there, and it is neither read nor followed. Nothing was written; "
          f"remove it (rm {path}) and save again")


def _unwritable(folder: Path, error: OSError) -> str:
  return (f"cannot write a step claim in {folder} ({error.strerror}). Nothing was "
          "written; give the job write access to the checkpoint root, or save to "
          "another root")


def _abandoned(root: Path, folder: Path, step: int, path: Path, record: dict) -> str | None:
  """Why ``step``'s claim at ``path`` may be taken over, or None where it may not."""
  on_disk = any(entry.name == str(step) or entry.name.startswith(f"{step}.orbax-checkpoint-tmp")
                for entry in root.iterdir())
  if on_disk:
    return None
  if (record.get("host") == socket.gethostname() and _is_int(record.get("pid"))
      and not _alive(record["pid"])):
    return "its process has ended"
  age = _age(folder, path)
  if age is not None and abs(age) > ABANDONED_AFTER_SECONDS:
    return "it is old"
  return None


def _alive(pid: int) -> bool:
  """Whether a process ``pid`` runs on this host."""
  if pid <= 0:
    return True  # not a process this host can test: judged by its age
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except OSError:
    return True  # another user's process
  return True


def _age(folder: Path, path: Path) -> float | None:
  """Seconds since ``path`` was written, both times by the file system's clock.

  The claim's modification time against that of a file made here now, so
  that a file server's clock is compared with itself, not with this host's.
  """
  probe = folder / f".now-{uuid.uuid4().hex}"
  try:
    descriptor = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
      now = os.fstat(descriptor).st_mtime
    finally:
      os.close(descriptor)
      os.unlink(probe)
    return now - os.lstat(path).st_mtime
  except OSError:
    return None


def _refusal(step: int, root: Path, path: Path, record: dict) -> str:
  """Why another job's live claim on ``step`` stands, and what to do."""
  age = _age(path.parent, path)
  if {"pid", "host"} <= set(record) and _is_int(record["pid"]):
    who = f"process {record['pid']} on {str(record['host'])[:100]}"
  else:
    who = "a job that ended while claiming it, or another program"
  when = "" if age is None else f", {max(age, 0):.0f} s ago"
  return (f"step {step} of {root} is claimed by {who}{when} ({path}): another job saves "
          "to this root. Nothing was written, and nothing of the other job's is "
          "removed. A claim with nothing of its step on disk is taken over once it is "
          f"{ABANDONED_AFTER_SECONDS:.0f} s old, or at once where its process has ended "
          "on this host; if no other job runs, remove it (rm "
          f"{path}) and save again. Else save to another root, or restore the latest "
          "step and go on from there once the other job has stopped")


def _is_int(value: object) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and math.isfinite(value)


def _remove(paths: Iterable[Path]) -> None:
  """Unlinks what is there of ``paths`` (never following a link)."""
  for path in paths:
    try:
      os.unlink(path)
    except OSError:
      continue
