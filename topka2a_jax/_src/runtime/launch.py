"""Starts N local JAX processes on one script, as a multi-host job would.

:func:`launch` runs one command in N processes (the command line is
``topka2a-launch -n 4 [--devices-per-process 2] SCRIPT [ARGS...]``).
Every process runs the command with a loopback coordinator, its rank and
the process count in the environment (read by
:func:`topka2a_jax.distributed.initialize`), ``devices-per-process`` emulated
CPU devices, and gloo collectives over TCP. Output lines are forwarded with a
``[rank]`` prefix. When a process fails the others are stopped, and the
launcher says which rank failed and exits with its status; it exits 0 when
all succeed. SIGTERM, SIGINT or SIGHUP to the launcher stop every process
before it exits (with 128 + the signal's number); on Linux the processes are
killed with the launcher too when it is itself killed (SIGKILL). Each process
runs in a process group of its own, and stopping it stops the group: what a
process started itself (a data loader's workers) goes with it, except after a
SIGKILL to the launcher, which leaves it no moment to act.
"""

from __future__ import annotations

import collections
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from topka2a_jax._src.runtime.contract import (
  COORDINATOR,
  NUM_PROCESSES,
  PROCESS_ID,
  STALLED_STATUS,
)

GRACE_SECONDS = 5.0
"""How long a process stopped by a signal to the launcher gets to exit before
it is killed (JAX catches SIGTERM, for saving on preemption)."""

FAILURE_GRACE_SECONDS = 1.0
"""How long the others get when a process failed: their collectives wait for
it, so there is nothing left for them to finish."""

LONGEST_PIECE = 1 << 16
"""Characters of a process's line forwarded at once: a line without a newline
is passed on in pieces of this size, not held in memory whole."""

PR_SET_PDEATHSIG = 1
"""``prctl``'s option: the signal a process gets when its parent dies."""

SETTLE_SECONDS = 0.5
"""How long after the first failure the launcher waits for others before it
names one: a loaded machine can report a peer's exit (a collective whose
process has gone) before the exit that caused it."""

LOST_PEER = re.compile(
    r"closed by peer|Connection reset|Connection refused|Broken pipe|Socket closed|"
    r"heartbeat|UNAVAILABLE|coordination service|DEADLINE_EXCEEDED", re.IGNORECASE)
"""What a process prints when it fails because a peer has gone (gloo's and
JAX's coordination service's errors)."""

RECENT_LINES = 50
"""Lines of each process's output kept to tell a lost peer from a failure of its own."""


def free_port() -> int:
  """A TCP port on loopback that nothing listens on right now."""
  with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    return probe.getsockname()[1]


def process_env(rank: int, num_processes: int, devices: int, port: int,
                host: str = "127.0.0.1") -> dict[str, str]:
  """The environment of process ``rank``; the coordinator listens on ``host``."""
  env = dict(os.environ)
  flags = [flag for flag in env.get("XLA_FLAGS", "").split()
           if not flag.startswith("--xla_force_host_platform_device_count")]
  env.update({
      COORDINATOR: f"{host}:{port}",
      NUM_PROCESSES: str(num_processes),
      PROCESS_ID: str(rank),
      "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"]),
      "JAX_PLATFORMS": env.get("JAX_PLATFORMS", "cpu"),
      "PYTHONUNBUFFERED": "1",
  })
  return env


GLOO_CONNECTED = re.compile(
    r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. Expected number of "
    r"connected peer ranks is : (\d+)\s*$")
"""gloo's line when a process has joined its peers; forwarded only when some are
missing."""


def _is_chatter(line: str) -> bool:
  """Whether ``line`` only says that a process reached all its peers.

  Example:
    >>> _is_chatter("[Gloo] Rank 1 is connected to 3 peer ranks. Expected number "
    ...             "of connected peer ranks is : 3")
    True
  """
  found = GLOO_CONNECTED.search(line)
  return found is not None and found.group(1) == found.group(2)


