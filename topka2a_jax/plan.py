"""Command-line planner: predicted buckets and speedups before anything runs.

Usage:
  python -m topka2a_jax.plan --model resnet50 --devices 32 --density 0.01 \\
      --network eth10
  python -m topka2a_jax.plan --params 25000000 --devices 8 --density 0.05
  python -m topka2a_jax.plan --model resnet50 --devices 4 --density 0.01 \\
      --network eth1 --rank 4
  python -m topka2a_jax.plan --model gpt2-small --devices 64 --density 0.01 \\
      --devices-per-node 8 --network eth10 --inner-network nvlink

Prints the fusion plan (one row per bucket), the predicted step against
all-dense and all-TopkA exchanges, and the break-even densities of TopKA2A
for a bucket of the model's size; with ``--rank``, PowerSGD's exchange of the
same model at that rank. With ``--devices-per-node`` the devices
form nodes (``topka2a(axis_name=("node", "local"))``): ``--network`` is the
link between nodes, ``--inner-network`` the one inside a node, and every
sparse bucket takes the cheaper of the flat and the two-level route.
``--model`` takes the layer shapes of a
known model (:data:`MODELS`, in the order its layers run; the backward pass
produces their gradients in reverse).
"""

from __future__ import annotations

import argparse
import math
import sys

from topka2a_jax.algorithms import (
  ALLGATHER,
  AUTO,
  DENSE,
  POWERSGD,
  REGISTRY,
  TOPKA2A,
  TOPKA2A_SPARSE,
)
from topka2a_jax.compute import DEVICES
from topka2a_jax.cost import (
  NETWORKS,
  Cluster,
  Network,
  breakeven_density,
  get_network,
  low_rank_step,
)
from topka2a_jax.fusion import plan_fusion
from topka2a_jax.options import DEFAULT_ALGORITHM, INNER_NETWORK

Shapes = list[tuple[str, tuple[int, ...]]]


def _norm(name: str, width: int) -> Shapes:
  return [(f"{name}.scale", (width,)), (f"{name}.bias", (width,))]


