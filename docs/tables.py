"""The evidence pages' tables, generated from the committed JSON in ``evidence/data/``.

Every table an evidence page shows is a *named result*: an entry of
``RESULTS`` in ``docs/results.py`` that says which JSON it reads, which
command wrote them and which runs it shows; this module holds the kinds of
result and how each renders. The documentation build (``docs/conf.py``)
writes each one to ``evidence/tables/<name>.md``, and the page includes it::

    ```{include} tables/local_steps_on_a_slow_link.md
    ```

So no figure in a table is typed by hand, and a changed JSON changes its page.
A result that cannot be rendered (a missing file, a run the JSON does not
hold) fails the build.

Run by hand: ``python docs/tables.py`` writes every table and prints their names.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "evidence" / "data"
TABLES = HERE / "evidence" / "tables"


@dataclasses.dataclass(frozen=True)
class OneRun:
  """A result read from one JSON that one command wrote.

  Attributes:
    command: the command that wrote the JSON.
    file: the JSON under ``evidence/data/``.
  """

  command: str
  file: str


@dataclasses.dataclass(frozen=True)
class Result:
  """One named result of ``benchmarks/network_training.py``: a table and its provenance.

  Attributes:
    command: the command that wrote the JSON (one seed's; the table names the
      seeds it reads).
    groups: the JSON under ``evidence/data/``, one group for each seed or
      setting; a group's files are one run of the benchmark split over
      several invocations (a later file's run of the same name is ignored).
    runs: the runs the table shows, in order; ``None`` shows every run.
    against: the run the other rows are compared with: their final loss as a
      signed percentage of its, and, on a link, their time to each target
      as a share of its.
    also_against: a second run whose final loss the others' is also shown
      as a signed percentage of, or None.
    highest: also show each run's highest validation loss on the way.
  """

  command: str
  groups: tuple[tuple[str, ...], ...]
  runs: tuple[str, ...] | None = None
  against: str = "dense"
  also_against: str | None = None
  highest: bool = False


@dataclasses.dataclass(frozen=True)
class StepTimes(OneRun):
  """A short timing run of ``benchmarks/network_training.py`` on the link: each run's step.

  Attributes:
    against: the run whose step the others are shown as a share of.
    alone: the run without any exchange (the compute alone), whose step the
      others are shown as a multiple of.
  """

  against: str
  alone: str


@dataclasses.dataclass(frozen=True)
class Finals:
  """Runs of ``benchmarks/network_training.py`` over seeds: each run's final loss, a row a seed.

  Attributes:
    command: the command that wrote the JSON (one seed's).
    groups: the JSON under ``evidence/data/``, one group for each seed (read
      as :class:`Result`'s groups).
    runs: the runs, one column each.
    against: the run the others' final losses are a signed percentage of.
    steps_of: a run whose steps to each of the benchmark's targets the last
      column shows, with ``against``'s in parentheses; ``None`` shows none.
  """

  command: str
  groups: tuple[tuple[str, ...], ...]
  runs: tuple[str, ...]
  against: str = "dense"
  steps_of: str | None = None


@dataclasses.dataclass(frozen=True)
class FirstCalls(OneRun):
  """One ``benchmarks/first_call.py`` run: each step's first call against ``lax.pmean``'s.

  The first call's median over the trials, its ratio to the same trial's
  pmean first call (median, and the range over the trials), and a later
  step's seconds.
  """


@dataclasses.dataclass(frozen=True)
class Startups(OneRun):
  """One ``benchmarks/startup.py --checkout DIR`` run: each command's start, on two revisions.

  Attributes:
    revisions: the library's revision and the checkout's, as the columns name them.
  """

  revisions: tuple[str, str]


@dataclasses.dataclass(frozen=True)
class Selections(OneRun):
  """One ``benchmarks/selection.py`` run: each selection's time and the mass it keeps."""


@dataclasses.dataclass(frozen=True)
class ExchangeTimes(OneRun):
  """One run of ``benchmarks/network.py`` on the link: each exchange's time, and the model's.

  Attributes:
    algorithms: the exchanges shown (dense is always shown); ``None`` shows
      every one the run timed.
  """

  algorithms: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class CodingTimes(OneRun):
  """The few-bit exchanges of one ``benchmarks/network.py`` run: where their time goes.

  Its JSON holds the run's ``codes`` rows.
  """


@dataclasses.dataclass(frozen=True)
class StepUpdates:
  """``benchmarks/network_step.py`` runs of one step's update, side by side.

  Attributes:
    command: the command that wrote the JSON.
    files: (label, JSON under ``evidence/data/``) pairs, one column pair each.
  """

  command: str
  files: tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class Interleaved(OneRun):
  """One ``benchmarks/ab_step.py`` run: two versions' updates, alternated on one link."""


@dataclasses.dataclass(frozen=True)
class Rows(OneRun):
  """A benchmark's JSON rows as they are: one column per key.

  Attributes:
    columns: (heading, key, format spec) for each column, in order; a
      missing or empty value leaves its cell empty.
    where: (key, values) pairs: only the rows whose key holds one of the
      values are shown; empty shows every row.
  """

  columns: tuple[tuple[str, str, str], ...]
  where: tuple[tuple[str, tuple], ...] = ()


@dataclasses.dataclass(frozen=True)
class Pivot(OneRun):
  """A benchmark's JSON rows laid out as a grid: one key down, another across.

  Attributes:
    down: the key whose values name the grid's rows, in the JSON's order.
    across: the key whose values name its columns.
    columns: the values of ``across`` shown, in order.
    cell: a format string over a row's keys, e.g. ``"{ratio:.2f}x"``.
    headings: the columns' headings, where they differ from ``columns``.
  """

  down: str
  across: str
  columns: tuple[str, ...]
  cell: str
  headings: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Losses:
  """Runs of an example's comparison (``examples/comparison.py``'s JSON) scored by a loss.

  Attributes:
    command: the command that wrote the first JSON.
    files: the JSON under ``evidence/data/``, of the same seeds; a later
      file's run of a name already shown is left out.
    against: the run whose final loss the others' is a signed percentage
      of, seed by seed, and whose bytes a step theirs are a share of.
    at: steps whose validation loss is shown too, before the final one (a
      single seed's runs only).
  """

  command: str
  files: tuple[str, ...]
  against: str
  at: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ModelTimes:
  """The cost model's time of each exchange of one buffer, by device count.

  Computed at the build from :func:`topka2a_jax.cost.exchange_cost` (α-β
  alone: the messages and bytes of each exchange, no selection), so it
  reads no JSON: it is the model, not a measurement.

  Attributes:
    algorithms: the exchanges, in order.
    devices: the device counts, one column each.
    length: elements in the buffer.
    density: fraction sent.
    network: a name in :data:`topka2a_jax.cost.NETWORKS`.
  """

  algorithms: tuple[str, ...]
  devices: tuple[int, ...]
  length: int
  density: float
  network: str


@dataclasses.dataclass(frozen=True)
class Accuracy(OneRun):
  """One run of an example's comparison (``examples/comparison.py``'s JSON): the final scores.

  Attributes:
    against: the run whose mean final score the others are shown against,
      in points.
  """

  against: str


Named = (Result | Finals | StepTimes | FirstCalls | Startups | Selections | ExchangeTimes
         | CodingTimes | StepUpdates | Interleaved | Rows | Pivot | ModelTimes | Accuracy | Losses)
"""Every kind of named result."""


def _rows(group: tuple[str, ...], data: Path) -> tuple[dict, list[dict]]:
  """The group's header (its first file's) and its rows, a run's first row kept."""
  header, rows, seen = None, [], set()
  for name in group:
    loaded = json.loads((data / name).read_text())
    header = header or loaded
    for row in loaded["rows"]:
      if row["run"] not in seen:
        seen.add(row["run"])
        rows.append(row)
  return header, rows


def _percent(value: float, base: float) -> str:
  return f"{100 * (value / base - 1):+.1f}%"


def _target_cell(row: dict, base: dict, target: str, timed: bool) -> str:
  figures = row["targets"].get(target, {})
  steps = figures.get("steps")
  if steps is None:
    return "never"
  if not timed:
    return str(steps)
  if row is base:
    return f"{steps} / {figures['seconds']:.0f} s"
  mine, theirs = figures.get("seconds"), base["targets"].get(target, {}).get("seconds")
  return f"{steps} / {mine / theirs:.2f}x" if mine and theirs else f"{steps} / {mine:.0f} s"


def render_finals(result: Finals, data: Path = DATA) -> str:
  """Each seed's final losses, a column per run, and the steps to the targets of one."""
  head = ["seed", *(f"`{run}`" for run in result.runs)]
  if result.steps_of:
    head.append(f"`{result.steps_of}`'s steps to each target (`{result.against}`'s)")
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for group in result.groups:
    header, rows = _rows(group, data)
    by_run = {row["run"]: row for row in rows}
    base = by_run[result.against]
    cells = [str(header["seed"])]
    for run in result.runs:
      row = by_run[run]
      shown = f"{row['final']:.4f}"
      cells.append(shown if row is base else f"{shown} ({_percent(row['final'], base['final'])})")
    if result.steps_of:
      named = [str(target) for target in header["targets"]]
      mine = " / ".join(_target_cell(by_run[result.steps_of], base, t, False) for t in named)
      theirs = " / ".join(_target_cell(base, base, t, False) for t in named)
      cells.append(f"{mine} ({theirs})")
    lines.append("| " + " | ".join(cells) + " |")
  files = ", ".join(f"`{name}`" for group in result.groups for name in group)
  lines += ["", f"From `{result.command}`, one run a seed; JSON {files}."]
  return "\n".join(lines) + "\n"


def render_steps(result: StepTimes, data: Path = DATA) -> str:
  """The runs' steps in Markdown: each a share of ``against``'s and a multiple of ``alone``'s.

  A local-steps run's step is its median round over the round's steps (the
  benchmark's ``step_s``).

  Raises:
    KeyError: ``against`` or ``alone`` not among the JSON's runs.
  """
  loaded = json.loads((data / result.file).read_text())
  by_run = {row["run"]: row for row in loaded["rows"]}
  base, alone = by_run[result.against]["step_s"], by_run[result.alone]["step_s"]
  lines = [(f"| run | MB/step | s/step | share of `{result.against}`'s | "
            "multiple of the compute alone |"), "|---|---|---|---|---|"]
  for row in loaded["rows"]:
    lines.append(f"| `{row['run']}` | {row['bytes'] / 1e6:.3f} | {row['step_s']:.3f} | "
                 f"{row['step_s'] / base:.2f}x | {row['step_s'] / alone:.2f}x |")
  lines += ["", (f"{loaded['processes']} processes at {loaded['rate']}, "
                 f"{len(loaded['rows'][0]['seconds'])} steps a run. From `{result.command}`; "
                 f"JSON `{result.file}`.")]
  timed = [row for row in loaded["rows"] if "timeline" in row]
  if timed:
    lines += ["", ("When each round's exchange ran on process 0, against the steps of the "
                   "round after it (seconds from the run's first step):"), "",
              "| run | round | its exchange | the next round's steps |", "|---|---|---|---|"]
    for row in timed:
      every = _first_length(row["run"])
      steps = row["timeline"]["steps"]
      for number, (handed, ended) in enumerate(row["timeline"]["exchanges"]):
        after = steps[(number + 1) * every:(number + 2) * every]
        if len(after) == every:
          lines.append(f"| `{row['run']}` | {number + 1} | {handed:.2f} to {ended:.2f} | "
                       f"{after[0][0]:.2f} to {after[-1][1]:.2f} |")
  return "\n".join(lines) + "\n"


def _first_length(run: str) -> int:
  """The round length a ``local N, ...`` run's name starts with."""
  return int(run.split(",")[0].split()[1])


def _fit_sentence(fit: dict) -> str:
  """The link's fitted terms, as a sentence."""
  return (f"Fitted: α = {fit['alpha'] * 1e6:.0f} µs, {fit['bandwidth'] / 1e6:.1f} MB/s per "
          f"process, selection {fit['per_element'] * 1e9:.1f} ns per element + "
          f"{fit['per_entry'] * 1e9:.0f} ns per selected entry.")


def _setting(row: dict) -> str:
  """A row's density, or PowerSGD's rank."""
  return f"rank {row['rank']}" if row.get("rank") is not None else f"{row['density']:g}"


def render_exchanges(result: ExchangeTimes, data: Path = DATA) -> str:
  """Each exchange's time on the link beside the cost model's under the run's own fit.

  The model's seconds are the planner's (:class:`topka2a_jax.cost.StepModel`
  under :func:`topka2a_jax.cost.from_link_fit` of the run's fit): α-β on the
  fitted link, plus the fitted rates of the elements its selection reads and
  the entries it selects. PowerSGD's is the benchmark's own ratio to dense
  (priced by the matrix shape it chose for the buffer) times dense's model.
  """
  from topka2a_jax import cost
  from topka2a_jax.collectives import ALGORITHMS

  run = json.loads((data / result.file).read_text())
  fit, processes = run["fit"], run["processes"]
  settings = cost.PlannerSettings(**cost.from_link_fit(fit))
  shown = set(result.algorithms or ()) | {"dense"}
  rows = [row for row in run["rows"] if row.get("kind") is None
          and (row["algorithm"] in ALGORITHMS or row["algorithm"] == "powersgd")
          and (result.algorithms is None or row["algorithm"] in shown)]
  dense = {row["size"]: row["seconds"] for row in rows if row["algorithm"] == "dense"}
  several = len(dense) > 1

  def model(row: dict) -> float:
    priced = cost.StepModel((row["size"],), processes, row["density"] or 1.0, settings)
    if row["algorithm"] == "powersgd":
      return row["model_ratio"] * priced.seconds("dense", row["size"])
    return priced.seconds(row["algorithm"], row["size"])

  head = (["elements"] if several else []) + [
      "exchange", "density", "measured s", "x dense", "model s", "measured / model"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  order = [*ALGORITHMS, "powersgd"]
  for row in sorted(rows, key=lambda r: (r["size"], order.index(r["algorithm"]),
                                         r.get("rank") or r["density"])):
    name, size = row["algorithm"], row["size"]
    cells = [f"{size:,}"] if several else []
    cells += [f"`{name}`", _setting(row), f"{row['seconds']:.3f}",
              f"{row['seconds'] / dense[size]:.3f}x", f"{model(row):.3f}",
              f"{row['seconds'] / model(row):.2f}"]
    lines.append("| " + " | ".join(cells) + " |")
  sizes = ", ".join(f"{size:,}" for size in sorted(dense))
  lines += ["", (f"{processes} processes, {sizes} elements, `{run['rate']}`. "
                 f"{_fit_sentence(fit)} From `{result.command}`; JSON `{result.file}`.")]
  return "\n".join(lines) + "\n"


def render_coding(result: CodingTimes, data: Path = DATA) -> str:
  """Each few-bit exchange's time on the link beside its coding alone and its wire time.

  The coding alone is the same exchange of one process's buffer on a mesh of
  its one device (nothing crosses the link), run on every process at once;
  the wire is the fitted link's time for the exchange's bytes.
  """
  from topka2a_jax.collectives import ALGORITHMS

  run = json.loads((data / result.file).read_text())
  rows = [row for row in run["rows"] if row.get("kind") == "codes"]
  several = len({row["size"] for row in rows}) > 1
  head = (["elements"] if several else []) + [
      "exchange", "on the link s", "coding alone s", "wire (fit) s", "messages (fit) s"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for row in sorted(rows, key=lambda r: (r["size"], list(ALGORITHMS).index(r["algorithm"]))):
    cells = [f"{row['size']:,}"] if several else []
    cells += [f"`{row['algorithm']}`", f"{row['link_seconds']:.3f}",
              f"{row['seconds']:.3f}", f"{row['wire_seconds']:.3f}",
              f"{row['latency_seconds']:.3f}"]
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", (f"{run['processes']} processes, `{run['rate']}`. From `{result.command}`; "
                 f"JSON `{result.file}`.")]
  return "\n".join(lines) + "\n"


def render_step_updates(result: StepUpdates, data: Path = DATA) -> str:
  """Each run's update, seconds and share of dense's, a column pair per file."""
  runs = [(label, json.loads((data / file).read_text())) for label, file in result.files]
  head = ["gradient", "run"]
  for label, _ in runs:
    head += [f"{label} s", "x dense"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  keys = list(dict.fromkeys((row["gradient"], row["run"]) for _, run in runs
                            for row in run["rows"]))
  for gradient, name in keys:
    cells = [gradient, f"`{name}`"]
    for _, run in runs:
      row = next((r for r in run["rows"] if (r["gradient"], r["run"]) == (gradient, name)),
                 None)
      cells += ["", ""] if row is None else [f"{row['seconds']:.3f}", f"{row['ratio']:.3f}x"]
    lines.append("| " + " | ".join(cells) + " |")
  first = runs[0][1]
  files = ", ".join(f"`{file}`" for _, file in result.files)
  limits = "; ".join(f"{label} {run['flat_limit_s']:.3f} s" for label, run in runs)
  lines += ["", (f"{first['processes']} processes, `{first['rate']}`, density "
                 f"{first['density']:g}. The α-β time of the exchange planned for the flat "
                 f"buffer, under each run's fitted link: {limits}. From `{result.command}`; "
                 f"JSON {files}.")]
  return "\n".join(lines) + "\n"


def render_interleaved(result: Interleaved, data: Path = DATA) -> str:
  """Each version's ratios to ``lax.pmean`` round by round, and their median."""
  run = json.loads((data / result.file).read_text())
  lines = ["| version | revision | each round, x dense | median |", "|---|---|---|---|"]
  for version in sorted({r["version"] for r in run["runs"]}):
    mine = sorted((r for r in run["runs"] if r["version"] == version),
                  key=lambda r: r["round"])
    median = statistics.median(r["ratio"] for r in mine)
    each = ", ".join(f"{r['ratio']:.3f}x" for r in mine)
    lines.append(f"| {version} | `{mine[0]['revision']}` | {each} | {median:.3f}x |")
  lines += ["", (f"{run['gradient']} leaves, {run['processes']} processes, `{run['rate']}`, "
                 f"density {run['density']:g}. From `{result.command}`; "
                 f"JSON `{result.file}`.")]
  return "\n".join(lines) + "\n"


def render_first_calls(result: FirstCalls, data: Path = DATA) -> str:
  """Each run's first call, its ratio to pmean's with the trials' range, and a later step."""
  run = json.loads((data / result.file).read_text())
  lines = ["| run | first call (median) | vs pmean | range | a later step |",
           "|---|---|---|---|---|"]
  for row in run["rows"]:
    spread = ("" if row["ratio"] == 1.0
              else f"{min(row['ratios']):.2f}x to {max(row['ratios']):.2f}x")
    step = (f"{row['step_s']:.3f} s" if row["step_s"] >= 0.1
            else f"{row['step_s'] * 1e3:.1f} ms")
    lines.append(f"| `{row['run']}` | {row['first_s']:.2f} s | {row['ratio']:.2f}x | "
                 f"{spread} | {step} |")
  lines += ["", (f"{len(run['rows'][0]['ratios'])} trials, {run['weights']:,} weights. "
                 f"From `{result.command}`; JSON `{result.file}`.")]
  return "\n".join(lines) + "\n"


def render_startups(result: Startups, data: Path = DATA) -> str:
  """Each command's median seconds and its ratio to ``import jax``, on both revisions."""
  run = json.loads((data / result.file).read_text())
  rows = {row["command"]: row for row in run["rows"]}
  ours, theirs = result.revisions
  lines = [(f"| command | `{ours}` (median) | vs `import jax` | `{theirs}` (median) "
            "| vs `import jax` |"), "|---|---|---|---|---|"]

  def cells(row: dict | None) -> list[str]:
    if row is None:
      return ["", ""]
    low, high = row["ratio_range"]
    spread = "" if low == high else f" ({low:.2f}x to {high:.2f}x)"
    return [f"{row['seconds']:.2f} s", f"{row['ratio']:.2f}x{spread}"]

  for command, row in rows.items():
    if "[" in command:
      continue
    checkout = next((other for name, other in rows.items()
                     if name.startswith(f"{command} [")), None)
    lines.append("| " + " | ".join([f"`{command}`", *cells(row), *cells(checkout)]) + " |")
  lines += ["", (f"{len(run['trials'])} trials, each command in a fresh interpreter. "
                 f"From `{result.command}`; JSON `{result.file}`.")]
  return "\n".join(lines) + "\n"


def render_selections(result: Selections, data: Path = DATA) -> str:
  """Each size and density: a pass over the buffer, each selection's milliseconds, the mass kept."""
  rows = json.loads((data / result.file).read_text())
  lines = [("| elements | density | one pass ms | exact ms | threshold ms | approx ms | "
            "exact / threshold | threshold mass | approx mass | `\"auto\"` runs |"),
           "|---|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    times = [f"{row[key] * 1e3:.1f}" for key in ("pass_s", "exact_s", "threshold_s", "approx_s")]
    lines.append(f"| {row['elements']:,} | {row['density']:g} | " + " | ".join(times)
                 + f" | {row['exact_s'] / row['threshold_s']:.1f}x | "
                 f"{row['threshold_mass']:.4f} | {row['approx_mass']:.4f} | {row['auto']} |")
  lines += ["", f"From `{result.command}`; JSON `{result.file}`."]
  return "\n".join(lines) + "\n"


def render_rows(result: Rows, data: Path = DATA) -> str:
  """The JSON's rows, each key in its column and format."""
  run = json.loads((data / result.file).read_text())
  lines = ["| " + " | ".join(head for head, _, _ in result.columns) + " |",
           "|" + "---|" * len(result.columns)]
  for row in run["rows"]:
    if any(row.get(key) not in values for key, values in result.where):
      continue
    cells = ["" if row.get(key) in (None, "") else format(row[key], spec).replace("|", "\\|")
             for _, key, spec in result.columns]
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", f"From `{result.command}`; JSON `{result.file}`."]
  return "\n".join(lines) + "\n"


def render_pivot(result: Pivot, data: Path = DATA) -> str:
  """The JSON's rows as a grid, each cell its row formatted by ``result.cell``."""
  rows = json.loads((data / result.file).read_text())["rows"]
  cells = {(row[result.down], row[result.across]): result.cell.format(**row) for row in rows}
  lines = ["| " + " | ".join([result.down, *(result.headings or result.columns)]) + " |",
           "|" + "---|" * (len(result.columns) + 1)]
  for down in dict.fromkeys(row[result.down] for row in rows):
    shown = [cells.get((down, across), "") for across in result.columns]
    lines.append("| " + " | ".join([f"`{down}`", *shown]) + " |")
  lines += ["", f"From `{result.command}`; JSON `{result.file}`."]
  return "\n".join(lines) + "\n"


def render_model(result: ModelTimes) -> str:
  """Each exchange's milliseconds under the α-β model, a column per device count."""
  from topka2a_jax import cost
  from topka2a_jax.collectives import ALGORITHMS

  network = cost.get_network(result.network)
  head = ["exchange"] + [f"P = {p}" for p in result.devices]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name in result.algorithms:
    seconds = [cost.exchange_cost(name, result.length, p, result.density).seconds(network)
               for p in result.devices]
    cells = [f"{s * 1e3:.2f} ms" for s in seconds]
    lines.append(f"| {ALGORITHMS[name].title} | " + " | ".join(cells) + " |")
  lines += ["", (f"The cost model on `{result.network}` ({network.source}): "
                 f"{result.length:,} float32 elements at density {result.density:g}, "
                 "messages and bytes only (`topka2a_jax.cost.exchange_cost`).")]
  return "\n".join(lines) + "\n"


def render_accuracy(result: Accuracy, data: Path = DATA) -> str:
  """Each run's final score (mean, each seed's), last five evaluations' mean, bytes a step."""
  run = json.loads((data / result.file).read_text())
  means = {r["name"]: sum(s[-1] for s in r["scores"]) / len(r["scores"]) for r in run["runs"]}
  base = means[result.against]
  lines = [(f"| run | final accuracy, mean | each seed | points against "
            f"`{result.against}` | last five, mean | bytes a step |"), "|---|---|---|---|---|---|"]
  for r in run["runs"]:
    seeds = " / ".join(f"{s[-1]:.2%}" for s in r["scores"])
    points = round(100 * (means[r["name"]] - base), 2) + 0.0  # no "-0.00"
    versus = "" if r["name"] == result.against else f"{points:+.2f}"
    late = statistics.fmean(score for s in r["scores"] for score in s[-5:])
    lines.append(f"| `{r['name']}` | {means[r['name']]:.2%} | {seeds} | {versus} | "
                 f"{late:.2%} | {r['bytes_per_step']:,.0f} |")
  meta = run["meta"]
  lines += ["", (f"{meta['steps']} steps, seeds {', '.join(map(str, meta['seeds']))}. "
                 f"From `{result.command}`; JSON `{result.file}`.")]
  return "\n".join(lines) + "\n"


def render_losses(result: Losses, data: Path = DATA) -> str:
  """Each run's final loss a seed, against ``result.against``'s, and its bytes a step."""
  runs, seeds = {}, None
  for name in result.files:
    loaded = json.loads((data / name).read_text())
    if seeds is not None and loaded["meta"]["seeds"] != seeds:
      raise ValueError(f"{name} holds seeds {loaded['meta']['seeds']}, the files before it "
                       f"{seeds}: one table holds one set of seeds")
    seeds = loaded["meta"]["seeds"]
    for run in loaded["runs"]:
      runs.setdefault(run["name"], run)
  base = runs[result.against]
  if result.at and len(seeds) != 1:
    raise ValueError(f"losses at steps {result.at} need one seed's runs, not seeds {seeds}")
  head = ["run", *(f"step {step}" for step in result.at),
          *("final" if result.at else f"seed {seed}" for seed in seeds),
          f"vs `{result.against}`",
          "bytes/step", f"x `{result.against}`'s"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name, run in runs.items():
    finals = [scores[-1] for scores in run["scores"]]
    versus = "" if run is base else " / ".join(
        _percent(mine, theirs[-1]) for mine, theirs in zip(finals, base["scores"]))
    steps = [run["scores"][0][run["eval_steps"].index(step)] for step in result.at]
    cells = [f"`{name}`", *(f"{score:.3f}" for score in steps),
             *(f"{final:.4f}" for final in finals), versus,
             f"{run['bytes_per_step']:,.0f}",
             f"{run['bytes_per_step'] / base['bytes_per_step']:.3f}"]
    lines.append("| " + " | ".join(cells) + " |")
  files = ", ".join(f"`{name}`" for name in result.files)
  lines += ["", f"From `{result.command}`; JSON {files}."]
  return "\n".join(lines) + "\n"


def render_result(result: Result, data: Path = DATA) -> str:
  """A :class:`Result`'s table in Markdown, with the sentence that says where it comes from.

  Columns: the group's windows a device and seed (where there are several
  groups), the run, its bytes a step and (on a link) its seconds a step, the
  steps to each target (on a link, with the time as a share of
  ``result.against``'s), and the final validation loss with its difference to
  ``result.against``'s.

  Raises:
    KeyError: a run the result names that a group does not hold, or a group
      without the ``against`` run.
    FileNotFoundError: a JSON that is not under ``data``.
    ValueError: groups that measured different targets.
  """
  lines, columns = [], []
  for group in result.groups:
    header, rows = _rows(group, data)
    by_run = {row["run"]: row for row in rows}
    shown = [by_run[run] for run in result.runs] if result.runs else rows
    base = by_run[result.against]
    timed = header.get("rate") is not None
    named = [str(target) for target in header.get("targets", [])]
    # The benchmark adds one more target, its first run's final loss + 2%,
    # which rows written by another invocation measured against another run.
    targets = named + [target for target in base["targets"] if target not in named
                       and rows[0]["run"] == "dense"
                       and all(target in row["targets"] for row in shown)]
    names = [f"to {t}" if t in named else "to dense's final + 2%" for t in targets]
    if columns and names != columns:
      raise ValueError(f"{group} measures {names}, the groups before it {columns}: "
                       "one table holds one set of targets")
    if not columns:
      columns = names
      head = (["windows", "seed"] if len(result.groups) > 1 else []) + ["run", "MB/step"]
      head += (["s/step"] if timed else []) + names + ["final"]
      head += ["highest"] if result.highest else []
      lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in shown:
      cells = [str(header["batch"]), str(header["seed"])] if len(result.groups) > 1 else []
      cells += [f"`{row['run']}`", f"{row['bytes'] / 1e6:.3f}"]
      cells += [f"{row['step_s']:.3f}"] if timed else []
      cells += [_target_cell(row, base, target, timed) for target in targets]
      also = by_run.get(result.also_against)
      shares = ([_percent(row["final"], base["final"])] if row is not base else []) + (
          [f"{_percent(row['final'], also['final'])} of `{also['run']}`'s"]
          if also and also is not row else [])
      final = f"{row['final']:.4f}"
      cells.append(f"{final} ({'; '.join(shares)})" if shares else final)
      cells += [f"{row['highest']:.2f}"] if result.highest else []
      lines.append("| " + " | ".join(cells) + " |")
  files = ", ".join(f"`{name}`" for group in result.groups for name in group)
  lines += ["", f"From `{result.command}`; JSON {files}."]
  return "\n".join(lines) + "\n"


RENDERERS = {
    Result: render_result, Finals: render_finals, StepTimes: render_steps,
    FirstCalls: render_first_calls, Startups: render_startups, Selections: render_selections,
    ExchangeTimes: render_exchanges, CodingTimes: render_coding,
    StepUpdates: render_step_updates, Interleaved: render_interleaved, Rows: render_rows,
    Pivot: render_pivot, Accuracy: render_accuracy, Losses: render_losses,
    ModelTimes: lambda result, data: render_model(result),
}
"""Each kind of named result, and the function that renders it."""


def render(result: Named, data: Path = DATA) -> str:
  """The result's table in Markdown, with the sentence that says where it comes from.

  Raises:
    KeyError: a run the result names that its JSON does not hold.
    FileNotFoundError: a JSON that is not under ``data``.
    ValueError: files that measured different targets or seeds.
  """
  return RENDERERS[type(result)](result, data)


def write_all(out: Path = TABLES, data: Path = DATA) -> list[Path]:
  """Writes every result of ``results.RESULTS`` to ``out/<name>.md``; returns the paths."""
  from results import RESULTS  # docs/results.py: the named results, built from these kinds

  out.mkdir(parents=True, exist_ok=True)
  written = []
  for name, result in RESULTS.items():
    path = out / f"{name}.md"
    path.write_text(render(result, data))
    written.append(path)
  return written


if __name__ == "__main__":
  sys.path.insert(0, str(HERE))
  import tables  # results.py's kinds are this module's by name, not ``__main__``'s

  for path in tables.write_all():
    print(path.relative_to(HERE))
  sys.exit(0)
