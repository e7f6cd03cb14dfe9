"""Shared set-up: 8 emulated CPU devices, the mesh, and the two step builders.

Every test that runs the transform goes through one of two fixtures:

* ``exchange_steps(tx, mesh, grads_per_step)``: ``tx.update`` alone, on
  given per-device gradients, in a ``shard_map`` over ``"data"`` (the
  transform as a hand-written step calls it);
* ``train_steps(tx, mesh, loss_fn, params, batches, **options)``: whole
  training steps through :func:`topka2a_jax.train_step`.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax

NUM_DEVICES = 8


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
  """The quick subset (``-m "not slow"``) runs each test once, with its first parameters.

  Every later parameter set of a test is marked slow, so the full suite runs
  them all; the docstring examples (``test_docs.py``, one case per module)
  all stay quick.
  """
  seen = set()
  for item in items:
    test = item.nodeid.split("[")[0]
    if test in seen and not item.nodeid.startswith("tests/test_docs.py"):
      item.add_marker(pytest.mark.slow)
    seen.add(test)


@pytest.fixture(scope="session")
def mesh():
  """All 8 devices on one data-parallel axis, "data"."""
  assert jax.device_count() == NUM_DEVICES, "XLA_FLAGS were set too late"
  return jax.make_mesh((NUM_DEVICES,), ("data",))


def _exchange_steps(tx, mesh, grads_per_step, state=None):
  """Applies ``tx.update`` on every device for each step's stacked gradients.

  Args:
    tx: the optimizer.
    mesh: a 1-D mesh over ``"data"`` of P devices.
    grads_per_step: per step, a pytree whose leaves have a leading axis of
      P: row i is device i's gradient.
    state: the global state to start from; by default ``topka2a_jax.init``'s.

  Returns:
    ``(updates, state)`` per step: the updates as NumPy arrays with a leading
    device axis, and the global state.
  """
  devices = mesh.shape["data"]
  if state is None:
    params = jax.tree.map(lambda g: jax.ShapeDtypeStruct(g.shape[1:], g.dtype),
                          grads_per_step[0])
    state = topka2a_jax.init(tx, params, mesh)
  specs = topka2a_jax.state_specs(state)

  def step(grads, state):
    updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state)
    return jax.tree.map(lambda u: u[None], updates), state

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), specs),
                              out_specs=(P("data"), specs)))
  history = []
  for grads in grads_per_step:
    assert all(g.shape[0] == devices for g in jax.tree.leaves(grads))
    updates, state = run(jax.device_put(grads, NamedSharding(mesh, P("data"))), state)
    history.append((jax.tree.map(np.asarray, updates), state))
  return history


def _train_steps(tx, mesh, loss_fn, params, batches, **options):
  """Trains with :func:`topka2a_jax.train_step` from ``tx.init(params)``.

  The parameters are placed on the mesh first (replicated), so ``tx.init``
  finds it without ``topka2a(..., mesh=...)``; nothing is donated unless
  ``donate=True`` is passed.

  Returns:
    ``(params, opt_state, loss)`` after every step, as NumPy arrays.
  """
  options.setdefault("donate", False)  # callers may reuse their arrays
  step = topka2a_jax.train_step(loss_fn, tx, mesh, **options)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  state = tx.init(params)
  history = []
  for batch in batches:
    params, state, loss = step(params, state, batch)
    history.append(jax.tree.map(np.asarray, (params, state, loss)))
  return history


@pytest.fixture(scope="session")
def exchange_steps():
  """The transform alone on given per-device gradients (see the module)."""
  return _exchange_steps


@pytest.fixture(scope="session")
def train_steps():
  """Whole steps through topka2a_jax.train_step (see the module)."""
  return _train_steps
