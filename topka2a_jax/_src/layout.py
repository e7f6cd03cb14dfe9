"""Where each piece lives on the mesh: parameter specs and the residuals' layout.

The residual of a parameter is per device. As one global array it is the
stack, along the data axis, of one parameter-shaped block per data index:
shape ``(P * d0, d1, ...)`` for a parameter of shape ``(d0, d1, ...)``
(``(P,)`` for a scalar), split along dimension 0 by the data axis and, within
each block, exactly as the parameter is split over the other mesh axes. So
every device holds the residual of its own parameter shard, and a block
means the same entries whatever the sharding: a partitioner may move it,
never mix it up.

Over a pair of data axes ``(outer, inner)`` with ``L`` devices per node,
device ``j`` of a node keeps only slice ``j`` of its parameter shard
(:func:`residual_slice`): ``m = ceil(n / L)`` entries of the ``n`` of the
flattened shard, the last slice zero-padded. The global array is then 1-D,
one block of ``m`` per device, ordered by the data axes and then by the
other mesh axes that split the parameter.

Example:
  >>> residual_spec(DataAxis("data"), P(None, "model"))
  P('data', 'model')
  >>> residual_shape((16, 64), 4)
  (64, 64)
  >>> residual_spec(DataAxis(("node", "local")), P(None, "model"))
  P(('node', 'local', 'model'),)
  >>> residual_shape((16, 64), 8, per_node=4, pieces=2)  # slices of 128
  (2048,)
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from topka2a_jax._src.axis import DataAxis
from topka2a_jax._src.sizes import ceil_div
from topka2a_jax._src.states import map_per_device


def spec_axes(spec: P) -> tuple[Hashable, ...]:
  """Every mesh axis a ``PartitionSpec`` names, in order."""
  axes: list[Hashable] = []
  for entry in spec:
    for axis in entry if isinstance(entry, tuple) else (entry,):
      if axis is not None:
        axes.append(axis)
  return tuple(axes)


def _entry_axes(entry: Any) -> tuple[Hashable, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _entry(axes: Sequence[Hashable]) -> Any:
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else tuple(axes)


def restrict_spec(spec: P | None, shape: Sequence[int],
                  axis_sizes: Mapping[Hashable, int]) -> P:
  """``spec`` kept to the axes in ``axis_sizes`` that split ``shape`` evenly.

  Axes of other meshes or of size 1, and any dimension the named axes do not
  divide, are dropped (that dimension is then whole on every device). The
  result names no trailing whole dimensions, as ``P()`` for a replicated array.

  Example:
    >>> restrict_spec(P(None, ("data", "model")), (3, 8), {"model": 2})
    P(None, 'model')
  """
  entries = list(spec or ()) + [None] * (len(shape) - len(spec or ()))
  kept = []
  for size, entry in zip(shape, entries[: len(shape)]):
    axes = [a for a in _entry_axes(entry) if axis_sizes.get(a, 1) > 1]
    split = math.prod(axis_sizes[a] for a in axes)
    kept.append(_entry(axes) if split and size % split == 0 else None)
  while kept and kept[-1] is None:
    kept.pop()
  return P(*kept)


def local_shape(shape: Sequence[int], spec: P,
                axis_sizes: Mapping[Hashable, int]) -> tuple[int, ...]:
  """The shape of one device's block of an array of ``shape`` laid out by ``spec``."""
  entries = list(spec) + [None] * (len(shape) - len(spec))
  return tuple(size // math.prod(axis_sizes[a] for a in _entry_axes(entry))
               for size, entry in zip(shape, entries))


def residual_slice(size: int, per_node: int) -> int:
  """Entries of one device's slice of an ``size``-entry shard: ``ceil(size / L)``."""
  return ceil_div(size, per_node)


def residual_shape(shape: Sequence[int], num_devices: int, *,
                   per_node: int | None = None, pieces: int = 1) -> tuple[int, ...]:
  """Global shape of a parameter's residual: one block per data index.

  Args:
    shape: the parameter's global shape.
    num_devices: devices along the data axis (or the pair of them).
    per_node: for a pair of data axes, the inner axis' size ``L`` (the
      blocks are slices); None for one data axis (the blocks are shaped like
      the parameter).
    pieces: how many shards the other mesh axes split the parameter into.

  Returns:
    ``(num_devices * d0, d1, ...)`` for one data axis, ``(num_devices *
    pieces * m,)`` with ``m`` the slice of :func:`residual_slice` for a pair.
  """
  if per_node is not None:
    local = math.prod(shape) // pieces
    return (num_devices * pieces * residual_slice(local, per_node),)
  return (num_devices * shape[0], *shape[1:]) if shape else (num_devices,)


