"""Planning the buckets: a size threshold found by binary search on a cost model.

Fusing leaves into fewer, larger buckets saves per-message latency, but a
bucket can only be sent once its last leaf's gradient exists, so large
buckets start late and overlap less with the backward pass. The planner
predicts the step's end for a threshold from static sizes only:

* backward time is spread over the leaves in proportion to their size, last
  leaf first, so a bucket is ready when its last-produced leaf is;
* exchanges run one at a time, each as soon as its bucket is ready and the
  previous exchange is done, taking selection (a few-bit code's coding, at
  its own rate where one is given) plus α-β communication time;
* with ``algorithm="auto"`` every bucket takes its cheapest algorithm, so
  tiny buckets go dense;
* on a :class:`topka2a_jax.cost.Cluster` (a data axis that is a pair of
  mesh axes) every bucket also takes the cheaper route, flat over all
  devices or two-level (:func:`topka2a_jax.cost.cluster_cost`).

The threshold is found by a coarse log-spaced sweep followed by a binary
search on the sign of the discrete slope around the best point; the plan is
deterministic and printable.

Example:
  >>> plan = plan_fusion([4096, 64, 1_000_000], num_devices=32, density=0.01)
  >>> print(plan)  # doctest: +ELLIPSIS
  fusion plan: 3 leaves, 1,004,160 elements, P=32, density=0.01, network=eth10, ...
  ...
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from topka2a_jax._src.arguments import checked_count
from topka2a_jax._src.collectives import algorithms
from topka2a_jax._src.collectives.algorithms import ALGORITHMS, AUTO, DENSE
from topka2a_jax._src.planner.buckets import Bucket, plan_buckets
from topka2a_jax._src.planner.cost import (
  DEFAULT_MIN_SIZE,
  FLAT,
  TWO_LEVEL,
  Cluster,
  Network,
  cluster_cost,
  get_network,
)
from topka2a_jax._src.planner.forms import FORMS, PLAIN
from topka2a_jax._src.sizes import ceil_div, check_density

DEFAULT_SELECTION_SECONDS_PER_ELEMENT = 1e-10
"""Selection cost: 10 G elements/s, a few passes over accelerator memory.

Pass a measured figure for other hardware (``lax.top_k`` on a CPU is ~3e-8).
"""

DEFAULT_SELECTION_SECONDS_PER_ENTRY = 1e-9
"""Cost per selected entry (compaction, packing, the receiver's scatter-add;
see :func:`topka2a_jax.cost.selected_entries`): 1 G entries/s, an
order-of-magnitude estimate for scattered accesses to accelerator memory.

Pass a measured figure for other hardware: the repository's link benchmark
fits it on a host (the network evidence page gives its fits).
"""

NO_BACKWARD = "not given: no overlap with the backward pass assumed"
"""How a plan made without a backward pass's duration says so."""

MODEL_GRID = 512  # thresholds considered between the smallest leaf and the model
MODEL_COARSE = 2  # every MODEL_COARSE-th of them is evaluated first


@dataclasses.dataclass(frozen=True)
class PlannedBucket:
  """A bucket with its predicted timing.

  Attributes:
    bucket: leaves, algorithm and size.
    ready: seconds into the backward pass when its last leaf is ready.
    seconds: its selection plus communication time.
    finish: when its exchange ends.
  """

  bucket: Bucket
  ready: float
  seconds: float
  finish: float


