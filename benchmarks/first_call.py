"""The first call of a training step: tracing, planning and compiling, against plain pmean.

Every configuration runs in a fresh process (no compilation cache shared), on
8 emulated CPU devices, with an MLP and Adam: by default of 11.5M weights
(1024 -> 2048 -> 2048 -> 2048 -> 512, with biases); ``--model small``, three
matrices without biases (784 -> 256 -> 256 -> 10, 269k weights), where the
library's own compile is not hidden behind the model's. It times the first
call of the step (what a user waits for when a run starts or a shape
changes) and the median of the next ones:

- ``pmean``: a jitted ``shard_map`` step written by hand, ``lax.pmean`` of the
  gradient, then Adam: the baseline of the ratios;
- ``topka2a``: ``train_step`` with ``optax.chain(topka2a(0.01), optax.adam(...))``;
- ``compress_updates``: ``train_step`` with
  ``compress_updates(optax.adam(...), 0.01)``;
- ``topka2a`` with its buckets planned to overlap the backward pass the
  step estimates (what accelerators' steps do; CPUs' plan no overlap, since
  XLA's CPU backend runs collectives in line), with ``fusion=10**9`` (one
  bucket), and with one bucket and ``selection="exact"``: what the
  planner's inputs and the selection cost;
- ``topka2a`` again, in a process started after an identical one filled
  JAX's persistent compilation cache: what a rerun of the program waits for.

``--split`` times the parts instead, each configuration in a fresh process:
the backward pass's estimate, ``step.lower(...)`` and ``.compile()``, and
counts the kernels (XLA fusions) and the sparse collectives (all-to-all and
all-gather) compiled.

Each configuration runs ``--trials`` times (3 by default), interleaved with
the others; the table gives the median first call, its median ratio to the
pmean step of the same trial and the range of those ratios.

Run:
  python benchmarks/first_call.py [--model mlp|small] [--runs NAME ...] [--trials 3]
      [--repeats 3] [--split] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {"mlp": ((1024, 2048, 2048, 2048, 512), True),
          "small": ((784, 256, 256, 10), False)}
"""Model name -> (layer widths, whether layers have biases)."""
DEVICES = 8
BATCH_PER_DEVICE = 32
CACHED = "topka2a, compilation cache warm"
"""The defaults' step in a process started after another filled JAX's
persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``): what a rerun
of the same program waits for."""

RUNS = {
    "pmean": {},
    "topka2a": {},
    "topka2a, buckets split to overlap the backward pass": {
        "backward_seconds": "estimated"},
    "topka2a, one bucket": {"fusion": 10**9},
    "topka2a, one bucket, exact selection": {"fusion": 10**9, "selection": "exact"},
    "compress_updates": {},
    CACHED: {},
}
"""Configurations: name -> options of the exchange besides the density."""


def _model(model: str):
  import jax
  import jax.numpy as jnp

  sizes, biases = MODELS[model]
  keys = jax.random.split(jax.random.key(0), len(sizes) - 1)
  params = {f"layer{i}": {"w": jax.random.normal(key, (m, n)) * m ** -0.5,
                          **({"b": jnp.zeros(n)} if biases else {})}
            for i, (key, m, n) in enumerate(zip(keys, sizes[:-1], sizes[1:]))}

  def loss(params, batch):
    x = batch
    for i in range(len(sizes) - 1):
      x = x @ params[f"layer{i}"]["w"] + (params[f"layer{i}"]["b"] if biases else 0.0)
      x = jax.nn.relu(x) if i < len(sizes) - 2 else x
    return jnp.mean(x ** 2)

  return params, loss


def _batch(model: str):
  import numpy as np

  return np.random.default_rng(0).normal(
      size=(DEVICES * BATCH_PER_DEVICE, MODELS[model][0][0])).astype(np.float32)


def _step(name: str, mesh, model: str):
  """``(step, params, state)``: ``step(params, state, batch)`` as a user calls it."""
  import jax
  import optax
  from jax import lax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import topka2a_jax

  params, loss = _model(model)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  adam = optax.adam(1e-3)
  if name == "pmean":
    def body(params, state, batch):
      value, grads = jax.value_and_grad(loss)(params, batch)
      grads = lax.pmean(grads, "data")
      updates, state = adam.update(grads, state, params)
      return optax.apply_updates(params, updates), state, lax.pmean(value, "data")

    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")),
                                   out_specs=(P(), P(), P())), donate_argnums=(0, 1))
    batch_sharding = NamedSharding(mesh, P("data"))

    def step(params, state, batch):  # as train_step does: the batch split over data
      return mapped(params, state, jax.device_put(batch, batch_sharding))
    step.lower = lambda params, state, batch: mapped.lower(
        params, state, jax.device_put(batch, batch_sharding))
    return step, params, adam.init(params)
  options = dict(RUNS[name])
  if options.get("backward_seconds") == "estimated":
    options["backward_seconds"] = topka2a_jax.train_step(
        loss, optax.sgd(0.0), mesh).backward_seconds(params, _batch(model))
  if name.startswith("compress_updates"):
    tx = topka2a_jax.compress_updates(adam, density=0.01, mesh=mesh, **options)
  else:
    tx = optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh, **options), adam)
  return topka2a_jax.train_step(loss, tx, mesh), params, tx.init(params)


def measure(name: str, repeats: int, model: str) -> dict:
  """In this process: the first call's seconds and the median of ``repeats`` more."""
  import jax
  import numpy as np

  mesh = jax.make_mesh((DEVICES,), ("data",))
  step, params, state = _step(name, mesh, model)
  batch = _batch(model)
  start = time.perf_counter()
  params, state, loss = step(params, state, batch)
  jax.block_until_ready((params, state, loss))
  first = time.perf_counter() - start
  seconds = []
  for _ in range(repeats):
    start = time.perf_counter()
    params, state, loss = step(params, state, batch)
    jax.block_until_ready((params, state, loss))
    seconds.append(time.perf_counter() - start)
  return {"run": name, "first_s": first, "step_s": float(np.median(seconds))}


