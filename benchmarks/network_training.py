"""End-to-end training on a real, bandwidth-limited link: dense against sparse.

Starts P processes (one CPU device each, gloo over TCP) inside the shaped
network namespace of ``benchmarks/link.py`` (loopback at 1 Gbit/s by
default) and trains the same model from the same initialisation and batches
once per configuration (:data:`RUNS`). By default: dense ``lax.pmean``; the
gradient compressed, ``optax.chain(topka2a(density), optax.adam(...))``;
Adam's updates compressed, ``compress_updates(optax.adam(...), density)``;
and the same through TopKA2A-sparse, whose owners hold back part of each
summed shard. Every step is forward, backward, exchange and Adam, through
:func:`topka2a_jax.train_step`.

The model is a byte-level transformer on the examples' data (the Python
standard library's source, ``examples/train_charlm.py``), made wide (width
384, 4 layers: 7.3M parameters) and fed few tokens per step (2 x 64 bytes per
process): its dense exchange then takes several times its compute on this
link, as the paper's models' exchanges did on theirs. (The examples' digits
CNN, 73k parameters, is bound by its compute.)

Reports seconds per step (median; a ``local N`` run's median round over N),
the training time to reach each of ``--targets`` (validation losses;
evaluations excluded), the final and the highest validation loss.
``--seed`` changes the initialisation and the batches, ``--batch`` the
windows per process and step.

``--local`` trains the same way in one process on as many emulated CPU
devices, with no link: the losses come out as on the link (to float
rounding: gloo adds in another order), the times do not. ``--b1`` sets
Adam's first-moment decay, ``--peak-lr`` its learning rate after the
warm-up (2e-3; the warm-up is a quarter of the steps, at most 30, and a
cosine takes it to 0 at the last step), dense's and local steps' inner one
alike. The ``local N...`` runs train with
``local_steps(optax.adam(...), N, ...)``: rounds of N steps, their
pseudo-gradients in 8 bits (``"local N"``), as named (``", rotated_4_4"``
is ``local_steps``' default), or else in ``rotated_4_8``, the default when
those runs were measured; outer SGD at 1 (or at 0.75, 1.25 or 1.5, DiLoCo's
Nesterov, or Nesterov at 0.5 with momentum 0.5); their bytes are a round's
over its N steps, and the validation loss is the shared parameters', which
move once a round. ``", inner state averaged"`` (Local Adam's state
averaging, DES-LOC's with one period: arXiv 2505.22549) also replaces every
device's Adam moments by their mean over the devices after each round (or
every third; ``", first moment averaged"`` and ``", second moment
averaged"``: one of them alone; ``", first moment averaged every round,
second every 6"`` and ``"... every 3 rounds, second every 6"``: a period
for each, DES-LOC's schedule), exactly, in float32:
:func:`average_inner_state`, timed and counted with the step;
``", inner state averaged in few bits"`` (every round, or every 3) does the
same in codes, a first try: the first moments in ``local_steps``' rotated
4-bit code, the second in ``collectives.relative_mean``. ``", inner state averaged
in 8 bits"`` is the library's own, ``local_steps(..., average_inner_state=True)``.
``", rotated_4_8, momentum from the round's mean step"`` sends nothing more:
after each round each device's Adam momentum becomes the devices' mean step
in its own second moment's units (:func:`momentum_from_mean_step`).
``", rotated_4_4, small leaves' state averaged"`` averages only the state of
the embeddings, the head and the norms, exactly (3% of the entries).
``"local N, rotated_4_4, every M from step S"`` shortens the rounds to M
steps from step S (``local_steps(..., every={0: N, S: M})``); on the link
(``--link-seconds``) its later steps take the time of a timed run of rounds
of M in the same code (``"local M, rotated_4_4"``), which that JSON must hold.

Run:
  python benchmarks/network_training.py [--rate 1gbit] [--processes 4]
      [--steps 300] [--density 0.01] [--targets 2.6 2.5 2.4] [--runs RUN ...]
      [--seed 0] [--batch 2] [--b1 0.9] [--peak-lr 2e-3] [--local] [--json out.json]
  python benchmarks/network_training.py --from-json a.json b.json [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import link  # benchmarks/link.py: the shaped namespace, its workers, the timer

ROOT = Path(__file__).resolve().parent.parent
WIDTH, LAYERS, HEADS, CONTEXT, BATCH_PER_DEVICE = 384, 4, 6, 64, 2
SMALL_LEAVES = ("embed", "position", "head", "norm1", "norm2")
RUNS = {
    "dense": {"algorithm": "dense"},
    "defaults": {},
    "updates": {"form": "updates"},
    "updates, topka2a_sparse": {"form": "updates", "algorithm": "topka2a_sparse"},
    "updates, all sent": {"form": "updates", "algorithm": "dense"},
    "momentum, variance frozen at 30": {"form": "momentum", "freeze_after": 30},
    "updates, EF21": {"form": "ef21"},
    "normalised, momentum after": {"form": "normalised"},
    "topka2a (paper)": {"algorithm": "topka2a", "selection": "exact"},
    "topka2a_sparse": {"algorithm": "topka2a_sparse", "selection": "threshold"},
    "allgather (TopkA)": {"algorithm": "allgather", "selection": "threshold"},
    "powersgd rank 1": {"algorithm": "powersgd", "rank": 1},
    "powersgd rank 4": {"algorithm": "powersgd", "rank": 4},
    "updates, powersgd rank 4": {"form": "updates", "algorithm": "powersgd", "rank": 4},
    "updates at 0.35%": {"form": "updates", "density": 0.0035},
    "updates at 0.1%": {"form": "updates", "density": 0.001},
    "updates, onebit": {"form": "updates", "algorithm": "onebit"},
    "updates, onebit_4": {"form": "updates", "algorithm": "onebit_4"},
    "updates, onebit_1": {"form": "updates", "algorithm": "onebit_1"},
    "momentum, variance frozen at 30, onebit": {"form": "momentum", "freeze_after": 30,
                                                "algorithm": "onebit"},
    "onebit": {"algorithm": "onebit"},
    **{name: {"algorithm": name} for name in (
        "quantized_4_8", "quantized_4_4", "quantized_2_8", "quantized_8_8", "quantized_8_4",
        "quantized_8_8_fine", "rotated_4_8", "rotated_4_4")},
    "defaults, buckets split to overlap the backward pass": {
        "backward_seconds": "estimated"},
    # A run that names no code sends what local_steps sent by default when it
    # was measured: rotated_4_8 (8 bits for the two outer momenta, earlier).
    **{f"local {every}{name}": {"form": "local", "every": every,
                                "algorithm": "rotated_4_8", **options}
       for every in (2, 4, 8)
       for name, options in (
           ("", {"algorithm": "quantized_8_8_fine"}),  # 8 bits, outer SGD at 1
           (", exact mean", {"algorithm": "dense"}),
           (", rotated_4_8", {"algorithm": "rotated_4_8"}),
           (", top-k 3%", {"algorithm": "topka2a_sparse", "density": 0.03}),
           (", nesterov", {"outer": "nesterov", "algorithm": "quantized_8_8_fine"}),
           (", outer 0.5 momentum 0.5", {"outer": "half momentum",
                                         "algorithm": "quantized_8_8_fine"}),
           (", outer 0.75", {"outer": "0.75"}),
           (", outer 1.25", {"outer": "1.25"}),
           (", outer 1.5", {"outer": "1.5"}),
           (", inner state averaged", {"inner_mean": ((None, 1),)}),
           (", inner state averaged every 3 rounds", {"inner_mean": ((None, 3),)}),
           (", first moment averaged", {"inner_mean": (("mu", 1),)}),
           (", second moment averaged", {"inner_mean": (("nu", 1),)}),
           # DES-LOC's periods: the slower the moment, the rarer its mean
           (", first moment averaged every round, second every 6",
            {"inner_mean": (("mu", 1), ("nu", 6))}),
           (", first moment averaged every 3 rounds, second every 6",
            {"inner_mean": (("mu", 3), ("nu", 6))}),
           (", inner state averaged in 8 bits", {"average_inner_state": True}),
           (", inner state averaged in few bits", {"inner_mean": ((None, 1),),
                                                   "inner_mean_coded": True}),
           (", inner state averaged in few bits every 3 rounds", {
               "inner_mean": ((None, 3),), "inner_mean_coded": True}),
           # no bytes: the round's mean step, in each device's own second moment
           (", rotated_4_8, momentum from the round's mean step",
            {"fold_momentum": True}),
           (", rotated_4_4", {"algorithm": "rotated_4_4"}),
           (", rotated_4_4, inner state averaged in 8 bits",
            {"algorithm": "rotated_4_4", "average_inner_state": True}),
           # the state of the leaves every byte meets (embeddings, head, norms):
           # 3% of the entries
           (", rotated_4_4, small leaves' state averaged",
            {"algorithm": "rotated_4_4", "inner_mean": ((SMALL_LEAVES, 1),)}))},
    # shorter rounds once the targets are behind (AdaComm's schedule)
    **{f"local {first}, rotated_4_4, every {later} from step {start}": {
        "form": "local", "every": {0: first, start: later}, "algorithm": "rotated_4_4"}
       for first, start, later in ((4, 100, 2), (4, 100, 1), (8, 96, 2))},
    **{f"local {every}, rotated_4_4": {"form": "local", "every": every,
                                       "algorithm": "rotated_4_4"} for every in (1, 2)},
    # each round's exchange beside the next round's steps, its mean a round late
    **{f"local {every}, rotated_4_4, overlapped {rule}": {
        "form": "local", "every": every, "algorithm": "rotated_4_4", "overlap": rule}
       for every in (1, 2, 4, 8) for rule in ("eager", "own", "delayed")},
    # the steps' compute alone: rounds longer than any run, so nothing is sent
    "no exchange (compute alone)": {"form": "local", "every": 2**30, "algorithm": "dense"},
    # the pseudo-gradient's rotated signs both ways: a quarter of rotated_4_4's bytes
    **{f"local {every}, rotated_1_1": {"form": "local", "every": every,
                                       "algorithm": "rotated_1_1"} for every in (1, 4)},
    "local 4, rotated_1_1, every 1 from step 100": {
        "form": "local", "every": {0: 4, 100: 1}, "algorithm": "rotated_1_1"},
    # the sparse all-reduces the paper compares against, before plain SGD
    **{f"plain SGD, {name}": {"form": "sgd", "algorithm": name} for name in (
        "dense", "topka2a", "topka2a_sparse", "allgather", "gtopk", "oktopk")},
}
"""Configurations: name -> options of ``topka2a`` besides the density.

