"""Does the backend run a collective beside independent compute? Measured on a link.

The planner splits a gradient into buckets so that each bucket's exchange
can run while the backward pass still computes the earlier layers. That
pays only where the backend overlaps a collective with compute that does
not depend on it. This benchmark starts P processes (one CPU device each,
gloo over TCP) in the shaped namespace of ``benchmarks/link.py`` and
times three jitted ``shard_map`` programs:

- ``exchange``: an all-to-all of ``--elements`` float32 per process;
- ``compute``: a chain of matmuls on another array;
- ``both``: the two in one program, with no dependency between them.

If ``both`` takes about ``max(exchange, compute)``, the backend overlaps; if
about ``exchange + compute``, it runs the collective in line, and buckets
split for overlap only add messages and compile time
(:attr:`topka2a_jax.cost.Device.overlaps`).

Run (as root):
  python benchmarks/overlap.py [--rate 1gbit] [--processes 2]
      [--elements 4000000] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import link  # benchmarks/link.py: the shaped namespace, its workers, the timer

WIDTH, MATMULS = 768, 12


def worker(elements: int, repeats: int, out: str | None) -> None:
  """In each process: the three programs' median seconds; process 0 prints them."""
  import topka2a_jax.distributed

  topka2a_jax.distributed.initialize()
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  sharded = NamedSharding(mesh, P("data"))

  def exchange(a):
    return lax.all_to_all(a, "data", 0, 0, tiled=True)

  def compute(b):
    for _ in range(MATMULS):
      b = jnp.tanh(b @ b)
    return b

  programs = {"exchange": lambda a, b: (exchange(a), b),
              "compute": lambda a, b: (a, compute(b)),
              "both": lambda a, b: (exchange(a), compute(b))}
  a = jax.make_array_from_callback((jax.device_count() * elements,), sharded,
                                   lambda index: np.ones(elements, np.float32))
  b = jax.make_array_from_callback(
      (jax.device_count() * WIDTH, WIDTH), sharded,
      lambda index: np.full((WIDTH, WIDTH), 1e-3, np.float32))
  seconds = {}
  for name, body in programs.items():
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                                out_specs=(P("data"), P("data"))))
    seconds[name] = link.timed(run, a, b, repeats=repeats, label=name)
  if jax.process_index() == 0:
    serial = seconds["exchange"] + seconds["compute"]
    overlapped = max(seconds["exchange"], seconds["compute"])
    hidden = (serial - seconds["both"]) / (serial - overlapped)
    print(f"{jax.process_count()} processes, {elements:,} float32 all-to-all, "
          f"{MATMULS} matmuls of {WIDTH}x{WIDTH}; median of {repeats}")
    print(f"{'program':10s} {'seconds':>8s}")
    for name, value in seconds.items():
      print(f"{name:10s} {value:8.3f}")
    print(f"exchange + compute {serial:.3f} s, max of the two {overlapped:.3f} s: "
          f"{100 * hidden:.0f}% of the shorter one hidden")
    if out:
      with open(out, "w") as file:
        json.dump({"processes": jax.process_count(), "elements": elements,
                   "seconds": seconds, "hidden_share": hidden}, file, indent=1)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rate", default="1gbit")
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--elements", type=int, default=4_000_000)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--json", help="also write the figures here")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    worker(args.elements, args.repeats, args.json)
    return 0
  return link.run_workers(
      args.rate, 0.0, args.processes, __file__, "--elements", str(args.elements),
      "--repeats", str(args.repeats), *(["--json", args.json] if args.json else []))


if __name__ == "__main__":
  sys.exit(main())
