"""Command-line planner: predicted buckets and speedups before anything runs.

Usage:
  python -m topka2a_jax.plan --model resnet50 --devices 32 --density 0.01 \\
      --network eth10
  python -m topka2a_jax.plan --params 25000000 --devices 8 --density 0.05

Prints the fusion plan (one row per bucket), the predicted step against
all-dense and all-TopkA exchanges, and the break-even densities of TopKA2A
for a bucket of the model's size.
"""

from __future__ import annotations

import argparse
import math
import sys

from topka2a_jax.cost import NETWORKS, Network, breakeven_density
from topka2a_jax.fusion import plan_fusion
from topka2a_jax.model_shapes import MODELS


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m topka2a_jax.plan", description=__doc__.splitlines()[0])
  model = parser.add_mutually_exclusive_group(required=True)
  model.add_argument("--model", choices=sorted(MODELS))
  model.add_argument("--params", type=int, help="one flat gradient of N elements")
  parser.add_argument("--devices", type=int, required=True)
  parser.add_argument("--density", type=float, required=True)
  parser.add_argument("--network", default="eth10",
                      help=f"one of {', '.join(NETWORKS)} (default eth10)")
  parser.add_argument("--latency", type=float,
                      help="measured α in seconds (with --bandwidth, replaces --network)")
  parser.add_argument("--bandwidth", type=float, help="measured bytes per second")
  parser.add_argument("--algorithm", default="auto",
                      choices=["auto", "dense", "allgather", "topka2a",
                               "topka2a_sparse"])
  parser.add_argument("--threshold", default="auto",
                      help="bucket size in elements, or auto (default)")
  parser.add_argument("--backward-ms", type=float,
                      help="backward pass time; default: one dense exchange")
  return parser


def main(argv: list[str] | None = None) -> int:
  """Runs the planner; returns the exit status."""
  args = _parser().parse_args(argv)
  if args.devices < 1:
    _parser().error("--devices must be at least 1")
  if not 0 < args.density <= 1:
    _parser().error("--density must be in (0, 1]")
  if (args.latency is None) != (args.bandwidth is None):
    _parser().error("give --latency and --bandwidth together")
  network = (Network(args.latency, args.bandwidth, "measured")
             if args.latency is not None else args.network)
  if args.model:
    shapes = MODELS[args.model]()
    names = [name for name, _ in shapes]
    sizes = [math.prod(shape) for _, shape in shapes]
  else:
    if args.params < 1:
      _parser().error("--params must be at least 1")
    names, sizes = ["gradient"], [args.params]
  threshold = args.threshold if args.threshold == "auto" else int(args.threshold)
  try:
    plan = plan_fusion(
        sizes, args.devices, args.density, names=names, network=network,
        algorithm=args.algorithm, threshold=threshold,
        backward_seconds=None if args.backward_ms is None else args.backward_ms / 1e3)
  except ValueError as error:
    _parser().error(str(error))
  print(plan)
  if args.devices > 1:
    total = sum(sizes)
    for name, algorithm in (("TopKA2A", "topka2a"),
                            ("TopKA2A-sparse", "topka2a_sparse")):
      dense = breakeven_density(algorithm, "dense", total, args.devices, network)
      topka = breakeven_density(algorithm, "allgather", total, args.devices, network)
      print(f"one {total:,}-element bucket: {name} beats dense below density "
            f"{_density(dense)} and beats TopkA above density {_density(topka)}")
  return 0


def _density(value: float | None) -> str:
  return "(never)" if value is None else f"{value:.4g}"


if __name__ == "__main__":
  sys.exit(main())