``"form": "updates"`` compresses Adam's updates,
``topka2a_jax.compress_updates(optax.adam(...), density, **options)``;
``"form": "momentum"`` compresses Adam's momentum and freezes its variance
after ``freeze_after`` dense steps (1-bit Adam's form,
``topka2a_jax.frozen_variance_adam``); two candidates measured and set aside:
``"form": "ef21"`` compresses the change of each device's Adam step and
applies the running sum of the mean changes (EF21 on the updates), and
``"form": "normalised"`` compresses each device's gradient divided by its own
RMS (Adam with b1 = 0) and applies the first moment and the learning rate to
the mean; the others compress the gradient, ``optax.chain(topka2a(density, **options),
optax.adam(...))``. Any run followed by ``", N dense steps"`` is a run too,
with ``warmup_steps=N``: ``"updates, 30 dense steps"``. ``"density"`` overrides
``--density`` for one run: the updates at 0.35% and at 0.1% send about the
bytes of PowerSGD at rank 4 and at rank 1 on this model (the table's
``MB/step``: what each process sends per step, read from the compiled step by
:func:`topka2a_jax.comm_report`). The ``onebit`` runs send every entry's sign
to its shard's owner and the owners' means back in 8 bits (``onebit_4``: 4,
``onebit_1``: 1): Adam's updates, the frozen-variance momentum, or (plain
``"onebit"``) the gradient before a replicated Adam; they ignore the density.
``"form": "sgd"`` exchanges the gradient before plain SGD,
``optax.chain(topka2a(density, algorithm=...), optax.sgd(...))``, at the
peak learning rate ``--sgd-peak-lr`` (same warm-up and cosine): the setting
of the sparse all-reduces' papers. ``"backward_seconds": "estimated"``
plans the buckets to overlap the backward pass the step estimates
(``TrainStep.backward_seconds``), as accelerators' steps do; on CPUs the
steps plan without it, since XLA's CPU backend runs collectives in line
(``benchmarks/overlap.py``).
"""

SGD_PEAK_LR = 0.02
"""Plain SGD's learning rate after the warm-up in the ``"plain SGD, ..."`` runs.

