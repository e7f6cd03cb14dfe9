"""Joining JAX's multi-process runtime, locally or on a cluster.

JAX's multi-controller runtime (``jax.distributed``) runs one process per
host (or per group of devices); the mesh then spans every process's devices
and the collectives cross processes: NCCL on GPUs, gloo over TCP on CPUs.
:func:`initialize` is the one call a training script makes first. It reads
the coordinator, process count and rank that ``topka2a-launch``
sets, or else ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
``JAX_PROCESS_ID`` (set them on each host of a cluster), or else leaves them
to JAX's own detection (SLURM, Open MPI, Kubernetes and cloud TPU
environments).

Example (in a script that ``topka2a-launch`` or a cluster
starts once per process; it cannot run in an interactive session that has
already used JAX):

  >>> import topka2a_jax.distributed
  >>> topka2a_jax.distributed.initialize()  # doctest: +SKIP
  >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))  # every process's
"""

from __future__ import annotations

import numbers
import os
import sys
import threading
import warnings
from typing import Any

import jax

from topka2a_jax._src.runtime import watchdog
from topka2a_jax._src.runtime.contract import COORDINATOR, NUM_PROCESSES, PROCESS_ID

VARIABLES = (
    (COORDINATOR, NUM_PROCESSES, PROCESS_ID),
    ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"),
)
"""Where :func:`initialize` looks, in order: the launcher's, then per host."""


def launched() -> bool:
  """Whether this process was started by ``topka2a-launch``."""
  return COORDINATOR in os.environ


def from_environment() -> tuple[str, int, int] | None:
  """Coordinator address, process count and rank, if the environment sets them.

  Returns:
    The first complete set of :data:`VARIABLES`, or None when neither is set
    completely (JAX's cluster detection then applies).

  Raises:
    ValueError: the process count or rank is not an integer.

  Example:
    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, JAX_COORDINATOR_ADDRESS="host0:1234",
    ...                      JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1"):
    ...   print(from_environment())
    ('host0:1234', 2, 1)
  """
  for names in VARIABLES:
    if all(name in os.environ for name in names):
      address, count, rank = (os.environ[name] for name in names)
      try:
        return address, int(count), int(rank)
      except ValueError:
        raise ValueError(
            f"{names[1]}={count!r} and {names[2]}={rank!r} must be integers "
            f"(the process count and this process's rank)") from None
  return None


FAILED_STATUS = 1
"""The exit status of a process that :func:`initialize` ends on an uncaught
exception (Python's own for one)."""


def _exit_at_once(previous):
  """An excepthook: ``previous`` prints the traceback, then the process ends.

  Without it, an uncaught exception after ``jax.distributed.initialize``
  runs JAX's shutdown at exit, a barrier that waits (5 minutes by default)
  for the peers, which meanwhile wait in a collective for this process: the
  whole job hangs, then aborts with another status.
  """
  def hook(kind, value, traceback):
    previous(kind, value, traceback)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(FAILED_STATUS)

  return hook


def _exit_at_once_on_failure(previous):
  """A ``sys.exit``: a failing status (not 0 or None) ends the process at once.

  ``sys.exit(n)`` raises SystemExit, which no excepthook sees; at exit JAX's
  shutdown barrier would then wait for peers that wait for this process.
  A status of 0 (or None) is a process that finished: it waits for the
  others at the barrier, as it should. In threads other than the main one
  ``sys.exit`` ends only the thread, as always.
  """
  def exit(status=None):
    if status in (None, 0) or threading.current_thread() is not threading.main_thread():
      previous(status)
    if not isinstance(status, int):
      print(status, file=sys.stderr)
      status = FAILED_STATUS
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

  return exit


def coordination_client() -> Any:
  """JAX's coordination client (its key-value store), or None where JAX hides it.

  JAX offers no public route to it; the stall watch reads it from
  ``jax._src.distributed``. ``tests/test_multiprocess.py`` holds that it is
  there, so that a JAX release that moves it fails a test.
  """
  try:
    from jax._src import distributed as jax_distributed
  except ImportError:
    return None
  return getattr(getattr(jax_distributed, "global_state", None), "client", None)


def arm_stall_watch(timeout_seconds: float, client: Any) -> bool:
  """Starts the stall watch on ``client``; without one, warns that it is off.

  Returns:
    Whether the watch runs.
  """
  if client is None:
    warnings.warn(
        "the stall watch is off: this JAX does not expose its coordination "
        "client (jax._src.distributed.global_state.client), which the watch "
        "uses to name the processes behind. Training goes on without it; pass "
        "stall_timeout_seconds=None to silence this.", RuntimeWarning, stacklevel=3)
    return False
  watchdog.arm(timeout_seconds, _process_id(), client)
  return True