def split(name: str, model: str) -> dict:
  """In this process: the backward estimate, lowering and compiling, timed apart."""
  import jax

  mesh = jax.make_mesh((DEVICES,), ("data",))
  step, params, state = _step(name, mesh, model)
  batch = _batch(model)
  start = time.perf_counter()
  if name != "pmean":
    step.backward_seconds(params, batch)
  estimate = time.perf_counter() - start
  start = time.perf_counter()
  lowered = step.lower(params, state, batch)
  lower = time.perf_counter() - start
  start = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - start
  text = compiled.as_text()
  buckets = text.count("all-to-all(") + text.count("all-gather(")
  return {"run": name, "estimate_s": estimate, "lower_s": lower,
          "compile_s": compile_s, "kernels": text.count(" fusion("),
          "gathers_and_alltoalls": buckets}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS),
                      metavar="RUN", help=f"among {', '.join(map(repr, RUNS))}")
  parser.add_argument("--model", default="mlp", choices=list(MODELS))
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--trials", type=int, default=3,
                      help="fresh processes per configuration, interleaved; the "
                      "table gives medians and the range of the ratios to pmean "
                      "of the same trial")
  parser.add_argument("--split", action="store_true",
                      help="time the backward estimate, lowering and compiling apart")
  parser.add_argument("--json", help="also write the rows here")
  parser.add_argument("--one", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.one:
    print(json.dumps(split(args.one, args.model) if args.split
                     else measure(args.one, args.repeats, args.model)))
    return 0
  env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_"
                        f"platform_device_count={DEVICES}").strip())
  sizes, biases = MODELS[args.model]
  weights = sum(m * n + n * biases for m, n in itertools.pairwise(sizes))
  print(f"MLP of {weights:,} weights on {DEVICES} emulated devices, Adam, "
        f"density 0.01; every run in a fresh process")
  if args.split:
    print(f"{'run':38s} {'estimate s':>10s} {'lower s':>8s} {'compile s':>9s} "
          f"{'kernels':>7s} {'collectives':>11s}")
  else:
    print(f"{'run':38s} {'first call s':>12s} {'vs pmean':>8s} {'range':>10s} "
          f"{'step s':>8s}")
  names = ["pmean", *[n for n in args.runs if n != "pmean"]]
  trials: dict[str, list[dict]] = {name: [] for name in names}
  for _ in range(1 if args.split else args.trials):
    for name in names:  # interleaved: a slow spell of the machine hits every run
      command = [sys.executable, __file__, "--one", name, "--repeats",
                 str(args.repeats), "--model", args.model,
                 *(["--split"] if args.split else [])]
      with tempfile.TemporaryDirectory() as cache:
        run_env = dict(env, JAX_COMPILATION_CACHE_DIR=cache) if name == CACHED else env
        for _ in range(2 if name == CACHED else 1):  # the first run fills the cache
          out = subprocess.run(command, env=run_env, check=True, capture_output=True,
                               text=True).stdout
      trials[name].append(json.loads(out.strip().splitlines()[-1]))
  rows = []
  for name in names:
    if args.split:
      row = trials[name][0]
      print(f"{name:38s} {row['estimate_s']:10.2f} {row['lower_s']:8.2f} "
            f"{row['compile_s']:9.2f} {row['kernels']:7d} "
            f"{row['gathers_and_alltoalls']:11d}")
    else:
      firsts = [t["first_s"] for t in trials[name]]
      ratios = [t["first_s"] / base["first_s"]
                for t, base in zip(trials[name], trials["pmean"])]
      row = {"run": name, "first_s": statistics.median(firsts),
             "ratio": statistics.median(ratios), "ratios": ratios,
             "step_s": statistics.median(t["step_s"] for t in trials[name]),
             "trials": trials[name]}
      print(f"{name:38s} {row['first_s']:12.2f} {row['ratio']:7.2f}x "
            f"{min(ratios):5.2f}..{max(ratios):<5.2f} {row['step_s']:8.3f}")
    rows.append(row)
  if args.json:
    Path(args.json).write_text(json.dumps(
        {"model": args.model, "weights": weights, "rows": rows}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
