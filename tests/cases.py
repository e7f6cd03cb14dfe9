"""Gradients for the tests, reading residuals back per device, a killed job's step claim."""

import subprocess
import sys

import numpy as np
import optax

LAUNCHER = ("-m", "topka2a_jax.tools.launch")
"""The local launcher's command line: ``[sys.executable, *LAUNCHER, "-n", N, ...]``."""

SHAPES = {"a": (3, 50), "b": (130,), "c": (2, 2, 30)}


def random_grads(seed, shapes=SHAPES, dtype=np.float32, devices=8):
  """Per-device gradients: each leaf ``(devices, *shape)``, row i device i's."""
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=(devices, *s)).astype(dtype) for k, s in shapes.items()}


def residuals_of(state, devices=8):
  """The per-device residuals of a chain's first state, as (devices, n) arrays."""
  return {k: np.asarray(v).reshape(devices, -1)
          for k, v in state[0].residuals.items()
          if not isinstance(v, optax.MaskedNode)}


def claimed_by_a_process_that_ended(root, step=1):
  """The claim on ``step`` that a job killed during its save leaves, made by its own process.

  Returns:
    The claim's path, ``root/.topka2a_claims/<step>``.
  """
  program = ("import sys; from pathlib import Path; "
             "from topka2a_jax._src.checkpointing import step_claims; "
             f"assert step_claims.claim(Path(sys.argv[1]), {step}, 'killed') is None")
  subprocess.run([sys.executable, "-c", program, str(root)], check=True)
  return root / ".topka2a_claims" / str(step)
