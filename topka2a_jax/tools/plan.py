"""Command-line planner: predicted buckets and speedups before anything runs.

Usage (``topka2a-plan`` is installed with the package; ``python -m
topka2a_jax.tools.plan`` runs the same)::

  topka2a-plan --model resnet50 --devices 32 --density 0.01 --network eth10
  topka2a-plan --params 25000000 --devices 8 --density 0.05
  topka2a-plan --model resnet50 --devices 4 --density 0.01 --network eth1 --rank 4
  topka2a-plan --model gpt2 --devices 64 --density 0.01 \\
      --devices-per-node 8 --network eth10 --inner-network nvlink
  topka2a-plan --model gpt2 --devices 4 --network eth1 --algorithm quantized_8_8
  topka2a-plan --model gpt2 --devices 4 --optimizer adam --link-fit fit.json
  topka2a-plan --model gpt2 --devices 8 --network eth10 --optimizer adam --local-steps 8

Prints the fusion plan (one row per bucket), the predicted step against
all-dense and all-TopkA exchanges, and the break-even densities of TopKA2A
for a bucket of the model's size; with ``--rank``, PowerSGD's exchange of the
same model at that rank. An ``--algorithm`` that sends every entry (a few-bit
one) needs no ``--density``. With ``--devices-per-node`` the devices
form nodes (``topka2a(axis_name=("node", "local"))``): ``--network`` is the
link between nodes, ``--inner-network`` the one inside a node, and every
sparse bucket takes the cheaper of the flat and the two-level route.
``--link-fit`` takes the link and the rates of one's own hosts from a JSON
file that the repository's link benchmark wrote there (``network.py --json``,
the planning guide): α, bandwidth, the
selection's costs and each few-bit code's, so that a few-bit form is planned
only where its coding costs less than the wire it saves.
``--local-steps H`` adds the plan of ``local_steps(inner, every=H)``: one
exchange of the pseudo-gradient a round of H steps, after the round's last
backward pass (nothing to overlap), its time spread over the round's steps,
against the step's compute alone (forward and backward); and overlapped
(``overlap=True``), the longer of a round's compute and its exchange;
``--average-inner-state N`` adds the inner state's mean to each round, N
floats a parameter (``average_inner_state=True``; Adam's N is 2).
``--model`` takes the layer shapes of a
known model (:data:`topka2a_jax.tools.model_shapes.MODELS`, in the order its
layers run; the backward pass produces their gradients in reverse).

Example:
  >>> main(["--params", "25000000", "--devices", "8", "--density", "0.01",
  ...       "--network", "eth10"])  # doctest: +ELLIPSIS
  fusion plan: 1 leaves, 25,000,000 elements, P=8, density=0.01, network=eth10, ...
  predicted step end: 6.594 ms; all dense: 140.700 ms (speedup 21.34x); ...
  --optimizer sgd: each bucket the cheapest of dense, allgather, topka2a, topka2a_sparse ...
  0
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import topka2a_jax
from topka2a_jax.collectives import ALGORITHMS
from topka2a_jax.cost import (
  AUTO_FORMS,
  AUTO_FORMS_WHY,
  DEVICES,
  INNER_NETWORK,
  LOCAL_STEPS_FORM,
  NETWORKS,
  Cluster,
  Network,
  breakeven_density,
  exchange_cost,
  from_link_fit,
  get_network,
  low_rank_step,
)
from topka2a_jax.tools.model_shapes import FORWARD_FLOPS, MODELS, Shapes

DESCRIPTION = "Command-line planner: predicted buckets and speedups before anything runs."
"""``--help``'s first line (written out: ``python -OO`` strips the docstrings)."""

AUTO = "auto"
"""``--algorithm``'s default, as ``topka2a``'s: each bucket its cheapest."""

OPTIMIZERS = {"adam": "adaptive", "momentum": "momentum", "sgd": "plain",
              **dict.fromkeys(("adamw", "nadam", "nadamw", "lion", "adafactor", "rmsprop",
                               "lamb", "adagrad", "muon"), "adaptive"),
              "nesterov": "momentum"}
