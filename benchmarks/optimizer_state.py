"""Optimizer-state bytes per device: Adam after the exchange, whole or sharded.

For each model on 8 emulated devices, builds the state of
``optax.chain(topka2a(0.01), optax.adam(1e-3))`` and of
``sharded_optimizer(optax.adam(1e-3), 0.01)`` (shapes only, nothing is
allocated) and reads every leaf's bytes on one device from its sharding:
Adam's moments and count, and the exchange's residuals, which both keep.

Models: the examples' digits CNN and character transformer (their Flax
parameters), and GPT-2 small's layer shapes (``topka2a_jax.tools.model_shapes``).

Run:
  python benchmarks/optimizer_state.py [--devices 8] [--json out.json]
"""

import os
import sys

DEVICES = int(sys.argv[sys.argv.index("--devices") + 1]) if "--devices" in sys.argv else 8
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={DEVICES}").strip()

import argparse
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from topka2a_jax.tools.model_shapes import gpt2_small


def example_params(module: str, model: str) -> list[jax.ShapeDtypeStruct]:
  """The parameter shapes of an example's Flax model."""
  from flax import nnx

  example = __import__(module)
  params = nnx.state(getattr(example, model)(nnx.Rngs(0)), nnx.Param)
  return [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in jax.tree.leaves(params)]


MODELS = {
    "digits CNN (examples)": lambda: example_params("train_digits", "CNN"),
    "character transformer (examples)": lambda: example_params("train_charlm", "CharLM"),
    "GPT-2 small": lambda: [jax.ShapeDtypeStruct(shape, jnp.float32)
                            for _, shape in gpt2_small()],
}


def bytes_on_one_device(state, specs, mesh) -> int:
  """Bytes of ``state``'s leaves on one device, from the shardings ``specs`` give."""
  leaves = jax.tree.leaves(state)
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
  return sum(math.prod(NamedSharding(mesh, spec).shard_shape(leaf.shape))
             * leaf.dtype.itemsize for leaf, spec in zip(leaves, spec_leaves))


def measure(params, mesh) -> dict:
  """Adam's and the residuals' bytes per device, plain chain and sharded."""
  plain_tx = optax.chain(topka2a_jax.topka2a(0.01), optax.adam(1e-3))
  sharded_tx = topka2a_jax.sharded_optimizer(optax.adam(1e-3), density=0.01)
  plain = jax.eval_shape(lambda: topka2a_jax.init(plain_tx, params, mesh))
  sharded = jax.eval_shape(lambda: topka2a_jax.init(sharded_tx, params, mesh))
  plain_specs = topka2a_jax.state_specs(plain)
  sharded_specs = topka2a_jax.state_specs(sharded)
  devices = mesh.shape["data"]
  return {
      "parameters": sum(p.size for p in params),
      "adam": bytes_on_one_device(plain[1], plain_specs[1], mesh),
      "adam_sharded": bytes_on_one_device(sharded.inner, sharded_specs.inner, mesh),
      "bound": sum(2 * 4 * -(-p.size // devices) for p in params) + 4,
      "residuals": bytes_on_one_device(plain[0], plain_specs[0], mesh),
      "residuals_sharded": bytes_on_one_device(sharded.exchange, sharded_specs.exchange,
                                               mesh),
  }


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=DEVICES)
  parser.add_argument("--json", help="also write the rows here")
  args = parser.parse_args()
  mesh = jax.make_mesh((args.devices,), ("data",))
  print(f"{args.devices} devices; Adam (float32 moments) after topka2a(0.01); "
        "MB per device")
  print(f"{'model':34s} {'params':>12s} {'Adam':>9s} {'sharded':>9s} {'ratio':>7s} "
        f"{'1/P+pad':>9s} {'residuals':>10s}")
  rows = []
  for name, make in MODELS.items():
    row = {"model": name, **measure(make(), mesh)}
    rows.append(row)
    print(f"{name:34s} {row['parameters']:12,d} {row['adam'] / 1e6:9.3f} "
          f"{row['adam_sharded'] / 1e6:9.3f} {row['adam_sharded'] / row['adam']:6.4f}x "
          f"{row['bound'] / 1e6:9.3f} {row['residuals'] / 1e6:10.3f}")
  if args.json:
    Path(args.json).write_text(json.dumps({"devices": args.devices, "rows": rows},
                                          indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
