"""The α-β cost of exchanging one buffer, and the densities where algorithms tie.

An exchange sends ``messages`` messages in sequence and ``bytes`` bytes per
device; on a network with per-message latency α and bandwidth B it takes
``messages * α + bytes / B`` seconds. What each exchange sends is in its
``_src/collectives/algorithms.py`` entry; this module names the links (measured
or preset) and solves for the density at which two exchanges tie. With
``v = i`` and α = 0, TopKA2A beats dense iff density < 1/2 and beats TopkA
iff density > 1/(2(P-1)).

Example:
  >>> cost = exchange_cost("topka2a", 25_000_000, 8, 0.01)
  >>> f"{cost.seconds(NETWORKS['eth10']):.3f} s"
  '0.072 s'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from topka2a_jax._src.collectives import algorithms
from topka2a_jax._src.collectives.algorithms import Cost
from topka2a_jax._src.sizes import ceil_div, compresses, matrix_shape

DEFAULT_MIN_SIZE = 1024
"""Leaves with fewer elements go dense.

Biases and normalisation scales are this small in most models. They are a
tiny share of the bytes (a thousand such leaves of 1,000 floats are 4 MB a
step), their shard-wise selection would send nearly every entry anyway, and
keeping them exact is what users of gradient compression do to keep accuracy.
"""


@dataclasses.dataclass(frozen=True)
class Network:
  """A link, in the α-β model.

  Attributes:
    latency: α, seconds per message (one step of a collective).
    bandwidth: bytes per second each device sends.
    name: a label for printing.
    source: where the figures come from.
  """

  latency: float
  bandwidth: float
  name: str = "custom"
  source: str = "given"

  def __post_init__(self):
    if not (self.latency >= 0 and math.isfinite(self.latency)):
      raise ValueError(f"latency must be seconds >= 0, got {self.latency!r}")
    if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
      raise ValueError(f"bandwidth must be bytes/s > 0, got {self.bandwidth!r}")


_GBIT = 1e9 / 8  # bytes per second in one Gbit/s

NETWORKS: dict[str, Network] = {
    "nvlink": Network(
        3e-6, 450e9, "nvlink",
        "H100 SXM NVLink 4: 900 GB/s both directions (NVIDIA datasheet); "
        "α: order of a few µs per NCCL step inside one node"),
    "ib100": Network(
        5e-6, 100 * _GBIT, "ib100",
        "100 Gb/s InfiniBand (EDR/HDR100) line rate; α: a few µs per "
        "RDMA message through the collective library"),
    "eth25": Network(
        25e-6, 25 * _GBIT, "eth25",
        "25 GbE line rate; α: tens of µs per TCP message through the kernel"),
    "eth10": Network(
        50e-6, 10 * _GBIT, "eth10",
        "10 GbE line rate; α: tens of µs per TCP message through the kernel"),
    "eth1": Network(
        100e-6, 1 * _GBIT, "eth1",
        "1 GbE line rate; α: ~100 µs per TCP message"),
}
"""Named presets: nominal line rates and order-of-magnitude latencies.

