"""What a training step's update costs on a real link: state kept, real models' leaves.

Inside the shaped namespace of ``benchmarks/link.py`` (loopback at
1 Gbit/s by default, P processes with one CPU device each, gloo over TCP),
times the update of three gradients, each against the dense exchange of the
same leaves:

- ``flat``: one buffer of 25M floats;
- ``gpt2``: GPT-2 small's leaf shapes with a 12,000-byte vocabulary and two
  blocks (24.2M floats; ``topka2a_jax.tools.model_shapes``);
- ``resnet50``: ResNet-50's leaf shapes (25.6M floats).

Every leaf's gradient has its own scale (a 20x spread, as real models'
layers do). Rows, for each gradient:

- ``dense``: ``lax.pmean`` of every leaf, applied to the parameters;
- ``defaults, state dropped``: ``topka2a(density)``'s update, only the means
  returned, so XLA may drop the residual's computation (what a benchmark
  that forgets the state measures);
- ``defaults``: the same update applied to the parameters, which are
  donated and carried into the next call with the new state, as a training
  step does;
- ``dense + adam`` and ``compress_updates``: a step's whole optimizer, dense
  ``pmean`` then Adam against ``compress_updates(optax.adam(...), density)``,
  both with their state kept.

It also fits the link's α and bandwidth to the dense rows of flat buffers
of 1M, 8M and 25M floats and prints, for the flat buffer, the α-β time of the
exchange the defaults plan (the physical limit of that exchange on this link)
beside the measured update.

Run (as root):
  python benchmarks/network_step.py [--rate 1gbit] [--processes 4]
      [--density 0.01] [--repeats 5] [--gradients flat gpt2 resnet50]
      [--runs dense defaults ...] [--no-fit] [--json out.json]

The workers import the library from wherever Python finds it first
(``PYTHONPATH``); the leaves' shapes come from this checkout, so
``benchmarks/ab_step.py`` can time two versions of the library on the same
gradients.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys
import tempfile
from pathlib import Path

import link  # benchmarks/link.py: the shaped namespace, its workers, the timer

FIT_SIZES = (1_000_000, 8_000_000, 25_000_000)
GRADIENTS = ("flat", "gpt2", "resnet50")
ROWS = ("dense", "defaults, state dropped", "defaults", "dense + adam", "compress_updates")


def leaf_shapes(gradient: str) -> list[tuple[int, ...]]:
  """The leaves' shapes of one of :data:`GRADIENTS`."""
  from topka2a_jax.tools.model_shapes import gpt2_small, resnet50

  if gradient == "flat":
    return [(FIT_SIZES[-1],)]
  shapes = gpt2_small(vocab=12_000, layers=2) if gradient == "gpt2" else resnet50()
  return [shape for _, shape in shapes]


