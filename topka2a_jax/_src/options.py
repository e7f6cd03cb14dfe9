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
import difflib
import math
import numbers
from collections.abc import Hashable, Sequence
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from topka2a_jax._src.arguments import checked_count
from topka2a_jax._src.axis import DataAxis
from topka2a_jax._src.collectives import algorithms, low_rank
from topka2a_jax._src.collectives.selection import check_selection
from topka2a_jax._src.planner import cost
from topka2a_jax._src.planner.cost import (
  AUTO_NETWORK,
  INNER_NETWORK,
  Cluster,
  Network,
  get_network,
)
from topka2a_jax._src.sizes import check_density, compresses

DEFAULT_AXIS = DataAxis("data")
"""``topka2a(density)`` with no ``axis_name=``: the mesh axis named ``"data"``."""

DEFAULT_ALGORITHM = algorithms.AUTO
"""``topka2a(density)`` with no ``algorithm=``: each bucket its cheapest exchange
under the cost model on the link (TopKA2A-sparse for large buckets on a
slow network, dense on a fast one)."""

DEFAULT_SELECTION = "auto"
"""``topka2a(density)`` with no ``selection=``: the fastest for the backend
(:func:`topka2a_jax.collectives.auto_choice`)."""


DEFAULT_MIN_SIZE = cost.DEFAULT_MIN_SIZE
"""Leaves with fewer elements go dense (:data:`cost.DEFAULT_MIN_SIZE`)."""


def _flag(name: str, value: Any) -> bool:
  if not isinstance(value, bool):
    raise TypeError(f"{name} must be True or False, got {value!r}")
  return value


def _floating(name: str):
  """The check of a dtype option: a floating dtype, or None."""
  def check(value: Any, given: dict[str, Any]) -> jnp.dtype | None:
    del given
    if value is None:
      return None
    try:
      dtype = jnp.dtype(value)
    except TypeError:
      dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(f"{name} must be a floating dtype such as jnp.bfloat16, or "
                      f"None; got {value!r}")
    return dtype
  return check


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


def argument_of(field: dataclasses.Field) -> str:
  """The keyword users pass for ``field``."""
  return field.metadata.get("argument") or field.name


def _check_together(options: dict[str, Any]) -> None:
  """The checks that read several options: what each algorithm takes and excludes."""
  algorithm = options["algorithm"]
  if algorithm == algorithms.POWERSGD.name:
    _check_low_rank(options, options["axis"])
    return
  algorithms.check_plan_options(algorithm, options["fusion"])
  quantizes = algorithm in algorithms.ALGORITHMS and algorithms.ALGORITHMS[algorithm].quantizes
  if quantizes and options["value_dtype"] is not None:
    raise ValueError(
        f"value_dtype narrows top-k values on the wire; algorithm={algorithm!r} "
        "sends signs and few-bit codes with float32 scales instead. Drop "
        "value_dtype=.")
  if options["rank"] is not None:
    sends = ("every entry as a few-bit code" if quantizes else
             "a top-k selection of density entries")
    raise ValueError(
        f"rank={options['rank']!r} sets the rank of algorithm='powersgd'; "
        f"algorithm={algorithm!r} sends {sends}. Drop rank=, or pass "
        "algorithm='powersgd'.")


def _density(density: Any, algorithm: str, forms_follow: bool = False) -> float:
  """``density`` checked; 1.0 where it is left out for an algorithm that ignores it.

  ``"auto"`` may leave it out too where its forms follow the optimizer after
  it (``forms_follow``): only before plain SGD is a top-k chosen, which then
  asks for it.
  """
  if density is None:
    if not (algorithms.ignores_density(algorithm)
            or (forms_follow and algorithm == algorithms.AUTO)):
      raise ValueError(
          f"density is required with algorithm={algorithm!r}: the fraction of "
          "entries each device sends, e.g. topka2a(0.01). Only "
          f"{', '.join(map(repr, algorithms.IGNORING_DENSITY))} leave it out, "
          "as they ignore it.")
    density = 1.0
  return check_density(density)