def _process_id() -> int:
  """This process's rank as ``jax.distributed.initialize`` recorded it.

  ``jax.process_index()`` would start JAX's backends, which a program may
  still mean to configure after :func:`initialize` (replace the CPU backend's
  factory, for one); ``jax.distributed.initialize`` itself starts none.
  """
  from jax._src import distributed as jax_distributed

  return jax_distributed.global_state.process_id


def initialize(*, fail_fast: bool = True,
               heartbeat_timeout_seconds: int | None = None,
               shutdown_timeout_seconds: int | None = None,
               stall_timeout_seconds: float | None = watchdog.DEFAULT_STALL_SECONDS,
               ) -> None:
  """Joins the multi-process runtime; call it before any other JAX call.

  CPU collectives across processes use gloo (JAX's default CPU client has
  none); GPUs keep NCCL. With nothing in the environment and no cluster to
  detect, ``jax.distributed.initialize`` raises: call this only when you
  mean to run several processes.

  Args:
    fail_fast: an uncaught exception ends this process at once, with status
      :data:`FAILED_STATUS` after its traceback, instead of waiting in JAX's
      shutdown barrier for peers that wait for it. Then
      ``topka2a-launch`` stops the others within seconds and
      names the failed rank; under another launcher (SLURM, torchrun-style),
      the peers stop when JAX's coordination service misses this process's
      heartbeats, after ``heartbeat_timeout_seconds``. So does
      ``sys.exit(n)`` with a failing status (``n`` not 0 or None), with
      status ``n``; ``sys.exit()`` and ``sys.exit(0)`` wait for the peers
      at JAX's shutdown barrier, as a finished process should. (``raise
      SystemExit(n)`` bypasses ``sys.exit``: it runs the barrier.)
    heartbeat_timeout_seconds: seconds after which the coordination service
      counts a silent process as dead and stops the job (JAX's default:
      100). Lower it to end a job whose process died (killed, out of memory)
      sooner.
    shutdown_timeout_seconds: how long a finishing process waits at exit for
      the others to finish (JAX's default: 300).
    stall_timeout_seconds: how long a dispatched training step may wait for
      its collectives before this process ends with status
      :data:`topka2a_jax.distributed.STALLED_STATUS` (124),
      naming the processes that dispatched fewer steps. This catches what
      the heartbeat cannot: a process that hangs alive (a deadlock, a stuck
      loader), whose peers would wait in the collective for ever. Only the
      time a step waits counts, not compiling, evaluating or saving between
      steps; the steps are those of :func:`topka2a_jax.train_step`,
      :func:`topka2a_jax.nnx_train_step` and any hand-written step given to
      :func:`topka2a_jax.distributed.watch`. None turns the watch off.
      Default: 600 s.

  Raises:
    ValueError: the process count or rank in the environment is malformed,
      or ``stall_timeout_seconds`` is not a positive number.

  Example:
    >>> initialize(heartbeat_timeout_seconds=20)  # doctest: +SKIP
    >>> jax.process_count()  # doctest: +SKIP
    4
  """
  if stall_timeout_seconds is not None and (
      isinstance(stall_timeout_seconds, bool)
      or not isinstance(stall_timeout_seconds, numbers.Real)
      or not stall_timeout_seconds > 0):
    raise ValueError(f"stall_timeout_seconds={stall_timeout_seconds!r} must be a "
                     f"positive number of seconds, or None to turn the watch off")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  timeouts = {name: value for name, value in (
      ("heartbeat_timeout_seconds", heartbeat_timeout_seconds),
      ("shutdown_timeout_seconds", shutdown_timeout_seconds)) if value is not None}
  settings = from_environment()
  if settings is None:
    jax.distributed.initialize(**timeouts)
  else:
    address, num_processes, process_id = settings
    jax.distributed.initialize(coordinator_address=address,
                               num_processes=num_processes, process_id=process_id,
                               **timeouts)
  if stall_timeout_seconds is not None:
    arm_stall_watch(stall_timeout_seconds, coordination_client())
  if fail_fast:
    sys.excepthook = _exit_at_once(sys.excepthook)
    sys.exit = _exit_at_once_on_failure(sys.exit)
