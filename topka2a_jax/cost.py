"""The α-β cost of exchanging one buffer, and the densities where algorithms tie.

An exchange sends ``messages`` messages in sequence and ``bytes`` bytes per
device; on a network with per-message latency α and bandwidth B it takes
``messages * α + bytes / B`` seconds. What each exchange sends is in its
:mod:`topka2a_jax.algorithms` entry; this module names the links (measured
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
from collections.abc import Callable

import jax

from topka2a_jax import algorithms
from topka2a_jax.algorithms import Cost


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
        f"{', '.join(NETWORKS)}, or pass topka2a_jax.Network(latency=seconds, "
        "bandwidth=bytes_per_second)")
  return NETWORKS[network]


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
    algorithm: a name in :data:`topka2a_jax.algorithms.REGISTRY`.
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
