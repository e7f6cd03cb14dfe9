"""A small character-level transformer on Python's own source, dense against sparse.

Trains a Flax NNX decoder-only transformer (byte-level, 2 layers) to predict
the next byte of the Python standard library's source, which every machine
with Python has: the files in ``SOURCES``, read from this interpreter's
``stdlib`` directory in that order and joined; the first ``TRAIN_BYTES`` bytes
train, the next ``VALID_BYTES`` validate. (The text differs slightly between
Python versions; the table records the version.) Data-parallel over 8
emulated CPU devices, from the same seed: dense ``lax.pmean``, TopKA2A at 1%
and 5% density, TopKA2A without error feedback, the TopkA allgather
baseline, and Adam's updates compressed at 1% with the defaults
(:func:`topka2a_jax.compress_updates`); ``--runs "local 4, rotated_4_4"``
trains with local steps as they come (:func:`topka2a_jax.local_steps`, the
shared parameters evaluated), ``"local 4, rotated_4_8"`` with 8 bits back,
``"local 4"`` with an 8-bit pseudo-gradient.
Prints final validation loss (nats per byte), bytes per step and time;
writes a PNG of validation and training loss against step, and JSON.

Run:
  python examples/train_charlm.py [--steps 600] [--seeds 0] [--quick]

``--quick`` is a two-minute smoke run (few steps, three runs). On a machine
with accelerators, drop the XLA_FLAGS line.
"""

import os

os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8"
)  # 8 CPU devices; must be set before JAX starts

import argparse
import functools
import math
import platform
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from comparison import BASE_RUNS, PAPER, Task, compare, plot, print_table, write_json
from flax import nnx

import topka2a_jax

SOURCES = ("argparse.py", "collections/__init__.py", "dataclasses.py",
           "functools.py", "inspect.py", "pathlib.py", "subprocess.py",
           "typing.py")
TRAIN_BYTES, VALID_BYTES = 400_000, 40_000
CONTEXT, WIDTH, HEADS, LAYERS = 64, 128, 4, 2
BATCH_PER_DEVICE = 8
LEARNING_RATE = 2e-3
WARMUP_STEPS = 50  # of the learning rate, the same in every run


def load_text() -> tuple[np.ndarray, np.ndarray]:
  """Training and validation bytes from the standard library's source."""
  root = Path(sysconfig.get_paths()["stdlib"])
  text = b"".join((root / name).read_bytes() for name in SOURCES)
  if len(text) < TRAIN_BYTES + VALID_BYTES:
    raise SystemExit(f"only {len(text)} bytes of source under {root}")
  data = np.frombuffer(text, np.uint8).astype(np.int32)
  return data[:TRAIN_BYTES], data[TRAIN_BYTES:TRAIN_BYTES + VALID_BYTES]


