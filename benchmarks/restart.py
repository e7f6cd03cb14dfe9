"""Training after a restart on fewer devices: the losses against the uninterrupted run.

For each seed, a small MLP regression (the README's problem, a fresh draw of
data and initial parameters per seed) trains with
``compress_updates(optax.adam(1e-2), 0.1)`` for ``--before`` steps on 8
emulated devices and is saved. Then three runs of ``--after`` steps on the
same global batches:

* uninterrupted: on the 8 devices;
* restored on 4 devices (``topka2a_jax.restore``, which keeps what the
  residuals owe the parameters: their sum over devices over the devices'
  number);
* restored on 4, with the residuals then multiplied by 8/4: what a restore
  that kept the residuals' sum would deliver (the rule before the fix).

It prints, per seed, the mean of the ``--after`` losses minus the
uninterrupted run's, and beside it the spread of the uninterrupted run over
the seeds (the standard deviation of its mean loss): the noise a difference
has to beat to be a finding.

Run:
  python benchmarks/restart.py [--seeds 3] [--json out.json]
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax


def loss_fn(params, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def problem(seed: int, steps: int):
  """Initial parameters and one global batch per step."""
  keys = jax.random.split(jax.random.key(seed), 3 + steps)
  params = {"w1": jax.random.normal(keys[0], (16, 256)) / 4,
            "w2": jax.random.normal(keys[1], (256, 4)) / 16}
  batches = []
  for key in keys[3:]:
    x = jax.random.normal(key, (512, 16))
    batches.append((x, jnp.sin(x[:, :4])))
  return params, batches


def optimizer():
  return topka2a_jax.compress_updates(optax.adam(1e-2), density=0.1)


def run(mesh, params, opt_state, batches):
  step = topka2a_jax.train_step(loss_fn, optimizer(), mesh)
  losses = []
  for batch in batches:
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  return params, opt_state, losses


def fresh(mesh, params):
  placed = jax.device_put(jax.tree.map(jnp.copy, params), NamedSharding(mesh, P()))
  return placed, topka2a_jax.init(optimizer(), placed, mesh)


def one_seed(seed: int, before: int, after: int, directory: Path) -> dict:
  big = jax.make_mesh((8,), ("data",))
  small = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  params, batches = problem(seed, before + after)
  p, s, _ = run(big, *fresh(big, params), batches[:before])
  checkpoint = directory / f"seed_{seed}"
  topka2a_jax.save(checkpoint, {"params": p, "opt_state": s}, big)
  _, _, straight = run(big, p, s, batches[before:])

  def restored(times: float):
    placed, like = fresh(small, params)
    state = topka2a_jax.restore(checkpoint, {"params": placed, "opt_state": like},
                                small)
    opt_state = state["opt_state"]
    exchange = opt_state.exchange._replace(residuals=jax.tree.map(
        lambda r: r * times, opt_state.exchange.residuals))
    return run(small, state["params"], opt_state._replace(exchange=exchange),
               batches[before:])[2]

  kept, summed = restored(1.0), restored(8 / 4)
  return {"seed": seed, "uninterrupted": straight, "restored": kept,
          "sum_kept": summed}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--before", type=int, default=20)
  parser.add_argument("--after", type=int, default=10)
  parser.add_argument("--json", type=Path)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as directory:
    rows = [one_seed(seed, args.before, args.after, Path(directory))
            for seed in range(args.seeds)]
  spread = float(np.std([np.mean(r["uninterrupted"]) for r in rows], ddof=1))
  print(f"compress_updates(adam(1e-2), 0.1): {args.before} steps on 8 devices, "
        f"saved, {args.after} more on 8 or restored on 4")
  print(f"{'seed':>4} | {'uninterrupted mean loss':>23} | {'restored - it':>13} | "
        f"{'sum kept - it':>13}")
  for r in rows:
    base = np.mean(r["uninterrupted"])
    print(f"{r['seed']:>4} | {base:>23.4f} | {np.mean(r['restored']) - base:>+13.4f} | "
          f"{np.mean(r['sum_kept']) - base:>+13.4f}")
  print(f"spread of the uninterrupted mean loss over seeds (std): {spread:.4f}")
  if args.json:
    args.json.write_text(json.dumps({"rows": rows, "seed_spread": spread}, indent=1))


if __name__ == "__main__":
  main()
