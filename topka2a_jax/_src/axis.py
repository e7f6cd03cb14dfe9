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

import dataclasses
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class DataAxis:
  """The data-parallel axis, parsed once: one mesh axis, or a pair ``(outer, inner)``.

  A pair (``("node", "local")``) is a cluster's nodes and the devices inside
  each: the two-level exchange and the residuals' slices read it. Build it
  with :meth:`parse`, which says what is wrong with a bad ``axis_name``.

  Attributes:
    name: the axis as JAX's collectives take it: ``"data"``, or the pair as
      a tuple.

  Example:
    >>> axis = DataAxis.parse(("node", "local"))
    >>> axis.names, axis.is_pair, axis.inner
    (('node', 'local'), True, 'local')
    >>> DataAxis.parse("data").size(jax.make_mesh((8,), ("data",)))
    8
  """

  name: Hashable = "data"

  @classmethod
  def parse(cls, axis_name: Any) -> DataAxis:
    """The record of ``axis_name`` (a record is returned as it is).

    Raises:
      TypeError: not a mesh axis name.
      ValueError: a tuple that is not a pair.
    """
    if isinstance(axis_name, DataAxis):
      return axis_name
    if not isinstance(axis_name, Hashable):
      raise TypeError(f"axis_name must be a mesh axis name, got {axis_name!r}")
    if isinstance(axis_name, tuple) and len(axis_name) != 2:
      raise ValueError(
          f"axis_name={axis_name!r}: the data axis is one mesh axis, or a pair "
          "(outer, inner) such as ('node', 'local') for the two-level exchange")
    return cls(axis_name)

  @property
  def names(self) -> tuple[Hashable, ...]:
    """The mesh axes it is made of: ``("node", "local")``, or one."""
    return self.name if isinstance(self.name, tuple) else (self.name,)

  @property
  def is_pair(self) -> bool:
    """Whether it is a pair ``(outer, inner)`` of mesh axes."""
    return len(self.names) == 2

  @property
  def inner(self) -> Hashable:
    """The axis inside a node: a pair's second, else the axis itself."""
    return self.names[-1]

  def on(self, mesh: Any) -> bool:
    """Whether ``mesh`` has every mesh axis it is made of."""
    return all(name in mesh.axis_names for name in self.names)

  def check_on(self, mesh: Any) -> None:
    """Raises unless ``mesh`` has every mesh axis it is made of.

    Raises:
      TypeError: ``mesh`` is not a mesh (None, say).
      ValueError: naming the axis, the mesh's axes and the option to pass.
    """
    if not hasattr(mesh, "axis_names") or not hasattr(mesh, "shape"):
      raise TypeError(f"mesh must be a jax.sharding.Mesh, e.g. jax.make_mesh((8,), "
                      f"('data',)), got {mesh!r}")
    if not self.on(mesh):
      raise ValueError(f"mesh has no axis {self.name!r}; its axes are "
                       f"{mesh.axis_names}. Pass the data-parallel axis with "
                       "axis_name=...")

  def size(self, mesh: Any = None) -> int:
    """Devices along it: on ``mesh``, or, without one, as bound by ``shard_map``."""
    if mesh is None:
      return bound_axis_size(self.name)
    return math.prod(mesh.shape[name] for name in self.names)

  def per_node(self, mesh: Any = None) -> int | None:
    """A pair's inner size (devices per node), else None; read as :meth:`size`."""
    if not self.is_pair:
      return None
    return DataAxis(self.inner).size(mesh)


def is_bound(axis_name: Hashable) -> bool:
  """Whether the call is inside a shard_map over ``axis_name``."""
  try:
    lax.axis_size(axis_name)
  except NameError:
    return False
  return True