Real links reach less than line rate and latencies vary with the stack; for
decisions that matter, measure and pass ``Network(latency=..., bandwidth=...)``.
"""


AUTO_NETWORK = "auto"
"""``network=AUTO_NETWORK``: the link the data axis most likely crosses."""

INNER_NETWORK = "nvlink"
"""The link inside a node that a pair of data axes assumes, unless ``network``
is a pair ``(outer, inner)``."""


def detected_network() -> Network:
  """The preset for where the data axis runs, as this process sees it.

  Several processes (hosts) exchange over a network between them: ``eth10``.
  One process with accelerators holds one node's devices, joined by a fast
  link: ``nvlink``. One process on CPUs (emulated devices): ``eth10``.
  Measure the link and pass a :class:`Network` for decisions that matter.

  Example:
    >>> detected_network().name  # one process on this CPU
    'eth10'
  """
  import jax  # here alone, so that the tables above load without JAX

  if jax.process_count() == 1 and jax.default_backend() != "cpu":
    return NETWORKS["nvlink"]
  return NETWORKS["eth10"]


def get_network(network: str | Network) -> Network:
  """Resolves a preset name or ``"auto"``, or passes a :class:`Network` through.

  Args:
    network: a key of :data:`NETWORKS`, ``"auto"`` (:func:`detected_network`)
      or a :class:`Network`.

  Returns:
    The network.

  Raises:
    ValueError: an unknown name.
  """
  if isinstance(network, Network):
    return network
  if network == AUTO_NETWORK:
    return detected_network()
  if network not in NETWORKS:
    raise ValueError(
        f"unknown network {network!r}; choose {AUTO_NETWORK!r} or one of "
        f"{', '.join(NETWORKS)}, or pass topka2a_jax.cost.Network(latency=seconds, "
        "bandwidth=bytes_per_second)")
  return NETWORKS[network]


def from_link_fit(fitted: dict, source: str = "a measured link fit") -> dict:
  """A measured link fit as the planner's settings (:func:`topka2a_jax.plan_fusion`'s,
  ``topka2a-plan --link-fit``).

  Args:
    fitted: the ``"fit"`` the repository's link benchmark writes with ``--json``
      (the planning guide): α,
      bandwidth, the selection's two rates and each few-bit code's.
    source: where the fit comes from, for the plan's network.

  Example:
    >>> options = from_link_fit({"alpha": 2e-4, "bandwidth": 3e7, "per_element": 7e-9,
    ...                          "per_entry": 1e-7, "coding": {"quantized_8_8_fine": 2e-9}})
    >>> options["network"].name, options["coding_seconds_per_element"]
    ('fitted', {'quantized_8_8_fine': 2e-09})
  """
  def number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise TypeError(f"its {what} is {value!r}, not a number")
    return float(value)

  return {"network": Network(number(fitted["alpha"], "alpha"),
                             number(fitted["bandwidth"], "bandwidth"), "fitted", source),
          "selection_seconds_per_element": number(fitted["per_element"], "per_element"),
          "selection_seconds_per_entry": number(fitted["per_entry"], "per_entry"),
          "coding_seconds_per_element": {
              name: number(rate, f"coding rate of {name}")
              for name, rate in fitted["coding"].items()}}


def exchange_cost(
    algorithm: str,
    length: int,
    num_devices: int,
    density: float,
    value_bytes: int = 4,
    index_bytes: int | None = None,
) -> Cost:
  """Cost of one exchange of a ``length``-element buffer, as implemented.

  Uses the same rounding as the collectives (:func:`selected_entries`),
  so the bytes equal what the compiled program sends.

  Args:
    algorithm: a name in :data:`topka2a_jax.collectives.ALGORITHMS`.
    length: elements in the buffer.
    num_devices: P.
    density: fraction sent, in (0, 1].
    value_bytes: bytes per value on the wire (dense sends the buffer's
      float32 whatever this says).
    index_bytes: bytes per index on the wire; by default the narrowest the
      collectives use for this buffer.

  Returns:
    The :class:`Cost`.

  Raises:
    ValueError: an unknown algorithm.

  Example:
    >>> exchange_cost("dense", 1000, 8, 0.01).bytes
    7000.0
  """
  return algorithms.get(algorithm).cost(length, num_devices, density, value_bytes,
                                        index_bytes)


def continuous_cost(
    algorithm: str,
    length: float,
    num_devices: int,
    density: float,
    value_bytes: int = 4,
    index_bytes: int | None = None,
) -> Cost:
  """:func:`exchange_cost` without rounding: ``k = density * d``, ``s = d / P``."""
  return algorithms.get(algorithm).cost(length, num_devices, density, value_bytes,
                                        index_bytes, exact=False)


@dataclasses.dataclass(frozen=True)
class LowRankStep:
  """What one step of ``algorithm="powersgd"`` sends for a model's leaves.

  Attributes:
    rank: the rank asked for.
    low_rank: the leaves that go low rank, as matrices ``(m, n)``.
    dense_elements: elements of the other leaves, all-reduced densely.
    cost: messages and bytes per device of the step: the two all-reduces
      of the factors and one dense all-reduce of the rest (fused).
    multiply_adds: one device's matmul work (``algorithms.LowRank.flops``).
  """

  rank: int
  low_rank: tuple[tuple[int, int], ...]
  dense_elements: int
  cost: Cost
  multiply_adds: float

  def seconds(self, network: Network, seconds_per_multiply_add: float = 0.0) -> float:
    """Its time on ``network`` in the α-β model, plus the matmuls at the given rate."""
    return self.cost.seconds(network) + seconds_per_multiply_add * self.multiply_adds


def low_rank_step(shapes: Sequence[Sequence[int]], num_devices: int, rank: int,
                  min_size: int = DEFAULT_MIN_SIZE) -> LowRankStep:
  """The exchange of one step of ``topka2a(algorithm="powersgd", rank=rank)``.

  Args:
    shapes: every gradient leaf's shape.
    num_devices: P.
    rank: PowerSGD's rank.
    min_size: the transform's ``min_size``.

  Example:
    >>> step = low_rank_step([(5000, 5000), (5000,)], 4, 4)
    >>> step.low_rank, step.dense_elements, step.cost.bytes
    (((5000, 5000),), 5000, 270000.0)
  """
  matrices = tuple(matrix_shape(shape) for shape in shapes
                   if compresses(shape, rank, min_size))
  dense = sum(math.prod(shape) for shape in shapes
              if not compresses(shape, rank, min_size))
  factors = algorithms.POWERSGD.cost(matrices, num_devices, rank) if matrices else Cost(0, 0.0)
  rest = algorithms.DENSE.cost(dense, num_devices, 1.0) if dense else Cost(0, 0.0)
  return LowRankStep(rank, matrices, dense,
                     Cost(factors.messages + rest.messages, factors.bytes + rest.bytes),
                     algorithms.POWERSGD.flops(matrices, rank))


def elements_read(algorithm: str, length: int, num_devices: int) -> int:
  """Elements one device's selections read in one exchange: work growing with ``d``.

  Example:
    >>> elements_read("topka2a_sparse", 1000, 4)
    1250
  """
  return algorithms.get(algorithm).elements_read(length, num_devices)


def selected_entries(algorithm: str, length: int, num_devices: int,
                     density: float) -> int:
  """Entries one device selects in one exchange: the work that grows with ``k``.

  Selection reads every element (:func:`elements_read`), but compacting the
  chosen entries, packing them and adding them in at the receiver cost per
  entry.

  Example:
    >>> selected_entries("topka2a_sparse", 1000, 4, 0.01)
    15
  """
  return algorithms.get(algorithm).selected_entries(length, num_devices, density)


FLAT = "flat"
"""Route of an exchange over every device of a cluster as one axis."""

TWO_LEVEL = "two_level"
"""Route of :func:`topka2a_jax.collectives.two_level`: dense inside each node,
the exchange (sparse, or a dense all-reduce) between nodes."""


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Nodes of devices: a fast link inside each node, a slow one between them.

  Devices are numbered node by node, as a ``("node", "local")`` mesh orders
  them, so a ring over all of them crosses each node's network card once in
  each direction.

  Attributes:
    nodes: N, nodes (the outer mesh axis).
    per_node: L, devices per node (the inner mesh axis).
    outer: the link between nodes; its bandwidth is one node's network card,
      shared by the node's devices.
    inner: the link between the devices of one node.
  """

  nodes: int
  per_node: int
  outer: Network
  inner: Network

  def __post_init__(self):
    for name in ("nodes", "per_node"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")

  @property
  def devices(self) -> int:
    """P = N L, every device of the cluster."""
    return self.nodes * self.per_node


@dataclasses.dataclass(frozen=True)
class ClusterCost:
  """One exchange on a :class:`Cluster`, link by link.

  Attributes:
    seconds: its time in the α-β model, phase after phase.
    outer_bytes: bytes each node's network card sends.
    inner_bytes: bytes each device sends to devices of its own node.
  """

  seconds: float
  outer_bytes: float
  inner_bytes: float


def _flat_phase(phase: algorithms.Phase, cluster: Cluster) -> ClusterCost:
  """A collective over all N L devices: which of its bytes cross the nodes."""
  nodes, per_node, peers = cluster.nodes, cluster.per_node, cluster.devices - 1
  if phase.pattern == algorithms.RING:  # one edge per node crosses, one per device
    outer = phase.bytes if nodes > 1 else 0.0
    inner = phase.bytes if per_node > 1 else 0.0
  elif phase.pattern == algorithms.TREE:  # rounds to partners 2^r away: the last
    # log2(N) of log2(N L) rounds cross, for every device of the node at once
    crossing = math.log2(nodes) / math.log2(cluster.devices) if nodes > 1 else 0.0
    outer = per_node * crossing * phase.bytes
    inner = (1 - crossing) * phase.bytes
  else:  # every device sends to each peer directly
    outer = per_node * (cluster.devices - per_node) / peers * phase.bytes
    inner = (per_node - 1) / peers * phase.bytes
  outer_seconds = (phase.messages * cluster.outer.latency
                   + outer / cluster.outer.bandwidth) if outer else 0.0
  inner_seconds = (phase.messages * cluster.inner.latency
                   + inner / cluster.inner.bandwidth) if inner else 0.0
  return ClusterCost(max(outer_seconds, inner_seconds), outer, inner)


def cluster_cost(
    algorithm: str,
    length: int,
    cluster: Cluster,
    density: float,
    route: str = TWO_LEVEL,
    value_bytes: int = 4,
    residual_slices: bool = True,
) -> ClusterCost:
  """Cost of one exchange of a ``length``-element buffer on a cluster.

  ``route=FLAT`` runs ``algorithm`` over all N L devices as one axis: a ring
  phase's slowest edge crosses a network card, and in an AlltoAll every
  device of a node sends to the N L - L devices of other nodes through the
  one card. A sparse one then reduce-scatters what it did not send inside
  the node, as every device keeps the residual of one slice of the buffer
  (``bucket_exchange.exchange_buckets``). ``route=TWO_LEVEL`` is
  :func:`topka2a_jax.collectives.two_level`: a ring reduce-scatter inside the
  node, ``algorithm`` over the N nodes on
  a slice of ``m = ceil(length / L)`` elements (all L devices of a node at
  once, through its card), and a ring all-gather inside the node. For dense
  that is a hierarchical all-reduce: the card carries ``2(N-1)/N`` of the
  buffer instead of a flat ring's ``2(NL-1)/(NL)``, in ``2(N-1)`` slow
  messages instead of ``2(NL-1)``.

  Args:
    algorithm: a name in :data:`topka2a_jax.collectives.ALGORITHMS`.
    length: elements in the buffer.
    cluster: the nodes and their links.
    density: fraction sent, in (0, 1].
    route: :data:`FLAT` or :data:`TWO_LEVEL`.
    value_bytes: bytes per value the sparse exchange sends.
    residual_slices: whether every device keeps the residual of one slice,
      as the transform does over a pair of data axes: a flat sparse exchange
      then reduce-scatters its unsent inside the node. False prices the flat
      exchange over one data axis of all N L devices, whose residuals are
      whole.

  Returns:
    The :class:`ClusterCost`.

  Raises:
    ValueError: an unknown algorithm or route.

  Example:
    >>> for nodes, per_node in [(2, 4), (8, 8)]:
    ...   cluster = Cluster(nodes, per_node, outer=NETWORKS["eth10"],
    ...                     inner=NETWORKS["nvlink"])
    ...   flat = cluster_cost("topka2a_sparse", 25_000_000, cluster, 0.01, FLAT)
    ...   two = cluster_cost("topka2a_sparse", 25_000_000, cluster, 0.01)
    ...   print(f"{nodes} x {per_node}: bytes {two.outer_bytes / flat.outer_bytes:.2f}x, "
    ...         f"seconds {two.seconds / flat.seconds:.2f}x")
    2 x 4: bytes 0.35x, seconds 0.37x
    8 x 8: bytes 0.22x, seconds 0.20x
  """
  entry = algorithms.get(algorithm)
  per_node = cluster.per_node
  width = ceil_div(length, per_node)
  ring = (per_node - 1) * width * 4  # float32 slices, each way of the node's ring
  ring_seconds = (per_node - 1) * cluster.inner.latency + ring / cluster.inner.bandwidth
  if route == FLAT:
    phases = [_flat_phase(phase, cluster) for phase in
              entry.phases(length, cluster.devices, density, value_bytes)]
    if residual_slices and entry.sparse and per_node > 1:  # unsent to slices
      phases.append(ClusterCost(ring_seconds, 0.0, float(ring)))
    return ClusterCost(sum(p.seconds for p in phases),
                       sum(p.outer_bytes for p in phases),
                       sum(p.inner_bytes for p in phases))
  if route != TWO_LEVEL:
    raise ValueError(f"unknown route {route!r}; choose {FLAT!r} or {TWO_LEVEL!r}")
  inner_seconds = 2 * ring_seconds
  outer = entry.phases(width, cluster.nodes, density, value_bytes)
  outer_bytes = per_node * sum(phase.bytes for phase in outer)
  outer_seconds = (sum(phase.messages for phase in outer) * cluster.outer.latency
                   + outer_bytes / cluster.outer.bandwidth)
  return ClusterCost(inner_seconds + outer_seconds, float(outer_bytes), 2.0 * ring)


def breakeven_density(
    algorithm: str,
    other: str,
    length: float,
    num_devices: int,
    network: str | Network,
    value_bytes: int = 4,
    index_bytes: int | None = None,
) -> float | None:
  """The density at which two algorithms take the same time, α included.

  Args:
    algorithm: e.g. ``"topka2a"``.
    other: e.g. ``"dense"`` or ``"allgather"``.
    length: elements in the buffer.
    num_devices: P, at least 2.
    network: a preset name or a :class:`Network`.
    value_bytes: bytes per value on the wire.
    index_bytes: bytes per index on the wire; by default what the collectives
      use (which may differ between the two algorithms).

  Returns:
    The density in (0, 1] where the times cross, or None when one algorithm
    is faster at every density.

  Example:
    >>> round(breakeven_density("topka2a", "dense", 1e6, 8, Network(0.0, 1e9)), 9)
    0.5
  """
  net = get_network(network)

  def gap(density: float) -> float:
    mine = continuous_cost(algorithm, length, num_devices, density, value_bytes,
                           index_bytes)
    theirs = continuous_cost(other, length, num_devices, density, value_bytes,
                             index_bytes)
    return mine.seconds(net) - theirs.seconds(net)

  return _root(gap, 1e-12, 1.0)


def _root(f: Callable[[float], float], low: float, high: float) -> float | None:
  """A root of ``f`` in [low, high] by bisection, if the sign changes there."""
  f_low, f_high = f(low), f(high)
  if f_low == 0:
    return low
  if f_high == 0:
    return high
  if (f_low > 0) == (f_high > 0):
    return None
  for _ in range(200):
    mid = 0.5 * (low + high)
    if (f(mid) > 0) == (f_low > 0):
      low = mid
    else:
      high = mid
    if high - low <= 1e-15 * high:
      break
  return 0.5 * (low + high)
