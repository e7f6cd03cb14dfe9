"""Which mesh axis a 2-D training step's collectives cross, read from compiled HLO.

Compiles (without running) ``topka2a_jax.train_step`` for a two-layer MLP
whose weights are sharded over a ``"model"`` axis by ``jax.device_put``
alone, on a ``4 x 2`` mesh of emulated CPU devices, with automatic and with
explicit axis types, dense and sparse; prints each step's collectives by the
axes they span (``topka2a_jax.comm_report(..., mesh=mesh)``). The sparse
exchange should add traffic over ``"data"`` only: over ``"model"`` a sparse
step sends what the dense step sends.

Run:
  python benchmarks/mesh_axes.py [--hidden 1024] [--json out.json]
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax

SPECS = {"w": P(None, "model"), "v": P("model", None)}


def loss_fn(params, batch):
  x, t = batch
  hidden = jnp.tanh(x @ params["w"])  # columns of w live on "model"
  # The contraction runs over "model": explicit axes need the result's layout.
  out = jnp.matmul(hidden, params["v"], out_sharding=P())
  return jnp.mean((out - t) ** 2)


def report(kind: str, algorithm: str, hidden: int):
  types = (AxisType.Auto if kind == "auto" else AxisType.Explicit,) * 2
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=types)
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(256, hidden)).astype(np.float32),
            "v": rng.normal(size=(hidden, 16)).astype(np.float32)}
  params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}
  batch = (np.ones((64, 256), np.float32), np.ones((64, 16), np.float32))
  tx = optax.chain(topka2a_jax.topka2a(0.01, algorithm=algorithm), optax.adam(1e-3))
  step = topka2a_jax.train_step(loss_fn, tx, mesh)
  with jax.set_mesh(mesh):
    lowered = step.lower(params, tx.init(params), batch)
  return topka2a_jax.comm_report(lowered, mesh=mesh)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--hidden", type=int, default=1024)
  parser.add_argument("--json", help="also write the rows to this file")
  args = parser.parse_args()
  print(f"MLP 256 x {args.hidden} x 16 ({(256 + 16) * args.hidden:,} weights), "
        "4 x 2 mesh, batch 64, density 0.01; bytes each device sends per step")
  print(f"{'axes':9s} {'algorithm':9s} {'over data':>11s} {'over model':>11s} "
        f"{'model collectives'}")
  rows = []
  for kind in ("auto", "explicit"):
    for algorithm in ("dense", "topka2a"):
      result = report(kind, algorithm, args.hidden)
      model_rows = [r for r in result.collectives if "model" in r.axes]
      row = {"axes": kind, "algorithm": algorithm,
             "data_bytes": result.bytes_of(axis="data"),
             "model_bytes": result.bytes_of(axis="model"),
             "model_collectives": [f"{r.count} {r.kind} ({','.join(r.axes)})"
                                   for r in model_rows]}
      rows.append(row)
      print(f"{kind:9s} {algorithm:9s} {row['data_bytes']:11,.0f} "
            f"{row['model_bytes']:11,.0f} {'; '.join(row['model_collectives'])}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  main()