Of 0.002, 0.01, 0.02 and 0.05, the largest at which the dense run's 100
steps (seed 0, batch 2) did not diverge; its loss fell fastest there.
"""

DEFAULT_RUNS = ["dense", "defaults", "updates", "updates, topka2a_sparse",
                "momentum, variance frozen at 30"]
"""What a run of the benchmark compares unless ``--runs`` says otherwise."""


def run_options(name: str) -> dict:
  """The options of ``topka2a`` of the run called ``name``."""
  if name in RUNS:
    return RUNS[name]
  base, _, rest = name.rpartition(", ")
  count, _, suffix = rest.partition(" ")
  if base in RUNS and suffix == "dense steps" and count.isdigit():
    return {**RUNS[base], "warmup_steps": int(count)}
  raise ValueError(
      f"unknown run {name!r}; choose among {', '.join(map(repr, RUNS))}, or one "
      "of them and N dense steps first: 'updates, 30 dense steps'")


def optimizer(name: str, density: float, mesh, schedule, b1: float,
              backward_seconds: float = 0.0):
  """The optimizer of the run called ``name``: the gradient or the updates compressed.

  ``backward_seconds`` stands for ``"estimated"`` in the run's options.
  """
  import optax

  import topka2a_jax

  options = dict(run_options(name))
  if options.get("backward_seconds") == "estimated":
    options["backward_seconds"] = backward_seconds
  form = options.pop("form", "gradient")
  density_given = "density" in options  # a code takes none: local_steps refuses one
  density = options.pop("density", density)
  if form == "local":
    outer = {None: None,
             "nesterov": optax.sgd(0.7, momentum=0.9, nesterov=True),  # DiLoCo's
             # a steady step of the mean pseudo-gradient, its rounds' noise averaged
             "half momentum": optax.sgd(0.5, momentum=0.5, nesterov=True),
             # a shorter or a longer step than to the mean
             "0.75": optax.sgd(0.75), "1.25": optax.sgd(1.25), "1.5": optax.sgd(1.5),
             }[options.pop("outer", None)]
    options.pop("inner_mean", None)  # applied by the training loop
    options.pop("inner_mean_coded", None)
    options.pop("fold_momentum", None)
    return topka2a_jax.local_steps(optax.adam(schedule, b1=b1), every=options.pop("every"),
                                   outer=outer, density=density if density_given else None,
                                   mesh=mesh, **options)
  if form == "sgd":
    return optax.chain(topka2a_jax.topka2a(density, mesh=mesh, **options), optax.sgd(schedule))
  if form == "updates":
    return topka2a_jax.compress_updates(optax.adam(schedule, b1=b1), density=density,
                                        mesh=mesh, **options)
  if form == "momentum":
    return topka2a_jax.frozen_variance_adam(schedule, density, b1=b1, mesh=mesh,
                                            **options)
  if form == "ef21":
    return optax.chain(
        topka2a_jax.compress_updates(optax.chain(optax.adam(schedule, b1=b1),
                                                 _differences()),
                                     density=density, mesh=mesh, **options),
        _running_sum())
  if form == "normalised":
    return optax.chain(
        topka2a_jax.compress_updates(optax.scale_by_adam(b1=0.0), density=density, mesh=mesh,
                                     **options),
        optax.ema(b1, debias=True), optax.scale_by_learning_rate(schedule))
  return optax.chain(topka2a_jax.topka2a(density, mesh=mesh, **options),
                     optax.adam(schedule, b1=b1))


def _differences():
  """Each update minus the previous one (the first minus zeros): EF21's input."""
  import jax
  import jax.numpy as jnp
  import optax

  def update(updates, previous, params=None):
    del params
    return jax.tree.map(jnp.subtract, updates, previous), updates

  return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)