"""``--optimizer``'s names and the kinds of :data:`topka2a_jax.cost.AUTO_FORMS`: Adam's
family and the other per-entry adaptive steps plan as ``adam``."""

_LONGEST_ROUND = 2**31 - 1
"""The most steps a round of ``local_steps`` may take (its state counts them in int32)."""


STATE_FORM = "quantized_8_8"
"""How ``--average-inner-state`` prices ``collectives.relative_mean``: the same
AlltoAll and AllGather of 8-bit codes (its scales, one per 512 entries, add 0.7%)."""

DENSE, ALLGATHER, TOPKA2A, TOPKA2A_SPARSE = (
    ALGORITHMS[name] for name in ("dense", "allgather", "topka2a", "topka2a_sparse"))


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="topka2a-plan", description=DESCRIPTION)
  model = parser.add_mutually_exclusive_group(required=True)
  model.add_argument("--model", choices=sorted(MODELS))
  model.add_argument("--params", type=int, help="one flat gradient of N elements")
  parser.add_argument("--devices", type=int, required=True)
  parser.add_argument("--density", type=float,
                      help="fraction of each bucket sent; not needed with an --algorithm "
                           "that sends every entry (onebit, quantized_A_B, dense)")
  parser.add_argument("--network",
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
  parser.add_argument("--link-fit", metavar="JSON",
                      help="the link and the hosts' selection and coding costs as "
                           "the link benchmark fitted them (network.py --json; replaces "
                           "--network)")
  parser.add_argument(
      "--algorithm", default=AUTO, choices=[AUTO, *ALGORITHMS],
      help=f"the exchange of every large bucket; default {AUTO}: each bucket its "
           f"cheapest, as in topka2a(...). "
           + "; ".join(f"{a.name}: {a.summary}" for a in ALGORITHMS.values()))
  parser.add_argument(
      "--optimizer", default="sgd", choices=sorted(OPTIMIZERS),
      type=lambda name: name.strip().lower(),
      help="what follows topka2a(...) in the chain, which decides the forms "
           "--algorithm auto plans with: adam (Adam's family; adamw, lion, adafactor, "
           "rmsprop... plan the same) the 8-bit gradient or "
           "dense, momentum (momentum SGD) 4 bits up and 8 back or dense, sgd (plain "
           "SGD, the default) the top-k forms or dense")
  parser.add_argument("--rank", type=int,
                      help="also price PowerSGD at this rank (algorithm='powersgd'); "
                           "needs --model, whose layer shapes it compresses")
  parser.add_argument("--local-steps", type=int, metavar="H",
                      help="also plan local_steps(inner, every=H): the pseudo-gradient "
                           "exchanged once a round of H steps (in --algorithm, or "
                           f"{LOCAL_STEPS_FORM} by default), against compute alone")
  parser.add_argument("--average-inner-state", type=float, metavar="N",
                      help="with --local-steps: also price local_steps(..., "
                           "average_inner_state=True) for an inner state of N floats "
                           "per parameter (Adam's: 2), 8 bits each way a round")
  parser.add_argument("--threshold", default="auto", type=_threshold,
                      help="bucket size in elements, or auto (default)")
  parser.add_argument("--backward-ms", type=float,
                      help="backward pass time; default: from --model's FLOPs on "
                           "--device, else none (no overlap)")
  parser.add_argument("--device", default="h100", choices=sorted(DEVICES),
                      help="the devices' rate, for the backward pass (default h100)")
  parser.add_argument("--batch-per-device", type=int, default=32,
                      help="samples per device per step (default 32)")
  return parser


def _threshold(text: str) -> int | str:
  """``--threshold``: ``auto``, or a whole number of elements of at least 1."""
  if text == "auto":
    return text
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a bucket size: give a whole number of elements of at "
        "least 1, e.g. 1000000, or auto")
  return value