class _Output:
  """The processes' output, forwarded with each line's rank until one fails.

  After the first failure, what the others print (the traceback of a
  collective whose peer has gone: gloo's "Connection closed by peer") is
  held back and summarized, so that the first failure's own message is
  what the job ends on.
  """

  HOLDING = -1
  """:attr:`failed` while the launcher decides which failure to name: every
  process's output is held."""

  def __init__(self):
    self.lock = threading.Lock()
    self.failed: int | None = None
    self.held: dict[int, list[str]] = {}
    self.recent: dict[int, collections.deque[str]] = {}

  def lost_a_peer(self, rank: int) -> bool:
    """Whether ``rank``'s last lines say it failed because a peer had gone."""
    with self.lock:
      return any(LOST_PEER.search(line) for line in self.recent.get(rank, ()))

  def name(self, rank: int) -> None:
    """Ends the holding: ``rank`` is the failure named; its held lines go out."""
    with self.lock:
      self.failed = rank
      for line in self.held.pop(rank, []):
        _write(f"[{rank}] {line}\n")

  def forward(self, rank: int, stream) -> None:
    """Writes each of a process's lines with its rank, until its output ends.

    The stream decodes bytes that are not UTF-8 as escapes (``\\xff``), and a
    line that cannot be written (the launcher's own output closed) is
    dropped: the pipe is read to its end whatever comes, so that no process
    ever blocks on a full pipe. A line longer than :data:`LONGEST_PIECE` is
    forwarded as it comes, in pieces of that size, each on a line of its own
    with the rank, never held whole.
    """
    at_start = True  # whether the next piece begins a line
    while True:
      piece = stream.readline(LONGEST_PIECE)  # a line, or its next piece
      if not piece:
        return
      if at_start and piece.endswith("\n") and _is_chatter(piece):
        continue
      with self.lock:
        self.recent.setdefault(rank, collections.deque(maxlen=RECENT_LINES)).append(piece)
        if self.failed is not None and rank != self.failed:
          held = self.held.setdefault(rank, [])
          if at_start or not held:
            held.append(piece.rstrip("\n")[:LONGEST_PIECE])
          at_start = piece.endswith("\n")
          continue
        # a piece of a longer line goes on a line of its own, never inside another's
        _write(f"[{rank}] {piece}" if piece.endswith("\n") else f"[{rank}] {piece}\n")
      at_start = piece.endswith("\n")

  def summary(self) -> list[str]:
    """One line per process whose output after the failure was held back."""
    with self.lock:
      return [f"launch: process {rank} printed {len(lines)} more line"
              f"{'s' if len(lines) > 1 else ''} after process {self.failed} failed, "
              f"held back (a peer's collective fails once a process is gone); "
              f"its last: {lines[-1].strip()[:200]!r}"
              for rank, lines in sorted(self.held.items()) if lines]


def _write(text: str) -> None:
  """Writes ``text`` to the launcher's stdout; a closed or broken stdout is ignored."""
  try:
    sys.stdout.write(text)
    sys.stdout.flush()
  except (OSError, ValueError):
    pass


def named_failure(failures: Sequence[int], lost_a_peer: Callable[[int], bool]) -> int:
  """The failure to name among ``failures`` (ranks, in the order their exits came).

  The first whose output does not say it lost a peer, else the first.

  Example:
    >>> named_failure([0, 1], lambda rank: rank == 0)
    1
  """
  return next((rank for rank in failures if not lost_a_peer(rank)), failures[0])


_GROUP_KEEPER = """
import os, signal, sys, time
parent, groups = int(sys.argv[1]), [int(g) for g in sys.argv[2:]]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles the job's Ctrl-C
while os.getppid() == parent:
  time.sleep(0.2)
for group in groups:
  try:
    os.killpg(group, signal.SIGKILL)
  except OSError:
    pass
"""
"""A process that outlives a launcher killed by SIGKILL for as long as it takes to
kill the workers' process groups: their children, which the parent-death signal
does not reach."""


