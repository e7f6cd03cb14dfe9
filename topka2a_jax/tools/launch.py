"""Starts N local JAX processes on one script, as a multi-host job would.

Usage (``topka2a-launch`` is installed with the package; ``python -m
topka2a_jax.tools.launch`` runs the same)::

  topka2a-launch -n 4 [--devices-per-process 2] SCRIPT [ARGS...]

What the processes get and how a failure ends the job:
:func:`topka2a_jax.distributed.launch`.

Example::

  $ topka2a-launch -n 2 --devices-per-process 2 train.py --steps 5
  [0] 4 devices in 2 processes
  [1] 4 devices in 2 processes
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from topka2a_jax.distributed import launch


def main(argv: Sequence[str] | None = None) -> int:
  """Starts the processes of ``argv`` (the command line's by default); their status.

  Example:
    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
    ...   _ = script.write("print('hello')")
    >>> main(["-n", "1", script.name])
    [0] hello
    0
  """
  parser = argparse.ArgumentParser(
      prog="topka2a-launch",
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