class Block(nnx.Module):
  """Pre-norm causal self-attention and MLP, each with a residual connection."""

  def __init__(self, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.qkv = nnx.Linear(WIDTH, 3 * WIDTH, rngs=rngs)
    self.proj = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
    self.norm2 = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.up = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
    self.down = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, _ = x.shape
    q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
    heads = lambda t: t.reshape(batch, length, HEADS, WIDTH // HEADS)
    causal = jnp.tril(jnp.ones((length, length), bool))
    attended = jax.nn.dot_product_attention(heads(q), heads(k), heads(v),
                                            mask=causal[None, None])
    x = x + self.proj(attended.reshape(batch, length, WIDTH))
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class CharLM(nnx.Module):
  """Byte embeddings, learnt positions, ``LAYERS`` blocks and a byte head."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(256, WIDTH, rngs=rngs)
    self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (CONTEXT, WIDTH)))
    self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.head = nnx.Linear(WIDTH, 256, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens) + self.position[: tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))


def make_task(eval_every: int) -> Task:
  train, valid = load_text()
  windows = np.lib.stride_tricks.sliding_window_view(valid, CONTEXT + 1)
  valid_windows = windows[:: CONTEXT][:128]  # 128 disjoint windows, 8k bytes

  def loss(model, windows):
    logits = model(windows[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, windows[:, 1:]).mean()

  def batches(seed, size):
    rng = np.random.default_rng(2000 + seed)
    while True:
      starts = rng.integers(0, len(train) - CONTEXT - 1, size)
      yield np.stack([train[s:s + CONTEXT + 1] for s in starts])

  validation = nnx.jit(loss)
  return Task(lambda seed: CharLM(nnx.Rngs(seed)), loss, batches,
              lambda model: float(validation(model, valid_windows)),
              eval_every=eval_every)


def optimizer(steps: int, learning_rate: float, updates: bool = False,
              every: int = 0, **options) -> optax.GradientTransformation:
  """Adam with a linear warm-up and cosine decay, after the exchange or inside it.

  ``updates=True`` compresses Adam's updates
  (:func:`topka2a_jax.compress_updates`); ``every=N`` runs Adam on each
  device alone for rounds of ``N`` steps and exchanges the pseudo-gradients
  (:func:`topka2a_jax.local_steps`, outer SGD at 1); otherwise the gradient
  is exchanged first, ``optax.chain(topka2a(...), adam)``.
  """
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, learning_rate, WARMUP_STEPS, max(steps, WARMUP_STEPS + 1))
  if every:
    return topka2a_jax.local_steps(optax.adam(schedule), every=every, **options)
  if updates:
    return topka2a_jax.compress_updates(optax.adam(schedule), **options)
  return optax.chain(topka2a_jax.topka2a(**options), optax.adam(schedule))


RUNS = {
    **BASE_RUNS,
    "topka2a 1%, 100 dense warm-up steps": {"density": 0.01, "warmup_steps": 100,
                                            **PAPER},
    "updates 1%": {"density": 0.01, "updates": True},
    "updates, onebit": {"algorithm": "onebit", "updates": True},
    "updates, onebit_4": {"algorithm": "onebit_4", "updates": True},
    "quantized_8_8": {"algorithm": "quantized_8_8"},
    "quantized_4_8": {"algorithm": "quantized_4_8"},
    "quantized_8_8_fine": {"algorithm": "quantized_8_8_fine"},
    "rotated_4_8": {"algorithm": "rotated_4_8"},
    "rotated_4_4": {"algorithm": "rotated_4_4"},
    "local 2": {"every": 2, "algorithm": "quantized_8_8_fine"},
    "local 4": {"every": 4, "algorithm": "quantized_8_8_fine"},
    "local 4, rotated_4_8": {"every": 4, "algorithm": "rotated_4_8"},
    "local 4, rotated_4_4": {"every": 4},  # local_steps' default form
    "local 4, rotated_4_4, overlapped": {"every": 4, "overlap": True},
}
QUICK_RUNS = ("dense (pmean)", "topka2a 1%", "updates 1%")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=600)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0])
  parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=None,
                      metavar="RUN", help="subset of the runs (the first is the "
                      "baseline of the bytes ratio)")
  parser.add_argument("--lr", type=float, default=LEARNING_RATE,
                      help="Adam's peak learning rate")
  parser.add_argument("--quick", action="store_true",
                      help="a one-minute smoke run: 40 steps of three runs")
  parser.add_argument("--out", default="charlm",
                      help="writes OUT.png (curves) and OUT.json (all figures)")
  args = parser.parse_args()
  steps = 40 if args.quick else args.steps
  names = args.runs or (QUICK_RUNS if args.quick else list(RUNS))

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  params = jax.tree.leaves(nnx.state(CharLM(nnx.Rngs(0)), nnx.Param))
  print(f"{jax.device_count()} devices, {steps} steps of "
        f"{BATCH_PER_DEVICE * jax.device_count()} x {CONTEXT} bytes, seeds "
        f"{args.seeds}, {sum(p.size for p in params):,} parameters, Python "
        f"{platform.python_version()} source; uniform guess: "
        f"{math.log(256):.3f} nats/byte")
  runs = {name: functools.partial(optimizer, steps, args.lr, **RUNS[name]) for name in names}
  results = compare(runs, make_task(eval_every=max(1, steps // 12)), steps=steps,
                    seeds=tuple(args.seeds), batch_per_device=BATCH_PER_DEVICE,
                    mesh=mesh)
  print_table(results, "valid loss", "{:.4f}")
  plot(results, args.out + ".png", "validation loss (nats/byte)",
       f"byte-level transformer on stdlib source, {jax.device_count()} devices")
  write_json(results, args.out + ".json", steps=steps, seeds=args.seeds,
             python=platform.python_version())
  print(f"\nwrote {args.out}.png and {args.out}.json")


if __name__ == "__main__":
  main()
