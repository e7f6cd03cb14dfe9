"""Gradient exchanges on a real, bandwidth-limited link, against the cost model.

Makes a network namespace whose loopback is shaped with ``tc`` (a token
bucket at a rate, default 1 Gbit/s, and optionally netem's added delay), starts P processes
inside it with ``topka2a-launch`` (one CPU device each, gloo collectives
over TCP), and times one gradient exchange per algorithm, size and density:
the median of repeated runs after a warm-up, each run started together on
every process. All the traffic of the P processes crosses the one shaped
loopback, so the link is shared like a switch with that capacity.

Beside the top-k exchanges, PowerSGD (``algorithm="powersgd"``) at each of
``--ranks`` on the buffer as a near-square matrix: its two all-reduces, the
matmuls and Gram-Schmidt, with the residual and the next ``Q`` kept, as a
step keeps them.

From the measurements it fits the planner's model of an exchange (seconds =
messages * α + bytes / bandwidth + elements read * selection + entries selected *
per-entry cost + PowerSGD's passes over its matrix + its multiply-adds, each
few-bit code's passes at its own coding rate; non-negative least squares over
all rows, :class:`topka2a_jax.cost.StepModel`) and prints, beside each
measured ratio to dense, the ratio the fitted model predicts. Last it prints
what ``algorithm="auto"`` plans for one bucket of each size under the fit,
by the optimizer after the exchange, beside the form measured fastest; the
fit goes into ``--json``'s file, which ``topka2a-plan --link-fit`` reads.

Needs root (or CAP_NET_ADMIN) for ``ip netns`` and ``tc``, and the kernel's
``tbf`` qdisc (``netem`` too for ``--delay-ms``). Where any is missing it
says so and exits with status 2; the namespace is always removed afterwards.

Run:
  python benchmarks/network.py [--rate 1gbit] [--delay-ms 0] [--processes 4]
      [--sizes 1000000 8000000 25000000] [--densities 0.01 0.05 0.1]
      [--ranks 1 4] [--repeats 5] [--selection threshold] [--json out.json]
      [--algorithms dense quantized_8_8_fine rotated_4_8 ...]
  python benchmarks/network.py --rows out.json    # the saved rows, fitted anew

Beside the exchanges, it times the defaults' whole update (``topka2a(density)``
with no other option: the planner's algorithm, the backend's selection) on
the same buffer, applied to donated parameters with its new state kept as a
training step keeps them, and prints it against dense.

For the exchanges that code every entry in a few bits it also times their
coding alone (:data:`CODES`): the same exchange of each process's buffer on a
one-device mesh, where the collectives move nothing, run on every process at
once as the exchange is. Beside the link's time it prints that coding time and
the bytes' wire time under the fitted bandwidth: where an exchange's time goes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from link import run_workers, timed

from topka2a_jax.collectives import ALGORITHMS, COLLECTIVES

DEFAULTS = "defaults"
"""The row of ``topka2a(density)`` with no other option, its exchange timed."""


def defaults_seconds(mesh, buffer, density: float, repeats: int) -> float:
  """Median time of the defaults' update of one ``buffer``-sized gradient.

  The update is applied to the parameters, which are donated and carried
  into the next call with the new state, as a training step does: the
  residual's computation is timed, and XLA reuses the donated buffers the
  way a step reuses them.
  """

  import jax
  import numpy as np
  import optax
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import topka2a_jax

  # The mean is applied as it is (plain SGD): say so, as a chain would show it.
  tx = topka2a_jax.topka2a(density, mesh=mesh, follows="sgd")
  params = jax.device_put([np.zeros(buffer.shape[0] // mesh.size, buffer.dtype)],
                          NamedSharding(mesh, P()))
  state = topka2a_jax.init(tx, params, mesh)
  specs = topka2a_jax.state_specs(state)

  def step(b, params, state):
    updates, state = tx.update([b], state)
    return optax.apply_updates(params, updates), state

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P(), specs),
                              out_specs=(P(), specs)), donate_argnums=(1, 2))
  params, state = run(buffer, params, state)
  jax.block_until_ready(state)
  seconds = []
  for _ in range(repeats):
    multihost_utils.sync_global_devices("defaults")
    start = time.perf_counter()
    params, state = run(buffer, params, state)
    jax.block_until_ready((params, state))
    seconds.append(time.perf_counter() - start)
  return float(np.median(seconds))


CODES = "codes"
"""The ``kind`` of a row that times a few-bit exchange's coding alone (no link)."""


