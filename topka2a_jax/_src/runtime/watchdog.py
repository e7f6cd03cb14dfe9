"""Ending a multi-process job whose step waits on a process that stopped.

A process that hangs while staying alive (a deadlock, a stuck data loader, a
``time.sleep`` in the wrong place) keeps sending JAX's coordination
heartbeats, so ``heartbeat_timeout_seconds`` never fires; its peers wait in
the step's collectives for it, and neither gloo (through JAX) nor NCCL
(``xla_gpu_nccl_termination_timeout_seconds`` is off by default, and it
does not cover a peer that never enters the collective) ends the wait. The
whole job would hold its machines until someone kills it.

:class:`StallWatch` watches the steps from the host: every training step
(:func:`topka2a_jax.train_step`, :func:`topka2a_jax.nnx_train_step`, or a
user's own step through :func:`watch`) hands it the step's loss right after
dispatch, and a thread polls whether it is ready. Only the time a step runs
counts, from its dispatch or, for a step queued behind others by JAX's
asynchronous dispatch, from the moment the one before it finished:
compiling, evaluating and saving between steps do not. A step that runs
longer than the timeout ends this process with
:data:`STALLED_STATUS` and a message that names the processes that
dispatched fewer steps (through JAX's coordination key-value store, which
every process's watch writes its count to), since those are the ones that
stopped making progress.

Example:
  >>> watch(jax.numpy.zeros(()))  # no watch armed: nothing happens
"""

from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import time
from typing import Any

import jax

from topka2a_jax._src.runtime.contract import STALLED_STATUS

DEFAULT_STALL_SECONDS = 600
"""The stall timeout :func:`topka2a_jax.distributed.initialize` arms by
default: ten minutes, as PyTorch's NCCL watchdog. A step that waits longer
has lost a peer; a slower peer that catches up inside it is no stall."""

POLL_SECONDS = 1.0
"""How often the watch looks at the oldest step still in flight."""

STOP_SECONDS = 30.0
"""How long a finishing process waits for the watch's last call into the
runtime (a readiness check, a store write) to return."""

_KEY = "topka2a_jax/steps/"
"""The coordination store's directory of every process's dispatched steps."""


