"""The digits example, the README's main command: its default run against its docs.

The default run is ``python examples/train_digits.py`` itself (``main()``,
writing its JSON to a temporary folder). The tests read that JSON, the file
a user gets, and check it against the committed run whose table the accuracy
evidence page shows (each mean within that run's spread over the seeds, the
bytes exactly) and against the claims that page makes: over the last five
evaluations the sparse runs are within a point of dense, and without error
feedback the card's chain ends worse. A final accuracy differs from one
machine of this kind to another (their rounding differs, and 300 steps
amplify it), so no check rests on one seed's last evaluation.
"""

import json

import evidence
import jax
import numpy as np
import pytest
import train_digits
from comparison import compare

pytestmark = pytest.mark.slow  # trains the example's runs over three seeds

TEST_IMAGE = 1 / 360  # one image of the test set, in accuracy
DOCUMENTED = "digits_defaults"
"""The named result of the accuracy page's first table: the default run, committed."""


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


def test_default_run_is_the_documented_run_to_the_seeds_spread(default_run):
  meta, runs = default_run
  documented = evidence.json_of(DOCUMENTED)
  assert meta == documented["meta"] == {"steps": 300, "seeds": [0, 1, 2]}
  assert ([run["name"] for run in documented["runs"]] == list(train_digits.DEFAULT_RUNS)
          == list(runs))
  for row in documented["runs"]:
    finals = [scores[-1] for scores in row["scores"]]
    name = row["name"]
    assert min(finals) - TEST_IMAGE / 2 <= final(runs[name]) <= max(finals) + TEST_IMAGE / 2, name
    assert runs[name]["bytes_per_step"] == row["bytes_per_step"], name


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
