"""The evidence pages' figures, drawn from the committed JSON in ``evidence/data/``.

The documentation build runs this (``docs/conf.py``), so a figure can never
disagree with the rows its page's tables come from, and a figure that cannot
be drawn fails the build. Each figure is written to ``evidence/figures/``
under the name of the JSON file it draws.

* ``network_training*.json`` (``benchmarks/network_training.py``):
  validation loss against training time and against steps, one line per run.
* ``network_*.json`` (``benchmarks/network.py``): each exchange's time on the
  link, as a share of dense's, against the fitted model's.
* ``charlm_*.json`` (``examples/train_charlm.py``): validation loss against
  steps, one line per run and seed.

Run by hand: ``python docs/figures.py`` (needs matplotlib, in the ``docs`` extra).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "evidence" / "data"
FIGURES = HERE / "evidence" / "figures"
TRAINING_JSON = "network_training*.json"
"""``benchmarks/network_training.py``'s files under :data:`DATA`, one figure each."""
CHARLM_JSON = "charlm_*.json"
"""``examples/train_charlm.py``'s files under :data:`DATA`, one figure each."""


def _pyplot():
  import matplotlib

  matplotlib.use("Agg")  # no display: files only
  import matplotlib.pyplot as plt

  return plt


LEGENDS = {
    "dense": "dense: optax.adam on lax.pmean",
    "dense (pmean)": "dense: optax.adam on lax.pmean",
    "updates 1%": "compress_updates(adam, density=0.01)",
    "defaults": "chain(topka2a({density}), adam)",
    "updates": "compress_updates(adam, density={density})",
    "updates, topka2a_sparse": 'compress_updates(adam, {density}, algorithm="topka2a_sparse")',
    "onebit": 'chain(topka2a(algorithm="onebit"), adam)',
    "quantized_8_8": 'chain(topka2a(algorithm="quantized_8_8"), adam)',
    "quantized_4_8": 'chain(topka2a(algorithm="quantized_4_8"), adam)',
    "quantized_8_8_fine": 'chain(topka2a(algorithm="quantized_8_8_fine"), adam)',
    "rotated_4_8": 'chain(topka2a(algorithm="rotated_4_8"), adam)',
    "rotated_4_4": 'chain(topka2a(algorithm="rotated_4_4"), adam)',
    "quantized_4_8_stochastic": "quantized_4_8 rounded stochastically (removed)",
    "updates, onebit": 'compress_updates(adam, algorithm="onebit")',
    "updates, onebit_4": "compress_updates(adam)",
    "updates, onebit_1": 'compress_updates(adam, algorithm="onebit_1")',
    "momentum, variance frozen at 30": "frozen_variance_adam(lr, {density}, freeze_after=30)",
    "momentum, variance frozen at 30, onebit":
        'frozen_variance_adam(lr, freeze_after=30, algorithm="onebit")',
    "local 2": 'local_steps(adam, every=2, algorithm="quantized_8_8_fine")',
    "local 4": 'local_steps(adam, every=4, algorithm="quantized_8_8_fine")',
    "local 4, rotated_4_8": 'local_steps(adam, every=4, algorithm="rotated_4_8")',
    "local 4, rotated_4_4": "local_steps(adam, every=4)",
    "topka2a 1%": 'chain(topka2a(0.01, algorithm="topka2a", selection="exact"), adam)',
    "topka2a 5%": 'chain(topka2a(0.05, algorithm="topka2a", selection="exact"), adam)',
    "topka2a 1%, no error feedback":
        'chain(topka2a(0.01, algorithm="topka2a", error_feedback=False), adam)',
    "allgather (TopkA) 1%": 'chain(topka2a(0.01, algorithm="allgather"), adam)',
    "topka2a 1%, 100 dense warm-up steps":
        'chain(topka2a(0.01, algorithm="topka2a", warmup_steps=100), adam)',
}
"""What a user writes for each run of ``benchmarks/network_training.py`` and
``examples/train_charlm.py`` (``adam`` is the run's ``optax.adam``); the
figures' legends."""


def legend(run: str, density: float) -> str:
  """The legend of ``run``: what a user writes for it, at the run's density.

  Raises:
    KeyError: a run with no entry in :data:`LEGENDS`, which a figure would
      otherwise label with the benchmark's own name for it.
  """
  return LEGENDS[run].format(density=f"{density:g}")