def codes_seconds(exchange, local_buffer, repeats: int) -> float:
  """Median time of ``exchange``'s encoding and decoding of one process's buffer.

  The exchange runs on a mesh of this process's one device: its AlltoAll and
  AllGather move nothing, the codes are made and read as on the link. On one
  device the owner codes the whole mean where on P it codes 1/P of it, so this
  is an upper bound of the coding in the link's run (loose for one-bit codes,
  whose means cost the most to code).
  """
  import jax
  import numpy as np
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  local = Mesh(np.array(jax.local_devices()[:1]), ("data",))
  run = jax.jit(jax.shard_map(lambda b: exchange(b, "data", 1.0).mean, mesh=local,
                              in_specs=P("data"), out_specs=P()))
  return timed(run, local_buffer, repeats=repeats, label="codes")


def matrix_of(size: int) -> tuple[int, int]:
  """``size`` elements as the squarest matrix ``(m, n)``, ``n <= m``.

  Example:
    >>> matrix_of(25_000_000), matrix_of(8_000_000)
    ((5000, 5000), (3125, 2560))
  """
  n = max(d for d in range(1, math.isqrt(size) + 1) if size % d == 0)
  return size // n, n


def powersgd_seconds(mesh, buffer, size: int, rank: int, repeats: int) -> float:
  """Median time of one PowerSGD exchange of ``buffer`` as a matrix, everything kept."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from topka2a_jax.collectives import initial_factor, powersgd

  shape = matrix_of(size)
  first = np.asarray(initial_factor(shape, rank, 0))
  q = jax.make_array_from_callback(first.shape, NamedSharding(mesh, P()),
                                   lambda index: first[index])

  def one(row, q):
    (mean,), (residual,), (new_q,) = powersgd([row.reshape(shape)], [q], "data")
    return mean, residual.ravel(), new_q

  run = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=(P("data"), P()),
                              out_specs=(P(), P("data"), P())))
  return timed(run, buffer, q, repeats=repeats, label="powersgd")


def worker(sizes: list[int], densities: list[float], ranks: list[int], repeats: int,
           selection: str, out: str, algorithms: list[str]) -> None:
  """Inside the namespace, on every process: time the exchanges."""
  import topka2a_jax.distributed

  topka2a_jax.distributed.initialize()
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("data",))
  rows = []
  for size in sizes:
    buffer = jax.make_array_from_callback(
        (mesh.size * size,), NamedSharding(mesh, P("data")),
        lambda index, size=size: np.random.default_rng(index[0].start or 0).normal(
            size=size).astype(np.float32))
    for algorithm in algorithms:
      entry = ALGORITHMS[algorithm]
      # Dense and the quantizing exchanges select nothing: one row each.
      for density in [1.0] if algorithm == "dense" or entry.quantizes else densities:
        exchange = COLLECTIVES[algorithm]
        run = jax.jit(jax.shard_map(
            lambda b, exchange=exchange, density=density: exchange(
                b, "data", density, selection=selection).mean,
            mesh=mesh, in_specs=P("data"), out_specs=P()))
        rows.append({"size": size, "algorithm": algorithm, "density": density,
                     "seconds": timed(run, buffer, repeats=repeats, label="exchange")})
        if jax.process_index() == 0:
          print(f"{algorithm:15s} {size:>11,} {density:5g} "
                f"{rows[-1]['seconds']:.4f} s", flush=True)
        if entry.quantizes:
          local = jax.device_put(buffer.addressable_shards[0].data, jax.local_devices()[0])
          rows.append({"size": size, "algorithm": algorithm, "density": density,
                       "kind": CODES, "seconds": codes_seconds(exchange, local, repeats)})
          if jax.process_index() == 0:
            print(f"{algorithm:15s} {size:>11,} coding alone "
                  f"{rows[-1]['seconds']:.4f} s", flush=True)
    for rank in ranks:
      rows.append({"size": size, "algorithm": "powersgd", "density": None,
                   "rank": rank,
                   "seconds": powersgd_seconds(mesh, buffer, size, rank, repeats)})
      if jax.process_index() == 0:
        print(f"{'powersgd':15s} {size:>11,} rank {rank} "
              f"{rows[-1]['seconds']:.4f} s", flush=True)
    for density in densities:
      rows.append({"size": size, "algorithm": DEFAULTS, "density": density,
                   "seconds": defaults_seconds(mesh, buffer, density, repeats)})
      if jax.process_index() == 0:
        print(f"{DEFAULTS:15s} {size:>11,} {density:5g} "
              f"{rows[-1]['seconds']:.4f} s", flush=True)
  if jax.process_index() == 0:
    Path(out).write_text(json.dumps(rows))


def coded_forms(rows: list[dict]) -> list[str]:
  """The few-bit exchanges among ``rows``, in registry order: one coding rate each."""
  present = {r["algorithm"] for r in rows}
  return [name for name, entry in ALGORITHMS.items()
          if entry.quantizes and name in present]


def terms(row: dict, processes: int, coded: list[str]) -> list[float]:
  """The model of one exchange: messages, bytes, elements, entries, matrix passes,
  products, then the elements each few-bit exchange of ``coded`` codes.

  Seconds = α * messages + bytes / bandwidth + per_element * elements
  + per_entry * entries selected + per_matrix_element * matrix elements
  + per_multiply_add * multiply-adds + coding[form] * elements coded, as in
  :class:`topka2a_jax.cost.StepModel`. Dense selects nothing; only
  PowerSGD passes over its matrix (a fixed number of times whatever the
  rank: two products with the factors, the mean and the residual) and
  multiplies (:attr:`topka2a_jax.cost.LowRankStep.multiply_adds`, growing
  with the rank); a few-bit exchange's passes over the buffer are charged at
  its own rate, not the selection's.
  """
  from topka2a_jax.cost import (
    elements_read,
    exchange_cost,
    low_rank_step,
    selected_entries,
  )

  codes = [0.0] * len(coded)
  if row["algorithm"] == "powersgd":
    step = low_rank_step([matrix_of(row["size"])], processes, row["rank"], min_size=0)
    return [step.cost.messages, step.cost.bytes, 0, 0, row["size"], step.multiply_adds,
            *codes]
  cost = exchange_cost(row["algorithm"], row["size"], processes, row["density"])
  elements = elements_read(row["algorithm"], row["size"], processes)
  entries = selected_entries(row["algorithm"], row["size"], processes, row["density"])
  if row["algorithm"] in coded:
    codes[coded.index(row["algorithm"])], elements = elements, 0
  return [cost.messages, cost.bytes, elements, entries, 0, 0, *codes]


class Fit(NamedTuple):
  """The planner's model of the link, fitted to the measured exchanges.

  Attributes:
    alpha: seconds per message.
    bandwidth: bytes per second per process.
    per_element: selection's seconds per element read.
    per_entry: seconds per entry selected.
    per_matrix_element: PowerSGD's seconds per matrix element.
    per_multiply_add: PowerSGD's seconds per multiply-add.
    coding: each few-bit exchange's seconds per element its coding passes
      over (``coding_seconds_per_element`` of :func:`topka2a_jax.plan_fusion`).
  """

  alpha: float
  bandwidth: float
  per_element: float
  per_entry: float
  per_matrix_element: float
  per_multiply_add: float
  coding: dict[str, float]

  def coefficients(self, coded: list[str]) -> list[float]:
    """The coefficients of :func:`terms`, in its order."""
    return [self.alpha, 1 / self.bandwidth, self.per_element, self.per_entry,
            self.per_matrix_element, self.per_multiply_add,
            *(self.coding[name] for name in coded)]

  def planner_options(self) -> dict:
    """The fit as :func:`topka2a_jax.plan_fusion`'s model options (what
    ``topka2a-plan --link-fit`` makes of it)."""
    from topka2a_jax.cost import from_link_fit

    return from_link_fit(self._asdict())


def exchange_rows(rows: list[dict]) -> list[dict]:
  """The rows of one exchange each: not the defaults' whole update, not coding alone."""
  return [r for r in rows if r["algorithm"] != DEFAULTS and r.get("kind") != CODES]


