"""Running a per-device function on a mesh and reading every device's result."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def on_each_device(fn, mesh, axis="data"):
  """``fn`` compiled once to run per device: see :func:`per_device`, which calls it once.

  Calling the result again with arrays of the same shapes reuses the compiled
  program (a loop of steps compiles one).
  """

  def body(*blocks):
    outputs = fn(*(block[0] for block in blocks))
    return jax.tree.map(lambda out: out[None], outputs)

  run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))

  def call(*stacked):
    placed = [jax.device_put(x, NamedSharding(mesh, P(axis))) for x in stacked]
    return jax.tree.map(np.asarray, run(*placed))

  return call


def per_device(fn, mesh, *stacked, axis="data"):
  """Runs ``fn`` in shard_map with device i given ``x[i]`` of each ``stacked``.

  Returns:
    ``fn``'s outputs as NumPy arrays with a leading axis: row i is what device
    i returned (so replicas can be compared bitwise).
  """
  return on_each_device(fn, mesh, axis)(*stacked)