def _runs(mesh, shapes, density: float, names: tuple[str, ...] = ROWS) -> dict:
  """Row name -> a zero-argument callable doing one step's update, as a step does.

  Every run but the first contrast returns the parameters with the update
  applied and its optimizer state, both donated and carried into the next
  call: what a training step keeps, so XLA can drop nothing a step pays for
  and the donated buffers are reused the way a step reuses them.
  """
  import jax
  import numpy as np
  import optax
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import topka2a_jax

  rng = np.random.default_rng(0)
  scales = 10.0 ** rng.uniform(-0.65, 0.65, len(shapes))  # a 20x spread

  def gradient(shape, scale, seed):
    return jax.make_array_from_callback(
        (mesh.size, *shape), NamedSharding(mesh, P("data")),
        lambda index: (scale * np.random.default_rng(seed + (index[0].start or 0))
                       .normal(size=(1, *shape))).astype(np.float32))

  grads = [gradient(shape, scale, 1000 * i) for i, (shape, scale)
           in enumerate(zip(shapes, scales))]
  replicated = NamedSharding(mesh, P())
  fresh_params = lambda: jax.device_put(
      [np.zeros(shape, np.float32) for shape in shapes], replicated)
  first = lambda g: [x[0] for x in g]

  def carried(tx, mean=None):
    """One jitted step: updates of ``tx`` (after ``mean`` of the gradients) applied.

    The parameters and the state are donated and carried into the next call.
    """
    params = fresh_params()
    carry = [params, tx.init(params) if mean else topka2a_jax.init(tx, params, mesh)]
    specs = P() if mean else topka2a_jax.state_specs(carry[1])

    def body(g, params, state):
      g = first(g)
      updates, state = tx.update(mean(g) if mean else g, state, params)
      return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(), specs),
                                 out_specs=(P(), specs)), donate_argnums=(1, 2))

    def run():
      carry[:] = step(grads, *carry)
      return carry
    return run

  pmean = lambda g: [lax.pmean(x, "data") for x in g]
  # The mean is applied as it is (plain SGD): say so, as a chain would show it.
  # A version from before ``follows=`` (``benchmarks/ab_step.py`` runs older
  # ones) planned for plain SGD by default.
  planned_for = ({"follows": "sgd"} if "follows" in inspect.signature(
      topka2a_jax.topka2a).parameters else {})
  defaults = topka2a_jax.topka2a(density, mesh=mesh, **planned_for)

  def dropped():
    state = topka2a_jax.init(defaults, fresh_params(), mesh)
    update = jax.jit(jax.shard_map(
        lambda g, s: defaults.update(first(g), s)[0], mesh=mesh,
        in_specs=(P("data"), topka2a_jax.state_specs(state)), out_specs=P()))
    return lambda: update(grads, state)

  made = {
      "dense": lambda: carried(optax.identity(), mean=pmean),
      "defaults, state dropped": dropped,
      "defaults": lambda: carried(defaults),
      "dense + adam": lambda: carried(optax.adam(1e-3), mean=pmean),
      "compress_updates": lambda: carried(
          topka2a_jax.compress_updates(optax.adam(1e-3), density=density, mesh=mesh)),
  }
  return {name: made[name]() for name in names}


def worker(args: argparse.Namespace) -> None:
  """On every process inside the namespace: time every row."""
  import topka2a_jax.distributed

  topka2a_jax.distributed.initialize()
  import jax
  import numpy as np
  from jax import lax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("data",))
  dense = jax.jit(jax.shard_map(lambda b: lax.pmean(b, "data"), mesh=mesh,
                                in_specs=P("data"), out_specs=P()))
  rows = []
  for size in () if args.no_fit else FIT_SIZES:  # the link's fit
    buffer = jax.make_array_from_callback(
        (mesh.size * size,), NamedSharding(mesh, P("data")),
        lambda index, size=size: np.ones(size, np.float32))
    run = functools.partial(dense, buffer)
    rows.append({"gradient": f"fit {size}", "run": "dense", "elements": size,
                 "seconds": link.timed(run, repeats=args.repeats, label="fit")})
  all_shapes = json.loads(Path(args.shapes).read_text())
  for gradient in args.gradients:
    shapes = [tuple(shape) for shape in all_shapes[gradient]]
    for name, run in _runs(mesh, shapes, args.density, tuple(args.runs)).items():
      rows.append({"gradient": gradient, "run": name,
                   "elements": int(sum(np.prod(s) for s in shapes)),
                   "seconds": link.timed(run, repeats=args.repeats, label=name)})
      if jax.process_index() == 0:
        print(f"{gradient:9s} {name:24s} {rows[-1]['seconds']:.4f} s", flush=True)
  if jax.process_index() == 0:
    Path(args.worker).write_text(json.dumps(rows))


def _dense_of(rows: list[dict], row: dict) -> dict:
  """The row ``row`` is set against: dense, or dense + adam for compress_updates."""
  return next(o for o in rows if o["gradient"] == row["gradient"] and o["run"] == (
      "dense + adam" if row["run"] == "compress_updates" else "dense"))