@dataclasses.dataclass(frozen=True)
class FusionPlan:
  """Buckets in exchange order, and the predicted step against baselines.

  Attributes:
    buckets: the planned buckets, in the order they are exchanged.
    threshold: the bucket size threshold used, in elements.
    names: a printable name per leaf.
    num_devices: P.
    density: the density planned for.
    network: the network planned for.
    backward_seconds: the backward pass time assumed.
    backward_source: where ``backward_seconds`` comes from.
    step_seconds: predicted end of the last exchange, from the start of
      backward.
    dense_seconds: the same with every bucket dense (its own best threshold).
    allgather_seconds: the same with every sparse bucket TopkA.
    cluster: the nodes and links planned for where the data axis is a pair.
  """

  buckets: tuple[PlannedBucket, ...]
  threshold: int
  names: tuple[str, ...]
  num_devices: int
  density: float
  network: Network
  backward_seconds: float
  step_seconds: float
  dense_seconds: float
  allgather_seconds: float
  backward_source: str = "given"
  cluster: Cluster | None = None

  def __str__(self) -> str:
    selects = any(  # a top-k somewhere; else every bucket sends every entry
        p.bucket.algorithm in ALGORITHMS and ALGORITHMS[p.bucket.algorithm].sparse
        and not ALGORITHMS[p.bucket.algorithm].quantizes for p in self.buckets)
    header = (f"fusion plan: {len(self.names)} leaves, "
              f"{sum(b.bucket.size for b in self.buckets):,} elements, "
              f"P={self.num_devices}, " + (f"density={self.density:g}, " if selects else "")
              + f"network={self.network.name}, threshold={self.threshold:,} elements")
    if self.cluster is not None:
      header += (f"; {self.cluster.nodes} nodes of {self.cluster.per_node} "
                 f"devices, {self.cluster.inner.name} inside a node")
    spans = [f"{self.names[p.bucket.leaves[0]]} .. {self.names[p.bucket.leaves[-1]]}"
             for p in self.buckets]
    width = max(len("first .. last leaf"), *map(len, spans))  # whole names
    named = max(14, *(len(p.bucket.algorithm) for p in self.buckets))  # whole names
    columns = (f"{'bucket':>6s} {'leaves':>6s} {'first .. last leaf':{width}s} "
               f"{'elements':>12s} {'algorithm':>{named}s} {'ms':>9s} {'ends at ms':>10s}")
    if self.cluster is not None:
      columns += f" {'route':>9s}"
    lines = [header, columns]
    for i, (planned, span) in enumerate(zip(self.buckets, spans)):
      lines.append(
          f"{i:6d} {len(planned.bucket.leaves):6d} {span:{width}s} "
          f"{planned.bucket.size:12,d} {planned.bucket.algorithm:>{named}s} "
          f"{1e3 * planned.seconds:9.3f} {1e3 * planned.finish:10.3f}"
          + (f" {planned.bucket.route:>9s}" if self.cluster is not None else ""))
    lines.append(f"backward pass: {1e3 * self.backward_seconds:.3f} ms "
                 f"({self.backward_source})")
    if all(p.bucket.algorithm == DENSE.name for p in self.buckets):
      lines.append("compression does not pay here: every bucket goes dense")
    lines.append(
        f"predicted step end: {1e3 * self.step_seconds:.3f} ms; all dense: "
        f"{1e3 * self.dense_seconds:.3f} ms "
        f"(speedup {self.dense_seconds / self.step_seconds:.2f}x)"
        + (f"; all TopkA: {1e3 * self.allgather_seconds:.3f} ms "
           f"(speedup {self.allgather_seconds / self.step_seconds:.2f}x)" if selects
           else ""))
    return "\n".join(lines)


def _simulate(
    sizes: Sequence[int],
    buckets: Sequence[Bucket],
    backward_seconds: float,
    bucket_seconds: Callable[[Bucket], float],
) -> tuple[PlannedBucket, ...]:
  """Times the exchanges of ``buckets`` against a backward pass."""
  total = sum(sizes)
  ready_at, produced = [0.0] * len(sizes), 0
  for leaf in reversed(range(len(sizes))):
    produced += sizes[leaf]
    ready_at[leaf] = backward_seconds * produced / total
  timed = sorted(
      ((max(ready_at[i] for i in b.leaves), b) for b in buckets),
      key=lambda pair: pair[0])
  planned, clock = [], 0.0
  for ready, bucket in timed:
    seconds = bucket_seconds(bucket)
    clock = max(clock, ready) + seconds
    planned.append(PlannedBucket(bucket, ready, seconds, clock))
  return tuple(planned)


