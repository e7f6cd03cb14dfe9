"""Bytes each device sends per training step, read from XLA's compiled HLO.

Compiles (without running) a jitted 8-device shard_map step of a 25.6M
parameter model (ResNet-50's layer shapes) for every algorithm (and float32
or bfloat16 values on the wire) and density,
and prints, per algorithm, the bytes that each kind of collective sends per
device (topka2a_jax.comm_report) beside the cost model's prediction for the
same bucket plan.

Run:
  python benchmarks/bytes_per_step.py [--densities 0.01 0.05] [--json out.json]
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse
import json
import math

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax
from topka2a_jax.collectives import ALGORITHMS
from topka2a_jax.tools.model_shapes import resnet50

CONFIGS = (  # (algorithm, value dtype on the wire): every one, then two narrowed
    *((name, None) for name in ALGORITHMS),
    ("topka2a", "bfloat16"),
    ("topka2a_sparse", "bfloat16"),
)


def compiled_report(mesh, params, algorithm, value_dtype, density):
  """comm_report of the compiled step for one configuration."""
  tx = optax.chain(topka2a_jax.topka2a(density, algorithm=algorithm,
                                       value_dtype=value_dtype), optax.sgd(0.1))
  state = jax.eval_shape(lambda: topka2a_jax.init(tx, params, mesh))
  specs = topka2a_jax.state_specs(state)

  def step(params, state, x):
    loss = lambda p: sum(jnp.sum(jnp.sin(w)) for w in p) * jnp.sum(x)
    grads = jax.grad(loss)(lax.pcast(params, "data", to="varying"))
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def placed(tree, spec_tree):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                          sharding=NamedSharding(mesh, s)),
        tree, spec_tree)

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
                              out_specs=(P(), specs)))
  x = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh, P("data")))
  lowered = run.lower(placed(params, jax.tree.map(lambda _: P(), params)),
                      placed(state, specs), x)
  return topka2a_jax.comm_report(lowered)


def modelled_bytes(sizes, algorithm, value_dtype, density):
  """The cost model's bytes for the bucket plan the transform makes."""
  value_bytes = 2 if value_dtype == "bfloat16" else 4
  plan = topka2a_jax.plan_fusion(sizes, 8, density, algorithm=algorithm,
                                 value_bytes=value_bytes)
  return sum(topka2a_jax.cost.exchange_cost(b.bucket.algorithm, b.bucket.size, 8, density,
                                       value_bytes=value_bytes).bytes
             for b in plan.buckets)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.05])
  parser.add_argument("--json", help="also write the rows to this file")
  args = parser.parse_args()

  mesh = jax.make_mesh((8,), ("data",))
  shapes = resnet50()
  params = [jax.ShapeDtypeStruct(shape, jnp.float32) for _, shape in shapes]
  sizes = [math.prod(shape) for _, shape in shapes]
  print(f"{sum(sizes):,} parameters (ResNet-50 shapes, float32), 8 devices; "
        "bytes sent per device per step")
  header = (f"{'algorithm':14s} {'values':>8s} {'density':>7s} {'all-reduce':>12s} "
            f"{'all-gather':>12s} {'all-to-all':>12s} {'total (HLO)':>13s} "
            f"{'model':>13s} {'vs dense':>8s}")
  print(header)
  rows = []
  for density in args.densities:
    dense_total = None
    for algorithm, value_dtype in CONFIGS:
      report = compiled_report(mesh, params, algorithm, value_dtype, density)
      dense_total = dense_total or report.total_bytes
      row = {
          "algorithm": algorithm, "values": value_dtype or "float32",
          "density": density,
          "all_reduce": report.bytes_of("all-reduce"),
          "all_gather": report.bytes_of("all-gather"),
          "all_to_all": report.bytes_of("all-to-all"),
          "total": report.total_bytes,
          "model": modelled_bytes(sizes, algorithm, value_dtype, density),
      }
      rows.append(row)
      print(f"{algorithm:14s} {row['values']:>8s} {density:7.2f} "
            f"{row['all_reduce']:12,.0f} "
            f"{row['all_gather']:12,.0f} {row['all_to_all']:12,.0f} "
            f"{row['total']:13,.0f} {row['model']:13,.0f} "
            f"{row['total'] / dense_total:7.3f}x")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  main()