def report(rows: list[dict], processes: int, density: float) -> dict:
  """Prints the tables; returns the rows, the fitted link and the flat limit."""
  import numpy as np

  from topka2a_jax import plan_fusion
  from topka2a_jax.cost import Network, exchange_cost

  fits = [r for r in rows if r["gradient"].startswith("fit")]
  if not fits:  # --no-fit: the rows against dense alone
    for r in rows:
      r["ratio"] = r["seconds"] / _dense_of(rows, r)["seconds"]
      print(f"{r['gradient']:9s} {r['run']:24s} {r['seconds']:8.4f} {r['ratio']:8.3f}x")
    return {"rows": rows}
  costs = [exchange_cost("dense", r["elements"], processes, 1.0) for r in fits]
  design = np.array([[c.messages, c.bytes] for c in costs], float)
  times = np.array([r["seconds"] for r in fits])
  alpha, per_byte = np.linalg.lstsq(design / times[:, None], np.ones(len(fits)),
                                    rcond=None)[0]
  alpha, per_byte = max(float(alpha), 0.0), max(float(per_byte), 1e-15)
  link = Network(alpha, 1 / per_byte, "fitted")
  print(f"\n{processes} processes; link fitted to the dense rows: α = "
        f"{alpha * 1e6:.0f} µs, bandwidth = {1e-6 / per_byte:.1f} MB/s; density "
        f"{density}")
  print(f"{'gradient':9s} {'run':24s} {'seconds':>8s} {'vs dense':>9s}")
  rows = [r for r in rows if not r["gradient"].startswith("fit")]
  for r in rows:
    r["ratio"] = r["seconds"] / _dense_of(rows, r)["seconds"]
    print(f"{r['gradient']:9s} {r['run']:24s} {r['seconds']:8.4f} {r['ratio']:8.3f}x"
          + ("  (against dense + adam)" if r["run"] == "compress_updates" else ""))
  limit = None
  flat = next((r for r in rows if r["gradient"] == "flat" and r["run"] == "defaults"),
              None)
  if flat is not None:
    plan = plan_fusion([flat["elements"]], processes, density, network=link)
    planned = [exchange_cost(b.bucket.algorithm, b.bucket.size, processes, density)
               for b in plan.buckets]
    limit = sum(c.messages * alpha + c.bytes * per_byte for c in planned)
    algorithms = ", ".join(b.bucket.algorithm for b in plan.buckets)
    print(f"\nflat: the defaults plan {algorithms}; its α-β time at the fitted "
          f"link is {limit:.4f} s; the update with its state took "
          f"{flat['seconds']:.4f} s, {flat['seconds'] / limit:.2f}x that")
  return {"alpha": alpha, "bandwidth": 1 / per_byte, "flat_limit_s": limit,
          "rows": rows}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rate", default="1gbit")
  parser.add_argument("--processes", type=int, default=4)
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--gradients", nargs="+", default=list(GRADIENTS),
                      choices=GRADIENTS)
  parser.add_argument("--runs", nargs="+", default=list(ROWS), choices=ROWS,
                      help="the rows to time (default all); dense is always timed")
  parser.add_argument("--no-fit", action="store_true",
                      help="skip the link's fit (dense exchanges of flat buffers)")
  parser.add_argument("--json", help="also write the rows here")
  parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
  parser.add_argument("--shapes", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    worker(args)
    return 0
  runs = ["dense", *(run for run in args.runs if run != "dense")]
  if "compress_updates" in runs and "dense + adam" not in runs:
    runs.append("dense + adam")  # what compress_updates is set against
  scratch = Path(tempfile.mkdtemp())
  out, shapes = scratch / "rows.json", scratch / "shapes.json"
  shapes.write_text(json.dumps({g: leaf_shapes(g) for g in args.gradients}))
  status = link.run_workers(
      args.rate, 0.0, args.processes, __file__, str(out), "--density", str(args.density),
      "--repeats", str(args.repeats), "--gradients", *args.gradients, "--runs", *runs,
      "--shapes", str(shapes), *(["--no-fit"] if args.no_fit else []))
  if status:
    return status
  result = report(json.loads(out.read_text()), args.processes, args.density)
  if args.json:
    Path(args.json).write_text(json.dumps(
        {"rate": args.rate, "processes": args.processes, "density": args.density,
         **result}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