def main(argv: list[str] | None = None) -> int:
  """Runs the planner on ``argv`` (the command line's by default); returns 0."""
  args = _parser().parse_args(argv)
  if args.devices < 1:
    _parser().error("--devices must be at least 1")
  kind = OPTIMIZERS[args.optimizer]
  forms = AUTO_FORMS[kind] if args.algorithm == AUTO else (args.algorithm,)
  selecting = args.density is not None
  if not selecting:
    if not all(name in ALGORITHMS and (ALGORITHMS[name].quantizes or name == DENSE.name)
               for name in forms):
      _parser().error(f"--density is required with --algorithm {args.algorithm} "
                      "(give e.g. --density 0.01)")
    args.density = 1.0
  if not 0 < args.density <= 1:
    _parser().error("--density must be in (0, 1]")
  if (args.latency is None) != (args.bandwidth is None):
    _parser().error("give --latency and --bandwidth together")
  given = [flag for flag, value in (("--network", args.network),
                                    ("--latency", args.latency),
                                    ("--link-fit", args.link_fit)) if value is not None]
  if len(given) > 1:
    _parser().error(f"{' and '.join(given)} each set the link: give one of them")
  rates = {}
  if args.link_fit is not None:
    rates = _link_fit(args.link_fit)
    network = rates.pop("network")
  elif args.latency is not None:
    network = Network(args.latency, args.bandwidth, "measured")
  else:
    network = args.network or "eth10"
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
  if args.local_steps is not None and not 1 <= args.local_steps <= _LONGEST_ROUND:
    _parser().error(f"--local-steps is the steps of a round, at least 1 and at most "
                    f"{_LONGEST_ROUND:,} (local_steps counts them in int32); got "
                    f"{args.local_steps}")
  if args.average_inner_state is not None and (
      args.local_steps is None or not 0 < args.average_inner_state < math.inf):
    _parser().error(f"--average-inner-state prices the inner state of --local-steps: "
                    f"give --local-steps H and the state's floats per parameter, "
                    f"above 0 and finite (Adam's: 2); got {args.average_inner_state}")
  if args.rank is not None and (args.rank < 1 or not args.model or cluster):
    _parser().error("--rank prices PowerSGD on a model's layer shapes over one data "
                    "axis: give a rank of at least 1 and --model, without "
                    "--devices-per-node")
  try:
    plan = topka2a_jax.plan_fusion(  # the first use of JAX: --help needs none
        sizes, args.devices, args.density, names=names, network=network,
        algorithm=args.algorithm, threshold=args.threshold, cluster=cluster,
        forms=AUTO_FORMS[kind], **rates, **_backward(args))
  except ValueError as error:
    _parser().error(str(error))
  print(plan)
  if all(name in ALGORITHMS and (ALGORITHMS[name].quantizes or name == DENSE.name)
         for name in forms):  # no top-k among the forms: set one beside it
    _print_top_k_beside(args, sizes, names, network, cluster, plan, rates)
  if args.algorithm == AUTO:
    print(f"--optimizer {args.optimizer}: each bucket the cheapest of "
          f"{', '.join(AUTO_FORMS[kind])} ({AUTO_FORMS_WHY[kind]})")
  if args.rank is not None:
    _print_low_rank(shapes, args.devices, args.rank, network, plan)
  if args.local_steps is not None:
    _print_local_steps(args, sizes, names, network, cluster, plan, rates)
  if args.devices > 1 and cluster is None and selecting:  # the top-k's breakevens
    total = sum(sizes)
    for sparse in (TOPKA2A, TOPKA2A_SPARSE):
      dense = breakeven_density(sparse.name, DENSE.name, total, args.devices, network)
      topka = breakeven_density(sparse.name, ALLGATHER.name, total, args.devices,
                                network)
      print(f"one {total:,}-element bucket: {sparse.title} beats dense below "
            f"density {_density(dense)} and beats {ALLGATHER.title} above density "
            f"{_density(topka)}")
  return 0


