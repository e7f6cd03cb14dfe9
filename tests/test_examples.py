"""The digits example, the README's main command: its default run against its docs.

The default run is ``python examples/train_digits.py`` itself (``main()``,
writing its JSON to a temporary folder). The tests read that JSON, the file
a user gets, and check it against the table ``docs/evidence/accuracy.md``
prints for it (each mean within the seeds' spread the table states, the
bytes exactly) and against the claims that page makes: over the last five
evaluations the sparse runs are within a point of dense, and without error
feedback the card's chain ends worse. A final accuracy differs from one
machine of this kind to another (their rounding differs, and 300 steps
amplify it), so no check rests on one seed's last evaluation.
"""

import json
import pathlib

import jax
import numpy as np
import pytest
import train_digits
from comparison import compare

pytestmark = pytest.mark.slow  # trains the example's runs over three seeds

ACCURACY_PAGE = pathlib.Path(__file__).parents[1] / "docs" / "evidence" / "accuracy.md"
TEST_IMAGE = 1 / 360  # one image of the test set, in accuracy


def documented_table(marker: str) -> dict[str, dict[str, float]]:
  """The first Markdown table after ``marker`` on the accuracy page, by run name."""
  text = ACCURACY_PAGE.read_text()
  rows = {}
  for line in text[text.index(marker):].splitlines():
    if not line.startswith("|"):
      if rows:
        return rows
      continue
    cells = [c.strip() for c in line.strip("|").split("|")]
    if cells[0] in ("run", "") or set(cells[1]) <= set("-: "):
      continue
    low, high = (float(end.rstrip("%")) / 100 for end in cells[2].split(".."))
    rows[cells[0].strip("`")] = {"final": float(cells[1].rstrip("%")) / 100,
                                 "spread": (low, high),
                                 "bytes": float(cells[5].replace(",", ""))}
  return rows


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("digits") / "digits"
  train_digits.main(["--out", str(out)])
  with open(f"{out}.json") as f:
    saved = json.load(f)
  return saved["meta"], {run["name"]: run for run in saved["runs"]}


def final(run) -> float:
  """Final test accuracy, mean over seeds."""
  return float(np.mean([scores[-1] for scores in run["scores"]]))


def late(run) -> float:
  """Test accuracy over the last five evaluations and the seeds."""
  return float(np.mean([scores[-5:] for scores in run["scores"]]))


def test_default_run_prints_the_documented_table(default_run):
  meta, runs = default_run
  assert meta == {"steps": 300, "seeds": [0, 1, 2]}
  documented = documented_table("**Digits.**")
  assert list(documented) == list(train_digits.DEFAULT_RUNS) == list(runs)
  for name, row in documented.items():
    low, high = row["spread"]
    assert low - TEST_IMAGE / 2 <= final(runs[name]) <= high + TEST_IMAGE / 2, name
    assert runs[name]["bytes_per_step"] == row["bytes"], name


def test_sparse_runs_are_within_a_point_of_dense_late_in_training(default_run):
  _, runs = default_run
  dense = late(runs["dense (pmean)"])
  assert dense > 0.95
  for name, share in (("defaults 1%", 0.2), ("updates 1%", 0.1)):
    assert late(runs[name]) > dense - 0.01, name
    assert runs[name]["bytes_per_step"] < share * runs["dense (pmean)"]["bytes_per_step"]


def test_without_error_feedback_the_chain_ends_worse(default_run):
  meta, _ = default_run
  names = ("topka2a 1%", "topka2a 1%, no error feedback")
  with_feedback, without = compare({name: lambda name=name, **mesh: train_digits.optimizer(
      train_digits.WEIGHT_DECAY, **train_digits.RUNS[name], **mesh) for name in names},
      train_digits.make_task(), steps=meta["steps"], seeds=tuple(meta["seeds"]),
      batch_per_device=train_digits.BATCH_PER_DEVICE,
      mesh=jax.make_mesh((8,), ("data",)))
  assert without.late < with_feedback.late - 0.01
  steps = meta["steps"]
  late_loss = np.mean([losses[-steps // 10:] for losses in with_feedback.losses])
  assert without.late_loss > 2 * late_loss
