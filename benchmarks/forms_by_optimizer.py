"""Which exchange keeps which optimizer's quality: the rule ``algorithm="auto"`` follows.

Trains the README's program (its MLP fitted to sin(x), full batch, 8
emulated CPU devices, 100 steps) once per optimizer and form, from the same
initialisation:

* ``dense``: ``optax.chain(topka2a(algorithm="dense"), optimizer)``, the
  mean gradient by ``lax.pmean``, the reference;
* ``top-k 1%``: ``topka2a(0.01, algorithm="topka2a_sparse")``, the top-k that
  ``"auto"`` sends before plain SGD, and the same after 30 dense steps
  (``warmup_steps=30``);
* ``DGC``: ``compress_updates(optimizer, 0.01)``, the optimizer on each
  device's gradient and its step's top-k exchanged (DGC's momentum
  correction, for momentum SGD);
* ``8 bits``: ``topka2a(algorithm="quantized_8_8_fine")``, what ``"auto"``
  sends before Adam's family;
* ``4 / 8 bits``: ``topka2a(algorithm="quantized_4_8")``, 4 bits to the
  owners and 8 back, what ``"auto"`` sends before momentum SGD;
* ``rotated 4 / 8 bits``: ``topka2a(algorithm="rotated_4_8")``, the same
  with each 512 entries rotated before their code;
* ``signs, 4 bits back`` and ``signs both ways``: ``topka2a(algorithm=
  "onebit_4")`` and ``"onebit_1"``, every entry's sign to the owners, their
  means back in 4 bits or as signs again: the only forms that code every
  entry in fewer bytes than a 1% top-k sends on 8 devices;
* ``headline``: ``topka2a(0.01)`` with no other option, whatever ``"auto"``
  reads from the chain.

Prints the final loss of each and its ratio to dense's, and the bytes each
device sends a step (:func:`topka2a_jax.comm_report` of the compiled step).

Run:
  python benchmarks/forms_by_optimizer.py [--steps 100] [--json out.json]
      [--optimizers "sgd(0.05, momentum=0.9)" ...] [--forms "4 / 8 bits" ...]
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import optax

import topka2a_jax

OPTIMIZERS = {
    "sgd(0.1)": lambda: optax.sgd(0.1),
    "sgd(0.01, momentum=0.9)": lambda: optax.sgd(0.01, momentum=0.9),
    "sgd(0.05, momentum=0.9)": lambda: optax.sgd(0.05, momentum=0.9),
    "sgd(0.1, momentum=0.9)": lambda: optax.sgd(0.1, momentum=0.9),
    "adam(1e-2)": lambda: optax.adam(1e-2),
    "lion(1e-3)": lambda: optax.lion(1e-3),
    "adafactor(1e-2)": lambda: optax.adafactor(1e-2),
}
"""The optimizers after the exchange: name -> a fresh one."""

def exchange(density=None, **options):
  """The chain of ``topka2a(density, **options)`` and the optimizer."""
  return lambda optimizer, mesh: optax.chain(
      topka2a_jax.topka2a(density, mesh=mesh, **options), optimizer)


FORMS = {
    "dense": exchange(algorithm="dense"),
    "top-k 1%": exchange(0.01, algorithm="topka2a_sparse"),
    "top-k 1%, 30 dense steps": exchange(0.01, algorithm="topka2a_sparse",
                                         warmup_steps=30),
    "DGC": lambda optimizer, mesh: topka2a_jax.compress_updates(optimizer, density=0.01,
                                                                mesh=mesh),
    "8 bits": exchange(algorithm="quantized_8_8_fine"),
    "4 / 8 bits": exchange(algorithm="quantized_4_8"),
    "rotated 4 / 8 bits": exchange(algorithm="rotated_4_8"),
    "signs, 4 bits back": exchange(algorithm="onebit_4"),
    "signs both ways": exchange(algorithm="onebit_1"),
    "headline": exchange(0.01),
}
"""The exchanges compared: name -> ``(optimizer, mesh) -> the optimizer to train``."""


def loss_fn(params, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def train(tx, mesh, steps: int) -> tuple[float, float]:
  """The final loss and the bytes each device sends a step."""
  params = {"w1": jax.random.normal(jax.random.key(0), (16, 256)) / 4,
            "w2": jax.random.normal(jax.random.key(1), (256, 4)) / 16}
  x = jax.random.normal(jax.random.key(2), (512, 16))
  batch = (x, jnp.sin(x[:, :4]))
  state, step = tx.init(params), topka2a_jax.train_step(loss_fn, tx, mesh)
  sent = topka2a_jax.comm_report(step.lower(params, state, batch)).total_bytes
  loss = None
  for _ in range(steps):
    params, state, loss = step(params, state, batch)
    loss = float(loss)  # read every step: XLA's CPU collectives can stall when many wait
  return loss, sent


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--json", help="also write the rows here")
  parser.add_argument("--optimizers", nargs="+", choices=list(OPTIMIZERS),
                      default=list(OPTIMIZERS), metavar="NAME",
                      help="the optimizers to train (default: every one)")
  parser.add_argument("--forms", nargs="+", choices=list(FORMS), default=list(FORMS),
                      metavar="NAME", help="the exchanges to train (default: every "
                      "one); dense is always trained, as the ratios' reference")
  args = parser.parse_args()
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  rows = []
  print(f"{'optimizer':26s} {'form':24s} {'final':>10s} {'vs dense':>9s} {'bytes':>8s}")
  forms = dict.fromkeys(["dense", *args.forms])
  for optimizer in args.optimizers:
    make, dense = OPTIMIZERS[optimizer], None
    for form in forms:
      options = FORMS[form]
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warning of a top-k before Adam
        final, sent = train(options(make(), mesh), mesh, args.steps)
      dense = final if dense is None else dense
      rows.append({"optimizer": optimizer, "form": form, "final": final,
                   "ratio": final / dense, "bytes": sent})
      print(f"{optimizer:26s} {form:24s} {final:10.4g} {final / dense:8.2f}x "
            f"{sent:8.0f}", flush=True)
  if args.json:
    Path(args.json).write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