def residual_spec(axis: DataAxis, param_spec: P | None = None) -> P:
  """The ``PartitionSpec`` of a parameter's residual.

  The data axis splits dimension 0 first (one block per data index); inside
  each block the parameter's own spec applies. For a pair of data axes the
  residual is 1-D (slices, see the module's docstring), split by the data
  axes and then by every axis of the parameter's spec.

  Args:
    axis: the data-parallel axis.
    param_spec: the parameter's spec over the other axes; None when it is
      replicated.

  Returns:
    The spec, e.g. ``P("data")`` or ``P(("data", "model"), None)``.

  Example:
    >>> residual_spec(DataAxis("data"), P("model", None))
    P(('data', 'model'),)
  """
  if axis.is_pair:
    return P(_entry((*axis.names, *spec_axes(param_spec or P()))))
  entries = list(param_spec or ())
  while entries and entries[-1] is None:
    entries.pop()
  if not entries:
    return P(_entry(axis.names))
  first = _entry((*axis.names, *_entry_axes(entries[0])))
  return P(first, *entries[1:])


def residual_block_spec(axis: DataAxis, param_spec: P) -> P:
  """How one data index's residual block splits over the other mesh axes.

  Like the parameter for one data axis; over all of the parameter's axes,
  in order, for the 1-D slices of a pair.

  Example:
    >>> residual_block_spec(DataAxis(("node", "local")), P("model", "expert"))
    P(('model', 'expert'),)
  """
  if axis.is_pair:
    axes = spec_axes(param_spec)
    return P(_entry(axes)) if axes else P()
  return param_spec


def factor_spec(param_spec: P | None) -> P:
  """The ``PartitionSpec`` of a PowerSGD factor ``Q`` (``_src/collectives/low_rank.py``).

  Replicated over the data axis; where the other mesh axes split the
  parameter, one ``(n, rank)`` block per shard along dimension 0, ordered by
  the axes that split it, since each shard is a matrix of its own.

  Example:
    >>> factor_spec(P(None, "model")), factor_spec(None)
    (P('model',), P())
  """
  axes = spec_axes(param_spec or P())
  return P(_entry(axes)) if axes else P()


def param_spec_of(leaf: Any, mesh: Mesh) -> P | None:
  """How ``leaf`` is split over ``mesh``, where that can be read; else None.

  A concrete array tells its ``NamedSharding`` (when it lives on a mesh with
  ``mesh``'s axis names); a traced value tells its type on meshes with
  explicit axes. Under ``jax.jit`` with automatic axes the partitioner has
  not decided yet, so nothing can be read.
  """
  if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
    sharding = leaf.sharding
  else:
    try:
      sharding = jax.typeof(leaf).sharding
    except (TypeError, AttributeError):
      return None
    types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    if AxisType.Explicit not in types:
      return None  # automatic axes: the partitioner decides later
  if not isinstance(sharding, NamedSharding):
    return None
  if tuple(sharding.mesh.axis_names) != tuple(mesh.axis_names):
    return None
  return sharding.spec


def constrain(x: Any, sharding: NamedSharding) -> Any:
  """``x`` (traced) laid out as ``sharding``: a reshard on explicit axes, else a constraint."""
  if AxisType.Explicit in sharding.mesh.axis_types:
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def automatic_axes(mesh: Any, exclude: DataAxis) -> dict[Hashable, int]:
  """Axes of ``mesh`` other than ``exclude``'s that are not manual, by size (> 1)."""
  types = getattr(mesh, "axis_types", None) or (AxisType.Auto,) * len(mesh.axis_names)
  return {name: size for name, size, kind in
          zip(mesh.axis_names, mesh.axis_sizes, types)
          if name not in exclude.names and kind != AxisType.Manual and size > 1}


def check_not_over_data(spec: P | None, axis: DataAxis, path: str) -> None:
  """Refuses a parameter split over the data axis itself, saying why.

  Raises:
    ValueError: ``spec`` names an axis of ``axis``.
  """
  axis_name = axis.name
  if spec is not None and set(axis.names) & set(spec_axes(spec)):
    raise ValueError(
        f"parameter {path} is sharded over the data axis {axis_name!r} "
        f"({spec}). topka2a averages gradients over {axis_name!r}, so every "
        f"device of {axis_name!r} must hold the same parameters: replicate them "
        f"over {axis_name!r} (shard them over other mesh axes at will), e.g. "
        f"jax.device_put(params, NamedSharding(mesh, P())). Sharding the "
        "parameters themselves over the data axis (FSDP) is not supported.")


_LAYOUT_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar(
    "topka2a_layout_mesh", default=None)


@contextlib.contextmanager
def laid_out_for(mesh: Mesh) -> Iterator[None]:
  """Within, ``init`` of every :func:`topka2a_jax.topka2a` lays its state out for ``mesh``.

  For transforms built without ``mesh=`` (:func:`topka2a_jax.init` uses it).
  """
  token = _LAYOUT_MESH.set(mesh)
  try:
    yield
  finally:
    _LAYOUT_MESH.reset(token)