def resnet50(classes: int = 1000) -> Shapes:
  """ResNet-50 (He et al. 2016): bottleneck blocks [3, 4, 6, 3], batch norm."""
  shapes: Shapes = [("conv1", (7, 7, 3, 64))] + _norm("bn1", 64)
  channels = 64
  for stage, (blocks, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
    for block in range(blocks):
      prefix = f"layer{stage + 1}.{block}"
      shapes += [(f"{prefix}.conv1", (1, 1, channels, width))]
      shapes += _norm(f"{prefix}.bn1", width)
      shapes += [(f"{prefix}.conv2", (3, 3, width, width))]
      shapes += _norm(f"{prefix}.bn2", width)
      shapes += [(f"{prefix}.conv3", (1, 1, width, 4 * width))]
      shapes += _norm(f"{prefix}.bn3", 4 * width)
      if block == 0:
        shapes += [(f"{prefix}.downsample", (1, 1, channels, 4 * width))]
        shapes += _norm(f"{prefix}.downsample_bn", 4 * width)
      channels = 4 * width
  return shapes + [("fc.kernel", (channels, classes)), ("fc.bias", (classes,))]


def bert_base(vocab: int = 30522, layers: int = 12, hidden: int = 768) -> Shapes:
  """BERT-base (Devlin et al. 2019), with the pooler."""
  shapes: Shapes = [
      ("embeddings.word", (vocab, hidden)),
      ("embeddings.position", (512, hidden)),
      ("embeddings.token_type", (2, hidden)),
  ] + _norm("embeddings.norm", hidden)
  for layer in range(layers):
    prefix = f"layer{layer}"
    for proj in ("query", "key", "value", "output"):
      shapes += [(f"{prefix}.attention.{proj}.kernel", (hidden, hidden)),
                 (f"{prefix}.attention.{proj}.bias", (hidden,))]
    shapes += _norm(f"{prefix}.attention.norm", hidden)
    shapes += [(f"{prefix}.intermediate.kernel", (hidden, 4 * hidden)),
               (f"{prefix}.intermediate.bias", (4 * hidden,)),
               (f"{prefix}.output.kernel", (4 * hidden, hidden)),
               (f"{prefix}.output.bias", (hidden,))]
    shapes += _norm(f"{prefix}.output.norm", hidden)
  return shapes + [("pooler.kernel", (hidden, hidden)), ("pooler.bias", (hidden,))]


def gpt2_small(vocab: int = 50257, layers: int = 12, hidden: int = 768) -> Shapes:
  """GPT-2 small (Radford et al. 2019), output embedding tied to the input."""
  shapes: Shapes = [("wte", (vocab, hidden)), ("wpe", (1024, hidden))]
  for layer in range(layers):
    prefix = f"h{layer}"
    shapes += _norm(f"{prefix}.ln_1", hidden)
    shapes += [(f"{prefix}.attn.c_attn.kernel", (hidden, 3 * hidden)),
               (f"{prefix}.attn.c_attn.bias", (3 * hidden,)),
               (f"{prefix}.attn.c_proj.kernel", (hidden, hidden)),
               (f"{prefix}.attn.c_proj.bias", (hidden,))]
    shapes += _norm(f"{prefix}.ln_2", hidden)
    shapes += [(f"{prefix}.mlp.c_fc.kernel", (hidden, 4 * hidden)),
               (f"{prefix}.mlp.c_fc.bias", (4 * hidden,)),
               (f"{prefix}.mlp.c_proj.kernel", (4 * hidden, hidden)),
               (f"{prefix}.mlp.c_proj.bias", (hidden,))]
  return shapes + _norm("ln_f", hidden)


MODELS = {"resnet50": resnet50, "bert-base": bert_base, "gpt2": gpt2_small}
"""Known models by the name ``--model`` takes."""

FORWARD_FLOPS = {
    "resnet50": (8.2e9, "4.1 G multiply-adds per 224 x 224 image"),
    "bert-base": (2 * 110e6 * 128, "2 FLOP per parameter per token, 128 tokens"),
    "gpt2": (2 * 124e6 * 1024, "2 FLOP per parameter per token, 1024 tokens"),
}
"""Forward FLOPs per sample of each known model, and how they are counted."""



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
  parser.add_argument("--devices-per-node", type=int,
                      help="devices per node, for a data axis of (node, local); "
                           "--network is then the link between nodes")
  parser.add_argument("--inner-network", default=INNER_NETWORK,
                      help=f"with --devices-per-node, the link inside a node "
                           f"(default {INNER_NETWORK})")
  parser.add_argument("--latency", type=float,
                      help="measured α in seconds (with --bandwidth, replaces --network)")
  parser.add_argument("--bandwidth", type=float, help="measured bytes per second")
  parser.add_argument(
      "--algorithm", default=AUTO, choices=[AUTO, *REGISTRY],
      help=f"the exchange of every large bucket; default {AUTO}: each bucket its "
           f"cheapest (topka2a(...) itself defaults to {DEFAULT_ALGORITHM}). "
           + "; ".join(f"{a.name}: {a.summary}" for a in REGISTRY.values()))
  parser.add_argument("--rank", type=int,
                      help="also price PowerSGD at this rank (algorithm='powersgd'); "
                           "needs --model, whose layer shapes it compresses")
  parser.add_argument("--threshold", default="auto",
                      help="bucket size in elements, or auto (default)")
  parser.add_argument("--backward-ms", type=float,
                      help="backward pass time; default: from --model's FLOPs on "
                           "--device, else none (no overlap)")
  parser.add_argument("--device", default="h100", choices=sorted(DEVICES),
                      help="the devices' rate, for the backward pass (default h100)")
  parser.add_argument("--batch-per-device", type=int, default=32,
                      help="samples per device per step (default 32)")
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
  cluster = None
  if args.devices_per_node is not None:
    if args.devices_per_node < 1 or args.devices % args.devices_per_node:
      _parser().error(f"--devices-per-node must divide --devices ({args.devices}) "
                      f"into whole nodes; got {args.devices_per_node}")
    try:
      cluster = Cluster(args.devices // args.devices_per_node, args.devices_per_node,
                        outer=get_network(network),
                        inner=get_network(args.inner_network))
    except ValueError as error:
      _parser().error(str(error))
  if args.model:
    shapes = MODELS[args.model]()
    names = [name for name, _ in shapes]
    sizes = [math.prod(shape) for _, shape in shapes]
  else:
    if args.params < 1:
      _parser().error("--params must be at least 1")
    names, sizes = ["gradient"], [args.params]
  if args.rank is not None and (args.rank < 1 or not args.model or cluster):
    _parser().error("--rank prices PowerSGD on a model's layer shapes over one data "
                    "axis: give a rank of at least 1 and --model, without "
                    "--devices-per-node")
  threshold = args.threshold if args.threshold == "auto" else int(args.threshold)
  try:
    plan = plan_fusion(
        sizes, args.devices, args.density, names=names, network=network,
        algorithm=args.algorithm, threshold=threshold, cluster=cluster,
        **_backward(args))
  except ValueError as error:
    _parser().error(str(error))
  print(plan)
  if args.rank is not None:
    _print_low_rank(shapes, args.devices, args.rank, network, plan)
  if args.devices > 1 and cluster is None:
    total = sum(sizes)
    for exchange in (TOPKA2A, TOPKA2A_SPARSE):
      dense = breakeven_density(exchange.name, DENSE.name, total, args.devices, network)
      topka = breakeven_density(exchange.name, ALLGATHER.name, total, args.devices,
                                network)
      print(f"one {total:,}-element bucket: {exchange.title} beats dense below "
            f"density {_density(dense)} and beats {ALLGATHER.title} above density "
            f"{_density(topka)}")
  return 0


def _print_low_rank(shapes: Shapes, devices: int, rank: int, network: Network | str,
                    plan) -> None:
  """PowerSGD's exchange of the model at ``rank``, beside the top-k plan."""
  step = low_rank_step([shape for _, shape in shapes], devices, rank)
  link = get_network(network)
  print(f"\n{POWERSGD.title} at rank {rank} (algorithm='powersgd'): "
        f"{len(step.low_rank)} of {len(shapes)} leaves low rank, "
        f"{step.dense_elements:,} elements dense")
  print(f"  {step.cost.bytes / 1e6:.3f} MB and {step.cost.messages} messages per device "
        f"and step: {step.cost.seconds(link) * 1e3:.2f} ms on {link.name} without "
        f"overlap (the top-k plan above: {plan.step_seconds * 1e3:.2f} ms with it), "
        f"plus {step.multiply_adds / 1e9:.3g} G multiply-adds of matmuls per device")
  print("  'auto' never picks it: a low-rank product changes what training learns, "
        "which no cost model prices; compare both on your model "
        "(docs/guides/choosing.md)")


def _backward(args: argparse.Namespace) -> dict:
  """The backward pass's duration and where it comes from, for plan_fusion."""
  if args.backward_ms is not None:
    return {"backward_seconds": args.backward_ms / 1e3,
            "backward_source": "given with --backward-ms"}
  if not args.model:
    return {}
  flops, counted = FORWARD_FLOPS[args.model]
  device = DEVICES[args.device]
  return {"backward_seconds": device.seconds(2 * flops * args.batch_per_device),
          "backward_source": f"twice the forward's {flops / 1e9:.3g} GFLOP per sample "
                             f"({counted}) x {args.batch_per_device} samples at "
                             f"{device.flops_per_second / 1e12:.3g} TFLOP/s "
                             f"({device.source})"}


def _density(value: float | None) -> str:
  return "(never)" if value is None else f"{value:.4g}"


if __name__ == "__main__":
  sys.exit(main())
