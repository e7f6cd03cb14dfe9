"""The GPU path in one command: selection at scale, and the transform's overhead.

On one accelerator (a GPU; it runs anywhere, for a check):

1. the selection benchmark (``benchmarks/selection.py``) at 25M and 100M
   elements over 8 shards: one pass over the buffer, exact top-k, the
   threshold search, ``lax.approx_max_k``, the mass each keeps, and which
   one ``selection="auto"`` runs on this backend;
2. the transform's overhead in a jitted single-device training step
   (``topka2a_jax.train_step`` on a 1-device mesh) of a GPT-2-small-sized
   transformer before Adam: step time with the dense exchange (on one
   device, nothing to send) against the defaults, the few-bit codes the
   README recommends (8 bits before Adam, 4 up and 8 back before momentum)
   and TopKA2A with each selection, so what is measured is each form's
   coding (selection, packing and scatter-adds, or quantizing and decoding)
   and the fraction of the step it adds.

Prints both tables and writes them as JSON. A few minutes on one GPU.

Run:
  python benchmarks/gpu.py [--json gpu.json] [--small]

``--small`` shrinks every size (a smoke run for machines without a GPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from selection import measure

import topka2a_jax

GPT2_SMALL = {"vocab": 50257, "width": 768, "layers": 12, "heads": 12, "context": 1024}


def transformer(dims: dict):
  """``(init, loss)`` of a decoder-only transformer with these dimensions."""
  width, layers, heads, vocab = dims["width"], dims["layers"], dims["heads"], dims["vocab"]

  def init(key):
    keys = iter(jax.random.split(key, 3 + 4 * layers))
    normal = lambda shape, scale: scale * jax.random.normal(next(keys), shape)
    params = {"embed": normal((vocab, width), 0.02),
              "position": normal((dims["context"], width), 0.02)}
    for layer in range(layers):
      params[f"block{layer}"] = {
          "qkv": normal((width, 3 * width), width ** -0.5),
          "proj": normal((width, width), width ** -0.5 / layers),
          "up": normal((width, 4 * width), width ** -0.5),
          "down": normal((4 * width, width), (4 * width) ** -0.5 / layers)}
    return params

  def loss(params, tokens):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    batch, length = inputs.shape
    x = params["embed"][inputs] + params["position"][:length]
    causal = jnp.tril(jnp.ones((length, length), bool))
    for layer in range(layers):
      p = params[f"block{layer}"]
      q, k, v = jnp.split(jax.nn.standardize(x) @ p["qkv"], 3, axis=-1)
      split = lambda t: t.reshape(batch, length, heads, width // heads)
      attended = jax.nn.dot_product_attention(split(q), split(k), split(v),
                                              mask=causal[None, None])
      x = x + attended.reshape(batch, length, width) @ p["proj"]
      x = x + jax.nn.gelu(jax.nn.standardize(x) @ p["up"]) @ p["down"]
    logits = jax.nn.standardize(x) @ params["embed"].T  # tied output embedding
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits),
                                         targets[..., None], axis=-1))

  return init, loss


STEP_RUNS = {
    "dense (nothing to send)": {"algorithm": "dense"},
    "defaults": {},
    "8 bits (quantized_8_8_fine)": {"algorithm": "quantized_8_8_fine"},
    "4 up, 8 back (quantized_4_8)": {"algorithm": "quantized_4_8"},
    "4 up rotated, 8 back (rotated_4_8)": {"algorithm": "rotated_4_8"},
    "topka2a, exact": {"algorithm": "topka2a", "selection": "exact"},
    "topka2a, threshold": {"algorithm": "topka2a", "selection": "threshold"},
    "topka2a, approx": {"algorithm": "topka2a", "selection": "approx"},
}
"""The step's exchanges, before the one Adam: every form the README recommends
(``defaults``: before Adam ``"auto"`` plans 8 bits or dense; the 8-bit code
itself; momentum's 4 bits up and 8 back, and the same rotated first) and the
top-k with each selection.
On one device nothing travels, so what each adds to the dense step is its
coding: selection and packing, or quantizing and decoding."""


def step_times(dims: dict, batch: int, density: float, repeats: int) -> list[dict]:
  """Median seconds per training step, per configuration, on one device."""
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  init, loss = transformer(dims)
  tokens = jax.random.randint(jax.random.key(1), (batch, dims["context"] + 1), 0,
                              dims["vocab"])
  rows = []
  for name, options in STEP_RUNS.items():
    tx = optax.chain(topka2a_jax.topka2a(density, mesh=mesh, **options),
                     optax.adam(1e-4))
    params = init(jax.random.key(0))
    state, step = tx.init(params), topka2a_jax.train_step(loss, tx, mesh)
    params, state, value = step(params, state, tokens)  # compiles
    float(value)
    seconds = []
    for _ in range(repeats):
      start = time.perf_counter()
      params, state, value = step(params, state, tokens)
      float(value)
      seconds.append(time.perf_counter() - start)
    median = float(np.median(seconds))
    base = rows[0]["seconds"] if rows else median
    rows.append({"run": name, "seconds": median, "adds": median / base - 1})
    print(f"{name:30s} {1e3 * median:9.1f} ms {median / base:6.2f}x "
          f"(adds {100 * (median / base - 1):+6.1f}% of the dense step)", flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", help="also write everything to this file")
  parser.add_argument("--small", action="store_true",
                      help="small sizes: a smoke run where there is no GPU")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  device = jax.devices()[0]
  print(f"{device.platform}: {device.device_kind}, JAX {jax.__version__}, "
        f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}")
  sizes = [1e5, 4e5] if args.small else [25e6, 1e8]
  dims = (dict(GPT2_SMALL, vocab=512, width=64, layers=2, heads=2, context=64)
          if args.small else GPT2_SMALL)
  print("\nSelection over 8 shards (the TopKA2A pattern on 8 devices):")
  selection = measure(sizes, [0.001, 0.01, 0.05], 8, args.repeats,
                      out=lambda line: print(line, flush=True))
  params = sum(x.size for x in jax.tree.leaves(
      jax.eval_shape(transformer(dims)[0], jax.random.key(0))))
  print(f"\nOne device's training step, {params / 1e6:.1f}M parameters "
        f"(GPT-2 small's shapes{' shrunk' if args.small else ''}), batch 8 x "
        f"{dims['context']} tokens, density 0.01, Adam:")
  steps = step_times(dims, 8, 0.01, args.repeats)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"device": device.device_kind, "platform": device.platform,
                 "date": time.strftime("%Y-%m-%d"), "selection": selection,
                 "steps": steps}, f, indent=2)


if __name__ == "__main__":
  main()