def search_threshold(
    evaluate: Callable[[int], float],
    low: int,
    high: int,
    points: int = MODEL_GRID,
    coarse: int = MODEL_COARSE,
) -> int:
  """A threshold in [low, high] minimising ``evaluate``: sweep, then bisect.

  The thresholds form a log-spaced grid of ``points``. Every ``coarse``-th is
  tried (with ``coarse >= points`` only the two ends); in
  the interval around each of the best three, a binary search on the sign of
  ``evaluate(g[m + 1]) - evaluate(g[m])`` finds a local minimum, and the
  best of those wins. Ties go to the larger threshold: fewer buckets, fewer
  messages.
  """
  if high <= low:
    return low
  ratio = high / low
  grid = sorted({round(low * ratio ** (j / (points - 1))) for j in range(points)})
  cache: dict[int, float] = {}

  def at(j: int) -> float:
    if grid[j] not in cache:
      cache[grid[j]] = evaluate(grid[j])
    return cache[grid[j]]

  tried = list(range(0, len(grid), coarse)) + [len(grid) - 1]
  found = []
  for best in sorted(tried, key=lambda j: (at(j), -j))[:3]:
    lo = max(0, best - coarse)
    hi = min(len(grid) - 1, best + coarse)
    while lo < hi:  # bisect on the sign of the slope
      mid = (lo + hi) // 2
      if at(mid + 1) <= at(mid):
        lo = mid + 1
      else:
        hi = mid
    found += [lo, best]
  return grid[min(found, key=lambda j: (at(j), -j))]  # ties: fewer, larger buckets


@dataclasses.dataclass(frozen=True)
class PlannerSettings:
  """What the planner prices a step with, the leaves aside: one record, by name.

  Each setting is checked where the record is made. The transforms make one
  per trace (``transforms/exchange_plan.py``); :func:`plan_fusion` and
  ``topka2a-plan`` from their arguments.

  Attributes:
    network: the link (a preset's name, made a :class:`topka2a_jax.cost.Network`),
      or with a ``cluster`` its outer link, which it is then set to.
    min_size: smaller leaves go dense, in buckets of their own.
    backward_seconds: the backward pass's duration; None (made 0) assumes
      no overlap, every bucket ready when the exchanges begin
      (:data:`NO_BACKWARD`).
    selection_seconds_per_element: cost of selecting top-k, per element
      read (:func:`topka2a_jax.cost.elements_read`).
    value_bytes: bytes per value on the wire.
    index_bytes: bytes per index on the wire; None for the collectives' own.
    selection_seconds_per_entry: cost per selected entry.
    cluster: for a data axis that is a pair (outer, inner) of mesh axes, its
      nodes and their two links; None for one axis.
    residual_slices: on a cluster, whether devices keep residuals (of their
      slices), so that a flat sparse bucket reduce-scatters its unsent
      inside the node; False without error feedback.
    whole_selection: whether ``"auto"`` takes only exchanges whose mean
      holds every device's whole selection.
    forms: the exchanges ``"auto"`` may take, or None for those before
      plain SGD (``transforms/following.py`` sets it from the optimizer
      after the exchange).
    coding_seconds_per_element: for the exchanges that code every entry in a
      few bits, each one's own cost per element its coding passes over
      (:func:`topka2a_jax.cost.elements_read`), by name (made sorted
      ``(name, seconds)`` pairs): coding a chunk costs less per element than
      searching it, and one code less than another (the link benchmark
      fits one per form on a link; the planning guide). A form not named is charged
      ``selection_seconds_per_element``.

  Raises:
    ValueError: an unknown network, a negative or non-finite duration, or a
      coding rate for an exchange that codes nothing.

  Example:
    >>> settings = PlannerSettings(network="eth1", min_size=0)
    >>> settings.network.name, settings.backward_seconds
    ('eth1', 0.0)
  """

  network: str | Network = "eth10"
  min_size: int = DEFAULT_MIN_SIZE
  backward_seconds: float | None = None
  selection_seconds_per_element: float = DEFAULT_SELECTION_SECONDS_PER_ELEMENT
  value_bytes: int = 4
  index_bytes: int | None = None
  selection_seconds_per_entry: float = DEFAULT_SELECTION_SECONDS_PER_ENTRY
  cluster: Cluster | None = None
  residual_slices: bool = True
  whole_selection: bool = False
  forms: Sequence[str] | None = None
  coding_seconds_per_element: Mapping[str, float] | tuple[tuple[str, float], ...] = ()

  def __post_init__(self) -> None:
    def made(name: str, value: Any) -> None:  # frozen: set once, here
      object.__setattr__(self, name, value)

    made("network", self.cluster.outer if self.cluster is not None
         else get_network(self.network))
    made("backward_seconds", self.backward_seconds or 0.0)
    for name in ("backward_seconds", "selection_seconds_per_element",
                 "selection_seconds_per_entry"):
      _check_seconds(name, getattr(self, name))
    coding = dict(self.coding_seconds_per_element)
    coded = [name for name, entry in ALGORITHMS.items() if entry.quantizes]
    for name, rate in coding.items():
      if name not in coded:
        raise ValueError(f"coding_seconds_per_element names {name!r}, which codes no "
                         f"entries; give rates for the few-bit exchanges: "
                         f"{', '.join(coded)}")
      _check_seconds(f"coding_seconds_per_element[{name!r}]", rate)
    made("coding_seconds_per_element", tuple(sorted(coding.items())))
    if self.forms is not None:
      made("forms", tuple(self.forms))