def mesh_laid_out_for() -> Mesh | None:
  """The mesh of the innermost :func:`laid_out_for` around this call, or None."""
  return _LAYOUT_MESH.get()


def replica_specs(inner_state: Any, axis: DataAxis | None, params_structure: Any = None,
                  param_specs: Any = None) -> Any:
  """The ``PartitionSpec`` of every leaf of the per-device ``inner`` state.

  Dimension 0 holds one copy per data index; a part shaped like the
  parameters (Adam's moments) is split like them after it.

  Args:
    inner_state: the state, arrays or shapes, every leaf ``(P, *shape)``.
    axis: the data axis; None inside a shard_map already manual over it.
    params_structure: the parameters' pytree structure, with ``param_specs``.
    param_specs: one ``PartitionSpec`` per parameter leaf, or None.

  Returns:
    A pytree of ``PartitionSpec`` with ``inner_state``'s structure.

  Example:
    >>> state = {"mu": jnp.zeros((8, 4, 6)), "count": jnp.zeros(8)}
    >>> replica_specs(state, DataAxis("data"))
    {'count': P('data',), 'mu': P('data',)}
  """
  first = None if axis is None else residual_spec(axis)[0]
  if param_specs is None:
    return jax.tree.map(lambda _: P(first), inner_state)
  spec_leaves = list(param_specs)

  def shaped_like_params(node: Any) -> bool:
    return (params_structure.num_leaves > 0
            and jax.tree.structure(node) == params_structure)

  def spec_for(node: Any) -> Any:
    if shaped_like_params(node):
      return params_structure.unflatten([P(first, *(spec or ())) for spec in spec_leaves])
    return P(first)

  return jax.tree.map(spec_for, inner_state, is_leaf=shaped_like_params)


def inner_specs(inner_state: Any, treedef: Any, leaf_specs: Sequence[P],
                first: Hashable | None) -> Any:
  """The spec of every leaf of the inner state, one block per data index.

  A part shaped like the parameters (Adam's moments) holds, for each
  parameter, its shards as ``(devices, 1, ..., 1, entries)``; where the
  parameter is split over other mesh axes, each of their devices holds the
  shards of its own piece, side by side along the last dimension.

  Args:
    inner_state: the inner state (arrays or shapes), every leaf per device.
    treedef: the parameters' structure.
    leaf_specs: each parameter's spec over the other mesh axes.
    first: the spec entry of dimension 0: the data axis, or None inside a
      shard_map already manual over it.

  Returns:
    A pytree of ``PartitionSpec`` with the inner state's structure.
  """
  def param_spec(leaf: Any, spec: P) -> P:
    axes = spec_axes(spec)
    if not axes or leaf.ndim < 2:
      return P(first)
    return P(first, *[None] * (leaf.ndim - 2), axes[0] if len(axes) == 1 else axes)

  def shaped_like_params(node: Any) -> bool:
    return jax.tree.structure(node) == treedef and treedef.num_leaves > 0

  def spec_for(node: Any) -> Any:
    if shaped_like_params(node):
      return treedef.unflatten([param_spec(leaf, spec) for leaf, spec in
                                zip(treedef.flatten_up_to(node), leaf_specs)])
    return P(first)

  return jax.tree.map(spec_for, inner_state, is_leaf=shaped_like_params)


def check_laid_out_over(opt_state: Any, axis: DataAxis, call: str) -> None:
  """Refuses an optimizer state whose per-device fields are laid out over another
  axis than ``axis`` (global arrays only: shapes and traced values say nothing).

  Args:
    opt_state: any optimizer state holding the transforms' states.
    axis: the data axis ``call`` was given.
    call: the function the user called, for the message.

  Raises:
    ValueError: naming the axis the state is laid out over, and the fix.
  """
  per_device: dict[str, list[Any]] = {}
  map_per_device(opt_state, lambda kind, value: per_device.setdefault(kind, []).append(
      value), lambda node: None)
  names = axis.names if axis.is_pair else (axis.name,)
  for kind, path, leaf in ((kind, path, leaf) for kind, values in per_device.items()
                           for value in values
                           for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]):
    sharding = getattr(leaf, "sharding", None)
    if (isinstance(leaf, jax.core.Tracer) or not isinstance(sharding, NamedSharding)
        or not sharding.spec):
      continue
    first = sharding.spec[0]
    over = tuple(first) if isinstance(first, (tuple, list)) else (first,)
    # the data axis comes first; axes the parameters are split over may follow
    if first is not None and over[:len(names)] != tuple(names):
      raise ValueError(
          f"{call}(..., axis_name={axis.name!r}): the optimizer state's per-device "
          f"{kind} {jax.tree_util.keystr(path)} is laid out over {first!r}, the axis its "
          f"exchange was built with; pass that one, axis_name={first!r}")