def _manual_axes() -> tuple[Hashable, ...]:
  """The mesh axes an enclosing ``jax.shard_map`` is manual over (none outside)."""
  return tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def bound_axis_size(axis_name: Hashable) -> int:
  """Returns the size of ``axis_name``, or explains why it is not bound.

  Args:
    axis_name: the mesh axis to exchange over (or a pair of them).

  Returns:
    The number of devices along the axis, a static Python int.

  Raises:
    ValueError: the axis is not bound, because the caller is not inside
      ``jax.shard_map``, or inside one over other axes; or it is bound by
      ``jax.vmap``, which has no devices to exchange between.

  Example:
    >>> bound_axis_size("data")  # outside shard_map
    Traceback (most recent call last):
    ValueError: axis name 'data' is not bound here: this call is outside ...
  """
  try:
    size = int(lax.axis_size(axis_name))
  except NameError as error:
    manual = _manual_axes()
    if manual:
      mapped = manual[0] if len(manual) == 1 else manual
      raise ValueError(
          f"axis name {axis_name!r} is not bound here: this call is inside "
          f"jax.shard_map over {mapped!r}, not over {axis_name!r}. The exchange "
          "runs over the axis the step splits the batch over: build the "
          f"transform with axis_name={mapped!r} (topka2a(...), "
          "compress_updates(...), sharded_optimizer(...)), or the step with "
          f"axis_name={axis_name!r} (train_step(...), nnx_train_step(...)). "
          f"(JAX said: {error})") from None
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
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if not set(names) <= set(_manual_axes()):
    raise ValueError(
        f"axis name {axis_name!r} is bound by jax.vmap, not by jax.shard_map "
        "over a mesh: the exchange keeps state per device and its collectives "
        "cross devices, which a vmapped axis does not have. Build the step with "
        "topka2a_jax.train_step(loss_fn, tx, mesh), or call this inside "
        f"jax.shard_map over a mesh with an axis named {axis_name!r}.")
  return size


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
  return set(DataAxis.parse(axis_name).names) <= varying_axes(x)


def vary_like(value: jax.Array, like: jax.Array, drop: tuple[Hashable, ...] = ()
              ) -> jax.Array:
  """``value`` typed as varying along the mesh axes ``like`` varies along, but ``drop``.

  For values made from constants inside ``shard_map`` (the zeros of a
  skipped step, the empty mean of an empty leaf), which must carry the type
  of what they stand in for.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> def typed():
    ...   x = as_varying(jnp.zeros(()), "data")  # a per-device value
    ...   kept, dropped = vary_like(jnp.zeros(()), x), vary_like(jnp.zeros(()), x, ("data",))
    ...   return jnp.array([is_varying(kept, "data"), is_varying(dropped, "data")])
    >>> jax.shard_map(typed, mesh=mesh, in_specs=(), out_specs=P())()
    Array([ True, False], dtype=bool)
  """
  axes = tuple(varying_axes(like) - set(drop))
  return lax.pcast(value, axes, to="varying") if axes else value


def as_varying(x: jax.Array, axis_name: Hashable) -> jax.Array:
  """``x`` typed as differing along the data axis (or both of a pair): per-device state.

  A value that already differs along one axis of a pair (a mean inside each
  node) is cast along the other only.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> bool(jax.shard_map(lambda: is_varying(as_varying(jnp.zeros(()), "data"), "data"),
    ...                    mesh=mesh, in_specs=(), out_specs=P())())
    True
  """
  if not tracks_varying_axes(axis_name):
    return x
  missing = tuple(n for n in DataAxis.parse(axis_name).names if n not in varying_axes(x))
  return lax.pcast(x, missing, to="varying") if missing else x


def per_device_blocks(tree: Any, axis_name: Hashable) -> Any:
  """Every leaf as this device's block of a per-device global array: ``(1, ...)``.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> jax.shard_map(lambda: per_device_blocks(jnp.zeros(3), "data"), mesh=mesh,
    ...               in_specs=(), out_specs=P("data"))().shape
    (8, 3)
  """
  return jax.tree.map(lambda x: as_varying(x, axis_name)[None], tree)


def holds_tracer(tree: Any) -> bool:
  """Whether any leaf of ``tree`` is traced: the call runs under a transformation.

  Example:
    >>> seen = []
    >>> _ = jax.jit(lambda x: seen.append(holds_tracer(x)) or x)(1.0)
    >>> holds_tracer({"w": jnp.zeros(2)}), seen
    (False, [True])
  """
  return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))