@dataclasses.dataclass(frozen=True)
class StepModel:
  """Predicted exchange times of one model's buckets on one network.

  Attributes:
    sizes: elements of every leaf, in pytree order (backward produces the
      last leaf first); all at least 1.
    num_devices: P, devices on the data-parallel axis.
    density: fraction of each sparse bucket sent.
    settings: everything else the step is priced with (:class:`PlannerSettings`).
  """

  sizes: tuple[int, ...]
  num_devices: int
  density: float
  settings: PlannerSettings
  _seconds: dict[tuple[str, int, str], float] = dataclasses.field(
      default_factory=dict, init=False, repr=False, compare=False)

  def candidates(self, algorithm: str) -> list[str]:
    """The exchanges a bucket labelled ``algorithm`` may take.

    ``"auto"`` takes ``forms`` (the forms that keep the quality of the
    optimizer after the exchange), by default those before plain SGD (any
    but the quantizing ones, ``forms.py``);
    with ``whole_selection`` only those whose mean holds every device's whole
    selection.
    """
    if algorithm != AUTO:
      return [algorithm]
    forms = self.settings.forms if self.settings.forms is not None else FORMS[PLAIN]
    return [name for name in forms
            if not (self.settings.whole_selection and ALGORITHMS[name].holds_back)]

  def routes(self) -> tuple[str, ...]:
    """The routes a bucket may take: two-level too on a cluster."""
    return (FLAT,) if self.settings.cluster is None else (FLAT, TWO_LEVEL)

  def seconds(self, algorithm: str, size: int, route: str = FLAT) -> float:
    """Selection plus communication time of one bucket.

    Remembered per ``(algorithm, size, route)``: the threshold search
    prices the same buckets under many thresholds.
    """
    key = (algorithm, size, route)
    if key not in self._seconds:
      self._seconds[key] = self._priced(algorithm, size, route)
    return self._seconds[key]

  def _priced(self, algorithm: str, size: int, route: str) -> float:
    entry, settings, cluster = ALGORITHMS[algorithm], self.settings, self.settings.cluster
    length, devices = size, self.num_devices
    if cluster is None:
      comm = entry.cost(size, devices, self.density, settings.value_bytes,
                        settings.index_bytes if entry.sparse else None
                        ).seconds(settings.network)
    else:
      comm = cluster_cost(algorithm, size, cluster, self.density, route,
                          settings.value_bytes, settings.residual_slices).seconds
      if route == TWO_LEVEL:
        length, devices = ceil_div(size, cluster.per_node), cluster.nodes
    per_element = dict(settings.coding_seconds_per_element).get(
        algorithm, settings.selection_seconds_per_element)
    return (comm
            + per_element * entry.elements_read(length, devices)
            + settings.selection_seconds_per_entry * entry.selected_entries(
                length, devices, self.density))

  def layout(self, algorithm: str, threshold: int) -> tuple[PlannedBucket, ...]:
    """Buckets under ``threshold``, timed; ``"auto"`` buckets take the cheapest.

    On a cluster every bucket also takes its algorithm's cheaper route.
    """
    labels = [DENSE.name if s < self.settings.min_size else algorithm for s in self.sizes]
    chosen = []
    for bucket in plan_buckets(self.sizes, labels, threshold):
      best, route = min(((a, r) for a in self.candidates(bucket.algorithm)
                         for r in self.routes()),
                        key=lambda choice: self.seconds(choice[0], bucket.size,
                                                        choice[1]))
      chosen.append(bucket._replace(algorithm=best, route=route))
    return _simulate(self.sizes, chosen, self.settings.backward_seconds,
                     lambda b: self.seconds(b.algorithm, b.size, b.route))

  def best_threshold(self, algorithm: str) -> int:
    """The threshold :func:`search_threshold` finds for ``algorithm``."""
    return search_threshold(lambda t: self.layout(algorithm, t)[-1].finish,
                            min(self.sizes), sum(self.sizes))

  def best_layout(self, algorithm: str) -> tuple[int, tuple[PlannedBucket, ...]]:
    """The threshold :meth:`best_threshold` finds and its buckets.

    Where ``"auto"`` sends every bucket dense, its buckets are those of
    ``"dense"`` at dense's own best threshold: the threshold searched among
    the compressed forms need not be the one that suits dense alone, and an
    all-dense plan must not be slower than all dense.
    """
    threshold = self.best_threshold(algorithm)
    planned = self.layout(algorithm, threshold)
    if algorithm == AUTO and all(p.bucket.algorithm == DENSE.name for p in planned):
      dense_at = self.best_threshold(DENSE.name)
      return dense_at, self.layout(DENSE.name, dense_at)
    return threshold, planned