def fit(rows: list[dict], processes: int) -> Fit:
  """Least squares over ``rows`` of :func:`terms`' coefficients, all non-negative.

  Relative errors are minimised, so small exchanges count as much as large
  ones (non-negative least squares on the design scaled by each row's time,
  each column by its norm).
  """
  import numpy as np
  from scipy.optimize import nnls

  coded = coded_forms(rows)
  times = np.array([r["seconds"] for r in rows])
  design = np.array([terms(r, processes, coded) for r in rows], float) / times[:, None]
  norms = np.linalg.norm(design, axis=0)
  norms[norms == 0] = 1.0
  scaled, _ = nnls(design / norms, np.ones(len(rows)))
  alpha, per_byte, element, entry, matrix, flop, *codes = scaled / norms
  return Fit(float(alpha), 1.0 / max(float(per_byte), 1e-15), float(element),
             float(entry), float(matrix), float(flop),
             {name: float(rate) for name, rate in zip(coded, codes)})


def report(rows: list[dict], processes: int, rate: str) -> list[dict]:
  """Prints the table; returns the rows with ratios and predictions."""
  defaults = [r for r in rows if r["algorithm"] == DEFAULTS]
  coding = [r for r in rows if r.get("kind") == CODES]
  rows = exchange_rows(rows)
  fitted = fit(rows, processes)
  coded = coded_forms(rows)

  def predicted(row: dict) -> float:
    return float(np.dot(terms(row, processes, coded), fitted.coefficients(coded)))

  import numpy as np

  print(f"\n{processes} processes, loopback at {rate}; fitted α = "
        f"{fitted.alpha * 1e6:.0f} µs, bandwidth = {fitted.bandwidth / 1e6:.1f} MB/s per "
        f"process, selection = {fitted.per_element * 1e9:.1f} ns per element + "
        f"{fitted.per_entry * 1e9:.0f} ns per selected entry, "
        f"PowerSGD {fitted.per_matrix_element * 1e9:.1f} ns per matrix element + "
        f"{fitted.per_multiply_add * 1e12:.0f} ps per multiply-add")
  if coded:
    print("coding, ns per element its passes read: " + ", ".join(
        f"{name} {rate * 1e9:.2f}" for name, rate in fitted.coding.items()))
  print(f"{'elements':>11s} {'density':>7s} {'algorithm':15s} {'seconds':>8s} "
        f"{'vs dense':>8s} {'model':>6s} {'off by':>7s}")
  dense = {r["size"]: r for r in rows if r["algorithm"] == "dense"}
  for r in rows:
    base = dense[r["size"]]
    model_ratio = predicted(r) / predicted(base)
    r.update(ratio=r["seconds"] / base["seconds"], model_ratio=model_ratio)
    setting = f"{r['density']:7g}" if "rank" not in r else f"{'rank ' + str(r['rank']):>7s}"
    print(f"{r['size']:11,} {setting} {r['algorithm']:15s} "
          f"{r['seconds']:8.4f} {r['ratio']:7.3f}x {model_ratio:5.3f}x "
          f"{r['ratio'] / model_ratio - 1:+6.0%}")
  crossover = 1 / (2 * (processes - 1))
  topka, a2a_title = ALGORITHMS["allgather"].title, ALGORITHMS["topka2a"].title
  print(f"\n{topka} against {a2a_title} (the model's crossover: "
        f"density 1/(2(P-1)) = {crossover:.3f}):")
  for r in rows:
    if r["algorithm"] != "allgather":
      continue
    a2a = next(o for o in rows if o["algorithm"] == "topka2a"
               and o["size"] == r["size"] and o["density"] == r["density"])
    faster = topka if r["seconds"] < a2a["seconds"] else a2a_title
    times = (r["seconds"], a2a["seconds"])
    margin = 1 - min(times) / max(times)
    if math.isclose(r["density"], crossover):
      verdict = "at the crossover itself: the model predicts a tie"
    else:
      expected = topka if r["density"] < crossover else a2a_title
      verdict = f"{'as' if faster == expected else 'NOT as'} the model says"
    print(f"  {r['size']:11,} at {r['density']:g}: {faster} faster by "
          f"{margin:.0%} ({verdict})")
  print("\nThe defaults, topka2a(density) with no other option:")
  for r in defaults:
    base = dense[r["size"]]
    r["ratio"] = r["seconds"] / base["seconds"]
    print(f"  {r['size']:11,} at {r['density']:g}: {r['seconds']:.4f} s, "
          f"{r['ratio']:.3f}x dense")
  if coding:
    report_coding(rows, coding, processes, fitted.alpha, fitted.bandwidth)
  report_plans(rows, processes, fitted)
  return rows + defaults + coding


