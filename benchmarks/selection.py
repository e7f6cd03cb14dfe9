"""Selection cost: exact top-k against threshold selection and one pass.

For each size and density, selects the top ``ceil(k / P)`` of each of P
shards of a float32 buffer (what TopKA2A does on P devices; P = 8 unless
``--shards`` says otherwise) with exact top-k (``lax.top_k``) and with
threshold selection, and times one ``jnp.sum(jnp.abs(x))`` pass over the
same buffer, all in one run: compare the ratios, not the absolute times, on
a shared machine. Also reports the magnitude mass threshold selection
captures, as a share of exact top-k's.

Run:
  python benchmarks/selection.py [--sizes 1e6 25e6 1e8] [--densities 0.001 0.01 0.05]
                                 [--shards 8] [--repeats 5] [--json out.json]
"""

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from topka2a_jax.selection import top_magnitudes
from topka2a_jax.threshold import threshold_magnitudes
from topka2a_jax.tuning import time_call


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 25e6, 1e8])
  parser.add_argument("--densities", type=float, nargs="+",
                      default=[0.001, 0.01, 0.05])
  parser.add_argument("--shards", type=int, default=8,
                      help="rows selected from, as TopKA2A on this many devices")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--json", help="also write the rows to this file")
  args = parser.parse_args()

  print(f"{'elements':>12s} {'density':>7s} {'pass ms':>8s} {'exact ms':>9s} "
        f"{'threshold ms':>12s} {'thr/pass':>8s} {'exact/thr':>9s} {'mass':>7s}")
  rows = []
  one_pass = jax.jit(lambda x: jnp.sum(jnp.abs(x)))
  for size in map(int, args.sizes):
    length = -(-size // args.shards)
    x = jax.random.normal(jax.random.key(0), (args.shards, length), jnp.float32)
    for density in args.densities:
      per_shard = -(-int(np.ceil(density * size)) // args.shards)
      exact = jax.jit(lambda x, k=per_shard: top_magnitudes(x, k))
      threshold = jax.jit(lambda x, k=per_shard: threshold_magnitudes(x, k))
      pass_s = time_call(functools.partial(one_pass, x), args.repeats)
      exact_s = time_call(functools.partial(exact, x), max(1, args.repeats // 2))
      threshold_s = time_call(functools.partial(threshold, x), args.repeats)
      mass = float(jnp.sum(jnp.abs(threshold(x)[0])) / jnp.sum(jnp.abs(exact(x)[0])))
      row = {"elements": size, "density": density, "pass_s": pass_s,
             "exact_s": exact_s, "threshold_s": threshold_s, "mass": mass}
      rows.append(row)
      print(f"{size:12,d} {density:7.3f} {1e3 * pass_s:8.2f} {1e3 * exact_s:9.1f} "
            f"{1e3 * threshold_s:12.1f} {threshold_s / pass_s:7.1f}x "
            f"{exact_s / threshold_s:8.1f}x {mass:7.4f}", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  main()
