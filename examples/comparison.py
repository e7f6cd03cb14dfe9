"""Training one Flax NNX model several ways, data-parallel, and comparing the runs.

Shared by ``train_digits.py`` and ``train_charlm.py``: each run is an
``nnx.Optimizer`` whose chain starts with the sparse exchange, trained by an
``nnx.jit`` step around :func:`topka2a_jax.nnx_train_step` (the model updated
in place), with a progress bar over every run, the bytes each device sends
per step read from the compiled step, a table of means over seeds and a PNG
of the curves.

Example:
  >>> results = compare(runs, task, steps=300, seeds=(0, 1, 2), mesh=mesh)
  >>> print_table(results, "test accuracy", "{:.2%}")
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import topka2a_jax

PAPER = {"algorithm": "topka2a", "selection": "exact"}
"""TopKA2A as the paper runs it: its exchange and an exact top-k."""

BASE_RUNS = {
    "dense (pmean)": {"density": 1.0, "algorithm": "dense"},
    "topka2a 1%": {"density": 0.01, **PAPER},
    "topka2a 5%": {"density": 0.05, **PAPER},
    "topka2a 1%, no error feedback": {"density": 0.01, "error_feedback": False,
                                      **PAPER},
    "allgather (TopkA) 1%": {"density": 0.01, "algorithm": "allgather",
                             "selection": "exact"},
}
"""The runs every example compares: name -> options of ``topka2a``."""


@dataclasses.dataclass(frozen=True)
class Task:
  """What is trained and how it is scored.

  Attributes:
    model: seed -> a freshly initialised ``nnx.Module``.
    loss: (model, batch) -> scalar training loss on one device's batch.
    batches: (seed, global batch size) -> an endless iterator of batches
      (pytrees of NumPy arrays whose leading axis is split across devices).
    evaluate: model -> the held-out score (a float).
    eval_every: steps between evaluations.
  """

  model: Callable[[int], nnx.Module]
  loss: Callable[[nnx.Module, Any], jax.Array]
  batches: Callable[[int, int], Iterator[Any]]
  evaluate: Callable[[Any], float]
  eval_every: int


@dataclasses.dataclass
class Result:
  """One configuration trained from several seeds."""

  name: str
  eval_steps: list[int]
  scores: list[list[float]]  # per seed, at eval_steps
  losses: list[list[float]]  # per seed, every step's mean training loss
  bytes_per_step: float
  seconds: float

  @property
  def final(self) -> np.ndarray:
    """The last evaluation, per seed."""
    return np.array([s[-1] for s in self.scores])

  @property
  def late(self) -> float:
    """The mean of the last five evaluations over all seeds: less noisy."""
    return float(np.mean([s[-5:] for s in self.scores]))

  @property
  def late_loss(self) -> float:
    """The mean training loss over the last tenth of the steps and all seeds."""
    tail = max(1, len(self.losses[0]) // 10)
    return float(np.mean([losses[-tail:] for losses in self.losses]))


def round_length(opt_state: Any) -> int:
  """Steps per exchange: a :func:`topka2a_jax.local_steps` state's round, else 1."""
  is_local = lambda node: isinstance(node, topka2a_jax.LocalStepsState)
  found = [node for node in jax.tree.leaves(opt_state, is_leaf=is_local) if is_local(node)]
  return int(found[0].every) if found else 1


def nnx_jit_step(train: topka2a_jax.NnxTrainStep):
  """The ``nnx.jit`` training step a Flax NNX user writes around ``train``."""

  @nnx.jit
  def step(model, optimizer, batch):
    return train(model, optimizer, batch)

  return step