def report_coding(rows: list[dict], coding: list[dict], processes: int, alpha: float,
                  bandwidth: float) -> None:
  """Prints where each few-bit exchange's time on the link goes.

  The coding (measured alone), the bytes' wire time and the messages' latency
  (both under the fitted model), and what is left of the link's measured time.
  """
  from topka2a_jax.cost import exchange_cost

  print("\nWhere the few-bit exchanges' time goes (seconds; coding measured on "
        "one device, which codes the owner's whole mean where each of P codes 1/P "
        "of it: an upper bound; wire and latency from the fit):")
  print(f"{'elements':>11s} {'algorithm':15s} {'on link':>8s} {'coding':>8s} "
        f"{'wire':>8s} {'latency':>8s} {'rest':>8s}")
  for r in coding:
    link = next(o for o in rows if o["algorithm"] == r["algorithm"]
                and o["size"] == r["size"])
    cost = exchange_cost(r["algorithm"], r["size"], processes, 1.0)
    wire, latency = cost.bytes / bandwidth, cost.messages * alpha
    r.update(link_seconds=link["seconds"], wire_seconds=wire, latency_seconds=latency)
    print(f"{r['size']:11,} {r['algorithm']:15s} {link['seconds']:8.4f} "
          f"{r['seconds']:8.4f} {wire:8.4f} {latency:8.4f} "
          f"{link['seconds'] - r['seconds'] - wire - latency:+8.4f}")