def _running_sum():
  """The sum of every update so far: EF21's estimate, applied every step."""
  import jax
  import jax.numpy as jnp
  import optax

  def update(updates, total, params=None):
    del params
    total = jax.tree.map(jnp.add, total, updates)
    return total, total

  return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)


def init(key):
  """The transformer's parameters: embeddings, LAYERS blocks, head."""
  import jax
  import jax.numpy as jnp

  keys = iter(jax.random.split(key, 4 + 4 * LAYERS))
  normal = lambda shape, scale: scale * jax.random.normal(next(keys), shape)
  params = {"embed": normal((256, WIDTH), 0.02), "position": normal((CONTEXT, WIDTH), 0.02),
            "head": normal((WIDTH, 256), WIDTH ** -0.5)}
  for layer in range(LAYERS):
    params[f"block{layer}"] = {
        "qkv": normal((WIDTH, 3 * WIDTH), WIDTH ** -0.5),
        "proj": normal((WIDTH, WIDTH), WIDTH ** -0.5 / LAYERS),
        "up": normal((WIDTH, 4 * WIDTH), WIDTH ** -0.5),
        "down": normal((4 * WIDTH, WIDTH), (4 * WIDTH) ** -0.5 / LAYERS),
        "norm1": jnp.ones(WIDTH), "norm2": jnp.ones(WIDTH)}
  return params


def loss(params, windows):
  """Mean next-byte cross-entropy of ``windows`` (B, CONTEXT + 1), nats per byte."""
  import jax
  import jax.numpy as jnp

  def norm(x, scale):
    return scale * (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)

  tokens, targets = windows[:, :-1], windows[:, 1:]
  batch, length = tokens.shape
  x = params["embed"][tokens] + params["position"][:length]
  causal = jnp.tril(jnp.ones((length, length), bool))
  for layer in range(LAYERS):
    p = params[f"block{layer}"]
    q, k, v = jnp.split(norm(x, p["norm1"]) @ p["qkv"], 3, axis=-1)
    heads = lambda t: t.reshape(batch, length, HEADS, WIDTH // HEADS)
    attended = jax.nn.dot_product_attention(heads(q), heads(k), heads(v),
                                            mask=causal[None, None])
    x = x + attended.reshape(batch, length, WIDTH) @ p["proj"]
    x = x + jax.nn.gelu(norm(x, p["norm2"]) @ p["up"]) @ p["down"]
  logits = x @ params["head"]
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None],
                                       axis=-1))