def _link_fit(path: str) -> dict:
  """``--link-fit``: the fit in ``path`` as the planner's settings, or the parser's error."""
  fix = ("write one with the repository's link benchmark, `network.py --json FIT.json` "
         "(the planning guide), on the link, "
         "or refit saved rows with `--rows OLD.json --json FIT.json`")
  try:
    return from_link_fit(json.loads(Path(path).read_text())["fit"],
                       f"the link fit in {path}")
  except OSError as error:
    _parser().error(f"--link-fit {path}: cannot read it ({error.strerror}); {fix}")
  except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
    _parser().error(f"--link-fit {path} holds no link fit ({type(error).__name__}: "
                    f"{error}); {fix}")


def _print_top_k_beside(args: argparse.Namespace, sizes: list[int], names: list[str],
                        network: Network | str, cluster: Cluster | None, plan,
                        rates: dict) -> None:
  """For a plan without a top-k: the best top-k plan at ``--density``, and why not it."""
  if args.density >= 1:  # none given
    print("every entry is sent (no top-k, so no density); give --density to set the "
          "best top-k at that density beside this plan")
    return
  top_k = topka2a_jax.plan_fusion(
      sizes, args.devices, args.density, names=names, network=network, algorithm=AUTO,
      threshold=args.threshold, cluster=cluster, forms=AUTO_FORMS["plain"],
      **rates, **_backward(args))
  print(f"the best top-k at density {args.density:g} (each bucket the cheapest of "
        f"{', '.join(AUTO_FORMS['plain'])}): {1e3 * top_k.step_seconds:.3f} ms "
        f"({top_k.step_seconds / plan.step_seconds:.2f}x this plan's time); before "
        "Adam's family a top-k ends far above dense (the accuracy evidence page), "
        "before plain SGD it is the form to use (--optimizer sgd)")


def _print_low_rank(shapes: Shapes, devices: int, rank: int, network: Network | str,
                    plan) -> None:
  """PowerSGD's exchange of the model at ``rank``, beside the top-k plan."""
  step = low_rank_step([shape for _, shape in shapes], devices, rank)
  link = get_network(network)
  print(f"\nPowerSGD at rank {rank} (algorithm='powersgd'): "
        f"{len(step.low_rank)} of {len(shapes)} leaves low rank, "
        f"{step.dense_elements:,} elements dense")
  print(f"  {step.cost.bytes / 1e6:.3f} MB and {step.cost.messages} messages per device "
        f"and step: {step.cost.seconds(link) * 1e3:.2f} ms on {link.name} without "
        f"overlap (the top-k plan above: {plan.step_seconds * 1e3:.2f} ms with it), "
        f"plus {step.multiply_adds / 1e9:.3g} G multiply-adds of matmuls per device")
  print("  'auto' never picks it: a low-rank product changes what training learns, "
        "which no cost model prices; compare both on your model "
        "(docs/guides/choosing.md)")


