"""What the launcher and the processes it starts agree on: variables and an exit status.

:func:`topka2a_jax.distributed.launch` hands each process its coordinator,
process count and rank in three environment variables, which
:func:`topka2a_jax.distributed.initialize` reads; a process whose step
waited past the stall timeout ends with :data:`STALLED_STATUS`, which the
launcher names. This module imports nothing but the standard library, so
``topka2a-launch`` starts without importing JAX.

Example:
  >>> COORDINATOR, STALLED_STATUS
  ('TOPKA2A_COORDINATOR', 124)
"""

COORDINATOR = "TOPKA2A_COORDINATOR"
"""The environment variable with process 0's ``host:port``."""

NUM_PROCESSES = "TOPKA2A_NUM_PROCESSES"
"""The environment variable with the number of processes."""

PROCESS_ID = "TOPKA2A_PROCESS_ID"
"""The environment variable with this process's rank."""

STALLED_STATUS = 124
"""The exit status of a process whose step waited past the stall timeout
(``timeout``'s own)."""
