"""Starts N local JAX processes on one script, as a multi-host job would.

Usage::

  python -m topka2a_jax.launch -n 4 [--devices-per-process 2] SCRIPT [ARGS...]

Every process runs ``SCRIPT ARGS`` with a loopback coordinator, its rank and
the process count in the environment (read by
:func:`topka2a_jax.distributed.initialize`), ``devices-per-process`` emulated
CPU devices, and gloo collectives over TCP. Output lines are forwarded with a
``[rank]`` prefix. When a process fails the others are stopped, and the
launcher exits with the failing process's status; it exits 0 when all
succeed.

Example:
  $ python -m topka2a_jax.launch -n 2 --devices-per-process 2 train.py --steps 5
  [0] 4 devices in 2 processes
  [1] 4 devices in 2 processes
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from topka2a_jax.distributed import COORDINATOR, NUM_PROCESSES, PROCESS_ID

GRACE_SECONDS = 5.0
"""How long a stopped process gets to exit before it is killed."""


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


def _forward(rank: int, stream, lock: threading.Lock) -> None:
  for line in stream:
    with lock:
      sys.stdout.write(f"[{rank}] {line}")
      sys.stdout.flush()


def _stop(processes: Sequence[subprocess.Popen]) -> None:
  for process in processes:
    if process.poll() is None:
      process.send_signal(signal.SIGTERM)
  deadline = time.monotonic() + GRACE_SECONDS
  for process in processes:
    try:
      process.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()


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
    0 when every process succeeded, else the first failure's status (a
    process killed by a signal counts as 128 + the signal number).

  Example:
    >>> launch([sys.executable, "-c", "pass"], 2, 1)
    0
  """
  port = free_port()
  lock = threading.Lock()
  processes, readers = [], []
  try:
    for rank in range(num_processes):
      prefix = list(prefixes[rank]) if prefixes else []
      process = subprocess.Popen(
          [*prefix, *command],
          env=process_env(rank, num_processes, devices_per_process, port, host),
          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      processes.append(process)
      reader = threading.Thread(target=_forward, args=(rank, process.stdout, lock),
                                daemon=True)
      reader.start()
      readers.append(reader)
    status = 0
    while status == 0 and any(p.poll() is None for p in processes):
      failed = [p.returncode for p in processes if p.poll() not in (None, 0)]
      status = failed[0] if failed else 0
      time.sleep(0.05)
    if status == 0:
      status = next((p.returncode for p in processes if p.returncode), 0)
  except KeyboardInterrupt:
    status = 128 + signal.SIGINT
  finally:
    _stop(processes)
    for reader in readers:
      reader.join(timeout=GRACE_SECONDS)
  return 128 - status if status < 0 else status


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m topka2a_jax.launch",
      description="Start N local JAX processes (gloo collectives over loopback) "
                  "on one script; the script calls topka2a_jax.distributed.initialize().")
  parser.add_argument("-n", "--num-processes", type=int, required=True)
  parser.add_argument("--devices-per-process", type=int, default=1,
                      help="emulated CPU devices in each process (default 1)")
  parser.add_argument("script", help="the Python script every process runs")
  parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
  options = parser.parse_args(argv)
  if options.num_processes < 1 or options.devices_per_process < 1:
    parser.error("-n and --devices-per-process must be at least 1")
  if not os.path.isfile(options.script):
    parser.error(f"no such script: {options.script}")
  return launch([sys.executable, options.script, *options.args],
                options.num_processes, options.devices_per_process)


if __name__ == "__main__":
  sys.exit(main())
