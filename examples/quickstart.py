"""Data-parallel training with sparse gradient averaging on 8 emulated devices.

Trains the same small MLP on a fixed synthetic regression task (noisy labels
from a random teacher network, minibatches on every device) seven ways and
prints the held-out loss of each: dense ``lax.pmean`` averaging, TopKA2A at
1% and 5% density, TopKA2A without error feedback, the TopkA allgather
baseline, TopKA2A with a sparse second phase, and TopKA2A sending bfloat16
values. Each run is the plain-jit route: ``tx.init(params)`` and a jitted
step from :func:`topka2a_jax.train_step`; no shard_map is written here.

Run:
  python examples/quickstart.py [--steps 400] [--lr 3e-3] [--json out.json]

On a machine with accelerators, drop the XLA_FLAGS line: the mesh then spans
the real devices.
"""

import os

os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8"
)  # 8 CPU devices; must be set before JAX starts

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import topka2a_jax

BATCH_PER_DEVICE = 32
PAPER = {"algorithm": "topka2a", "selection": "exact"}  # as the paper runs it
RUNS = {
    "dense (pmean)": {"density": 1.0, "algorithm": "dense"},
    "topka2a 1%": {"density": 0.01, **PAPER},
    "topka2a 5%": {"density": 0.05, **PAPER},
    "topka2a 5%, no error feedback": {"density": 0.05, "error_feedback": False,
                                      **PAPER},
    "allgather (TopkA) 5%": {"density": 0.05, "algorithm": "allgather",
                             "selection": "exact"},
    "topka2a_sparse 5%": {"density": 0.05, "algorithm": "topka2a_sparse",
                          "selection": "exact"},
    "topka2a 5%, bfloat16 values": {"density": 0.05, "value_dtype": jnp.bfloat16,
                                    **PAPER},
    "defaults 5%": {"density": 0.05},
}


def mlp(params, x):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  h = jnp.tanh(h @ params["w2"] + params["b2"])
  return h @ params["w3"]


def mse(params, x, y):
  return jnp.mean((mlp(params, x) - y) ** 2)


def mse_of_batch(params, batch):
  return mse(params, *batch)


def make_task(seed=0):
  """A random teacher network, noisy training labels, clean test labels."""
  keys = jax.random.split(jax.random.key(seed), 8)
  teacher_in = jax.random.normal(keys[0], (32, 64)) / 32**0.5
  teacher_out = jax.random.normal(keys[1], (64, 8)) / 8

  def truth(x):
    return jnp.tanh(x @ teacher_in) @ teacher_out

  x = jax.random.normal(keys[2], (8192, 32))
  y = truth(x) + 0.3 * jax.random.normal(keys[3], (8192, 8))
  x_test = jax.random.normal(keys[4], (2048, 32))
  params = {
      "w1": jax.random.normal(keys[5], (32, 128)) / 32**0.5,
      "b1": jnp.zeros(128),
      "w2": jax.random.normal(keys[6], (128, 128)) / 128**0.5,
      "b2": jnp.zeros(128),
      "w3": jax.random.normal(keys[7], (128, 8)) / 128**0.5,
  }
  return params, (x, y), (x_test, truth(x_test))


def train(mesh, options, steps, learning_rate):
  """Trains from the task's initial parameters; returns the held-out loss."""
  params, (x, y), (x_test, y_test) = make_task()
  x, y = np.asarray(x), np.asarray(y)
  tx = optax.chain(topka2a_jax.topka2a(min_size=1000, mesh=mesh, **options),
                   optax.adam(learning_rate))
  opt_state = tx.init(params)  # residuals per device, laid out for the mesh
  step = topka2a_jax.train_step(mse_of_batch, tx, mesh)  # a jitted step
  batch_size = BATCH_PER_DEVICE * mesh.shape["data"]
  for i in range(steps):
    # Device d trains on rows (i * 32 + [0, 32)) of its 1,024-row slice.
    rows = (i * BATCH_PER_DEVICE + np.arange(BATCH_PER_DEVICE)) % (len(x) // 8)
    chosen = (np.arange(8)[:, None] * (len(x) // 8) + rows).reshape(batch_size)
    params, opt_state, loss = step(params, opt_state, (x[chosen], y[chosen]))
    loss.block_until_ready()
  return float(mse(params, x_test, y_test))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
  parser.add_argument("--json", help="also write each run's held-out MSE here")
  args = parser.parse_args()

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  initial = float(mse(make_task()[0], *make_task()[2]))
  print(f"{jax.device_count()} devices, {args.steps} steps, adam({args.lr:g}); "
        f"held-out MSE before training: {initial:.4f}\n")
  print(f"{'run':32s} {'held-out MSE':>12s} {'vs dense':>9s} {'seconds':>8s}")
  dense, rows = None, []
  for name, options in RUNS.items():
    start = time.perf_counter()
    loss = train(mesh, options, args.steps, args.lr)
    dense = dense or loss
    rows.append({"run": name, "mse": loss, "ratio": loss / dense})
    print(f"{name:32s} {loss:12.4f} {loss / dense:8.2f}x "
          f"{time.perf_counter() - start:8.1f}")
  if args.json:
    with open(args.json, "w") as out:
      json.dump({"steps": args.steps, "lr": args.lr, "initial": initial, "rows": rows}, out,
                indent=1)


if __name__ == "__main__":
  main()
