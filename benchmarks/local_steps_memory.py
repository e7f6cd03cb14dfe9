"""A step's memory on one device with local steps, read from the compiled program.

On P emulated devices, compiles ``train_step`` for a model of ``--leaves``
float32 matrices of ``--width`` x ``--width`` with Adam, and reads one
device's arguments (parameters, optimizer state, batch) and temporaries
(what XLA allocates inside the step) from ``memory_analysis()``:

- ``optax.chain(topka2a(algorithm="quantized_8_8"), optax.adam(...))``, the
  8-bit form every step;
- ``local_steps(optax.adam(...), 4)``, the defaults;
- the same with ``average_inner_state=True``, whose round's end holds the
  inner state as one buffer and its mean;
- ``collectives.relative_mean`` alone, on a buffer of Adam's moments' size:
  whether XLA decodes the devices' rows into the mean without holding them
  all (its temporaries against the buffer's size).

The steps are compiled, not run: the figures are XLA's CPU plan, and a
GPU's differs by its fusions.

Run:
  python benchmarks/local_steps_memory.py [--devices 4] [--leaves 8]
      [--width 1024] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

MB = 2**20


def measure(leaves: int, width: int) -> list[dict[str, float | str]]:
  """One row a configuration: its name and one device's MB of arguments and temporaries."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import topka2a_jax

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  params = {f"w{i}": jnp.zeros((width, width), jnp.float32) for i in range(leaves)}
  batch = jnp.ones((mesh.size, width, width), jnp.float32)

  def loss(params, batch):
    return sum(jnp.sum(w * batch) for w in params.values())

  adam = optax.adam(1e-3)
  configurations = {
      "8-bit form every step": optax.chain(
          topka2a_jax.topka2a(algorithm="quantized_8_8", mesh=mesh), adam),
      "local_steps(adam, 4)": topka2a_jax.local_steps(adam, every=4, mesh=mesh),
      "local_steps(adam, 4, average_inner_state=True)": topka2a_jax.local_steps(
          adam, every=4, mesh=mesh, average_inner_state=True),
  }
  rows = []
  for name, tx in configurations.items():
    state = tx.init(params)
    step = topka2a_jax.train_step(loss, tx, mesh)
    rows.append(_row(name, step.lower(params, state, batch)))
  moments = jax.ShapeDtypeStruct((mesh.size, 2 * leaves * width * width), jnp.float32,
                                 sharding=NamedSharding(mesh, P("data")))
  mean = jax.jit(jax.shard_map(
      lambda row: topka2a_jax.collectives.relative_mean(row[0], "data")[None], mesh=mesh,
      in_specs=P("data"), out_specs=P("data")))
  rows.append(_row("collectives.relative_mean of the moments' size", mean.lower(moments)))
  return rows


def _row(name: str, lowered) -> dict[str, float | str]:
  """One device's MB of arguments and temporaries in ``lowered``'s compiled program."""
  memory = lowered.compile().memory_analysis()
  return {"run": name, "arguments_mb": memory.argument_size_in_bytes / MB,
          "temporaries_mb": memory.temp_size_in_bytes / MB}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--leaves", type=int, default=8)
  parser.add_argument("--width", type=int, default=1024)
  parser.add_argument("--json", help="also write the rows here")
  args = parser.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_"
                             f"platform_device_count={args.devices}").strip()
  rows = measure(args.leaves, args.width)
  params_mb = args.leaves * args.width**2 * 4 / MB
  print(f"{args.devices} devices; parameters {params_mb:.1f} MB a device "
        f"(Adam's moments {2 * params_mb:.1f} MB)")
  print(f"{'run':48s} {'arguments MB':>12s} {'temporaries MB':>14s} {'vs parameters':>13s}")
  for row in rows:
    print(f"{row['run']:48s} {row['arguments_mb']:12.1f} {row['temporaries_mb']:14.1f} "
          f"{row['temporaries_mb'] / params_mb:12.2f}x")
  if args.json:
    Path(args.json).write_text(json.dumps(
        {"devices": args.devices, "leaves": args.leaves, "width": args.width,
         "parameters_mb": params_mb, "rows": rows}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
