"""The digits example: the accuracy evidence its page claims.

The digits comparison is the README's main command (docs/evidence/accuracy.md); here three of its runs
train from the same three seeds and the same number of steps, and the test
checks the claims the accuracy page makes from them.
"""

import jax
import pytest
import train_digits
from comparison import compare

pytestmark = pytest.mark.slow  # trains the example's runs over three seeds


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
