"""Wall time of one jitted 8-device gradient exchange, by selection method.

Runs ``tx.update`` of ``topka2a(density, algorithm=..., selection=...)`` in a
jitted ``shard_map`` over 8 emulated CPU devices on a 25.6M-parameter
gradient (ResNet-50's layer shapes), and prints the median time per step for
exact and threshold selection, with the planned buckets (``fusion="auto"``)
and with one bucket, in one run. On a CPU the 8 devices share its cores and
the collectives run in memory, so only the ratios mean anything.

Run:
  python benchmarks/step_time.py [--density 0.01] [--repeats 3] [--json out.json]
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse
import json

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax
from topka2a_jax.tools.model_shapes import resnet50


def step_seconds(mesh, grads, algorithm, selection, fusion, density, repeats):
  params = [jax.ShapeDtypeStruct(g.shape[1:], g.dtype) for g in grads]
  tx = topka2a_jax.topka2a(density, algorithm=algorithm, selection=selection,
                           fusion=fusion)
  state = topka2a_jax.init(tx, params, mesh)
  specs = topka2a_jax.state_specs(state)
  run = jax.jit(jax.shard_map(
      lambda g, s: tx.update([x[0] for x in g], s), mesh=mesh,
      in_specs=(P("data"), specs), out_specs=(P(), specs)))
  # time_call waits for each step: one step in flight at a time.
  return topka2a_jax.cost.time_call(lambda: run(grads, state), repeats=repeats)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--json", help="also write the rows to this file")
  args = parser.parse_args()

  mesh = jax.make_mesh((8,), ("data",))
  shardings = NamedSharding(mesh, P("data"))
  keys = jax.random.split(jax.random.key(0), len(resnet50()))
  grads = [jax.device_put(jax.random.normal(key, (8, *shape)), shardings)
           for key, (_, shape) in zip(keys, resnet50())]
  print(f"{sum(g.size // 8 for g in grads):,} parameters, 8 devices, "
        f"density {args.density}: seconds per exchange step")
  print(f"{'algorithm':16s} {'buckets':>10s} {'exact':>9s} {'threshold':>10s} "
        f"{'speedup':>8s}")
  rows = []
  for algorithm in ("topka2a", "topka2a_sparse"):
    for fusion, label in (("auto", "planned"), (1 << 30, "one")):
      exact, threshold = (
          step_seconds(mesh, grads, algorithm, selection, fusion, args.density,
                       args.repeats)
          for selection in ("exact", "threshold"))
      rows.append({"algorithm": algorithm, "buckets": label,
                   "density": args.density, "exact_s": exact,
                   "threshold_s": threshold, "speedup": exact / threshold})
      print(f"{algorithm:16s} {label:>10s} {exact:9.3f} {threshold:10.3f} "
            f"{exact / threshold:7.2f}x", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"rows": rows, "repeats": args.repeats}, f, indent=2)


if __name__ == "__main__":
  main()