class StallWatch:
  """Polls the steps in flight; ends the process on one that waits too long.

  The watch stops when the interpreter begins to exit, before JAX's own
  clean-up: a thread that is inside a runtime call (a readiness check, a
  store write) when the interpreter finalizes is unwound by it, and the
  runtime's C++ turns that into an abort (status 134) of a process that had
  finished its work.

  Args:
    timeout: seconds a dispatched step may wait before it counts as stalled.
    rank: this process's index, for the message.
    store: JAX's coordination client (``key_value_set``,
      ``key_value_dir_get``), to name the process that fell behind; None
      names none.
  """

  def __init__(self, timeout: float, rank: int, store: Any = None):
    self._timeout, self._rank, self._store = timeout, rank, store
    self._lock = threading.Lock()
    self._in_flight: collections.deque = collections.deque()  # (step, since, loss)
    self._dispatched = 0
    self._published: int | None = None  # so that the first poll publishes 0
    self._stopping = threading.Event()
    self._thread = threading.Thread(target=self._run, name="topka2a-stall-watch",
                                    daemon=True)
    self._thread.start()
    # After JAX's exit handlers in registration order, so before them at exit.
    atexit.register(self.stop)

  def stop(self) -> None:
    """Ends the polling, waits (up to :data:`STOP_SECONDS`) for its last call, and
    publishes the final count, so that a peer's stall message counts every step
    this process dispatched before it ended."""
    self._stopping.set()
    if self._thread is not threading.current_thread():
      self._thread.join(STOP_SECONDS)
      if not self._thread.is_alive():
        with self._lock:
          dispatched = self._dispatched
        if dispatched != self._published:
          self._publish(dispatched)

  def dispatched(self, loss: jax.Array) -> None:
    """Notes one dispatched step, whose ``loss`` is ready when it has finished."""
    with self._lock:
      self._dispatched += 1
      self._in_flight.append((self._dispatched, time.monotonic(), loss))

  def _run(self) -> None:
    finished = float("-inf")  # when the watch saw the last finished step
    while not self._stopping.wait(POLL_SECONDS):
      with self._lock:
        while self._in_flight and _done(self._in_flight[0][2]):
          self._in_flight.popleft()
          finished = time.monotonic()
        oldest = self._in_flight[0][:2] if self._in_flight else None
        dispatched = self._dispatched
      if dispatched != self._published:
        self._publish(dispatched)
      if oldest is None:
        continue
      # A step queued behind others (asynchronous dispatch) starts to run
      # when the one before it finishes, not when it was dispatched.
      waited = time.monotonic() - max(oldest[1], finished)
      if waited > self._timeout:
        print(stall_message(oldest[0], waited, self._peers()),
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(STALLED_STATUS)

  def _publish(self, dispatched: int) -> None:
    if self._store is None:
      return
    try:
      self._store.key_value_set(f"{_KEY}{self._rank}", str(dispatched),
                                allow_overwrite=True)
      self._published = dispatched
    except Exception:  # noqa: BLE001 (the store is only there to name peers)
      self._store = None

  def _peers(self) -> dict[int, int]:
    """Every process's dispatched steps, as the store last heard them.

    Every watch publishes its count from the moment it is armed, so a
    process the store has not heard from has dispatched no step yet (its
    first compile, or its data loader, is slow) and counts 0.
    """
    if self._store is None:
      return {}
    try:
      entries = self._store.key_value_dir_get(_KEY)
    except Exception:  # noqa: BLE001
      return {}
    heard = {int(key.rsplit("/", 1)[1]): int(value) for key, value in entries}
    return {rank: heard.get(rank, 0) for rank in range(max(jax.process_count(), *heard, 0))}


def _done(loss: jax.Array) -> bool:
  """Whether the step of ``loss`` has finished (a deleted array has)."""
  try:
    return loss.is_ready()
  except RuntimeError:
    return True


def stall_message(step: int, waited: float, peers: dict[int, int]) -> str:
  """What a process says when it ends on a stall.

  Args:
    step: the number of the step that waited (this process's count).
    waited: seconds it waited.
    peers: every process's count of dispatched steps, rank -> count.

  Example:
    >>> print(stall_message(13, 61.0, {0: 13, 1: 12}))  # doctest: +ELLIPSIS
    topka2a_jax: step 13 waited 61 s ... process 1 stopped making progress ...
  """
  head = (f"topka2a_jax: step {step} waited {waited:.0f} s for its collectives, "
          f"past the stall timeout; ")
  behind = sorted(rank for rank, count in peers.items() if count < step)
  if behind:
    counts = ", ".join(f"process {rank} dispatched {peers[rank]}" for rank in behind)
    names = ", ".join(str(rank) for rank in behind)
    return (head + f"process {names} stopped making progress ({counts} steps "
            f"while this one reached {step}). Ending this process with status "
            f"{STALLED_STATUS}; raise initialize(stall_timeout_seconds=...) if a "
            f"process may lag this far behind the others.")
  return (head + "no process is behind in its count of steps, so either this "
          "step's computation takes longer than the timeout (raise "
          "initialize(stall_timeout_seconds=...) above its longest step) or a "
          "collective itself hangs (a device or link fault, or processes that "
          f"dispatch different programs). Ending this process with status "
          f"{STALLED_STATUS}.")


_WATCH: StallWatch | None = None


def arm(timeout: float, rank: int, store: Any = None) -> StallWatch:
  """Starts the process's one watch (replacing none); :func:`watch` feeds it."""
  global _WATCH
  if _WATCH is None:
    _WATCH = StallWatch(timeout, rank, store)
  return _WATCH


def watch(loss: Any) -> None:
  """Hands the stall watch one step, by an output ready when the step is done.

  The library's training steps call it; a hand-written step calls it with
  its loss (any array the step computes) after each call. Without
  :func:`topka2a_jax.distributed.initialize`'s watch armed, it does nothing.

  Args:
    loss: an array of the step's outputs (other values are ignored).
  """
  if _WATCH is not None and isinstance(loss, jax.Array):
    _WATCH.dispatched(loss)
