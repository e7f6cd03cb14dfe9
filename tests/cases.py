"""Gradients for the tests, and reading residuals back per device."""


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
