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
the claim is abandoned: the step itself is not on disk, and either the
process that made the claim has ended (judged only where the claim proves
it was made on this host, in this boot and this PID namespace, as after a
job killed during a save and restarted on the same machine), or the claim
and every file of Orbax's temporary directory for the step are older than
:data:`ABANDONED_AFTER_SECONDS` (by the file system's own clock), so that a
live job's save in flight is never taken over.

Only the job that wins a step removes that step's temporary directory
(:func:`claim`), and a writing manager removes the temporary directories of
older steps only after winning their claims (:func:`remove_abandoned_partials`):
nothing that merely opens a root, an evaluation job polling it included,
ever removes another job's files.

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
import functools
import json
import math
import os
import re
import shutil
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

PARTIAL = ".orbax-checkpoint-tmp"
"""What Orbax puts after a step's name while the step is being written."""

_LARGEST_PID = 2**31 - 1
"""Larger pids are no process a host can test: such claims are judged by age."""


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
      if record.get("token") == token:  # a retry: no save of this job is in flight
        _remove_partials(root, step)
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
    problem = _write_record(descriptor, path, token)
    if problem is not None:
      return problem
    if latest is not None:
      _remove(folder / _name(step, generation) for generation in generations)
    _remove_partials(root, step)  # the step is this job's alone now
    return None
  return (f"step {step} of {root}: its claims in {folder} kept changing while this job "
          "read them; another job is saving to this root")


def remove_abandoned_partials(root: Path, token: str, below: int) -> None:
  """Removes the temporary directories of steps under ``below`` that no live job writes.

  A step's temporary directory goes only once this manager has won the
  step's claim (:func:`claim`), so a live job's save in flight stays; one
  that no claim names goes once it has not changed for
  :data:`ABANDONED_AFTER_SECONDS`. The claims won here are removed with it.
  """
  folder = root / CLAIMS
  try:
    entries = os.listdir(root)
  except OSError:
    return
  steps = {_partial_step(name) for name in entries} - {None}
  for step in sorted(step for step in steps if step < below):
    if not _generations(folder, step) and not all(
        _untouched(folder, root / name) for name in entries
        if _partial_step(name) == step):
      continue  # no claim names it: a writer other than this library's may be live
    if claim(root, step, token) is None:
      _remove(folder / _name(step, generation)
              for generation in _generations(folder, step))


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
  """``(step, generation)`` of a claim's file name, or None for another name.

  Only the names :func:`_name` writes count (no leading zero, no generation
  0 written out): any other name is no claim, and is ignored.
  """
  match = re.fullmatch(r"(0|[1-9]\d*)(?:~([1-9]\d*))?", name)
  return None if match is None else (int(match[1]), int(match[2] or 0))


def _generations(folder: Path, step: int) -> list[int]:
  """The generations of ``step``'s claim in ``folder`` (none where it cannot be listed)."""
  try:
    names = os.listdir(folder)
  except OSError:
    return []
  return [parsed[1] for parsed in map(_parse, names)
          if parsed is not None and parsed[0] == step]


def _partial_step(name: str) -> int | None:
  """The step whose temporary directory Orbax names ``name``, or None."""
  match = re.fullmatch(r"(0|[1-9]\d*)" + re.escape(PARTIAL) + r".*", name)
  return None if match is None else int(match[1])


def _partials(root: Path, step: int) -> list[Path]:
  """Orbax's temporary directories of ``step`` in ``root``."""
  return [root / name for name in os.listdir(root) if _partial_step(name) == step]


def _remove_partials(root: Path, step: int) -> None:
  """Removes ``step``'s temporary directories (never following a link)."""
  for path in _partials(root, step):
    if path.is_symlink() or not path.is_dir():
      _remove([path])
    else:
      shutil.rmtree(path, ignore_errors=True)


def _write_record(descriptor: int, path: Path, token: str) -> str | None:
  """Writes this job's claim record into the new claim ``path``; None, or why not.

  A claim that cannot be written whole (a full disk) is removed, so that
  the same job's retry finds the step unclaimed.
  """
  record = json.dumps({"token": token, "host": socket.gethostname(), "pid": os.getpid(),
                       "boot": _boot_id(), "pid_namespace": _pid_namespace(),
                       "time": time.time()}).encode()
  try:
    try:
      while record:
        record = record[os.write(descriptor, record):]
    finally:
      os.close(descriptor)
  except OSError as error:
    _remove([path])
    return _unwritable(path.parent, error)
  return None


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
  kind = _kind(path)
  remove = f"rm -r {path}" if kind == "a directory" else f"rm {path}"
  return (f"{path} is {kind}, not a claim file: something other than topka2a_jax "
          "put it there, and it is neither read nor followed. Nothing was written; "
          f"remove it ({remove}) and save again")


class Unwritable(str):
  """Why no claim could be written: the file system refused, no other job."""


def _unwritable(folder: Path, error: OSError) -> Unwritable:
  if error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
    return Unwritable(
        f"cannot write a step claim in {folder}: its file system is full "
        f"({error.strerror}). Nothing was written and no claim is left; free space "
        "(or save to another root), then save again")
  return Unwritable(
      f"cannot write a step claim in {folder} ({error.strerror}). Nothing was written; "
      "give the job write access to the checkpoint root, or save to another root")


def _abandoned(root: Path, folder: Path, step: int, path: Path, record: dict) -> str | None:
  """Why ``step``'s claim at ``path`` may be taken over, or None where it may not."""
  if (root / str(step)).exists() or (root / str(step)).is_symlink():
    return None  # the step itself: never replaced
  if _process_ended(record):
    return "its process has ended"
  age = _age(folder, path)
  if age is None or abs(age) <= ABANDONED_AFTER_SECONDS:
    return None
  if not all(_untouched(folder, partial) for partial in _partials(root, step)):
    return None  # a save in flight: its job is writing the step now
  return "it is old"


def _process_ended(record: dict) -> bool:
  """Whether the claim proves that its process has ended.

  Only a claim made on this host, in this boot and in this PID namespace
  names a pid this process can test; containers that share a host name
  have PID namespaces of their own.
  """
  return (record.get("host") == socket.gethostname() and _is_int(record.get("pid"))
          and record.get("boot") == _boot_id()
          and record.get("pid_namespace") == _pid_namespace()
          and not _alive(record["pid"]))


@functools.cache
def _boot_id() -> str | None:
  """This host's boot, where the system names it (Linux), else None."""
  try:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
  except OSError:
    return None


def _pid_namespace() -> str | None:
  """This process's PID namespace, where the system names it (Linux), else None."""
  try:
    return os.readlink("/proc/self/ns/pid")
  except OSError:
    return None


def _alive(pid: int) -> bool:
  """Whether a process ``pid`` runs on this host (True where it cannot be tested)."""
  if not 0 < pid <= _LARGEST_PID:
    return True  # not a process this host can test: judged by its age
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except (OSError, OverflowError):
    return True  # another user's process
  return True


def _untouched(folder: Path, partial: Path) -> bool:
  """Whether nothing under ``partial`` changed for :data:`ABANDONED_AFTER_SECONDS`."""
  newest = None
  try:
    for directory, names, files in os.walk(partial):
      for name in [directory, *(os.path.join(directory, n) for n in names + files)]:
        changed = os.lstat(name).st_mtime
        newest = changed if newest is None else max(newest, changed)
  except OSError:
    return False
  if newest is None:  # a link, or gone: judged by the entry itself
    try:
      newest = os.lstat(partial).st_mtime
    except OSError:
      return True
  now = _now(folder)
  return now is not None and abs(now - newest) > ABANDONED_AFTER_SECONDS


def _age(folder: Path, path: Path) -> float | None:
  """Seconds since ``path`` was written, both times by the file system's clock.

  The claim's modification time against that of a file made here now, so
  that a file server's clock is compared with itself, not with this host's.
  """
  now = _now(folder)
  try:
    return None if now is None else now - os.lstat(path).st_mtime
  except OSError:
    return None


def _now(folder: Path) -> float | None:
  """The file system's time now: that of a file made in ``folder``."""
  probe = folder / f".now-{uuid.uuid4().hex}"
  try:
    descriptor = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
      return os.fstat(descriptor).st_mtime
    finally:
      os.close(descriptor)
      os.unlink(probe)
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
          "removed. A claim is taken over once it and its step's temporary files are "
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
