"""Exchanges that run on a stream of their own, which other collectives must not meet.

With ``local_steps(..., overlap=...)`` each round's exchange runs from the
training step's exchange thread (:mod:`topka2a_jax._src.training.overlap`).
Across processes, two streams' collectives can be paired with the wrong
peers (Gloo matches them in the order each process issues them), so a
collective on the caller's stream (a checkpoint's barrier, a
``multihost_utils`` call, an evaluation over sharded data) must not run
while one is in flight. :func:`settle` waits for every exchange in flight
to end; the checkpoints call it before their own collectives, and a user's
code calls ``step.settle()`` before its own.

Example:
  >>> settle()  # nothing in flight: returns at once
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol


class Settles(Protocol):
  """What holds exchanges in flight: it can wait for them to end."""

  def settle(self) -> None:
    """Returns once every exchange it dispatched has ended."""


_HOLDERS: weakref.WeakSet = weakref.WeakSet()
_LOCK = threading.Lock()


def register(holder: Settles) -> None:
  """Registers ``holder``, whose exchanges :func:`settle` will wait for (held weakly)."""
  with _LOCK:
    _HOLDERS.add(holder)


def settle() -> None:
  """Waits until no registered exchange is in flight."""
  with _LOCK:
    holders = list(_HOLDERS)
  for holder in holders:
    holder.settle()
