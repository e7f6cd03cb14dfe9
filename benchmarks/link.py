"""The link benchmarks' harness: a shaped network namespace, its worker processes, a timer.

``network.py``, ``network_step.py``, ``network_training.py``,
``network_nodes.py`` and ``overlap.py`` share it. A shaped namespace's
loopback is a token bucket at a rate (``tc``'s ``tbf``; optionally netem's
added delay); ``run_workers`` starts P processes inside it with
``topka2a-launch`` (one CPU device each, gloo collectives over TCP), and
``timed`` takes the median of runs started together on every process.

Needs root (or CAP_NET_ADMIN) for ``ip netns`` and ``tc``; where either is
missing :class:`NetworkUnavailable` says so, and nothing is left behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class NetworkUnavailable(RuntimeError):
  """Namespaces or traffic control are not permitted here."""


def checked(*command: str) -> None:
  """Runs ``command``; its failure raises :class:`NetworkUnavailable` with its message."""
  done = subprocess.run(command, capture_output=True, text=True, check=False)
  if done.returncode:
    raise NetworkUnavailable(f"`{' '.join(command)}` failed: "
                             f"{(done.stderr or done.stdout).strip()}")


class ShapedNamespace:
  """A network namespace whose loopback carries ``rate`` with ``delay_ms``."""

  def __init__(self, rate: str, delay_ms: float):
    self.name = f"topka2a-bench-{os.getpid()}"
    self.rate, self.delay_ms = rate, delay_ms
    self.made = False

  def __enter__(self) -> ShapedNamespace:  # noqa: PYI034
    for tool in ("ip", "tc"):
      if shutil.which(tool) is None:
        raise NetworkUnavailable(f"`{tool}` is not installed (package iproute2)")
    try:
      checked("ip", "netns", "add", self.name)
      self.made = True
      checked("ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up")
      tc = ["ip", "netns", "exec", self.name, "tc", "qdisc", "add", "dev", "lo"]
      # A token bucket at the rate; its burst must hold a 64 KiB loopback frame.
      checked(*tc, "root", "handle", "1:", "tbf", "rate", self.rate, "burst", "256kb",
           "latency", "200ms")
      if self.delay_ms:  # needs the sch_netem kernel module
        checked(*tc, "parent", "1:1", "handle", "10:", "netem", "delay",
             f"{self.delay_ms}ms", "limit", "100000")
    except NetworkUnavailable:
      self.__exit__()
      raise
    return self

  def __exit__(self, *exc_info) -> None:
    if self.made:
      subprocess.run(["ip", "netns", "del", self.name], check=False)
      self.made = False

  def command(self, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", self.name, *argv]


def run_workers(rate: str, delay_ms: float, processes: int, script: str,
                *worker_args: str) -> int:
  """Runs ``script --worker ...`` on ``processes`` processes in a shaped namespace.

  Returns the launcher's status, or 2 (after saying why) where no shaped
  namespace can be made here; the namespace is removed either way.
  """
  try:
    with ShapedNamespace(rate, delay_ms) as namespace:
      launch = namespace.command(sys.executable, "-m", "topka2a_jax.tools.launch", "-n",
                                 str(processes), script, "--worker", *worker_args)
      status = subprocess.run(launch, cwd=ROOT, check=False).returncode
  except NetworkUnavailable as error:
    print(f"cannot make a shaped network namespace here: {error}. It needs "
          "root (or CAP_NET_ADMIN) and the kernel's tbf qdisc (netem too for "
          "a delay); nothing was left behind.", file=sys.stderr)
    return 2
  if status:
    print(f"the worker processes failed (status {status})", file=sys.stderr)
  return status



def timed(run, *args, repeats: int, label: str) -> float:
  """Median seconds of ``run(*args)`` after a warm-up, started together everywhere."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  jax.block_until_ready(run(*args))  # compile and warm up
  seconds = []
  for _ in range(repeats):
    multihost_utils.sync_global_devices(label)
    start = time.perf_counter()
    jax.block_until_ready(run(*args))
    seconds.append(time.perf_counter() - start)
  return float(np.median(seconds))
