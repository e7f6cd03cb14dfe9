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
nor Orbax's temporary directory, and the claim is older than
:data:`ABANDONED_AFTER_SECONDS`, as after a job killed during a save and
restarted (its new manager removes Orbax's leftovers).

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

import json
import os
import socket
import time
import uuid
from pathlib import Path

CLAIMS = ".topka2a_claims"
"""The folder of a root that holds its steps' claims."""

ABANDONED_AFTER_SECONDS = 120.0
"""How old a claim with nothing of its step on disk must be to be taken over."""


def new_token() -> str:
  """A token naming one manager's claims."""
  return uuid.uuid4().hex


def claim(root: Path, step: int, token: str) -> str | None:
  """Claims ``step`` of ``root`` for the manager of ``token``; None, or why not.

  Call it on one process (process 0) and share the outcome.

  Returns:
    None when the step is this manager's: newly claimed, claimed by it
    before, or taken over from an abandoned claim; else a sentence naming
    the job that holds it and where its claim is.
  """
  path = root / CLAIMS / str(step)
  path.parent.mkdir(parents=True, exist_ok=True)
  record = {"token": token, "host": socket.gethostname(), "pid": os.getpid(),
            "time": time.time()}
  try:
    descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    held = _read(path)
    if held.get("token") == token:
      return None
    if _abandoned(root, step, path):
      path.write_text(json.dumps(record))
      return None
    who = (f"process {held['pid']} on {held['host']}, "
           f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(held['time']))}"
           if {"pid", "host", "time"} <= set(held) else "a job that ended while claiming it")
    return f"step {step} of {root} is claimed by {who} ({path})"
  with os.fdopen(descriptor, "w") as file:
    json.dump(record, file)
  return None


def _read(path: Path) -> dict:
  """A claim's record, or ``{}`` where it is empty or unreadable."""
  try:
    record = json.loads(path.read_text())
  except (OSError, ValueError):
    return {}
  return record if isinstance(record, dict) else {}


def _abandoned(root: Path, step: int, path: Path) -> bool:
  """Whether nothing of ``step`` is on disk and its claim is old."""
  on_disk = any(entry.name == str(step) or entry.name.startswith(f"{step}.orbax-checkpoint-tmp")
                for entry in root.iterdir())
  try:
    age = time.time() - path.stat().st_mtime
  except OSError:
    return False
  return not on_disk and age > ABANDONED_AFTER_SECONDS