def report_plans(rows: list[dict], processes: int, fitted: Fit) -> None:
  """Prints, per size, what ``algorithm="auto"`` plans under the fit against the fastest.

  For each kind of optimizer after the exchange (:data:`topka2a_jax.cost.AUTO_FORMS`)
  whose forms were all timed at a size, the planner prices one bucket of that
  size among them with the fitted link and rates; beside its choice, the form
  measured fastest among the same ones, and how much slower the choice ran.
  """
  import topka2a_jax
  from topka2a_jax.cost import AUTO_FORMS

  timed = {(r["algorithm"], r["size"], r["density"]): r["seconds"] for r in rows
           if r["algorithm"] != "powersgd"}

  def selects(name: str) -> bool:  # a top-k, whose time depends on its density
    return ALGORITHMS[name].sparse and not ALGORITHMS[name].quantizes

  def timing(name: str, size: int, density: float) -> float | None:
    return next((t for (n, at, d), t in timed.items() if n == name and at == size
                 and (d == density or not selects(name))), None)

  print("\nWhat algorithm=\"auto\" plans for one bucket under this fit, by the "
        "optimizer after it:")
  print(f"{'elements':>11s} {'optimizer':9s} {'density':>7s} {'plans':18s} "
        f"{'measured fastest':18s} {'planned / fastest':>17s}")
  kinds = {}  # each set of forms once, by the first kind that has it
  for kind, forms in AUTO_FORMS.items():
    kinds.setdefault(forms, kind)
  for size in sorted({r["size"] for r in rows}):
    for forms, kind in kinds.items():
      top_k = any(map(selects, forms))
      densities = sorted({d for n, at, d in timed if at == size and selects(n)}
                         ) if top_k else [1.0]
      for density in densities:
        seconds = {name: timing(name, size, density) for name in forms}
        if None in seconds.values():
          continue  # not every form of this kind was timed here
        plan = topka2a_jax.plan_fusion([size], processes, density, algorithm="auto",
                                       forms=forms, min_size=0,
                                       **fitted.planner_options())
        chosen = plan.buckets[0].bucket.algorithm
        fastest = min(seconds, key=seconds.get)
        shown = f"{density:7g}" if top_k else f"{'-':>7s}"
        print(f"{size:11,} {kind:9s} {shown} {chosen:18s} {fastest:18s} "
              f"{seconds[chosen] / seconds[fastest]:16.3f}x")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rate", default="1gbit", help="tc rate, e.g. 1gbit, 500mbit")
  parser.add_argument("--delay-ms", type=float, default=0.0)
  parser.add_argument("--processes", type=int, default=4)
  parser.add_argument("--sizes", type=int, nargs="+",
                      default=[1_000_000, 8_000_000, 25_000_000])
  parser.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.05, 0.1])
  parser.add_argument("--ranks", type=int, nargs="*", default=[1, 4],
                      help="PowerSGD's ranks (none: no PowerSGD rows)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--selection", default="threshold", choices=["exact", "threshold"])
  parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS),
                      choices=list(ALGORITHMS), metavar="NAME",
                      help="the exchanges to time (default: every one); dense is "
                           "always timed, as the ratios' reference")
  parser.add_argument("--json", help="also write the rows and the fit here (the fit "
                      "is what topka2a-plan --link-fit reads)")
  parser.add_argument("--rows", metavar="JSON",
                      help="report the rows a run wrote with --json, fitted anew, "
                           "instead of measuring (needs no link); with --json, write "
                           "them with the new fit")
  parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.rows:
    saved = json.loads(Path(args.rows).read_text())
    derived = ("ratio", "model_ratio", "link_seconds", "wire_seconds", "latency_seconds")
    measured = [{k: v for k, v in row.items() if k not in derived}
                for row in saved["rows"]]
    rows = report(measured, saved["processes"], saved["rate"])
    if args.json:
      write(args.json, {**saved, "rows": rows}, saved["processes"])
    return 0
  if args.worker:
    worker(args.sizes, args.densities, args.ranks, args.repeats, args.selection,
           args.worker, args.algorithms)
    return 0

  out = Path(tempfile.mkdtemp()) / "rows.json"
  status = run_workers(args.rate, args.delay_ms, args.processes, __file__, str(out),
                       "--sizes", *map(str, args.sizes), "--densities",
                       *map(str, args.densities), "--ranks", *map(str, args.ranks),
                       "--repeats", str(args.repeats),
                       "--selection", args.selection, "--algorithms",
                       *dict.fromkeys(["dense", *args.algorithms]))
  if status:
    return status
  rows = report(json.loads(out.read_text()), args.processes, args.rate)
  if args.json:
    write(args.json, {"rate": args.rate, "delay_ms": args.delay_ms,
                      "processes": args.processes, "selection": args.selection,
                      "rows": rows}, args.processes)
  return 0


def write(path: str, run: dict, processes: int) -> None:
  """Writes a run's settings and rows to ``path`` as JSON, with their fit."""
  fitted = fit(exchange_rows(run["rows"]), processes)
  Path(path).write_text(json.dumps({**run, "fit": fitted._asdict()}, indent=1))


if __name__ == "__main__":
  sys.exit(main())