def compare(
    runs: dict[str, Callable[..., optax.GradientTransformation]],
    task: Task,
    *,
    steps: int,
    seeds: tuple[int, ...],
    batch_per_device: int,
    mesh,
) -> list[Result]:
  """Trains every run from every seed, one step at a time; returns the results.

  ``runs`` maps a name to ``make_tx(mesh=mesh)``, the chain to train with.
  """
  num_devices = mesh.shape["data"]
  results = []
  # On a terminal, a bar; into a file or a pipe, a line every minute at most.
  bar = tqdm(total=len(runs) * len(seeds) * steps, unit="step", smoothing=0.05,
             mininterval=0.1 if sys.stderr.isatty() else 60.0)
  for name, make_tx in runs.items():
    bar.set_description(name)
    tx = make_tx(mesh=mesh)  # one per run: its seeds share one compilation
    train = topka2a_jax.nnx_train_step(task.loss, mesh)
    # Rounds in flight dispatch their exchange from the step itself, at top level.
    step = train if getattr(make_tx, "keywords", {}).get("overlap") else nnx_jit_step(train)
    result = Result(name, [], [], [], 0.0, 0.0)
    start = time.perf_counter()
    for seed in seeds:
      model = task.model(seed)
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      batches = task.batches(seed, batch_per_device * num_devices)
      if not result.bytes_per_step:
        lowered = train.lower(model, optimizer, next(batches))
        result.bytes_per_step = topka2a_jax.comm_report(lowered).step_bytes(
            round_length(optimizer.opt_state))
      scores, losses, eval_steps = [], [], []
      for i in range(1, steps + 1):
        loss = step(model, optimizer, next(batches))
        losses.append(float(loss))  # waits for the step: see the usage guide on CPU
        if i % task.eval_every == 0 or i == steps:
          scores.append(task.evaluate(model))
          eval_steps.append(i)
        bar.update()
      result.scores.append(scores)
      result.losses.append(losses)
      result.eval_steps = eval_steps
    result.seconds = (time.perf_counter() - start) / len(seeds)
    results.append(result)
  bar.close()
  return results


def print_table(results: list[Result], score: str, fmt: str) -> None:
  """One row per run, its figures over the seeds.

  Columns: the final score (mean, then min..max over seeds), the score
  averaged over the last five evaluations, the training loss over the last
  tenth of the steps, the bytes each device sends per step and their ratio
  to the first run's (the column ``vs dense`` where the first run is
  dense, as in the accuracy page's tables), and the wall time per seed.
  """
  base = results[0]
  width = max(len(r.name) for r in results)
  final = max(16, len("final " + score))  # every header as wide as its column
  ratio = max(8, len("vs " + base.name))
  print(f"\n{'run':{width}s} {'final ' + score:>{final}s} {'min..max':>15s} {'last 5':>7s} "
        f"{'train loss':>10s} {'bytes/step':>11s} {'vs ' + base.name:>{ratio}s} {'s/seed':>6s}")
  for r in results:
    low, high = fmt.format(r.final.min()), fmt.format(r.final.max())
    print(f"{r.name:{width}s} {fmt.format(r.final.mean()):>{final}s} {low + '..' + high:>15s} "
          f"{fmt.format(r.late):>7s} {r.late_loss:10.4f} {r.bytes_per_step:11,.0f} "
          f"{r.bytes_per_step / base.bytes_per_step:{ratio}.3f} "
          f"{r.seconds:6.1f}")


def write_json(results: list[Result], path: str, **meta: Any) -> None:
  """Every curve and figure, for anyone to re-plot or check."""
  with open(path, "w") as f:
    json.dump({"meta": meta, "runs": [dataclasses.asdict(r) for r in results]}, f)


def plot(results: list[Result], path: str, score: str, title: str) -> None:
  """Held-out score and training loss against step, mean over seeds per run."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
  colours = plt.get_cmap("tab10").colors
  late = []  # scores after the first quarter of training: the range that matters
  for i, r in enumerate(results):
    # Ten colours, then the same ten dashed: no two curves look alike.
    style = {"color": colours[i % 10], "linestyle": ("-", "--", ":")[i // 10 % 3]}
    scores = np.mean(r.scores, 0)
    left.plot(r.eval_steps, scores, label=r.name, **style)
    late.extend(scores[len(scores) // 4:])
    losses = np.mean(r.losses, 0)
    window = max(1, len(losses) // 50)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    right.plot(np.arange(window, len(losses) + 1), smooth, label=r.name, **style)
  low, high = min(late), max(late)
  margin = 0.05 * (high - low) or 0.01
  left.set_ylim(low - margin, high + margin)
  smoothing = f" (moving mean over {window} steps)" if window > 1 else ""
  first = results[0].eval_steps[len(results[0].eval_steps) // 4]
  left.set(xlabel="step", ylabel=score,
           title=f"{score} (axis fitted to steps {first} on)")
  right.set(xlabel="step", ylabel="training loss", yscale="log",
            title=f"training loss{smoothing}")
  left.legend(fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
