"""The α-β cost of exchanging one buffer, and the densities where algorithms tie.

An exchange sends ``messages`` messages in sequence and ``bytes`` bytes per
device; on a network with per-message latency α and bandwidth B it takes
``messages * α + bytes / B`` seconds. For a buffer of ``d`` elements on ``P``
devices with ``k = ceil(density * d)``, ``s = ceil(d / P)`` and
``q = ceil(k / P)``, and ``v``, ``i`` bytes per value and index:

| algorithm | messages | bytes sent per device |
|---|---|---|
| dense (ring all-reduce) | 2(P-1) | 2(P-1)/P · d·v |
| allgather (TopkA) | P-1 | (P-1) · k(v+i) |
| topka2a | 2(P-1) | (P-1) · (q(v+i) + s·v) |
| topka2a_sparse | 2(P-1) | (P-1) · 2q(v+i) |

Values and indices travel in one message (see :mod:`topka2a_jax.wire`), so
TopkA and TopKA2A pay one latency term per phase, not two as in the paper's
table. Indices are as narrow as the positions they address allow: 2 bytes up
to 65,536 positions (a shard, or TopkA's whole buffer), else 4. With v = i and α = 0, TopKA2A beats dense iff density < 1/2 and beats
TopkA iff density > 1/(2(P-1)).

Example:
  >>> cost = exchange_cost("topka2a", 25_000_000, 8, 0.01)
  >>> cost.seconds(NETWORKS["eth10"])
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from topka2a_jax.selection import ShardLayout, sparse_count
from topka2a_jax.wire import index_dtype


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


def get_network(network: str | Network) -> Network:
  """Resolves a preset name, or passes a :class:`Network` through.

  Args:
    network: a key of :data:`NETWORKS` or a :class:`Network`.

  Returns:
    The network.

  Raises:
    ValueError: an unknown name.
  """
  if isinstance(network, Network):
    return network
  if network not in NETWORKS:
    raise ValueError(
        f"unknown network {network!r}; choose one of {', '.join(NETWORKS)} or "
        "pass topka2a_jax.Network(latency=seconds, bandwidth=bytes_per_second)"
    )
  return NETWORKS[network]


@dataclasses.dataclass(frozen=True)
class Cost:
  """What one exchange puts on the wire, per device.

  Attributes:
    messages: latency terms paid in sequence.
    bytes: bytes each device sends.
  """

  messages: int
  bytes: float

  def seconds(self, network: Network) -> float:
    """Time on ``network`` in the α-β model."""
    return self.messages * network.latency + self.bytes / network.bandwidth


MODELLED_ALGORITHMS = ("dense", "allgather", "topka2a", "topka2a_sparse")


def _cost(
    algorithm: str,
    num_devices: int,
    length: float,
    k: float,
    shard_length: float,
    per_shard: float,
    value_bytes: int,
    index_bytes: int,
) -> Cost:
  """The table above, from the counts (exact ints or continuous floats)."""
  others = num_devices - 1
  pair = value_bytes + index_bytes
  if algorithm == "dense":
    return Cost(2 * others, 2 * others / num_devices * length * value_bytes)
  if algorithm == "allgather":
    return Cost(others, others * k * pair)
  if algorithm == "topka2a":
    return Cost(2 * others, others * (per_shard * pair + shard_length * value_bytes))
  if algorithm == "topka2a_sparse":
    return Cost(2 * others, others * 2 * per_shard * pair)
  raise ValueError(
      f"no cost model for algorithm {algorithm!r}; modelled: "
      f"{', '.join(MODELLED_ALGORITHMS)}"
  )


def _index_bytes(algorithm: str, length: float, num_devices: int) -> int:
  """Bytes of one index as the collectives send it."""
  addressed = length if algorithm == "allgather" else math.ceil(length / num_devices)
  return index_dtype(max(1, math.ceil(addressed))).itemsize


def exchange_cost(
    algorithm: str,
    length: int,
    num_devices: int,
    density: float,
    value_bytes: int = 4,
    index_bytes: int | None = None,
) -> Cost:
  """Cost of one exchange of a ``length``-element buffer, as implemented.

  Uses the same rounding as the collectives (:mod:`topka2a_jax.selection`),
  so the bytes equal what the compiled program sends.

  Args:
    algorithm: one of :data:`MODELLED_ALGORITHMS`.
    length: elements in the buffer.
    num_devices: P.
    density: fraction sent, in (0, 1].
    value_bytes: bytes per value on the wire.
    index_bytes: bytes per index on the wire; by default the narrowest the
      collectives use for this buffer.

  Returns:
    The :class:`Cost`.

  Example:
    >>> exchange_cost("dense", 1000, 8, 0.01).bytes
    7000.0
  """
  layout = ShardLayout.create(length, num_devices, density)
  if index_bytes is None:
    index_bytes = _index_bytes(algorithm, length, num_devices)
  return _cost(
      algorithm, num_devices, length, sparse_count(length, density),
      layout.shard_length, layout.per_shard, value_bytes, index_bytes)


def elements_read(algorithm: str, length: int, num_devices: int) -> int:
  """Elements one device's selections read in one exchange: work growing with ``d``.

  TopkA and TopKA2A select from the whole buffer once; TopKA2A-sparse's
  owner also selects from its summed shard of ``s = ceil(d / P)`` elements;
  dense selects nothing.

  Example:
    >>> elements_read("topka2a_sparse", 1000, 4)
    1250
  """
  if algorithm == "dense":
    return 0
  if algorithm == "topka2a_sparse":
    return length + -(-length // num_devices)
  return length


def selected_entries(algorithm: str, length: int, num_devices: int,
                     density: float) -> int:
  """Entries one device selects in one exchange: the work that grows with ``k``.

  Selection reads every element (:func:`elements_read`), but compacting the
  chosen entries, packing them and adding them in at the receiver cost per
  entry. TopkA selects ``k`` of the buffer; TopKA2A ``q`` of each of ``P``
  shards; TopKA2A-sparse also ``q`` of the owned, summed shard; dense none.

  Example:
    >>> selected_entries("topka2a_sparse", 1000, 4, 0.01)
    15
  """
  if algorithm == "dense":
    return 0
  if algorithm == "allgather":
    return sparse_count(length, density)
  layout = ShardLayout.create(length, num_devices, density)
  per_device = num_devices * layout.per_shard
  return per_device + layout.per_shard if algorithm == "topka2a_sparse" else per_device


def continuous_cost(
    algorithm: str,
    length: float,
    num_devices: int,
    density: float,
    value_bytes: int = 4,
    index_bytes: int | None = None,
) -> Cost:
  """:func:`exchange_cost` without rounding: ``k = density * d``, ``s = d / P``."""
  if index_bytes is None:
    index_bytes = _index_bytes(algorithm, length, num_devices)
  k = density * length
  return _cost(algorithm, num_devices, length, k, length / num_devices,
               k / num_devices, value_bytes, index_bytes)


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
    >>> breakeven_density("topka2a", "dense", 1e6, 8, Network(0.0, 1e9))
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
