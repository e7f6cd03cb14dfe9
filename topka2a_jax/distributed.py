"""Joining JAX's multi-process runtime, locally or on a cluster.

JAX's multi-controller runtime (``jax.distributed``) runs one process per
host (or per group of devices); the mesh then spans every process's devices
and the collectives cross processes: NCCL on GPUs, gloo over TCP on CPUs.
:func:`initialize` is the one call a training script makes first. It reads
the coordinator, process count and rank that ``python -m topka2a_jax.launch``
sets, or else leaves them to JAX's own detection (SLURM, Open MPI,
Kubernetes and cloud TPU environments), or to the standard variables
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``.

Example:
  >>> import topka2a_jax.distributed
  >>> topka2a_jax.distributed.initialize()  # before any other JAX call
  >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
"""

from __future__ import annotations

import os

import jax

COORDINATOR = "TOPKA2A_COORDINATOR"
NUM_PROCESSES = "TOPKA2A_NUM_PROCESSES"
PROCESS_ID = "TOPKA2A_PROCESS_ID"


def launched() -> bool:
  """Whether this process was started by ``python -m topka2a_jax.launch``."""
  return COORDINATOR in os.environ


def initialize() -> None:
  """Joins the multi-process runtime; call it before any other JAX call.

  CPU collectives across processes use gloo (JAX's default CPU client has
  none); GPUs keep NCCL. Outside the launcher, with no cluster to detect and
  no ``JAX_COORDINATOR_ADDRESS``, call it only when you mean to run several
  processes: ``jax.distributed.initialize`` then raises.

  Raises:
    ValueError: the launcher's variables are malformed.

  Example:
    >>> initialize()
    >>> jax.process_count()
    4
  """
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if not launched():
    jax.distributed.initialize()
    return
  try:
    num_processes = int(os.environ[NUM_PROCESSES])
    process_id = int(os.environ[PROCESS_ID])
  except (KeyError, ValueError) as error:
    raise ValueError(
        f"{COORDINATOR} is set, but {NUM_PROCESSES} and {PROCESS_ID} must be "
        f"integers too ({error}); start the script with python -m "
        "topka2a_jax.launch, or unset them") from None
  jax.distributed.initialize(coordinator_address=os.environ[COORDINATOR],
                             num_processes=num_processes, process_id=process_id)
