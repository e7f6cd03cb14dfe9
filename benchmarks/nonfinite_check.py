"""Three forms of the step's non-finite check: what each costs, and whether it sees a NaN.

Every step of ``topka2a`` (and of ``skip_nonfinite``) first asks whether any
device's gradient holds a NaN or an infinity. On P emulated devices holding
GPT-2-like leaves (``--gradient``, as ``benchmarks/network_step.py``), times
in one run (medians of ``--repeats``, after a warm-up) each form of that
check over all leaves, agreed over the devices:

- ``maximum only``: the largest magnitude, compared with a limit. XLA's CPU
  backend reduces float32 arrays of 4096 entries or more in vectorized
  pieces that drop NaN, so it misses one there;
- ``NaN read as infinity``: the same maximum over ``where(isnan(x), inf,
  |x|)``, which sees every NaN but stops the maximum's vectorization;
- ``maximum plus a sum times zero``: the maximum, plus the sum of every
  entry times zero (zero, or NaN where an entry is NaN or infinite): two
  plain reductions, the form the step runs since this was measured;

and beside them one read of the leaves (a sum of their magnitudes). Each
row also says whether the form flags a gradient with one NaN, the last
entry of the largest leaf on the last device.

Run:
  python benchmarks/nonfinite_check.py [--devices 4] [--gradient gpt2]
      [--repeats 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def measure(gradient: str, repeats: int) -> dict[str, dict]:
  """Each form's median seconds over the leaves, and whether it sees one NaN."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  from network_step import leaf_shapes

  import topka2a_jax

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  shapes = leaf_shapes(gradient)
  rng = np.random.default_rng(0)
  leaves = [rng.normal(size=(mesh.size, *shape)).astype(np.float32) for shape in shapes]
  largest = max(range(len(leaves)), key=lambda i: leaves[i].size)
  poisoned = [leaf.copy() for leaf in leaves]
  poisoned[largest][-1].reshape(-1)[-1] = np.nan
  split = NamedSharding(mesh, P("data"))
  clean, bad = ([jax.device_put(leaf, split) for leaf in tree] for tree in (leaves, poisoned))
  limit = float(jnp.finfo(jnp.float32).max) / mesh.size

  def agreed(largest_of):
    def check(tree):
      local = jnp.stack([~(largest_of(leaf[0]) <= limit) for leaf in tree]).any()
      return lax.pmax(local.astype(jnp.int32), "data") > 0
    return jax.jit(jax.shard_map(check, mesh=mesh, in_specs=P("data"), out_specs=P()))

  forms = {
      "maximum only": agreed(lambda x: jnp.max(jnp.abs(x))),
      "NaN read as infinity": agreed(
          lambda x: jnp.max(jnp.where(jnp.isnan(x), jnp.inf, jnp.abs(x)))),
      "maximum plus a sum times zero": agreed(
          lambda x: jnp.max(jnp.abs(x)) + jnp.sum(x * 0)),
  }
  read = jax.jit(jax.shard_map(
      lambda tree: lax.psum(sum(jnp.sum(jnp.abs(x)) for x in tree), "data"),
      mesh=mesh, in_specs=P("data"), out_specs=P()))
  rows = {"one read (a sum of magnitudes)": {
      "seconds": topka2a_jax.cost.time_call(lambda: read(clean), repeats), "sees_nan": None}}
  for name, form in forms.items():
    rows[name] = {"seconds": topka2a_jax.cost.time_call(lambda form=form: form(clean), repeats),
                  "sees_nan": bool(form(bad))}
  return rows


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--gradient", default="gpt2", choices=("flat", "gpt2", "resnet50"))
  parser.add_argument("--repeats", type=int, default=15)
  parser.add_argument("--json", help="also write the rows here")
  args = parser.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_"
                             f"platform_device_count={args.devices}").strip()
  sys.path.insert(0, str(Path(__file__).resolve().parent))
  measured = measure(args.gradient, args.repeats)
  read = measured["one read (a sum of magnitudes)"]["seconds"]
  rows = [{"form": name, "seconds": row["seconds"], "vs_read": row["seconds"] / read,
           "sees_nan": "" if row["sees_nan"] is None else ("yes" if row["sees_nan"] else "no")}
          for name, row in measured.items()]
  print(f"{args.devices} devices, {args.gradient} leaves, float32")
  print(f"{'form':30s} {'seconds':>8s} {'vs read':>8s}  sees one NaN")
  for row in rows:
    print(f"{row['form']:30s} {row['seconds']:8.4f} {row['vs_read']:7.1f}x  {row['sees_nan']}")
  if args.json:
    Path(args.json).write_text(json.dumps(
        {"devices": args.devices, "gradient": args.gradient, "rows": rows}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