def worker(args: argparse.Namespace) -> None:
  """Inside the namespace, on every process (or in one, ``--local``): train every run."""
  import topka2a_jax.distributed

  if not args.local:
    topka2a_jax.distributed.initialize()
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  import topka2a_jax

  sys.path.insert(0, str(ROOT / "examples"))
  from train_charlm import load_text

  train, valid = load_text()
  mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("data",))
  rng = np.random.default_rng(args.seed)
  size = args.batch * mesh.size
  starts = rng.integers(0, len(train) - CONTEXT - 1, (args.steps, size))
  batches = [np.stack([train[s:s + CONTEXT + 1] for s in row]) for row in starts]
  valid_windows = np.lib.stride_tricks.sliding_window_view(valid, CONTEXT + 1)[::CONTEXT][:64]
  validation = jax.jit(loss)
  backward = topka2a_jax.train_step(loss, optax.sgd(0.0), mesh).backward_seconds(
      init(jax.random.key(args.seed)), batches[0])
  rows = []
  for name in args.runs:
    warmup = min(30, args.steps // 4)
    peak = args.sgd_peak_lr if run_options(name).get("form") == "sgd" else args.peak_lr
    schedule = optax.warmup_cosine_decay_schedule(0.0, peak, warmup,
                                                  max(args.steps, warmup + 1))
    tx = optimizer(name, args.density, mesh, schedule, args.b1, backward)
    options = run_options(name)
    every = first_length(options.get("every", 1))
    params = jax.tree.map(lambda v: jax.make_array_from_callback(
        v.shape, NamedSharding(mesh, P()), lambda index, v=v: np.asarray(v)[index]),
        init(jax.random.key(args.seed)))
    state, step = tx.init(params), topka2a_jax.train_step(loss, tx, mesh)
    # local_steps' lowered step holds its round's exchange in a branch, taken once a round
    sent = topka2a_jax.comm_report(step.lower(params, state, batches[0])).step_bytes(
        options.get("every", 1), steps=args.steps)
    means = []  # (a program of its own, the steps between two runs of it)
    for only, rounds in options.get("inner_mean", ()):
      averaged = jax.jit(
          functools.partial(average_inner_state, only=only, mesh=mesh,
                            coded=options.get("inner_mean_coded", False)),
          donate_argnums=0, out_shardings=jax.tree.map(lambda leaf: leaf.sharding, state))
      means.append((averaged, every * rounds))
      sent += topka2a_jax.comm_report(averaged.lower(state)).step_bytes() / (every * rounds)
    folded = jax.jit(functools.partial(momentum_from_mean_step, b1=args.b1), donate_argnums=0,
                     out_shardings=jax.tree.map(lambda leaf: leaf.sharding, state))
    # compiles (an overlapped run: the steps that end a round, and its exchange's program)
    for _ in range(2 * every if "overlap" in options else 1):
      params, state, _ = step(params, state, batches[0])
    jax.block_until_ready(params)
    step.settle()  # an overlapped run's last round, still in flight
    params = jax.tree.map(lambda v: jax.make_array_from_callback(
        v.shape, NamedSharding(mesh, P()), lambda index, v=v: np.asarray(v)[index]),
        init(jax.random.key(args.seed)))
    state = tx.init(params)
    seconds, evals = [], []
    timeline = Timeline(step, tx) if "overlap" in options else None
    for i, batch in enumerate(batches, 1):
      if not timeline:  # (a barrier is a collective: not beside an exchange in flight)
        multihost_utils.sync_global_devices(f"{name} {i}")
      start = time.perf_counter()
      fold = options.get("fold_momentum") and i % every == 0
      before = jax.tree.map(jnp.copy, params) if fold else None  # the step donates them
      params, state, _ = step(params, state, batch)
      if fold:
        lengths = sum(float(schedule(count)) for count in range(i - every, i))
        state = folded(state, before, params, lengths)
      for averaged, period in means:
        if i % period == 0:
          state = averaged(state)
      jax.block_until_ready((params, state))
      seconds.append(time.perf_counter() - start)
      if timeline:
        timeline.stepped(start)
      if i % args.eval_every == 0 or i == args.steps:
        step.settle()  # the evaluation places its windows with a collective
        evals.append((i, float(validation(params, valid_windows))))
    step.settle()  # the last round's exchange, before the next run's barriers
    rows.append({"run": name, "seconds": seconds, "evals": evals, "bytes": sent,
                 **({"timeline": timeline.finished()} if timeline else {})})
    if jax.process_index() == 0:
      print(f"{name:20s} {seconds_a_step(name, seconds):.3f} s/step, valid loss "
            f"{evals[-1][1]:.4f}", flush=True)
      Path(args.worker).write_text(json.dumps(rows))  # each run kept as it ends


class Timeline:
  """When each step and each round's exchange ran on this process, in seconds from the
  run's first step: the overlap's evidence that a round's exchange runs during the
  next round's steps.

  A step's interval is from its dispatch to its results being ready; an
  exchange's from the end of the step that handed its round over to its mean
  being ready (a thread waits on it, so the steps are not held back).
  """

  def __init__(self, step, tx):
    import threading

    self._flight = step._flight(tx)  # the step's driver of the rounds in flight
    self._origin, self._lock = None, threading.Lock()
    self.steps, self.exchanges, self._watchers = [], [], []
    self._seen = self._flight._in_flight  # the warm-up's last round: not this run's

  def stepped(self, start: float) -> None:
    """Records the step dispatched at ``start``, whose results are ready now."""
    import threading

    import jax

    ended = time.perf_counter()
    self._origin = start if self._origin is None else self._origin
    flight = self._flight._in_flight
    if flight is not None and flight is not self._seen:  # this step handed a round over
      self._seen = flight

      def watch(future=flight[1], handed=ended):
        jax.block_until_ready(future.result())
        with self._lock:
          self.exchanges.append([handed - self._origin, time.perf_counter() - self._origin])

      self._watchers.append(threading.Thread(target=watch, daemon=True))
      self._watchers[-1].start()
    self.steps.append([start - self._origin, ended - self._origin])

  def finished(self) -> dict:
    for watcher in self._watchers:
      watcher.join()
    return {"steps": self.steps, "exchanges": sorted(self.exchanges)}


def average_inner_state(state, only: str | tuple[str, ...] | None = None, mesh=None,
                        coded: bool = False):
  """``local_steps``' state with every device's inner state replaced by the devices' mean.

  The inner state's leaves are global ``(devices, ...)`` arrays split along
  the data axis: the mean over dimension 0 is one all-reduce of each
  floating leaf (Adam's moments; with ``only``, the leaves under that field,
  ``"mu"`` or ``"nu"``: Adam's first or second moments); the step counts are
  kept. ``only`` may also name several: the leaves under any of them
  (``SMALL_LEAVES``). With ``coded`` (and the ``mesh``), the means go in few bits instead:
  the first moments through the rotated 4-bit code of ``local_steps``' own
  pseudo-gradient (``"rotated_4_8"``), the second moments through
  :func:`topka2a_jax.collectives.relative_mean`; what the codes round off
  is dropped.
  """
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import topka2a_jax

  def named(path, names):
    names = (names,) if isinstance(names, str) else names
    return any(getattr(key, "name", getattr(key, "key", None)) in names for key in path)

  def averaged(path, leaf):
    return (only is None or named(path, only)) and jnp.issubdtype(leaf.dtype, jnp.floating)

  def mean(path, leaf):
    if not averaged(path, leaf):
      return leaf
    return jnp.broadcast_to(leaf.mean(0, keepdims=True), leaf.shape)

  if not coded:
    return state._replace(inner=jax.tree_util.tree_map_with_path(mean, state.inner))
  rotated = topka2a_jax.collectives.COLLECTIVES["rotated_4_8"]

  def coded_mean(path, block):  # one device's (1, ...) block, inside shard_map
    if not averaged(path, block):
      return block
    flat = block.reshape(-1)
    if named(path, "nu"):
      got = topka2a_jax.collectives.relative_mean(flat, "data")
    else:
      got = rotated(flat, "data", 1.0).mean
    return got.reshape(block.shape).astype(block.dtype)

  inner = jax.shard_map(
      lambda tree: jax.tree_util.tree_map_with_path(coded_mean, tree), mesh=mesh,
      in_specs=P("data"), out_specs=P("data"))(state.inner)
  return state._replace(inner=inner)


def momentum_from_mean_step(state, before, after, lengths: float, b1: float = 0.9,
                            b2: float = 0.999, eps: float = 1e-8):
  """``local_steps``' state with each device's Adam momentum set to the round's mean step.

  The shared parameters moved by ``after - before``, minus the sum over the
  round of Adam's learning rate (``lengths``) times the devices' mean step
  ``m_hat / (sqrt(v_hat) + eps)``; each device's first moment becomes that
  mean step in its own second moment's units, so that its next step is the
  devices' mean step, and decays as its own gradients come in. Nothing is
  exchanged beyond the pseudo-gradient.
  """
  import jax
  import jax.numpy as jnp
  import optax

  def fold(inner):
    if not isinstance(inner, optax.ScaleByAdamState):
      return inner
    t = inner.count.astype(jnp.float32)  # (devices,)

    def moment(nu, a, b):
      shape = (-1,) + (1,) * (nu.ndim - 1)
      v_hat = nu / (1 - b2 ** t).reshape(shape)
      step = (a - b).astype(jnp.float32) / -lengths
      return ((1 - b1 ** t).reshape(shape) * step[None] * (jnp.sqrt(v_hat) + eps)
              ).astype(nu.dtype)

    return inner._replace(mu=jax.tree.map(moment, inner.nu, after, before))

  return state._replace(inner=jax.tree.map(
      fold, state.inner, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState)))