def _keep_groups(processes: Sequence[subprocess.Popen]) -> subprocess.Popen | None:
  """Starts :data:`_GROUP_KEEPER` for ``processes``' groups (None where it cannot)."""
  try:
    return subprocess.Popen([sys.executable, "-c", _GROUP_KEEPER, str(os.getpid()),
                             *(str(process.pid) for process in processes)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
  except OSError:
    return None


def _signal_group(process: subprocess.Popen, number: int) -> None:
  """Sends ``number`` to ``process``'s group: the process and every child it started."""
  try:
    os.killpg(process.pid, number)
  except (ProcessLookupError, PermissionError):  # the group has no process left
    pass


def _stop(processes: Sequence[subprocess.Popen], grace: float) -> None:
  """Stops every process and what it started (each runs in its own process group)."""
  for process in processes:
    _signal_group(process, signal.SIGTERM)
  deadline = time.monotonic() + grace
  for process in processes:
    try:
      process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()
  for process in processes:  # children that outlived their process, or ignored SIGTERM
    _signal_group(process, signal.SIGKILL)


def _dies_with(parent: int):
  """A ``preexec_fn``: the child is killed when the launcher dies (Linux), or None.

  ``PR_SET_PDEATHSIG`` with SIGKILL, so that a launcher killed by SIGKILL
  (which it cannot catch) leaves no worker behind; SIGTERM would not do,
  since JAX catches it. ``prctl`` is looked up here, before the fork, so the
  child only calls it. None where it is missing.
  """
  if not sys.platform.startswith("linux"):
    return None
  try:
    import ctypes
    prctl = ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):
    return None

  def set_up() -> None:
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the launcher died before the call above
      os._exit(128 + signal.SIGKILL)

  return set_up


def launch(command: Sequence[str], num_processes: int, devices_per_process: int, *,
           prefixes: Sequence[Sequence[str]] | None = None,
           host: str = "127.0.0.1") -> int:
  """Runs ``command`` in ``num_processes`` processes; returns the exit status.

  Args:
    command: the program and its arguments, e.g. ``[sys.executable, "train.py"]``.
    num_processes: how many processes.
    devices_per_process: emulated CPU devices in each.
    prefixes: per process, words run before ``command`` (e.g. ``ip netns
      exec NAME`` to start each process in its own network namespace).
    host: the address process 0's coordinator listens on, as the others
      reach it.

  Returns:
    0 when every process succeeded, else the status of the first process
    to fail in time (a peer that dies of the broken connection afterwards
    is not blamed; a process killed by a signal counts as 128 + the signal
    number).

  Example:
    >>> launch([sys.executable, "-c", "pass"], 2, 1)
    0
  """
  if not command:
    raise ValueError("launch needs a command to run, e.g. [sys.executable, \"train.py\"]; "
                     "got none")
  for name, value in (("num_processes", num_processes),
                      ("devices_per_process", devices_per_process)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"launch needs {name} of at least 1, got {value!r}: a job of no "
                       "process, or of processes with no device, runs nothing")
  port = free_port()
  output = _Output()
  processes, readers, keeper = [], [], None
  failed_rank = None
  previous = _stop_on_signals()
  dies_with_launcher = _dies_with(os.getpid())
  try:
    # Every process is started before any reader thread: no fork meets a thread.
    for rank in range(num_processes):
      prefix = list(prefixes[rank]) if prefixes else []
      processes.append(subprocess.Popen(
          [*prefix, *command],
          env=process_env(rank, num_processes, devices_per_process, port, host),
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, encoding="utf-8",
          errors="backslashreplace", start_new_session=True,  # a group to stop whole
          preexec_fn=dies_with_launcher))  # noqa: PLW1509 (no thread runs yet)
    keeper = _keep_groups(processes)
    exits: queue.Queue = queue.Queue()  # (rank, status), in the order they ended
    for rank, process in enumerate(processes):
      reader = threading.Thread(target=output.forward, args=(rank, process.stdout),
                                daemon=True)
      reader.start()
      readers.append(reader)
      threading.Thread(target=lambda rank=rank, process=process: exits.put(
          (rank, process.wait())), daemon=True).start()
    running = len(processes)
    while failed_rank is None and running:
      try:  # a short wait, so that a signal to the launcher is handled
        rank, returncode = exits.get(timeout=0.05)
      except queue.Empty:
        continue
      running -= 1
      if returncode:  # the first process to fail in time, not in rank order
        failed_rank = _settled(rank, exits, output)
    status = 0 if failed_rank is None else _status(processes[failed_rank].returncode)
  except _Stopped as stopped:
    status = 128 + stopped.signal
  finally:
    _stop(processes, GRACE_SECONDS if failed_rank is None else FAILURE_GRACE_SECONDS)
    if keeper is not None:
      keeper.terminate()
      keeper.wait()
    for reader in readers:
      reader.join(timeout=GRACE_SECONDS)
    for number, handler in previous.items():
      signal.signal(number, handler)
  if failed_rank is not None:
    for line in output.summary():
      print(line, file=sys.stderr, flush=True)
    others = len(processes) - 1
    why = (" (a step waited past the stall timeout: its message names the "
           "process that stopped)" if status == STALLED_STATUS else "")
    print(f"launch: process {failed_rank} of {len(processes)} failed "
          f"with status {status}{why}; stopped the other {others}", file=sys.stderr,
          flush=True)
  return status


def _settled(first: int, exits: queue.Queue, output: _Output) -> int:
  """The failure to name, once the others within :data:`SETTLE_SECONDS` have come.

  Every process's output is held meanwhile; the named one's is then written.
  """
  with output.lock:
    output.failed = _Output.HOLDING
  failures, deadline = [first], time.monotonic() + SETTLE_SECONDS
  while (left := deadline - time.monotonic()) > 0:
    try:
      rank, returncode = exits.get(timeout=left)
    except queue.Empty:
      break
    if returncode:
      failures.append(rank)
  named = named_failure(failures, output.lost_a_peer)
  output.name(named)
  return named


class _Stopped(Exception):
  """The launcher got a signal that stops the whole job."""

  def __init__(self, number: int):
    super().__init__(f"signal {number}")
    self.signal = number


def _stop_on_signals() -> dict[int, object]:
  """Turns SIGTERM, SIGINT and SIGHUP into :class:`_Stopped`; the old handlers."""
  def handler(number, frame):
    del frame
    raise _Stopped(number)

  previous = {}
  if threading.current_thread() is threading.main_thread():
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
      previous[number] = signal.signal(number, handler)
  return previous


def _status(returncode: int) -> int:
  """An exit status: a process killed by signal N counts as 128 + N."""
  return 128 - returncode if returncode < 0 else returncode
