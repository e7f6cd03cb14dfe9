"""Error feedback at work: the quickstart's MLP trained with sparse gradients.

The task (examples/quickstart.py) is fixed: a random teacher network with
noisy labels, learnt by a 3-layer MLP from minibatches on 8 devices with
Adam. Minibatch noise is what makes dropping the unsent gradient hurt:
without error feedback the small but consistent gradient entries never get
through.
"""

import functools

import jax
import pytest
import quickstart

pytestmark = pytest.mark.slow  # trains the quickstart's MLP, 400 steps a run

STEPS, LEARNING_RATE = 400, 3e-3


@functools.cache
def held_out_loss(**options):
  mesh = jax.make_mesh((8,), ("data",))
  return quickstart.train(mesh, {"density": 0.05, "selection": "exact", **options},
                          STEPS, LEARNING_RATE)


@pytest.mark.parametrize("algorithm", ["topka2a", "allgather"])
def test_sparse_training_stays_close_to_dense(algorithm):
  params, _, test_set = quickstart.make_task()
  initial = float(quickstart.mse(params, *test_set))
  dense = held_out_loss(algorithm="dense")
  sparse = held_out_loss(algorithm=algorithm)
  assert sparse < 0.3 * initial
  assert sparse < 1.25 * dense


def test_error_feedback_clearly_helps():
  with_feedback = held_out_loss(algorithm="topka2a")
  without = held_out_loss(algorithm="topka2a", error_feedback=False)
  assert without > 1.15 * with_feedback
