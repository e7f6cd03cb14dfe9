"""An evaluation job: polls a training job's checkpoint root until told to stop.

Run by tests/test_checkpoint.py beside a job that saves, as a user's
evaluation loop runs beside training:

  python tests/checkpoint_reader.py ROOT STOP_FILE [read-only]

Every 0.2 s it builds a ``topka2a_jax.CheckpointManager`` on ROOT (read-only
with the third argument, as the checkpoints guide recommends; a plain one
without, as most evaluation loops are first written), asks for the latest
step and restores it. It writes ``ROOT.ready`` once it polls, stops once
STOP_FILE exists, and prints how many polls it made.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

import topka2a_jax

ENTRIES = 1 << 20
"""The saving job's array: ``{"w": float32[ENTRIES]}``."""


def main(root: Path, stop: Path, read_only: bool) -> None:
  mesh = jax.make_mesh((2,), ("data",))
  like = {"w": jnp.zeros((ENTRIES,), jnp.float32)}
  options = {"read_only": True} if read_only else {}
  polls = 0
  while not stop.exists():
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # a step not sealed yet restores with a warning
      with topka2a_jax.CheckpointManager(root, mesh, **options) as manager:
        latest = manager.latest_step()
        if latest is not None:
          manager.restore(like, latest)
    polls += 1
    Path(f"{root}.ready").touch()
    time.sleep(0.2)
  print(f"polls {polls}")


if __name__ == "__main__":
  main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:] == ["read-only"])
