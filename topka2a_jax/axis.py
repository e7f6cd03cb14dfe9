"""The mesh axis that gradients are exchanged over, checked at trace time.

Every collective in this package runs inside ``jax.shard_map`` over one named
mesh axis. The helpers here turn JAX's terse failures (an unbound axis name,
gradients that were silently summed already) into errors that say what is
wrong and how to fix it.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> scale = jax.shard_map(lambda x: x * bound_axis_size("data"), mesh=mesh,
  ...                       in_specs=P("data"), out_specs=P("data"))
  >>> scale(jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data"))))
  Array([8., 8., 8., 8., 8., 8., 8., 8.], dtype=float32)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def axis_names(axis_name: Hashable) -> tuple[Hashable, ...]:
  """The mesh axes a data axis is made of: ``("node", "local")``, or one.

  Example:
    >>> axis_names("data"), axis_names(("node", "local"))
    (('data',), ('node', 'local'))
  """
  return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def on_mesh(mesh: Any, axis_name: Hashable) -> bool:
  """Whether ``mesh`` has every axis ``axis_name`` is made of."""
  return all(name in mesh.axis_names for name in axis_names(axis_name))


def check_on_mesh(mesh: Any, axis_name: Hashable) -> None:
  """Raises unless ``mesh`` has every axis ``axis_name`` is made of.

  Raises:
    ValueError: naming the axis, the mesh's axes and the option to pass.
  """
  if not on_mesh(mesh, axis_name):
    raise ValueError(f"mesh has no axis {axis_name!r}; its axes are "
                     f"{mesh.axis_names}. Pass the data-parallel axis with "
                     "axis_name=...")


def is_bound(axis_name: Hashable) -> bool:
  """Whether the call is inside a shard_map over ``axis_name``."""
  try:
    lax.axis_size(axis_name)
  except NameError:
    return False
  return True


def mesh_axis_size(mesh: Any, axis_name: Hashable) -> int:
  """Devices along ``axis_name`` of ``mesh``: the product over its axes."""
  return math.prod(mesh.shape[name] for name in axis_names(axis_name))


def devices_per_node(axis_name: Hashable, mesh: Any = None) -> int | None:
  """The inner axis' size for a pair ``(outer, inner)`` of data axes, else None.

  Read from ``mesh``, or, without one, from the axis bound by ``shard_map``.
  """
  names = axis_names(axis_name)
  if len(names) == 1:
    return None
  return mesh.shape[names[1]] if mesh is not None else bound_axis_size(names[1])


def bound_axis_size(axis_name: Hashable) -> int:
  """Returns the size of ``axis_name``, or explains why it is not bound.

  Args:
    axis_name: the mesh axis to exchange over.

  Returns:
    The number of devices along the axis, a static Python int.

  Raises:
    ValueError: the axis is not bound, because the caller is not inside
      ``jax.shard_map`` or the mesh has no axis of that name.

  Example:
    >>> bound_axis_size("data")  # outside shard_map
    Traceback (most recent call last):
    ValueError: axis name 'data' is not bound here: this call is outside ...
  """
  try:
    return int(lax.axis_size(axis_name))
  except NameError as error:
    raise ValueError(
        f"axis name {axis_name!r} is not bound here: this call is outside "
        f"jax.shard_map over {axis_name!r}. The sparse exchange runs on "
        "per-device gradients inside a shard_map over the data axis; under "
        "plain jax.jit the partitioner has already all-reduced the gradients "
        "densely, leaving nothing to compress. Build the training step with "
        "topka2a_jax.train_step(loss_fn, tx, mesh) (Flax NNX: "
        "topka2a_jax.nnx_train_step), or call this inside jax.shard_map over "
        f"a mesh with an axis named {axis_name!r} (another name: "
        f"axis_name=...). (JAX said: {error})"
    ) from None


def tracks_varying_axes(axis_name: Hashable) -> bool:
  """Whether shard_map is checking which values vary along ``axis_name``.

  That is the default (``check_vma=True``); with ``check_vma=False`` JAX keeps
  no such types and nothing can be checked.

  Args:
    axis_name: a bound mesh axis.

  Returns:
    True when values carry their varying-axes type.
  """
  probe = lax.pcast(jnp.zeros((), jnp.float32), axis_name, to="varying")
  return is_varying(probe, axis_name)


def varying_axes(x: jax.Array) -> frozenset[Hashable]:
  """The mesh axes along which ``x`` is typed as differing between devices.

  Args:
    x: a value inside shard_map.

  Returns:
    The axes; empty outside shard_map or with ``check_vma=False``.
  """
  return frozenset(jax.typeof(x).mat.varying)


def grouped_by_varying_axes(arrays: Sequence[jax.Array],
                            key: Callable[[jax.Array], Any] = lambda _: None
                            ) -> list[list[int]]:
  """Positions of ``arrays`` grouped by ``key`` and by the mesh axes they vary over.

  One collective over a group never mixes a piece of a parameter split over
  other mesh axes with a parameter replicated over them, which would make the
  latter's result differ along those axes.

  Example:
    >>> grouped_by_varying_axes([jnp.zeros(2), jnp.zeros(3, jnp.int32)],
    ...                         key=lambda x: x.dtype)
    [[0], [1]]
  """
  groups: dict[Any, list[int]] = {}
  for i, array in enumerate(arrays):
    groups.setdefault((key(array), varying_axes(array)), []).append(i)
  return list(groups.values())


def is_varying(x: jax.Array, axis_name: Hashable) -> bool:
  """Whether ``x`` is typed as differing from device to device along the axis.

  Args:
    x: a value inside shard_map.
    axis_name: a bound mesh axis.

  Returns:
    True when ``x`` may differ between the devices of ``axis_name``.
  """
  return set(axis_names(axis_name)) <= varying_axes(x)


def as_varying(x: jax.Array, axis_name: Hashable) -> jax.Array:
  """``x`` typed as differing along the data axis (or both of a pair): per-device state.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> bool(jax.shard_map(lambda: is_varying(as_varying(jnp.zeros(()), "data"), "data"),
    ...                    mesh=mesh, in_specs=(), out_specs=P())())
    True
  """
  if not tracks_varying_axes(axis_name) or is_varying(x, axis_name):
    return x
  return lax.pcast(x, axis_names(axis_name), to="varying")