_LONGEST_STEP_SECONDS = 1e9
"""A predicted step past this (31 years) comes from a link no network has."""


def _check_seconds(name: str, seconds: Any) -> None:
  """Raises ValueError unless ``seconds`` is a finite real number of at least 0."""
  if (isinstance(seconds, bool) or not isinstance(seconds, numbers.Real)
      or not 0 <= seconds < math.inf):
    raise ValueError(f"{name} is {seconds!r}: give a duration in seconds, finite and at "
                     "least 0 (e.g. 2e-9 for 2 ns per element)")


def step_model(sizes: Sequence[int], num_devices: int, density: float,
               **settings: Any) -> StepModel:
  """Validates the inputs and builds a :class:`StepModel`.

  Args:
    sizes: elements of every leaf, in pytree order.
    num_devices: P, devices on the data-parallel axis.
    density: fraction of each sparse bucket sent.
    **settings: :class:`PlannerSettings`' fields, by name (``network``,
      ``min_size``, ``backward_seconds``, ``cluster``, ``forms``, ...).

  Raises:
    ValueError: empty ``sizes``, a cluster whose devices are not
      ``num_devices``, or a bad setting (:class:`PlannerSettings`).
  """
  if not sizes or min(sizes) < 1:
    raise ValueError(f"need at least one leaf, all non-empty; got sizes {sizes}")
  checked_count("num_devices", num_devices, 1)
  check_density(density)
  cluster = settings.get("cluster")
  if cluster is not None and cluster.devices != num_devices:
    raise ValueError(f"a cluster of {cluster.nodes} nodes x {cluster.per_node} "
                     f"devices has {cluster.devices} devices, not {num_devices}")
  return StepModel(tuple(sizes), num_devices, density, PlannerSettings(**settings))


