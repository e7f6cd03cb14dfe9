"""Gradients for the tests, reading residuals back per device, a killed job's step claim,
NNX training against the functional step."""

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


def nnx_against_functional(make_tx, mesh, steps, wrap=lambda train: train):
  """Trains a small NNX model through ``nnx.Optimizer`` and ``nnx_train_step`` (inside
  ``wrap``) and its split parameters through ``train_step``, from the same batches;
  asserts every step's loss and the final parameters equal, bitwise.

  Returns ``(model, optimizer, train, state, batch)``: the NNX run, its step and
  the functional run's optimizer state after the last ``batch``.
  """
  import chex
  import jax.numpy as jnp
  from flax import nnx

  import topka2a_jax

  def make():
    return nnx.Sequential(nnx.Linear(64, 48, rngs=nnx.Rngs(0)), nnx.relu,
                          nnx.Linear(48, 8, rngs=nnx.Rngs(1)))

  def loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)

  model = make()
  optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
  train = wrap(topka2a_jax.nnx_train_step(loss, mesh))
  graphdef, params = nnx.split(make())
  functional_tx = make_tx()
  state = functional_tx.init(params)
  functional = topka2a_jax.train_step(
      lambda p, batch: loss(nnx.merge(graphdef, p), batch), functional_tx, mesh)
  rng = np.random.default_rng(0)
  for _ in range(steps):
    batch = (rng.normal(size=(32, 64)).astype(np.float32),
             rng.normal(size=(32, 8)).astype(np.float32))
    got = train(model, optimizer, batch)
    params, state, want = functional(params, state, batch)
    np.testing.assert_array_equal(got, want)
  chex.assert_trees_all_equal(nnx.as_pure(nnx.state(model, nnx.Param)), nnx.as_pure(params))
  return model, optimizer, train, state, batch