def first_length(every: int | dict) -> int:
  """The first round's length of ``local_steps(..., every)``."""
  return every if isinstance(every, int) else every[0]


def linked_seconds(name: str, steps: int, timed: dict[str, dict]) -> list[float] | None:
  """Each of a run's ``steps`` steps, timed at its run's median on the link.

  ``timed`` holds the link's rows by run. A run whose rounds change length
  takes, in each stretch, the median of a timed run of that round length
  and code and nothing else (itself for its first): a run that also
  averages the state, say, has a longer step. None where the link timed none.
  """
  every = RUNS.get(name, {}).get("every")
  if not isinstance(every, dict):
    return [seconds_a_step(name, timed[name]["seconds"])] * steps if name in timed else None
  seconds = []
  for (start, length), (end, _) in itertools.pairwise([*sorted(every.items()), (steps, None)]):
    alike = [run for run in ([name] if start == 0 else []) + list(timed)
             if run in timed and set(RUNS.get(run, {"": None})) <= {"form", "every", "algorithm"}
             and RUNS[run].get("algorithm") == RUNS[name]["algorithm"]
             and first_length(RUNS[run].get("every", 1)) == length]
    if not alike:
      return None
    seconds += [seconds_a_step(alike[0], timed[alike[0]]["seconds"])] * max(0, end - start)
  return seconds[:steps]


