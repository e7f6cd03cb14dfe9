"""A small training run that can stop, save, and resume in another process.

Imported by tests/test_checkpoint.py, and run as a script by it so that a
fresh process restores the checkpoint:

  python tests/resumable.py straight OUT.npz        # 10 steps
  python tests/resumable.py first CHECKPOINT        # 5 steps, then save
  python tests/resumable.py resume CHECKPOINT OUT.npz  # restore, 5 more

Under ``topka2a-launch`` every process runs it on its share of
the 8 devices. ``--sharded N`` trains with :data:`SHARDED` instead, and
resumes on the first N devices.
"""

import os
import sys

import topka2a_jax.distributed
from topka2a_jax._src.runtime.distributed import launched

if __name__ == "__main__":
  if launched():
    topka2a_jax.distributed.initialize()
  else:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax

TX = optax.chain(topka2a_jax.topka2a(0.05, algorithm="topka2a", min_size=64),
                 optax.adam(1e-2))
"""A top-k before Adam, named (the default would send 8-bit codes, whose
rounding turns Gloo's other order of addition into whole quantization steps
between two processes and one); it warns once, as a user's would."""
SHARDED = topka2a_jax.sharded_optimizer(optax.adam(1e-2), density=1.0, algorithm="topka2a",
                                        min_size=64)
"""Adam sharded over the devices; density 1.0, so any device count trains alike."""
PARAMS = {"w": jnp.zeros((40, 30)), "b": jnp.zeros(30)}


def fresh(mesh, tx=TX):
  """Initial {"params", "opt_state"} on ``mesh`` (fresh buffers: steps donate them)."""
  params = jax.device_put(jax.tree.map(jnp.copy, PARAMS), NamedSharding(mesh, P()))
  return {"params": params, "opt_state": topka2a_jax.init(tx, params, mesh)}


def batch(step):
  """The global batch of a step: the same whatever the device count."""
  rng = np.random.default_rng(step)
  return rng.normal(size=(48, 40)).astype(np.float32)


def loss(params, x):
  return jnp.mean((x @ params["w"] + params["b"] - jnp.sin(x[:, :30])) ** 2)


def train(state, mesh, steps, tx=TX):
  """Runs the given step numbers; returns the new state."""
  step = topka2a_jax.train_step(loss, tx, mesh)
  params, opt_state = state["params"], state["opt_state"]
  for i in steps:
    params, opt_state, _ = step(params, opt_state, batch(i))
    jax.block_until_ready(params)
  return {"params": params, "opt_state": opt_state}


def leaves(state):
  """Every leaf as one NumPy array, gathered from all processes (the parameters last)."""
  return [np.asarray(leaf) for leaf in jax.tree.leaves(
      multihost_utils.process_allgather(state, tiled=True))]


def main(mode, *paths, tx=TX, resume_devices=8):
  mesh = jax.make_mesh((8,), ("data",))
  write = jax.process_index() == 0
  if mode == "straight":
    saved = leaves(train(fresh(mesh, tx), mesh, range(10), tx))
    if write:
      np.savez(paths[0], *saved)
  elif mode == "first":
    topka2a_jax.save(paths[0], train(fresh(mesh, tx), mesh, range(5), tx), mesh)
  elif mode == "resume":
    mesh = jax.make_mesh((resume_devices,), ("data",),
                         devices=jax.devices()[:resume_devices])
    state = topka2a_jax.restore(paths[0], fresh(mesh, tx), mesh)
    saved = leaves(train(state, mesh, range(5, 10), tx))
    if write:
      np.savez(paths[1], *saved)


if __name__ == "__main__":
  arguments = sys.argv[1:]
  if arguments[0] == "--sharded":
    main(*arguments[2:], tx=SHARDED, resume_devices=int(arguments[1]))
  else:
    main(*arguments)