def plan_fusion(
    sizes: Sequence[int] | Any,
    num_devices: int,
    density: float,
    *,
    names: Sequence[str] | None = None,
    algorithm: str = "auto",
    threshold: int | str = "auto",
    backward_source: str | None = None,
    **model_options,
) -> FusionPlan:
  """Plans the buckets of a model's gradient from its leaf sizes alone.

  Args:
    sizes: elements of every leaf, in pytree order (backward produces the
      last leaf first); or the parameter pytree itself (arrays or
      ``jax.ShapeDtypeStruct``), whose paths then name the leaves.
    num_devices: P, devices on the data-parallel axis.
    density: fraction of each sparse bucket sent.
    names: printable leaf names; by default their paths or positions.
    algorithm: ``"auto"`` (cheapest per bucket), or one algorithm for every
      bucket of leaves with at least ``min_size`` elements.
    threshold: bucket size in elements, or ``"auto"`` to search for it.
    backward_source: where ``backward_seconds`` comes from, for the printout.
    **model_options: ``network`` (preset name or :class:`topka2a_jax.cost.Network`,
      default ``"eth10"``), ``min_size``, ``backward_seconds``,
      ``selection_seconds_per_element``, ``selection_seconds_per_entry``,
      ``value_bytes``, ``index_bytes``, ``cluster``, ``forms``,
      ``coding_seconds_per_element``: :class:`PlannerSettings`' fields.

  Returns:
    The :class:`FusionPlan`, with all-dense and all-TopkA baselines planned
    the same way.

  Raises:
    ValueError: empty ``sizes``, an unknown algorithm or network, or a bad
      threshold.

  Example:
    >>> [b.bucket.algorithm for b in plan_fusion(
    ...     [4096, 64, 1_000_000], 32, 0.01, network="eth10").buckets]
    ['topka2a_sparse', 'dense']
  """
  algorithms.check_plan_options(algorithm, threshold)
  if not (isinstance(sizes, Sequence) and all(isinstance(s, int) for s in sizes)):
    with_paths = jax.tree_util.tree_flatten_with_path(sizes)[0]
    names = names or [jax.tree_util.keystr(path) for path, _ in with_paths]
    sizes = [math.prod(leaf.shape) for _, leaf in with_paths]
  model = step_model(sizes, num_devices, density, **model_options)
  names = tuple(names) if names is not None else tuple(map(str, range(len(sizes))))
  if len(names) != len(sizes):
    raise ValueError(f"names has {len(names)} entries for {len(sizes)} leaves: give one "
                     "name per size, or leave names out")

  def end(choice: str) -> tuple[int, tuple[PlannedBucket, ...]]:
    if threshold == "auto":
      return model.best_layout(choice)
    return threshold, model.layout(choice, threshold)

  chosen_threshold, planned = end(algorithm)
  network = model.settings.network
  if not planned[-1].finish < _LONGEST_STEP_SECONDS:
    raise ValueError(
        f"the step predicted on {network.name} is {planned[-1].finish} s: its "
        f"latency ({network.latency} s) or bandwidth ({network.bandwidth} "
        "bytes/s) is beyond what a link can have. Give a measured link "
        "(the link benchmark of the planning guide fits one) or a preset of "
        "topka2a_jax.cost.NETWORKS")
  return FusionPlan(
      buckets=planned,
      threshold=chosen_threshold,
      names=names,
      num_devices=num_devices,
      density=density,
      network=network,
      backward_seconds=model.settings.backward_seconds,
      backward_source=backward_source or (
          "given" if model_options.get("backward_seconds") is not None
          else NO_BACKWARD),
      step_seconds=planned[-1].finish,
      dense_seconds=end(DENSE.name)[1][-1].finish,
      allgather_seconds=end(algorithms.ALLGATHER.name)[1][-1].finish,
      cluster=model.settings.cluster,
  )
