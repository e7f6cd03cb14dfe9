"""A small CNN on scikit-learn's handwritten digits, dense against sparse.

Trains a Flax NNX convolutional network on the 8x8 digits bundled with
scikit-learn (1,797 images, nothing downloaded), data-parallel over 8
emulated CPU devices, from three seeds. By default three runs, about two
minutes on two cores: dense ``lax.pmean``; the README's one-liner,
``optax.chain(topka2a(0.01), decay, sgd)`` with no other option (before
momentum SGD it sends 4-bit codes to the owners, 8-bit means back); and the
momentum step compressed instead of the gradient
(:func:`topka2a_jax.compress_updates`). ``--all`` adds the full table (about
15 minutes): TopKA2A as the paper runs it at 1% and 5%, without error
feedback, the TopkA allgather baseline, weight decay before the exchange, a
sparse second phase with threshold selection, 50 dense warm-up steps, a
bucket per leaf and the optimizer sharded.

Prints final test accuracy (mean and spread over seeds), the bytes each
device sends per step (read from the compiled step) and the time per seed;
writes a PNG of test accuracy and training loss against step, and the
curves as JSON.

Run:
  python examples/train_digits.py [--all] [--steps 300] [--seeds 0 1 2] [--out digits]

On a machine with accelerators, drop the XLA_FLAGS line: the mesh then spans
the real devices.
"""

import os

os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8"
)  # 8 CPU devices; must be set before JAX starts

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from comparison import BASE_RUNS, PAPER, Task, compare, plot, print_table, write_json
from flax import nnx
from sklearn.datasets import load_digits

import topka2a_jax

TEST_FRACTION = 0.2  # of the 1,797 images, after a permutation with seed 0
BATCH_PER_DEVICE = 16
LEARNING_RATE = 0.05
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4


