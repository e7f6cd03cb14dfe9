"""The options of :func:`topka2a_jax.topka2a`, validated once into a frozen record.

Every argument of the transform is checked here, at construction, with an
error that names the option and says what it takes; the rest of the package
reads the normalised values from :class:`Options`.

Example:
  >>> options = Options.create(0.01)
  >>> options.density, options.algorithm
  (0.01, 'auto')
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Hashable
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from topka2a_jax._src.arguments import checked_count
from topka2a_jax._src.axis import DataAxis
from topka2a_jax._src.collectives import algorithms, low_rank
from topka2a_jax._src.collectives.selection import check_selection
from topka2a_jax._src.planner import cost
from topka2a_jax._src.planner.cost import AUTO_NETWORK, Cluster, Network, get_network
from topka2a_jax._src.sizes import check_density

DEFAULT_AXIS = DataAxis("data")
"""``topka2a(density)`` with no ``axis_name=``: the mesh axis named ``"data"``."""

DEFAULT_ALGORITHM = algorithms.AUTO
"""``topka2a(density)`` with no ``algorithm=``: each bucket its cheapest exchange
under the cost model on the link (TopKA2A-sparse for large buckets on a
slow network, dense on a fast one)."""

DEFAULT_SELECTION = "auto"
"""``topka2a(density)`` with no ``selection=``: the fastest for the backend
(:func:`topka2a_jax.collectives.auto_choice`)."""

INNER_NETWORK = "nvlink"
"""The link inside a node that a pair of data axes assumes, unless ``network``
is a pair ``(outer, inner)``."""

DEFAULT_MIN_SIZE = cost.DEFAULT_MIN_SIZE
"""Leaves with fewer elements go dense (:data:`cost.DEFAULT_MIN_SIZE`)."""


def _flag(name: str, value: Any) -> bool:
  if not isinstance(value, bool):
    raise TypeError(f"{name} must be True or False, got {value!r}")
  return value


def _value_dtype(value_dtype: Any) -> jnp.dtype | None:
  if value_dtype is None:
    return None
  try:
    dtype = jnp.dtype(value_dtype)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"value_dtype must be a floating dtype such as jnp.bfloat16, or None; "
        f"got {value_dtype!r}")
  return dtype


def _backward_seconds(value: Any) -> float | None:
  if value is not None and not (
      isinstance(value, numbers.Real) and 0 <= value < math.inf):
    raise ValueError(f"backward_seconds must be None or seconds >= 0, got {value!r}")
  return None if value is None else float(value)


def _network(network: Any, axis: DataAxis) -> Any:
  """A preset name, ``"auto"`` or a :class:`Network`; a pair of them for a pair of axes."""
  if isinstance(network, tuple):
    if not axis.is_pair or len(network) != 2:
      raise ValueError(
          f"network={network!r} is a pair of links (between nodes, inside a "
          f"node) for axis_name=(outer, inner); with axis_name={axis.name!r} give "
          "one network")
    return tuple(_network(one, DEFAULT_AXIS) for one in network)
  return network if network == AUTO_NETWORK else get_network(network)


def _mesh(mesh: Any, axis: DataAxis) -> Mesh | None:
  if mesh is None:
    return None
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh(...)) "
                    f"or None, got {type(mesh).__name__}")
  axis.check_on(mesh)
  return mesh


def _check_low_rank(options: dict[str, Any], axis: DataAxis) -> None:
  """Validates ``rank`` for ``algorithm="powersgd"`` (its default if None) and what it excludes."""
  rank = options.get("rank")
  options["rank"] = (low_rank.DEFAULT_RANK if rank is None else checked_count("rank", rank, 1))
  if axis.is_pair:
    raise ValueError(
        f"algorithm='powersgd' runs over one data axis, got axis_name={axis.name!r}. "
        "Name the axis over all data-parallel devices (a mesh axis that spans "
        "both levels), or use a top-k algorithm for the two-level exchange.")
  if options.get("value_dtype") is not None:
    raise ValueError(
        "value_dtype narrows top-k values on the wire; algorithm='powersgd' "
        "all-reduces its float32 factors as they are. Drop value_dtype=.")


@dataclasses.dataclass(frozen=True)
class Options:
  """What one :func:`topka2a_jax.topka2a` transform does; see its arguments.

  Attributes:
    density: fraction of every sparse bucket each device sends, in (0, 1].
    axis: the data-parallel axis (``axis_name``, parsed).
    algorithm: a collective's name, or ``"auto"``.
    error_feedback: whether unsent entries are kept for the next step.
    min_size: smaller leaves go dense and keep no residual.
    fusion: bucket size threshold in elements, or ``"auto"``.
    network: the link the planner models, or ``"auto"`` (resolved when the
      update is traced, :func:`topka2a_jax.cost.detected_network`); for a
      pair of data axes, the link between nodes, or a pair ``(outer,
      inner)`` of links.
    backward_seconds: the backward pass's duration, or None for the default.
    value_dtype: dtype of sparse values on the wire; None sends them as they are.
    selection: a key of :data:`topka2a_jax.collectives.SELECTIONS`.
    warmup_steps: applied steps exchanged densely first.
    skip_nonfinite: whether a non-finite gradient skips the step everywhere.
    mesh: the mesh ``init`` lays the state out for, or None.
    whole_selection: whether ``"auto"`` takes only exchanges whose mean holds
      every device's whole selection (:func:`topka2a_jax.compress_updates`).
    rank: the rank of ``algorithm="powersgd"``'s factors, else None.
  """

  density: float
  axis: DataAxis = DEFAULT_AXIS
  algorithm: str = DEFAULT_ALGORITHM
  error_feedback: bool = True
  min_size: int = DEFAULT_MIN_SIZE
  fusion: int | str = "auto"
  network: Network | str | tuple[Network | str, Network | str] = AUTO_NETWORK
  backward_seconds: float | None = None
  value_dtype: jnp.dtype | None = None
  selection: str = DEFAULT_SELECTION
  warmup_steps: int = 0
  skip_nonfinite: bool = True
  mesh: Mesh | None = None
  whole_selection: bool = False
  rank: int | None = None

  @classmethod
  def create(cls, density: Any, **options: Any) -> Options:
    """Validates the transform's arguments; raises naming the first bad one.

    Raises:
      ValueError, TypeError: an argument out of range or of the wrong type.
    """
    defaults = {field.name: field.default for field in dataclasses.fields(cls)}
    defaults["axis_name"] = defaults.pop("axis").name  # the argument's name
    normalised = dict(options)
    unknown = sorted(set(normalised) - set(defaults))
    if unknown:
      raise TypeError(f"unknown option(s) {', '.join(unknown)}; the options are "
                      f"{', '.join(sorted(set(defaults) - {'density'}))}")
    axis = normalised["axis"] = DataAxis.parse(
        normalised.pop("axis_name", defaults["axis_name"]))
    fusion = normalised.get("fusion", defaults["fusion"])
    if fusion != "auto":
      normalised["fusion"] = checked_count("fusion", fusion, 1)
    algorithm = normalised.get("algorithm", defaults["algorithm"])
    if algorithm == algorithms.POWERSGD.name:
      _check_low_rank(normalised, axis)
    else:
      algorithms.check_plan_options(algorithm, fusion)
      if (algorithm in algorithms.ALGORITHMS and algorithms.ALGORITHMS[algorithm].quantizes
          and normalised.get("value_dtype") is not None):
        raise ValueError(
            f"value_dtype narrows top-k values on the wire; algorithm={algorithm!r} "
            "sends signs and few-bit codes with float32 scales instead. Drop "
            "value_dtype=.")
      if normalised.get("rank") is not None:
        sends = ("every entry as a few-bit code" if algorithm in algorithms.ALGORITHMS
                 and algorithms.ALGORITHMS[algorithm].quantizes else
                 "a top-k selection of density entries")
        raise ValueError(
            f"rank={normalised['rank']!r} sets the rank of algorithm='powersgd'; "
            f"algorithm={algorithm!r} sends {sends}. Drop rank=, or pass "
            "algorithm='powersgd'.")
    for name in ("error_feedback", "skip_nonfinite", "whole_selection"):
      if name in normalised:
        _flag(name, normalised[name])
    for name, minimum in (("min_size", 0), ("warmup_steps", 0)):
      if name in normalised:
        normalised[name] = checked_count(name, normalised[name], minimum)
    normalised["network"] = _network(normalised.get("network", defaults["network"]),
                                     axis)
    normalised["backward_seconds"] = _backward_seconds(
        normalised.get("backward_seconds"))
    normalised["value_dtype"] = _value_dtype(normalised.get("value_dtype"))
    check_selection(normalised.get("selection", defaults["selection"]))
    normalised["mesh"] = _mesh(normalised.get("mesh"), axis)
    if density is None:
      if not algorithms.ignores_density(algorithm):
        raise ValueError(
            f"density is required with algorithm={algorithm!r}: the fraction of "
            "entries each device sends, e.g. topka2a(0.01). Only "
            f"{', '.join(map(repr, algorithms.IGNORING_DENSITY))} leave it out, "
            "as they ignore it.")
      density = 1.0
    return cls(check_density(density), **normalised)

  def cluster(self) -> Cluster | None:
    """The nodes and links of a pair of data axes, inside ``shard_map``; else None.

    The inner link is ``network``'s second, or :data:`INNER_NETWORK`.
    """
    if not self.axis.is_pair:
      return None
    outer, inner = (self.network if isinstance(self.network, tuple)
                    else (self.network, INNER_NETWORK))
    per_node = self.axis.per_node()
    return Cluster(self.axis.size() // per_node, per_node,
                   outer=get_network(outer), inner=get_network(inner))

  def outer_network(self) -> Network:
    """The link the planner prices: between nodes for a pair of data axes."""
    outer = self.network[0] if isinstance(self.network, tuple) else self.network
    return get_network(outer)

  @property
  def axis_name(self) -> Hashable:
    """The data axis as JAX's collectives take it (``axis.name``)."""
    return self.axis.name

  @property
  def value_bytes(self) -> int:
    """Bytes per sparse value on the wire."""
    return 4 if self.value_dtype is None else self.value_dtype.itemsize

  @property
  def is_low_rank(self) -> bool:
    """Whether matrices go as low-rank products (``algorithm="powersgd"``)."""
    return self.algorithm == algorithms.POWERSGD.name

  def sends_low_rank(self, local_shape: tuple[int, ...]) -> bool:
    """Whether a leaf goes as a low-rank product (:func:`low_rank.compresses`)."""
    return self.is_low_rank and low_rank.compresses(local_shape, self.rank, self.min_size)

  def keeps_residual(self, local_size: int, local_shape: tuple[int, ...] | None = None
                     ) -> bool:
    """Whether a leaf is compressed with error feedback (else it goes dense).

    Args:
      local_size: elements of the leaf on one device: the whole leaf, or its
        shard where parameters are sharded over other mesh axes.
      local_shape: its shape there; decides for ``algorithm="powersgd"``.
    """
    if self.is_low_rank:
      return (self.error_feedback and local_shape is not None
              and self.sends_low_rank(local_shape))
    sparse = self.algorithm == algorithms.AUTO or algorithms.get(self.algorithm).sparse
    return (self.error_feedback and sparse and local_size > 0
            and local_size >= self.min_size)