def _print_local_steps(args: argparse.Namespace, sizes: list[int], names: list[str],
                       network: Network | str, cluster: Cluster | None, plan,
                       rates: dict) -> None:
  """``local_steps(inner, every=H)``'s plan: a round's exchange over its steps."""
  every = args.local_steps
  algorithm = LOCAL_STEPS_FORM if args.algorithm == AUTO else args.algorithm
  try:
    round_plan = topka2a_jax.plan_fusion(
        sizes, args.devices, args.density, names=names, network=network,
        algorithm=algorithm, threshold=args.threshold, cluster=cluster,
        forms=AUTO_FORMS["plain"], backward_seconds=0.0,
        backward_source="after the round's last step", **rates)
  except ValueError as error:
    _parser().error(f"--local-steps: {error}")
  exchange = round_plan.step_seconds
  sent = "" if cluster else (
      f", {_round_bytes(round_plan) / 1e6:.3f} MB per device "
      f"({_round_bytes(round_plan) / every / 1e6:.3f} MB a step)")
  print(f"\nlocal steps, every {every} (local_steps(inner, every={every})): the "
        f"pseudo-gradient in {algorithm} once a round{sent}, {exchange * 1e3:.3f} ms "
        f"on {round_plan.network.name} after the round's last step")
  if args.average_inner_state is not None:
    state_plan = topka2a_jax.plan_fusion(
        [math.ceil(args.average_inner_state * sum(sizes))], args.devices, args.density,
        names=["inner state"], network=network, algorithm=STATE_FORM, cluster=cluster,
        forms=AUTO_FORMS["plain"], backward_seconds=0.0,
        backward_source="after the round's last step", **rates)
    exchange += state_plan.step_seconds
    sent = "" if cluster else f", {_round_bytes(state_plan) / 1e6:.3f} MB per device"
    print(f"  and the inner state averaged (average_inner_state=True: "
          f"{args.average_inner_state:g} floats a parameter, 8 bits each way, priced as "
          f"{STATE_FORM}){sent}, {state_plan.step_seconds * 1e3:.3f} ms: "
          f"{exchange * 1e3:.3f} ms a round")
  compute = _compute_seconds(args)
  if compute is None:
    print(f"  {exchange / every * 1e3:.3f} ms of exchange a step; give --model or "
          "--backward-ms to set it against the step's compute")
    if args.average_inner_state is None:
      print(f"  overlapped (local_steps(..., overlap=True)): hidden where a step's compute "
            f"takes at least {exchange / every * 1e3:.3f} ms")
    return
  step = compute + exchange / every
  forward = compute - (_backward(args).get("backward_seconds") or 0.0)
  per_step, dense = forward + plan.step_seconds, forward + plan.dense_seconds
  print(f"  a step: {compute * 1e3:.3f} ms of compute alone (forward and backward) + "
        f"{exchange / every * 1e3:.3f} ms of exchange = {step * 1e3:.3f} ms, "
        f"{step / compute:.2f}x compute alone")
  print(f"  with the forward pass, the per-step plan above takes {per_step * 1e3:.3f} ms "
        f"and all dense {dense * 1e3:.3f} ms: local steps' speedup {per_step / step:.2f}x "
        f"and {dense / step:.2f}x")
  if args.average_inner_state is None:  # the state's mean runs in line: no overlap
    late = max(compute, exchange / every)
    bound = ("the round's compute hides its exchange" if exchange <= every * compute
             else "the exchange outlasts the round's compute")
    print(f"  overlapped (local_steps(..., overlap=True)): each round's exchange beside the "
          f"next round's steps, a step {late * 1e3:.3f} ms, {late / compute:.2f}x compute "
          f"alone: {bound}")


def _round_bytes(plan) -> float:
  """Bytes each device sends in one exchange of ``plan``'s buckets (one data axis)."""
  return sum(exchange_cost(p.bucket.algorithm, p.bucket.size, plan.num_devices,
                           plan.density).bytes for p in plan.buckets)


def _compute_seconds(args: argparse.Namespace) -> float | None:
  """A step's forward and backward passes: 1.5x the backward's, or from --model's FLOPs."""
  if args.backward_ms is not None:
    return 1.5 * args.backward_ms / 1e3
  if not args.model:
    return None
  flops, _ = FORWARD_FLOPS[args.model]
  return DEVICES[args.device].seconds(3 * flops * args.batch_per_device)


def _backward(args: argparse.Namespace) -> dict:
  """The backward pass's duration and where it comes from, for plan_fusion."""
  if args.backward_ms is not None:
    return {"backward_seconds": args.backward_ms / 1e3,
            "backward_source": "given with --backward-ms"}
  if not args.model:
    return {}
  flops, counted = FORWARD_FLOPS[args.model]
  device = DEVICES[args.device]
  if not device.overlaps:
    return {"backward_seconds": 0.0,
            "backward_source": f"{device.name} runs collectives in line with "
                               f"compute: no exchange overlaps it"}
  return {"backward_seconds": device.seconds(2 * flops * args.batch_per_device),
          "backward_source": f"twice the forward's {flops / 1e9:.3g} GFLOP per sample "
                             f"({counted}) x {args.batch_per_device} samples at "
                             f"{device.flops_per_second / 1e12:.3g} TFLOP/s "
                             f"({device.source})"}


def _density(value: float | None) -> str:
  return "(never)" if value is None else f"{value:.4g}"


if __name__ == "__main__":
  sys.exit(main())
