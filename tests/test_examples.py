"""The real-data examples: accuracy evidence on digits, a smoke run of the LM.

The digits comparison is the README's main command (docs/evidence/accuracy.md); here three of its runs
train from the same three seeds and the same number of steps, and the test
checks the claims the accuracy page makes from them.
"""

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest
import train_digits
from comparison import compare

pytestmark = pytest.mark.slow  # examples and several processes

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.fixture(scope="module")
def digits_results():
  runs = {name: (lambda options=options, **mesh: train_digits.optimizer(
      train_digits.WEIGHT_DECAY, **options, **mesh))
          for name, options in train_digits.RUNS.items()
          if name in ("dense (pmean)", "topka2a 1%", "topka2a 1%, no error feedback",
                      "updates 1%")}
  results = compare(runs, train_digits.make_task(), steps=400, seeds=(0, 1, 2),
                    batch_per_device=train_digits.BATCH_PER_DEVICE,
                    mesh=jax.make_mesh((8,), ("data",)))
  return {r.name: r for r in results}


def test_sparse_digits_within_a_point_of_dense(digits_results):
  dense = digits_results["dense (pmean)"]
  sparse = digits_results["topka2a 1%"]
  assert dense.final.mean() > 0.95
  assert sparse.final.mean() > dense.final.mean() - 0.01
  assert sparse.bytes_per_step < 0.55 * dense.bytes_per_step


def test_digits_with_the_momentum_step_compressed_within_a_point_of_dense(
    digits_results):
  dense = digits_results["dense (pmean)"]
  updates = digits_results["updates 1%"]
  assert updates.final.mean() > dense.final.mean() - 0.01


def test_digits_without_error_feedback_is_worse(digits_results):
  with_feedback = digits_results["topka2a 1%"]
  without = digits_results["topka2a 1%, no error feedback"]
  assert without.late < with_feedback.late - 0.005  # last five evaluations
  assert without.late_loss > 1.3 * with_feedback.late_loss


def test_charlm_quick_run_writes_its_table_and_plot(tmp_path):
  out = tmp_path / "charlm"
  done = subprocess.run(
      [sys.executable, str(EXAMPLES / "train_charlm.py"), "--quick", "--out", str(out)],
      capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "updates 1%" in done.stdout and "valid loss" in done.stdout
  assert out.with_suffix(".png").stat().st_size > 10_000
  runs = json.loads(out.with_suffix(".json").read_text())["runs"]
  assert runs[0]["name"] == "dense (pmean)"
  assert all(r["scores"][0][-1] < 5.0 for r in runs)  # learnt: ln 256 is 5.55
