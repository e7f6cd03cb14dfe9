"""Several processes (hosts): joining JAX's runtime, and a launcher for one machine.

A script calls :func:`initialize` before any other JAX call. It reads the
coordinator, process count and rank from the variables :func:`launch` sets
(:data:`COORDINATOR`, :data:`NUM_PROCESSES`, :data:`PROCESS_ID`) or from a
cluster's own (SLURM, Open MPI, Kubernetes, through
``jax.distributed.initialize``), and ends the process at once when it raises,
so that the others stop instead of waiting on it; a step that waits past
the stall timeout on a process that hangs alive ends the job too
(:data:`STALLED_STATUS`; a hand-written step hands its loss to
:func:`watch`). :func:`launch` starts N
processes of one script on this machine, stops them all when one fails, and
names it (the command line: ``topka2a-launch -n N SCRIPT``).

Example:
  >>> import topka2a_jax.distributed
  >>> topka2a_jax.distributed.initialize()  # doctest: +SKIP
"""

from typing import TYPE_CHECKING

from topka2a_jax._src import lazy as _lazy

if TYPE_CHECKING:  # the namespace; at run time each name is imported on first use
  from topka2a_jax._src.runtime import contract as _contract
  from topka2a_jax._src.runtime.distributed import initialize
  from topka2a_jax._src.runtime.launch import launch
  from topka2a_jax._src.runtime.watchdog import watch

  COORDINATOR = _contract.COORDINATOR
  """The environment variable with process 0's ``host:port``, set by :func:`launch`."""

  NUM_PROCESSES = _contract.NUM_PROCESSES
  """The environment variable with the number of processes, set by :func:`launch`."""

  PROCESS_ID = _contract.PROCESS_ID
  """The environment variable with this process's rank, set by :func:`launch`."""

  STALLED_STATUS = _contract.STALLED_STATUS
  """The exit status (124) of a process whose training step waited past
  ``initialize(stall_timeout_seconds=...)`` for a peer that stopped."""

_LAZY = {  # each name, its module (":attribute" where the name differs); the
    # block above says the same to type checkers, and tests/test_package.py
    # holds the two equal
    "initialize": "topka2a_jax._src.runtime.distributed",
    "launch": "topka2a_jax._src.runtime.launch",
    "watch": "topka2a_jax._src.runtime.watchdog",
    "COORDINATOR": "topka2a_jax._src.runtime.contract",
    "NUM_PROCESSES": "topka2a_jax._src.runtime.contract",
    "PROCESS_ID": "topka2a_jax._src.runtime.contract",
    "STALLED_STATUS": "topka2a_jax._src.runtime.contract",
}

__all__ = ["COORDINATOR", "NUM_PROCESSES", "PROCESS_ID", "STALLED_STATUS", "initialize",
           "launch", "watch"]

__getattr__, __dir__ = _lazy.attach(__name__, _LAZY)
del _lazy  # help() lists the face's names, not the loader