def seconds_a_step(name: str, seconds: list[float]) -> float:
  """The run's typical step: its median, or for local steps its median round over its steps.

  A ``local N`` run's steps are N - 1 without an exchange and one with it:
  their median would leave the exchange out.
  """
  import numpy as np

  try:
    every = first_length(run_options(name).get("every", 1))
  except ValueError:  # a saved row of a run no longer in RUNS: one exchange a step
    every = 1
  rounds = len(seconds) // every
  if every == 1 or not rounds:
    return float(np.median(seconds))
  whole = np.asarray(seconds[:rounds * every]).reshape(rounds, every).sum(1)
  return float(np.median(whole)) / every


def report(rows: list[dict], targets: list[float]) -> list[dict]:
  """Prints the table; returns the rows with their summary figures.

  A step's seconds are the run's typical step (:func:`seconds_a_step`), or
  their mean where the rounds change length. For every target, and for the
  first row's final loss plus 2%: the steps
  and the training time (the steps' seconds summed up to the first
  evaluation at or below it) to reach it, and that time as a share of the
  first row's.
  """
  import numpy as np

  dense = rows[0]
  targets = [*targets, round(dense["evals"][-1][1] * 1.02, 4)]
  for row in rows:
    seconds = np.asarray(row["seconds"])
    changing = isinstance(RUNS.get(row["run"], {}).get("every"), dict)  # rounds: their mean
    row.update(step_s=float(seconds.mean()) if changing else seconds_a_step(row["run"], seconds),
               final=row["evals"][-1][1],
               highest=max(value for _, value in row["evals"]), targets={})
    for target in targets:
      reached = next((i for i, value in row["evals"] if value <= target), None)
      row["targets"][str(target)] = {
          "steps": reached,
          "seconds": None if reached is None else float(seconds[:reached].sum())}
  for row in rows:
    for target, figures in row["targets"].items():
      mine, base = figures["seconds"], dense["targets"][target]["seconds"]
      figures["ratio"] = mine / base if mine and base else None
  head = " ".join(f"{'to ' + str(t):>17s}" for t in targets[:-1]) + (
      f" {'to dense+2% (' + str(targets[-1]) + ')':>17s}")
  print(f"\n{'run':24s} {'MB/step':>7s} {'s/step':>7s} {'vs dense':>8s} {head}  "
        f"{'final':>7s} {'highest':>7s}")
  print(f"{'':24s} {'':>7s} {'':>7s} {'':>8s} "
        + " ".join(f"{'steps':>5s} {'s':>5s} {'ratio':>5s}" for _ in targets))
  for row in rows:
    cells = []
    for target in targets:
      figures = row["targets"][str(target)]
      ratio = "-" if figures["ratio"] is None else f"{figures['ratio']:.2f}"
      cells.append(f"{figures['steps'] or '-':>5} "
                   f"{figures['seconds'] or float('nan'):5.0f} {ratio:>5s}")
    megabytes = f"{row['bytes'] / 1e6:7.3f}" if "bytes" in row else f"{'-':>7s}"
    print(f"{row['run']:24s} {megabytes} {row['step_s']:7.3f} "
          f"{row['step_s'] / dense['step_s']:7.3f}x "
          + " ".join(cells) + f"  {row['final']:7.4f} {row['highest']:7.2f}")
  return rows


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rate", default="1gbit")
  parser.add_argument("--processes", type=int, default=4)
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--eval-every", type=int, default=10)
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--targets", type=float, nargs="+", default=[2.6, 2.5, 2.4],
                      help="validation losses (nats per byte) whose time to reach is shown")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the initialisation and of the batches")
  parser.add_argument("--batch", type=int, default=BATCH_PER_DEVICE,
                      help="windows of CONTEXT bytes per process and step")
  parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, metavar="RUN",
                      help=(f"runs among {', '.join(map(repr, RUNS))}, each may add "
                            "', N dense steps' (the first is the baseline of the "
                            "ratios)").replace("%", "%%"))  # argparse formats with %
  parser.add_argument("--b1", type=float, default=0.9, help="Adam's b1")
  parser.add_argument("--peak-lr", type=float, default=2e-3,
                      help="Adam's learning rate after the warm-up (it then decays "
                           "to 0 by the last step, a cosine)")
  parser.add_argument("--sgd-peak-lr", type=float, default=SGD_PEAK_LR,
                      help="the same for the 'plain SGD, ...' runs")
  parser.add_argument("--local", action="store_true",
                      help="one process of emulated CPU devices, no link: losses only")
  parser.add_argument("--json", help="also write the rows here")
  parser.add_argument("--from-json", nargs="+", metavar="JSON",
                      help="no training: the table of the rows these files hold "
                           "(of one batch and seed), the first file's first row "
                           "the baseline, each run named once")
  parser.add_argument("--link-seconds", metavar="JSON",
                      help="with --from-json: a shorter run of the same runs on "
                           "the link (same batch); each step of a row is timed "
                           "at that run's median seconds a step on the link, and "
                           "its bytes are the link's (rows it lacks are left out)")
  parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
  args = parser.parse_args()
  for name in args.runs:
    try:
      run_options(name)
    except ValueError as error:
      parser.error(str(error))
  status = 0
  if args.worker:
    worker(args)
    return 0
  if args.from_json:
    saved = [json.loads(Path(name).read_text()) for name in args.from_json]
    rows, seen = [], set()
    for table in saved:
      rows += [row for row in table["rows"] if row["run"] not in seen]
      seen |= {row["run"] for row in table["rows"]}
    if args.link_seconds:
      link = json.loads(Path(args.link_seconds).read_text())
      timed = {row["run"]: row for row in link["rows"]}
      if rows[0]["run"] not in timed:
        parser.error(f"{args.link_seconds} has no run {rows[0]['run']!r}, the baseline")
      missing = []
      for row in rows:
        row["seconds"] = linked_seconds(row["run"], len(row["seconds"]), timed)
        if row["seconds"] is None:
          missing.append(row["run"])
        elif row["run"] in timed and not isinstance(run_options(row["run"]).get("every"), dict):
          row["bytes"] = timed[row["run"]]["bytes"]  # (a changing round's: its whole run's)
      if missing:
        print(f"left out, not timed on the link: {', '.join(missing)}")
      rows = [row for row in rows if row["seconds"] is not None]
      print(f"steps and losses from {', '.join(args.from_json)}; each step timed at "
            f"its run's median on the link ({args.link_seconds}, "
            f"{len(link['rows'][0]['seconds'])} steps a run, {link['rate']})")
    rows = report(rows, saved[0]["targets"])
    timing = ({"rate": link["rate"], "seconds": "each step at its run's median on "
               f"the link, {Path(args.link_seconds).name}"} if args.link_seconds else {})
    if args.json:
      Path(args.json).write_text(json.dumps({**saved[0], **timing, "rows": rows},
                                            indent=1))
    return 0
  out = Path(tempfile.mkdtemp()) / "rows.json"
  if args.local:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_"
                               f"platform_device_count={args.processes}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    args.worker = str(out)
    print(f"{args.processes} emulated devices in one process, no link; Adam b1 "
          f"{args.b1}, peak learning rate {args.peak_lr} (plain SGD's "
          f"{args.sgd_peak_lr}); density {args.density}; "
          f"{args.steps} steps per run; seed {args.seed}; {args.batch} x {CONTEXT} "
          "bytes per device and step")
    worker(args)
  else:
    status = train_on_the_link(args, out)
    if status and not out.exists():
      return status
  rows = report(json.loads(out.read_text()), args.targets)
  if args.json:
    Path(args.json).write_text(json.dumps(
        {"rate": None if args.local else args.rate, "processes": args.processes,
         "density": args.density, "b1": args.b1, "peak_lr": args.peak_lr,
         "sgd_peak_lr": args.sgd_peak_lr, "seed": args.seed, "batch": args.batch,
         "targets": args.targets, "rows": rows}, indent=1))
  return status


def train_on_the_link(args: argparse.Namespace, out: Path) -> int:
  """Runs the worker on every process inside the shaped namespace; its status."""
  print(f"{args.processes} processes on loopback at {args.rate}; transformer of "
        f"{WIDTH} x {LAYERS} layers, {args.batch} x {CONTEXT} bytes per "
        f"process and step; Adam's peak learning rate {args.peak_lr}; density "
        f"{args.density}; {args.steps} steps per run; seed {args.seed}")
  return link.run_workers(
      args.rate, 0.0, args.processes, __file__, str(out), "--steps", str(args.steps),
      "--eval-every", str(args.eval_every), "--density", str(args.density),
      "--b1", str(args.b1), "--peak-lr", str(args.peak_lr),
      "--sgd-peak-lr", str(args.sgd_peak_lr), "--seed", str(args.seed),
      "--batch", str(args.batch), "--runs", *args.runs)

if __name__ == "__main__":
  sys.exit(main())
