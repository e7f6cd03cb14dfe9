"""What a full pass over a gradient costs on this backend: read, written in place, written fresh.

On P emulated devices, each holding ``--elements`` float32 entries, times in
one run (medians of ``--repeats``, after a warm-up):

- ``read``: one reduction over the buffer (``jnp.sum(jnp.abs(x))``);
- ``written in place``: ``x + g`` into ``x``'s donated buffer, what an
  update of a residual costs when XLA reuses its buffer;
- ``written fresh``: ``2 g`` into a new buffer, what every full-size array
  a step writes outside a donated buffer costs.

The ratios, not the absolute times, are the finding: they say how much a
step's copies cost next to its passes on this machine
(docs/evidence/network.md).

Run:
  python benchmarks/buffer_writes.py [--devices 4] [--elements 25000000]
      [--repeats 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def measure(elements: int, repeats: int) -> dict[str, float]:
  """Median seconds of each pass over every device's ``elements`` floats."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import topka2a_jax

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  split = NamedSharding(mesh, P("data"))
  g = jax.device_put(np.ones(mesh.size * elements, np.float32), split)
  kept = [jax.device_put(np.zeros(mesh.size * elements, np.float32), split)]
  read = jax.jit(lambda g: jnp.sum(jnp.abs(g)))
  add_into = jax.jit(lambda x, g: x + g, donate_argnums=0)
  doubled = jax.jit(lambda g: 2 * g)

  def in_place():
    kept[0] = add_into(kept[0], g)
    return kept[0]

  passes = {"read": lambda: read(g), "written in place": in_place,
            "written fresh": lambda: doubled(g)}
  return {name: topka2a_jax.cost.time_call(run, repeats) for name, run in passes.items()}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=4)
  parser.add_argument("--elements", type=int, default=25_000_000)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--json", help="also write the rows here")
  args = parser.parse_args()
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_"
                             f"platform_device_count={args.devices}").strip()
  seconds = measure(args.elements, args.repeats)
  print(f"{args.devices} devices x {args.elements:,} float32")
  print(f"{'pass':18s} {'seconds':>8s} {'vs read':>8s}")
  for name, value in seconds.items():
    print(f"{name:18s} {value:8.4f} {value / seconds['read']:7.1f}x")
  if args.json:
    Path(args.json).write_text(json.dumps(
        {"devices": args.devices, "elements": args.elements, "seconds": seconds},
        indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
