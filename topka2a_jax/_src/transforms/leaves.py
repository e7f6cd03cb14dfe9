"""Gradient and parameter pytrees taken apart, and where each leaf lives.

The three transforms (:func:`topka2a_jax.topka2a`,
:func:`topka2a_jax.compress_updates`, :func:`topka2a_jax.sharded_optimizer`)
and the training step read their trees through :func:`leaves_of` (a Flax
``Variable`` counts as one leaf) and ask here how each leaf splits over the
mesh axes other than the data axis, and whether it is still per device.

Example:
  >>> leaves = leaves_of({"w": jnp.zeros((4, 3))})
  >>> leaves.paths, leaves.structure.num_leaves
  (["['w']"], 1)
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from topka2a_jax._src import layout
from topka2a_jax._src.axis import is_varying, tracks_varying_axes


def _is_variable(node: Any) -> bool:
  """Whether ``node`` is a Flax NNX Variable (a leaf's box), without importing Flax."""
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(node, nnx.Variable)


class Leaves(NamedTuple):
  """A pytree taken apart: its leaves, their printable paths, and its structure.

  Attributes:
    paths: each leaf's path, as ``jax.tree_util.keystr`` prints it.
    values: the leaves, a Flax ``Variable``'s value in place of the box.
    structure: the tree with each ``Variable`` as one leaf (residuals and
      specs mirror it).
    full: the structure that rebuilds the tree as it came, ``Variable``
      boxes included.
  """

  paths: list[str]
  values: list[Any]
  structure: Any
  full: Any


def leaves_of(tree: Any) -> Leaves:
  """Leaves of ``tree`` with their printable paths, and the tree's structure twice.

  A Flax ``Variable`` counts as one leaf, its value, so that a state built
  from ``nnx.state(model)`` mirrors the plain arrays updates arrive as.

  Example:
    >>> leaves = leaves_of({"b": jnp.zeros(2), "w": jnp.ones((2, 3))})
    >>> leaves.paths, [v.shape for v in leaves.values]
    (["['b']", "['w']"], [(2,), (2, 3)])
  """
  with_paths, structure = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=_is_variable)
  paths = [jax.tree_util.keystr(path) or "<root>" for path, _ in with_paths]
  values = [leaf.get_value() if _is_variable(leaf) else leaf for _, leaf in with_paths]
  full = jax.tree.structure(tree)
  return Leaves(paths, values, structure,
                full if full.num_leaves == len(values) else structure)


def check_floating(leaves: Sequence[Any], paths: Sequence[str], what: str) -> None:
  for leaf, path in zip(leaves, paths):
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f"{what} leaf {path} has dtype {dtype}; topka2a exchanges floating "
          "gradients only. Keep integer and other non-float leaves out of the "
          "differentiated pytree, or skip them with optax.masked(...).")


def given_specs(treedef: Any, specs: Any) -> list[P | None]:
  """The parameters' specs passed as :data:`PARAM_SPECS`, one per leaf, or Nones."""
  if specs is None:
    return [None] * treedef.num_leaves
  return treedef.flatten_up_to(specs)


def shard_specs(grads: Sequence[jax.Array], given: Sequence[P | None],
                others: dict[Hashable, int]) -> list[P]:
  """How each gradient leaf splits over ``others``: its type, the given spec, or whole."""
  mesh = jax.sharding.get_abstract_mesh()
  specs = []
  for grad, spec in zip(grads, given):
    typed = layout.param_spec_of(grad, mesh)
    specs.append(layout.restrict_spec(typed if typed is not None else spec,
                                      grad.shape, others))
  return specs


def local_shapes(grads: Sequence[jax.Array], given: Sequence[P | None],
                  others: dict[Hashable, int]) -> list[tuple[int, ...]]:
  """The shape of each leaf on one device, after the split over ``others``."""
  if not others:
    return [tuple(g.shape) for g in grads]
  specs = shard_specs(grads, given, others)
  return [tuple(layout.local_shape(grad.shape, spec, others))
          for grad, spec in zip(grads, specs)]


def check_per_device(grads: Sequence[jax.Array], paths: Sequence[str],
                     axis_name: Hashable) -> None:
  """Rejects gradients that JAX already summed across the axis."""
  if not grads or not tracks_varying_axes(axis_name):
    return
  for grad, path in zip(grads, paths):
    if not is_varying(grad, axis_name):
      raise ValueError(
          f"gradient leaf {path} is identical on every device of "
          f"{axis_name!r} (typed invariant along it), so it was already "
          "summed across devices: jax.grad adds a dense psum when it "
          "differentiates with respect to replicated parameters inside "
          "shard_map. Differentiate with respect to per-device copies: "
          f"jax.grad(loss)(jax.lax.pcast(params, {axis_name!r}, "
          "to='varying'), batch), or let topka2a_jax.train_step do it.")