def training_curves(data: dict, out: Path) -> None:
  """Validation loss against training seconds (left) and steps (right)."""
  plt = _pyplot()
  figure, (by_time, by_step) = plt.subplots(1, 2, figsize=(11, 5), sharey=True)
  for row in data["rows"]:
    steps = [step for step, _ in row["evals"]]
    losses = [loss for _, loss in row["evals"]]
    elapsed, total, seconds = [], 0.0, row["seconds"]
    for i, step in enumerate(steps):
      total += sum(seconds[(steps[i - 1] if i else 0):step])
      elapsed.append(total)
    style = {"linewidth": 2.2 if row["run"] == "dense" else 1.4,
             "color": "black" if row["run"] == "dense" else None}
    label = legend(row["run"], data["density"])
    by_time.plot(elapsed, losses, label=label, **style)
    by_step.plot(steps, losses, label=label, **style)
  for target in data.get("targets", []):
    for axes in (by_time, by_step):
      axes.axhline(target, color="grey", linewidth=0.6, linestyle=":")
  by_time.set_xlabel("training time on the link (s)")
  by_step.set_xlabel("step")
  by_time.set_ylabel("validation loss (nats per byte)")
  low = min(loss for row in data["rows"] for _, loss in row["evals"])
  by_time.set_ylim(low - 0.1, max(3.2, low + 1.0))
  handles, labels = by_step.get_legend_handles_labels()
  figure.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
  figure.suptitle(f"{data['processes']} processes at {data.get('rate') or 'no link'}, "
                  f"batch {data['batch']} per process, seed {data['seed']}")
  rows = (len(labels) + 1) // 2  # the legend's, under the plots
  figure.tight_layout(rect=(0, 0.04 + 0.045 * rows, 1, 1))
  figure.savefig(out, dpi=110)
  plt.close(figure)


def exchange_times(data: dict, out: Path) -> None:
  """Each exchange's time as a share of dense's: measured against the fitted model's."""
  plt = _pyplot()
  figure, axes = plt.subplots(figsize=(5.5, 5))
  rows = [row for row in data["rows"] if "model_ratio" in row]
  for algorithm in sorted({row["algorithm"] for row in rows}):
    mine = [row for row in rows if row["algorithm"] == algorithm]
    axes.scatter([row["model_ratio"] for row in mine], [row["ratio"] for row in mine],
                 label=algorithm, s=18)
  ends = [min(min(r["model_ratio"], r["ratio"]) for r in rows),
          max(max(r["model_ratio"], r["ratio"]) for r in rows)]
  axes.plot(ends, ends, color="grey", linewidth=0.8)
  axes.set_xscale("log")
  axes.set_yscale("log")
  axes.set_xlabel("fitted model: time / dense's")
  axes.set_ylabel("measured on the link: time / dense's")
  axes.set_title(f"{data['processes']} processes at {data['rate']}", fontsize=9)
  axes.legend(fontsize=7)
  figure.tight_layout()
  figure.savefig(out, dpi=110)
  plt.close(figure)


def seeds_curves(data: dict, out: Path) -> None:
  """Validation loss against steps, one line per run and seed (the examples' JSON)."""
  plt = _pyplot()
  figure, axes = plt.subplots(figsize=(7, 5))
  seeds = data["meta"]["seeds"]
  for run in data["runs"]:
    dense = run["name"] == "dense (pmean)"
    color = "black" if dense else None  # each run's seeds in one colour
    for seed, scores in zip(seeds, run["scores"]):
      first = seed == seeds[0]
      line, = axes.plot(run["eval_steps"], scores, linewidth=2.2 if dense else 1.4,
                        color=color, linestyle="-" if first else "--",
                        label=legend(run["name"], 0.01) if first else None)
      color = line.get_color()
  axes.set_xlabel("step")
  axes.set_ylabel("validation loss (nats/byte)")
  axes.set_ylim(top=min(3.0, axes.get_ylim()[1]))
  axes.set_title(f"character model, {data['meta']['steps']} steps, seed"
                 + (f"s {seeds} (dashed: the second)" if len(seeds) > 1 else f" {seeds[0]}"),
                 fontsize=9)
  axes.legend(fontsize=7)
  figure.tight_layout()
  figure.savefig(out, dpi=110)
  plt.close(figure)


def draw_all() -> list[Path]:
  """Every figure the committed JSON holds; returns the files written."""
  FIGURES.mkdir(parents=True, exist_ok=True)
  written = []
  for path in sorted(DATA.glob(TRAINING_JSON)):
    out = FIGURES / f"{path.stem}.png"
    training_curves(json.loads(path.read_text()), out)
    written.append(out)
  for path in sorted(DATA.glob("network_2*.json")):
    data = json.loads(path.read_text())
    if any("model_ratio" in row for row in data.get("rows", [])):
      out = FIGURES / f"{path.stem}.png"
      exchange_times(data, out)
      written.append(out)
  for path in sorted(DATA.glob(CHARLM_JSON)):
    out = FIGURES / f"{path.stem}.png"
    seeds_curves(json.loads(path.read_text()), out)
    written.append(out)
  return written


if __name__ == "__main__":
  for written in draw_all():
    print(written.relative_to(HERE))
  sys.exit(0)