class CNN(nnx.Module):
  """Two 3x3 convolutions, 2x2 average pooling and two dense layers (73k params)."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 16, kernel_size=(3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), rngs=rngs)
    self.dense1 = nnx.Linear(4 * 4 * 32, 128, rngs=rngs)
    self.dense2 = nnx.Linear(128, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = nnx.relu(self.conv1(x))
    x = nnx.relu(self.conv2(x))
    x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = nnx.relu(self.dense1(x.reshape(x.shape[0], -1)))
    return self.dense2(x)


def split_digits():
  """The fixed train/test split: images (N, 8, 8, 1) in [0, 1], labels (N,)."""
  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]
  order = np.random.default_rng(0).permutation(len(images))
  cut = int(len(images) * (1 - TEST_FRACTION))
  train, test = order[:cut], order[cut:]
  return (images[train], digits.target[train]), (images[test], digits.target[test])


def make_task() -> Task:
  (x_train, y_train), (x_test, y_test) = split_digits()

  def loss(model, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

  def batches(seed, size):
    rng = np.random.default_rng(1000 + seed)
    while True:  # epochs of shuffled, full batches
      order = rng.permutation(len(x_train))
      for start in range(0, len(order) - size + 1, size):
        chosen = order[start:start + size]
        yield x_train[chosen], y_train[chosen].astype(np.int32)

  @nnx.jit
  def accuracy(model):
    return jnp.mean(jnp.argmax(model(x_test), -1) == y_test)

  return Task(lambda seed: CNN(nnx.Rngs(seed)), loss, batches,
              lambda model: float(accuracy(model)), eval_every=10)


def optimizer(weight_decay: float, decay_first: bool = False, sharded: bool = False,
              updates: bool = False, learning_rate: float = LEARNING_RATE,
              momentum: float | None = MOMENTUM, **options) -> optax.GradientTransformation:
  """Momentum SGD (plain SGD with ``momentum=None``) with weight decay around the exchange.

  The recommended order is exchange, then weight decay, then momentum:
  the decay is computed from the replicated parameters, identical on every
  device, so it needs no exchange and is applied in full at every step.
  ``decay_first=True`` adds it to the gradient before the exchange instead,
  where it competes for the ``density`` slots and waits in the residual.
  ``sharded=True`` runs decay and momentum on each device's shard only
  (:func:`topka2a_jax.sharded_optimizer`); ``updates=True`` runs them on
  every device's own gradient and exchanges their updates
  (:func:`topka2a_jax.compress_updates`).
  """
  decay = optax.add_decayed_weights(weight_decay)
  sgd = optax.sgd(learning_rate, momentum=momentum)
  if updates:
    return topka2a_jax.compress_updates(optax.chain(decay, sgd), **options)
  if sharded:
    return topka2a_jax.sharded_optimizer(optax.chain(decay, sgd), **options)
  exchange = topka2a_jax.topka2a(**options)
  return optax.chain(decay, exchange, sgd) if decay_first else optax.chain(
      exchange, decay, sgd)


RUNS = {
    **BASE_RUNS,
    "topka2a 1%, weight decay before exchange": {"density": 0.01,
                                                 "decay_first": True, **PAPER},
    "topka2a_sparse 1%, threshold selection": {
        "density": 0.01, "algorithm": "topka2a_sparse", "selection": "threshold"},
    "topka2a 1%, 50 dense warm-up steps": {"density": 0.01, "warmup_steps": 50,
                                           **PAPER},
    "defaults 1%": {"density": 0.01},
    "topka2a 1%, a bucket per leaf": {"density": 0.01, "fusion": 1, **PAPER},
    "topka2a 1%, a bucket per leaf, optimizer sharded": {"density": 0.01,
                                                         "sharded": True, **PAPER},
    "updates 1%": {"density": 0.01, "updates": True},
    "updates, onebit": {"algorithm": "onebit", "updates": True},
    "onebit (gradient)": {"algorithm": "onebit"},
    "gtopk 1%": {"density": 0.01, "algorithm": "gtopk", "selection": "exact"},
    "oktopk 1%": {"density": 0.01, "algorithm": "oktopk", "selection": "exact"},
}
"""Every run of ``--all``: name -> options of :func:`optimizer`. The
``onebit`` runs send every entry's sign and the owners' means back in 8 bits
(``topka2a(algorithm="onebit")``): the step of momentum SGD, or the gradient.
``gtopk`` and ``oktopk`` are the global top-k exchanges the TopKA2A paper
compares against (gTop-k, Ok-Topk), with an exact top-k as ``topka2a 1%``."""

DEFAULT_RUNS = ("dense (pmean)", "defaults 1%", "updates 1%")
"""The runs without ``--all``: dense, the one-liner and the step's form."""


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  which = parser.add_mutually_exclusive_group()
  which.add_argument("--all", action="store_true", help="every run, the full table")
  which.add_argument("--runs", nargs="+", choices=list(RUNS), metavar="RUN",
                    help=("these runs (the first is the baseline of the bytes "
                          f"ratio) among: {'; '.join(RUNS)}").replace("%", "%%"))
  parser.add_argument("--weight-decay", type=float, default=WEIGHT_DECAY)
  parser.add_argument("--learning-rate", type=float, default=LEARNING_RATE)
  parser.add_argument("--momentum", type=float, default=MOMENTUM,
                      help="0 trains with plain SGD")
  parser.add_argument("--out", default="digits",
                      help="writes OUT.png (curves) and OUT.json (all figures)")
  args = parser.parse_args(argv)
  names = list(RUNS) if args.all else args.runs or list(DEFAULT_RUNS)

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  momentum = args.momentum or None  # optax.sgd's plain SGD
  print(f"{jax.device_count()} devices, {args.steps} steps of "
        f"{BATCH_PER_DEVICE * jax.device_count()} images, seeds {args.seeds}, "
        f"sgd(lr={args.learning_rate}, momentum={momentum}), "
        f"weight decay {args.weight_decay:g}")
  start = time.perf_counter()
  runs = {name: functools.partial(optimizer, args.weight_decay,
                                  learning_rate=args.learning_rate, momentum=momentum,
                                  **RUNS[name])
          for name in names}
  results = compare(runs, make_task(),
                    steps=args.steps, seeds=tuple(args.seeds),
                    batch_per_device=BATCH_PER_DEVICE, mesh=mesh)
  print_table(results, "test accuracy", "{:.2%}")
  plot(results, args.out + ".png", "test accuracy",
       f"digits CNN, {jax.device_count()} devices, mean of seeds {args.seeds}")
  write_json(results, args.out + ".json", steps=args.steps, seeds=args.seeds)
  minutes, seconds = divmod(round(time.perf_counter() - start), 60)
  print(f"\n{minutes} min {seconds} s; wrote {args.out}.png and {args.out}.json")


if __name__ == "__main__":
  main()