FOLLOWS_KINDS = {"adam": "adaptive", "momentum": "momentum", "sgd": "plain"}
"""``follows=``'s names, and the kind of optimizer each says (``planner/forms.py``)."""


def _follows(value: Any) -> Any:
  """None, a name of :data:`FOLLOWS_KINDS` (as its kind), or an optax transform."""
  if value is None:
    return None
  if isinstance(value, str):
    if value not in FOLLOWS_KINDS:
      raise ValueError(
          f"follows={value!r} names no optimizer kind: give one of "
          f"{', '.join(map(repr, FOLLOWS_KINDS))} (Adam's family, momentum SGD, plain "
          "SGD), or the optimizer itself, follows=optax.adam(1e-3)")
    return FOLLOWS_KINDS[value]
  if not (callable(getattr(value, "init", None)) and callable(getattr(value, "update", None))):
    raise TypeError(
        f"follows= takes the optimizer after the exchange (an optax transform such as "
        f"optax.adam(1e-3)) or one of {', '.join(map(repr, FOLLOWS_KINDS))}; got "
        f"{type(value).__name__}")
  return value


def _axis(value: Any, given: dict[str, Any]) -> DataAxis:
  del given
  return DataAxis.parse(value)


def _checked_mesh(value: Any, given: dict[str, Any]) -> Mesh | None:
  return _mesh(value, given["axis"])


def _algorithm(value: Any, given: dict[str, Any]) -> str:
  del given
  if value != algorithms.POWERSGD.name:
    algorithms.check_plan_options(value, "auto")
  return value


def _fusion(value: Any, given: dict[str, Any]) -> int | str:
  del given
  return value if value == "auto" else checked_count("fusion", value, 1)


def _count(name: str, minimum: int):
  return lambda value, given: checked_count(name, value, minimum)


def _flagged(name: str):
  return lambda value, given: _flag(name, value)


def _selection(value: Any, given: dict[str, Any]) -> str:
  del given
  check_selection(value)
  return value


def _option(default: Any, doc: str, check: Any, *, argument: str | None = None,
            annotation: str | None = None, user: bool = True) -> Any:
  """One option: its default, the docstring line every transform shows, its check.

  Args:
    default: what the transforms use when it is left out.
    doc: its line in the transforms' Args sections (one paragraph).
    check: ``(value, the options checked before it) -> normalised value``,
      raising ValueError or TypeError naming the option.
    argument: the keyword users pass, where it differs from the field's name.
    annotation: the type the signatures show, where it differs from the field's.
    user: False for a setting the library's own transforms pass, which no
      signature shows.
  """
  return dataclasses.field(default=default, metadata={
      "doc": doc, "check": check, "argument": argument, "annotation": annotation,
      "user": user})


