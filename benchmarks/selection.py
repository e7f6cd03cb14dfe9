"""Selection cost: exact top-k, the threshold search, approx_max_k, and "auto".

For each size and density, selects the top ``ceil(k / P)`` of each of P
shards of a float32 buffer (what TopKA2A does on P devices; P = 8 unless
``--shards`` says otherwise) with every selection of
``topka2a_jax.collectives.SELECTIONS`` (exact ``lax.top_k``, the threshold
search, ``lax.approx_max_k`` and ``"auto"``, the default's choice for this
backend), and times one ``jnp.sum(jnp.abs(x))`` pass over the same buffer,
all in one run: compare the ratios, not the absolute times, on a shared
machine. Also reports the magnitude mass each keeps, as a share of exact
top-k's, which of them "auto" runs here, and how its time compares with
the fastest of the three.

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

from topka2a_jax.collectives import SELECTIONS, auto_choice, get_selection
from topka2a_jax.cost import time_call


def measure(sizes, densities, shards: int, repeats: int, out=print) -> list[dict]:
  """Times every selection on ``shards`` rows of each size; one row per case."""
  names = [name for name in SELECTIONS if name != "auto"]
  out(f"{'elements':>12s} {'density':>7s} {'pass ms':>8s} "
      + " ".join(f"{name + ' ms':>12s}" for name in names)
      + f" {'auto':>9s} {'auto/best':>9s} "
      + " ".join(f"{name[:6] + ' mass':>11s}" for name in names[1:]))
  rows = []
  one_pass = jax.jit(lambda x: jnp.sum(jnp.abs(x)))
  for size in map(int, sizes):
    length = -(-size // shards)
    x = jax.random.normal(jax.random.key(0), (shards, length), jnp.float32)
    for density in densities:
      per_shard = -(-int(np.ceil(density * size)) // shards)
      row = {"elements": size, "density": density,
             "pass_s": time_call(functools.partial(one_pass, x), repeats)}
      picked = {}
      for name in names:
        select = jax.jit(functools.partial(get_selection(name), k=per_shard))
        slow = name in ("exact", "approx") and jax.default_backend() == "cpu"
        row[f"{name}_s"] = time_call(functools.partial(select, x),
                                     max(1, repeats // 2) if slow else repeats)
        picked[name] = select(x)[0]
      exact_mass = jnp.sum(jnp.abs(picked["exact"]))
      for name in names[1:]:
        row[f"{name}_mass"] = float(jnp.sum(jnp.abs(picked[name])) / exact_mass)
      best = min(row[f"{name}_s"] for name in names)
      row["auto"] = auto_choice()
      row["auto_vs_best"] = row[f"{row['auto']}_s"] / best
      rows.append(row)
      out(f"{size:12,d} {density:7.3f} {1e3 * row['pass_s']:8.2f} "
          + " ".join(f"{1e3 * row[name + '_s']:12.1f}" for name in names)
          + f" {row['auto']:>9s} {row['auto_vs_best']:8.2f}x "
          + " ".join(f"{row[name + '_mass']:11.4f}" for name in names[1:]))
  within = sum(row["auto_vs_best"] <= 1.1 for row in rows)
  out(f"\nauto ({jax.default_backend()}) within 10% of the fastest in "
      f"{within} of {len(rows)} rows")
  return rows


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
  rows = measure(args.sizes, args.densities, args.shards, args.repeats,
                 out=lambda line: print(line, flush=True))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)


if __name__ == "__main__":
  main()