@dataclasses.dataclass(frozen=True)
class Options:
  """What one exchange transform does: every option, declared once.

  Each field is one option of :func:`topka2a_jax.topka2a`,
  :func:`topka2a_jax.compress_updates` and :func:`topka2a_jax.sharded_optimizer`:
  its default, its check, and its line in their docstrings (the field's
  ``doc``). ``transforms/signatures.py`` builds their signatures and Args
  from them, and types their ``**options`` for type checkers
  (:class:`~topka2a_jax._src.transforms.signatures.TopKA2AOptions`), so a
  new option is one field here, its line in those types, and the code that
  reads it.
  :meth:`create` runs the checks, in the order the fields are declared.

  Attributes:
    density: fraction of every sparse bucket each device sends, in (0, 1].
  """

  density: float
  axis: DataAxis = _option(
      DEFAULT_AXIS,
      "the data-parallel mesh axis, or a pair ``(outer, inner)`` of them, e.g. "
      "``(\"node\", \"local\")``: then the planner prices every bucket both flat over "
      "all devices and two-level (reduced densely inside each node and exchanged "
      "between nodes, one slice per device; :func:`topka2a_jax.collectives.two_level`) "
      "on the two links (:func:`topka2a_jax.cost.cluster_cost`), and takes the "
      "cheaper. Each device then keeps the residual of its slice of every leaf only, "
      "1/L of it for L devices per node.",
      _axis, argument="axis_name", annotation="Hashable")
  mesh: Mesh | None = _option(
      None,
      "the mesh of the training step. With it, ``tx.init(params)`` (as "
      "``nnx.Optimizer`` calls it) returns the state as global arrays laid out for "
      "the mesh: residuals per device, each holding its own parameter shard's, "
      "everything else replicated. Without it, ``init`` reads the mesh from the "
      "parameters' shardings.",
      _checked_mesh)
  algorithm: str = _option(
      DEFAULT_ALGORITHM,
      "``\"auto\"`` (the default): the forms that keep the quality of the optimizer "
      "after the exchange in its chain, each bucket the cheapest of them under the "
      "cost model on ``network``, dense where compression does not pay (small "
      "buckets, fast links): before Adam's family or an optimizer it does not know, "
      "every entry in 8 bits (``\"quantized_8_8_fine\"``); before momentum SGD, 4 "
      "bits up and 8 back (``\"quantized_4_8\"``); before plain SGD or nothing, a "
      "top-k at ``density`` (the TopKA2A forms or TopkA). Or one name in "
      ":data:`topka2a_jax.collectives.ALGORITHMS` for every large bucket: the paper's "
      "TopKA2A; its sparse-second-phase variant, "
      "O(k) volume; TopkA, whose volume grows with the number of devices; dense "
      "``lax.pmean``, which ignores ``density``. Or ``\"quantized_8_8\"`` (and the "
      "other ``\"quantized_A_B\"``): every entry in A bits (one scale per chunk) to "
      "its shard's owner by AlltoAll, the owners' means back in B bits by AllGather, "
      "with error feedback on both phases (:func:`topka2a_jax.collectives.few_bit`); "
      "``\"rotated_4_8\"`` and ``\"rotated_4_4\"`` rotate each 512 entries by a "
      "random-sign Walsh-Hadamard transform before a 4-bit code, so that one large "
      "entry does not coarsen its neighbours' steps (``\"rotated_1_1\"`` sends the rotated "
      "entries' signs both ways); "
      "``\"onebit\"``, ``\"onebit_4\"`` and ``\"onebit_1\"`` send signs (1-bit "
      "Adam's compressed all-reduce, :func:`topka2a_jax.collectives.onebit`) and the "
      "means back in 8, 4 or 1 bits. Or ``\"powersgd\"``: every matrix leaf as a "
      "rank-``rank`` product in two all-reduces, vectors and small matrices dense "
      "(:func:`topka2a_jax.collectives.powersgd`). These last ignore ``density``; "
      "``\"auto\"`` picks only ``\"quantized_8_8_fine\"`` and ``\"quantized_4_8\"`` of "
      "them. An explicit top-k "
      "or sign before Adam's family is kept, with a warning.",
      _algorithm)
  follows: Any = _option(
      None,
      "what the program does with the exchange's mean, for ``algorithm=\"auto\"``: "
      "the optimizer itself (``follows=optax.adam(1e-3)``) or its kind, "
      "``\"adam\"`` (Adam's family, signs, any per-entry adaptive step), "
      "``\"momentum\"`` or ``\"sgd\"`` (plain SGD, the mean applied as it is). "
      "None (the default) reads it from the ``optax.chain`` or ``optax.named_chain`` "
      "running the exchange; where nothing can be read there (no chain, nothing "
      "after the exchange in it, an optimizer it does not know), ``\"auto\"`` sends "
      "every entry in 8 bits, safe before both, and says so once.",
      lambda value, given: _follows(value),
      annotation="Literal['adam', 'momentum', 'sgd'] | Transform | None")
  error_feedback: bool = _option(
      True,
      "keep what was not sent and add it to the next step's gradient. Without it "
      "the unsent mass is dropped and accuracy suffers.",
      _flagged("error_feedback"))
  min_size: int = _option(
      DEFAULT_MIN_SIZE, "leaves with fewer elements on a device go dense.",
      _count("min_size", 0))
  fusion: int | str = _option(
      "auto",
      "leaves are fused, last first, into flat buckets of at least this many "
      "elements (a larger leaf gets a bucket of its own); ``\"auto\"`` finds the "
      "threshold at trace time by binary search on the cost model's predicted step "
      "time (:func:`topka2a_jax.plan_fusion`).",
      _fusion, annotation="int | Literal['auto']")
  network: Network | str | tuple[Network | str, Network | str] = _option(
      AUTO_NETWORK,
      "the link the cost model plans for: ``\"auto\"`` (the default: ``eth10`` "
      "between processes, ``nvlink`` among one process's accelerators; "
      ":func:`topka2a_jax.cost.detected_network`), a preset name "
      "(:data:`topka2a_jax.cost.NETWORKS`) or a measured "
      ":class:`topka2a_jax.cost.Network`. Used by ``fusion=\"auto\"`` and "
      "``algorithm=\"auto\"``. For a pair of data axes it is the link between nodes, "
      "the one inside a node being ``\"nvlink\"``; or give both, "
      "``network=(between, inside)``.",
      lambda value, given: _network(value, given["axis"]), annotation="Any")
  backward_seconds: float | None = _option(
      None,
      "the backward pass's duration, which bucket exchanges overlap. By default "
      ":func:`topka2a_jax.train_step` estimates it from XLA's cost analysis of the "
      "compiled gradient against the device's rate (:data:`topka2a_jax.cost.DEVICES`); "
      "in a hand-written step, no overlap is assumed.",
      lambda value, given: _backward_seconds(value))
  value_dtype: jnp.dtype | None = _option(
      None,
      "dtype of the sparse values on the wire, e.g. ``jnp.bfloat16``; accumulation "
      "stays in float32 and the rounding stays in the residual. None sends float32. "
      "Indices always travel in the narrowest unsigned type that fits (uint16 for "
      "shards of up to 65,536). Not with the exchanges that send codes.",
      _floating("value_dtype"), annotation="Any")
  residual_dtype: jnp.dtype | None = _option(
      None,
      "dtype the residuals are kept in. None (the default) keeps float32 (float64 "
      "for float64 leaves), so nothing rounds away. ``jnp.bfloat16`` halves their "
      "memory, a copy of the model per device; gradient and residual are still "
      "added in float32, and what rounds off when the residual is stored is lost.",
      _floating("residual_dtype"), annotation="Any")
  selection: str = _option(
      DEFAULT_SELECTION,
      "``\"auto\"`` (the default: the fastest for the backend, "
      ":func:`topka2a_jax.collectives.auto_choice`), ``\"exact\"`` top-k (a sort), "
      "``\"threshold\"`` (a magnitude threshold found in a few passes, many times "
      "faster on large buckets; where it may keep less than 99% of exact top-k's "
      "magnitude mass, or miss a nonzero entry over a background of zeros, it sorts "
      "exactly instead) or ``\"approx\"`` (``lax.approx_max_k``).",
      _selection)
  warmup_steps: int = _option(
      0,
      "exchange densely (``lax.pmean``) for this many applied steps, then sparsely. "
      "The switch happens at run time inside the one compiled step; the residuals "
      "are zero when sparsification begins.",
      _count("warmup_steps", 0))
  skip_nonfinite: bool = _option(
      True,
      "when any device's gradient holds a NaN or an infinity, every device skips the "
      "step alike: zero updates, residuals and ``count`` untouched, "
      "``nonfinite_steps`` incremented. A stateful optimizer later in the chain "
      "(momentum, Adam) would still move on zero updates; wrap the whole chain in "
      ":func:`topka2a_jax.skip_nonfinite` to skip it too (its decision is passed "
      "down, so the check runs once). False lets non-finite values through (and "
      "into the residuals).",
      _flagged("skip_nonfinite"))
  rank: int | None = _option(
      None,
      "the rank of ``algorithm=\"powersgd\"`` (default ``4``); refused with the "
      "others. A matrix goes low rank where its factors are at most half its size.",
      lambda value, given: value)  # checked with the algorithm, in create
  whole_selection: bool = _option(
      False,
      "whether ``\"auto\"`` takes only exchanges whose mean holds every device's "
      "whole selection (:func:`topka2a_jax.compress_updates` sets it).",
      _flagged("whole_selection"), user=False)
  density_given: bool = _option(
      True,
      "whether the caller gave ``density``: ``\"auto\"`` takes it as 1.0 where it "
      "is left out, and refuses a top-k then (``transforms/following.py``).",
      lambda value, given: value, user=False)
  auto_forms: tuple[str, ...] | None = _option(
      None,
      "the exchanges ``\"auto\"`` may plan a bucket with, or None for every top-k "
      "form and dense: set from the optimizer after the exchange in its chain "
      "(``transforms/following.py``).",
      lambda value, given: value, user=False)
  caller: str = _option(
      "topka2a",
      "the factory the user called (``local_steps``, ``compress_updates``...), "
      "named in messages.",
      lambda value, given: value, user=False)

  @classmethod
  def create(cls, density: Any, *, forms_follow: bool = False, caller: str = "topka2a",
             arguments: tuple[str, ...] = (), **options: Any) -> Options:
    """Validates the transform's arguments; raises naming the first bad one.

    Only the options users pass (:func:`user_options`); the library's own
    settings are set on the record made here (``dataclasses.replace``).
    ``forms_follow``: ``"auto"``'s forms will follow the optimizer after the
    exchange (:func:`topka2a_jax.topka2a`), so ``density`` may be left out
    until a top-k is chosen. ``caller`` and its own ``arguments`` (besides
    the options) name what the user called in messages.

    Raises:
      ValueError, TypeError: an argument out of range or of the wrong type.
    """
    fields = {argument_of(field): field for field in user_options()}
    for name in sorted(set(options) - set(fields)):
      close = difflib.get_close_matches(name, [*arguments, *fields], n=1)
      raise TypeError(f"unknown option {name}="
                      + (f" (did you mean {close[0]}=?)" if close else "")
                      + (f"; the arguments of {caller} are {', '.join(sorted(arguments))}, "
                         "and " if arguments else "; ")
                      + f"the options are {', '.join(sorted(fields))}")
    normalised: dict[str, Any] = {  # the library's own settings, at their defaults
        field.name: field.default for field in dataclasses.fields(cls)
        if field.name != "density" and not field.metadata["user"]}
    for argument, field in fields.items():
      normalised[field.name] = field.metadata["check"](
          options.get(argument, field.default), normalised)
    _check_together(normalised)
    normalised["density_given"] = density is not None
    normalised["caller"] = caller
    return cls(_density(density, normalised["algorithm"], forms_follow), **normalised)

  def cluster(self) -> Cluster | None:
    """The nodes and links of a pair of data axes, inside ``shard_map``; else None.

    The inner link is ``network``'s second, or :data:`cost.INNER_NETWORK`.
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
    """Whether a leaf goes as a low-rank product (:func:`sizes.compresses`)."""
    return self.is_low_rank and compresses(local_shape, self.rank, self.min_size)

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


def user_options(exclude: Sequence[str] = ()) -> list[dataclasses.Field]:
  """The options users pass, in the order the signatures show them."""
  return [field for field in dataclasses.fields(Options)
          if field.name != "density" and field.metadata["user"]
          and argument_of(field) not in exclude]
