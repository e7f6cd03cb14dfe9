"""Every exchange the library implements, and everything it knows about each.

One :class:`Algorithm` per exchange: the name ``topka2a(algorithm=...)``
takes (its collective is :data:`.collectives.COLLECTIVES` of that name), where the entries it
does not send wait, and its cost terms, from which the cost model, the planner, the
command-line planner and the benchmarks all read. Adding an exchange is one
entry here plus its collective and tests.

For a buffer of ``d`` elements on ``P`` devices with ``k = ceil(density * d)``,
shards of ``s = ceil(d / P)``, ``q = ceil(k / P)`` per shard, and ``v``, ``i``
bytes per value and index:

| algorithm | messages | bytes sent per device | elements read | entries selected |
|---|---|---|---|---|
| dense (ring all-reduce) | 2(P-1) | 2(P-1)/P · d·v | 0 | 0 |
| allgather (TopkA) | P-1 | (P-1) · k(v+i) | d | k |
| topka2a | 2(P-1) | (P-1) · (q(v+i) + s·v) | d | P·q |
| topka2a_sparse | 2(P-1) | (P-1) · 2q(v+i) | d + s | P·q + q |
| gtopk | t + P-1 | t·k(v+i) + (P-1)·q(v+i) | d | k + 2k(t - e) |
| oktopk | 4(P-1) | 2(P-1)/P · 4B + (P-1)·(c + q)(v+i) | d | k + P·c |
| onebit (b bits back) | 2(P-1) | (P-1) · s'(1 + b + 64/C)/8 | 4d + 2s | 0 |
| quantized_a_b (a bits up, b back) | 2(P-1) | (P-1) · s'(a + b + 64/C)/8 | 4d + 2s | 0 |
| rotated_4_b (each chunk rotated first) | 2(P-1) | (P-1) · s'(4 + b + 64/C)/8 | 7d + 3s | 0 |

(gTop-k: ``t = m + 2e`` rounds, ``2^m`` the largest power of two up to
``P``, ``e`` 1 where ``P`` is not one, else 0. Ok-Topk: ``c = 2q`` pairs to
each owner at most, ``B`` counts in the histogram that balances its
regions. ``s'``: the shard rounded up to whole chunks of ``C`` entries, at most
``sizes.CHUNK``, a power of two for a rotated code; each chunk sends one
float32 scale per phase.)

Values and indices travel in one message (``wire.py``), so TopkA and
TopKA2A pay one latency term per phase. Indices are as narrow as the
positions they address allow: a shard, or for TopkA, gTop-k and Ok-Topk
the whole buffer. gTop-k's rounds run one after another, each a message of
``k`` pairs to one partner, so its bytes are those of its longest path; an
all-gather of a slice of the result from each device ends it, which gives
the mean the type JAX gives a value the same on every device
(``global_top_k.py``).

Each exchange is a sequence of :class:`Phase` s, each with its pattern:
all-reduce and all-gather pass data around a ring (each device sends to one
neighbour), the owner phase sends to every peer directly (AlltoAll). The
pattern decides which bytes cross a node's network card on a cluster
(:func:`topka2a_jax.cost.cluster_cost`).

Example:
  >>> ALGORITHMS["topka2a"].cost(25_000_000, 8, 0.01).messages
  14
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from topka2a_jax._src.sizes import (
  CHUNK,
  ShardLayout,
  ceil_div,
  index_dtype,
  sparse_count,
  wire_bytes,
)

AUTO = "auto"
"""``algorithm=AUTO``: each bucket takes the cheapest entry under the cost model."""


class Counts(NamedTuple):
  """The sizes one exchange's cost depends on (floats for the continuous model).

  Attributes:
    devices: P.
    length: d, elements in the buffer.
    k: entries selected from the whole buffer.
    shard: s, elements per shard.
    per_shard: q, entries selected per shard.
    value_bytes: v.
    index_bytes: i.
  """

  devices: int
  length: float
  k: float
  shard: float
  per_shard: float
  value_bytes: float
  index_bytes: float


RING = "ring"
"""A phase that passes data around a ring: all-reduce, all-gather, reduce-scatter."""

PAIRS = "pairs"
"""A phase in which every device sends its own piece to every peer (AlltoAll)."""

TREE = "tree"
"""Rounds of recursive doubling: in round ``r`` each device swaps with the
device ``2^r`` away."""


class Phase(NamedTuple):
  """One collective of an exchange.

  Attributes:
    pattern: :data:`RING` or :data:`PAIRS`.
    messages: latency terms it pays in sequence.
    bytes: bytes each device sends in it.
  """

  pattern: str
  messages: float
  bytes: float


@dataclasses.dataclass(frozen=True)
class Cost:
  """What one exchange puts on the wire, per device.

  Attributes:
    messages: latency terms paid in sequence.
    bytes: bytes each device sends.
  """

  messages: int
  bytes: float

  def seconds(self, network) -> float:
    """Time on ``network`` (a :class:`topka2a_jax.cost.Network`) in the α-β model."""
    return self.messages * network.latency + self.bytes / network.bandwidth


class Codes(NamedTuple):
  """The codes of a few-bit exchange (:func:`few_bit <topka2a_jax.collectives.few_bit>`).

  Attributes:
    bits: bits per entry to the owners.
    gather_bits: bits per entry of the owners' means back.
    chunk: entries per float32 scale, in both phases.
    rotated: whether each chunk is rotated before its code
      (``collectives/rotation.py``); its chunks are then a power of two long.
  """

  bits: int
  gather_bits: int
  chunk: int = CHUNK
  rotated: bool = False


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """One exchange of a flat buffer across the data axis.

  Attributes:
    name: what ``topka2a(algorithm=...)`` takes.
    title: its printable name.
    summary: what it does, in one line.
    sparse: whether it compresses with error feedback: a top-k selection,
      or every entry as a few-bit code (:attr:`quantizes`), the rest (or the
      rounding) waiting in a residual; a dense exchange sends everything.
    unsent_at: where the entries not sent wait.
    compresses_values: whether ``value_dtype`` applies to what it sends
      (an all-reduce adds in transit, so it sends the buffer's dtype).
    global_indices: whether its indices address the whole buffer rather
      than one shard.
    traffic: ``Counts -> its phases``, in order (:class:`Phase`).
    reads: ``(d, P) -> elements its selections (or its codes) pass over``.
    selects: ``Counts -> entries it selects``.
    holds_back: whether owners hold back part of the summed selection (it
      waits in their residuals), so that the mean lacks some of what the
      devices selected.
    codes: for the exchanges that send every entry as a few-bit code
      rather than a selection, their :class:`Codes` (bits to the owners,
      bits back, entries per scale): their collective is :func:`few_bit
      <topka2a_jax.collectives.few_bit>` with those. None for the others,
      whose collective is the function of their name.
  """

  name: str
  title: str
  summary: str
  sparse: bool
  unsent_at: str
  compresses_values: bool
  global_indices: bool
  traffic: Callable[[Counts], tuple[Phase, ...]]
  reads: Callable[[int, int], int]
  selects: Callable[[Counts], float]
  holds_back: bool = False
  codes: Codes | None = None

  @property
  def quantizes(self) -> bool:
    """Whether it sends every entry as a few-bit code, not a selection.

    ``"auto"`` takes one only where the optimizer after the exchange asks
    for it (Adam's family, momentum: :mod:`topka2a_jax._src.planner.forms`);
    among the top-k exchanges it never picks one, since a code trades what
    is sent, not only time.
    """
    return self.codes is not None

  @property
  def delivers_bursts(self) -> bool:
    """Whether its error feedback hands the optimizer after it each entry as a
    burst of many steps' gradients: a top-k, or the gradient's signs (whose
    magnitudes wait in the residual). Adam's moments go wrong on bursts
    (``transforms/following.py`` warns of them).
    """
    return self.sparse and (self.codes is None or self.codes.bits == 1)

  def index_bytes(self, length: float, devices: int) -> int:
    """Bytes of one index on the wire, as the collective sends it."""
    addressed = length if self.global_indices else math.ceil(length / devices)
    return index_dtype(max(1, math.ceil(addressed))).itemsize

  def counts(self, length: float, devices: int, density: float, value_bytes: int = 4,
             index_bytes: int | None = None, *, exact: bool = True) -> Counts:
    """The sizes of one exchange: the collectives' rounding, or none (``exact=False``)."""
    if index_bytes is None:
      index_bytes = self.index_bytes(length, devices)
    if not self.compresses_values:
      value_bytes = 4
    if exact:
      layout = ShardLayout.create(int(length), devices, density)
      return Counts(devices, length, sparse_count(int(length), density),
                    layout.shard_length, layout.per_shard, value_bytes, index_bytes)
    k = density * length
    return Counts(devices, length, k, length / devices, k / devices, value_bytes,
                  index_bytes)

  def cost(self, length: float, devices: int, density: float, value_bytes: int = 4,
           index_bytes: int | None = None, *, exact: bool = True) -> Cost:
    """Messages and bytes of one exchange of ``length`` elements.

    Example:
      >>> ALGORITHMS["dense"].cost(1000, 8, 0.01).bytes
      7000.0
    """
    phases = self.phases(length, devices, density, value_bytes, index_bytes,
                         exact=exact)
    return Cost(int(sum(phase.messages for phase in phases)),
                float(sum(phase.bytes for phase in phases)))

  def phases(self, length: float, devices: int, density: float, value_bytes: int = 4,
             index_bytes: int | None = None, *, exact: bool = True) -> tuple[Phase, ...]:
    """The collectives of one exchange of ``length`` elements, in order.

    Example:
      >>> [phase.pattern for phase in ALGORITHMS["topka2a"].phases(1000, 8, 0.01)]
      ['pairs', 'ring']
    """
    return self.traffic(self.counts(length, devices, density, value_bytes,
                                    index_bytes, exact=exact))

  def elements_read(self, length: int, devices: int) -> int:
    """Elements one device's selections read in one exchange.

    Example:
      >>> ALGORITHMS["topka2a_sparse"].elements_read(1000, 4)
      1250
    """
    return self.reads(length, devices)

  def selected_entries(self, length: int, devices: int, density: float) -> int:
    """Entries one device selects in one exchange (packed, sent, added in).

    Example:
      >>> ALGORITHMS["topka2a_sparse"].selected_entries(1000, 4, 0.01)
      15
    """
    return int(self.selects(self.counts(length, devices, density)))


def _ring(c: Counts) -> tuple[Phase, ...]:
  return (Phase(RING, 2 * (c.devices - 1),
                2 * (c.devices - 1) / c.devices * c.length * c.value_bytes),)


def _gather_pairs(c: Counts) -> tuple[Phase, ...]:
  return (Phase(RING, c.devices - 1, (c.devices - 1) * c.k * (c.value_bytes
                                                              + c.index_bytes)),)


def _to_owners(c: Counts) -> Phase:
  return Phase(PAIRS, c.devices - 1,
               (c.devices - 1) * c.per_shard * (c.value_bytes + c.index_bytes))


def _to_owners_then_shards(c: Counts) -> tuple[Phase, ...]:
  return (_to_owners(c),
          Phase(RING, c.devices - 1, (c.devices - 1) * c.shard * c.value_bytes))


def _to_owners_then_pairs(c: Counts) -> tuple[Phase, ...]:
  owners = _to_owners(c)
  return owners, owners._replace(pattern=RING)


def doubling_rounds(num_devices: int) -> tuple[int, int]:
  """``(rounds, extra)``: gTop-k's rounds of recursive doubling, and the
  devices past the largest power of two, which take two rounds more.

  Example:
    >>> doubling_rounds(8), doubling_rounds(6)
    ((3, 0), (2, 2))
  """
  rounds = num_devices.bit_length() - 1
  return rounds, num_devices - (1 << rounds)


def _merges(devices: int) -> int:
  """gTop-k's merges on the busiest device: one a round, one more for the extra devices."""
  rounds, extra = doubling_rounds(devices)
  return rounds + (extra > 0)


def _doubling(c: Counts) -> tuple[Phase, ...]:
  """gTop-k's rounds, each ``k`` pairs to one partner (``global_top_k.py``)."""
  rounds, extra = doubling_rounds(c.devices)
  rounds += 2 * (extra > 0)
  pair = c.value_bytes + c.index_bytes
  typed = Phase(RING, c.devices - 1, (c.devices - 1) * math.ceil(c.k / c.devices) * pair)
  return (Phase(TREE, rounds, rounds * c.k * pair), typed) if rounds else ()


OKTOPK_CAPACITY = 2
"""Ok-Topk's entries to each owner, in units of ``ceil(k / P)`` (``global_top_k.py``)."""

OKTOPK_BINS_PER_DEVICE = 64
"""Bins per device of the histogram that balances Ok-Topk's regions."""


def oktopk_bins(length: float, devices: int) -> tuple[int, int]:
  """``(bins, width)`` of the histogram that balances Ok-Topk's regions.

  Example:
    >>> oktopk_bins(10_000, 4), oktopk_bins(100, 4)
    ((250, 40), (100, 1))
  """
  length = max(1, math.ceil(length))
  width = ceil_div(length, min(length, OKTOPK_BINS_PER_DEVICE * devices))
  return ceil_div(length, width), width


def oktopk_capacity(k: float, devices: int) -> float:
  """Pairs one device sends one owner in Ok-Topk's reduce-scatter."""
  return min(k, OKTOPK_CAPACITY * math.ceil(k / devices))


def _balanced_scatter_then_pairs(c: Counts) -> tuple[Phase, ...]:
  pair = c.value_bytes + c.index_bytes
  peers = c.devices - 1
  return (Phase(RING, 2 * peers, 2 * peers / c.devices * 4 * oktopk_bins(c.length,
                                                                        c.devices)[0]),
          Phase(PAIRS, peers, peers * oktopk_capacity(c.k, c.devices) * pair),
          Phase(RING, peers, peers * math.ceil(c.k / c.devices) * pair))


def _codes_then(codes: Codes) -> Callable[[Counts], tuple[Phase, ...]]:
  """The phases of :func:`few_bit <topka2a_jax.collectives.few_bit>`.

  Each device sends every peer its shard's codes of ``bits`` bits and chunk
  scales, then every peer gets each owner's shard in ``gather_bits`` bits
  per entry.
  """
  def traffic(c: Counts) -> tuple[Phase, ...]:
    shard = math.ceil(c.length / c.devices)
    return (Phase(PAIRS, c.devices - 1,
                  (c.devices - 1) * wire_bytes(shard, codes.bits, codes.chunk,
                                               powers_of_two=codes.rotated)),
            Phase(RING, c.devices - 1, (c.devices - 1) * wire_bytes(
                shard, codes.gather_bits, codes.chunk, powers_of_two=codes.rotated)))
  return traffic


def _quantized(bits: int, gather_bits: int, *, name: str | None = None,
               chunk: int = CHUNK, how: str = "", rotated: bool = False) -> Algorithm:
  if name is None:
    name = ("onebit" if gather_bits == 8 else f"onebit_{gather_bits}") if bits == 1 else (
        f"quantized_{bits}_{gather_bits}")
  what = f"every entry's sign{how}" if bits == 1 else f"every entry in {bits} bits{how}"
  return Algorithm(
      name=name, title=f"{bits}-bit A2A, {gather_bits}-bit AllGather{how}",
      summary=(f"{what} to its shard's owner by AlltoAll, the owners' means back "
               f"in {gather_bits} bit{'s' if gather_bits > 1 else ''} by AllGather"),
      sparse=True, unsent_at="the sender, and the owner for its mean's rounding",
      compresses_values=False, global_indices=False,
      traffic=_codes_then(Codes(bits, gather_bits, chunk, rotated)),
      # Passes over the buffer: its codes, their decoding (the residual), the
      # owner's sum of P shards and the final decoding; over the owner's
      # shard, its codes and their decoding. A rotation adds three passes
      # over the buffer (the rotation, and the inverse of the residual's and
      # of the means' decoding) and one over the owner's shard: within 15%
      # of the link at 1M to 25M entries (docs/evidence/network.md).
      reads=lambda length, devices: (7 if rotated else 4) * length + (
          3 if rotated else 2) * ceil_div(length, devices),
      selects=lambda c: 0, holds_back=True,
      codes=Codes(bits, gather_bits, chunk, rotated))


DENSE = Algorithm(
    name="dense", title="dense", summary="lax.pmean: a ring all-reduce of everything",
    sparse=False, unsent_at="nowhere (all is sent)",
    compresses_values=False, global_indices=False, traffic=_ring,
    reads=lambda length, devices: 0, selects=lambda c: 0)

ALLGATHER = Algorithm(
    name="allgather", title="TopkA",
    summary="every device's top-k pairs all-gathered and summed everywhere",
    sparse=True, unsent_at="the sender",
    compresses_values=True, global_indices=True, traffic=_gather_pairs,
    reads=lambda length, devices: length, selects=lambda c: c.k)

TOPKA2A = Algorithm(
    name="topka2a", title="TopKA2A",
    summary="shard-wise top-k, AlltoAll to the owners, AllGather of the summed shards",
    sparse=True, unsent_at="the sender",
    compresses_values=True, global_indices=False, traffic=_to_owners_then_shards,
    reads=lambda length, devices: length, selects=lambda c: c.devices * c.per_shard)

TOPKA2A_SPARSE = Algorithm(
    name="topka2a_sparse", title="TopKA2A-sparse",
    summary="TopKA2A whose owners re-select their summed shard: O(k) volume",
    sparse=True,
    unsent_at="the sender, and the owner for its summed shard",
    compresses_values=True, global_indices=False, traffic=_to_owners_then_pairs,
    reads=lambda length, devices: length + ceil_div(length, devices),
    selects=lambda c: (c.devices + 1) * c.per_shard, holds_back=True)

GTOPK = Algorithm(
    name="gtopk", title="gTop-k",
    summary="every device's top-k merged up a tree of recursive doubling: the global top-k",
    sparse=True, unsent_at="the sender, and each merge's first device for what it drops",
    compresses_values=True, global_indices=True, traffic=_doubling,
    reads=lambda length, devices: length,
    selects=lambda c: c.k + 2 * c.k * _merges(c.devices),
    holds_back=True)

OKTOPK = Algorithm(
    name="oktopk", title="Ok-Topk",
    summary="top-k, a sparse reduce-scatter over balanced regions, their tops all-gathered",
    sparse=True, unsent_at="the sender, and the owner for its region's rest",
    compresses_values=True, global_indices=True, traffic=_balanced_scatter_then_pairs,
    reads=lambda length, devices: length,
    selects=lambda c: c.k + c.devices * oktopk_capacity(c.k, c.devices), holds_back=True)

ONEBIT = _quantized(1, 8)
"""Signs to the owners, 8-bit means back: 1.125 bytes per entry in all."""

ONEBIT_4 = _quantized(1, 4)
"""Signs to the owners, 4-bit means back: 0.625 bytes per entry."""

ONEBIT_1 = _quantized(1, 1)
"""Signs both ways (DeepSpeed's compressed all-reduce): 0.25 bytes per entry."""

FEW_BIT = (*(_quantized(bits, back)
              for bits, back in ((4, 8), (4, 4), (2, 8), (8, 8), (8, 4))),
           _quantized(8, 8, name="quantized_8_8_fine", chunk=256,
                      how=", one scale per 256 entries"),
           *(_quantized(4, back, name=f"rotated_4_{back}", chunk=512, rotated=True,
                        how=", each 512 entries rotated, one scale each")
             for back in (8, 4)),
           _quantized(1, 1, name="rotated_1_1", chunk=512, rotated=True,
                      how=", each 512 entries rotated, one scale each"))
"""Codes of 2 to 8 bits to the owners, 4 or 8 back (and one of 1 bit both ways,
last): the gradient at a few bits;
``quantized_8_8_fine`` with one scale per 256 entries instead of 4,096;
``rotated_4_8`` and ``rotated_4_4`` rotate each 512 entries by a random-sign
Walsh-Hadamard transform before their 4-bit code (``rotation.py``);
and ``rotated_1_1``, a 1-bit code, sends the rotated entries' signs both
ways, each 512 with their mean magnitude."""

ALGORITHMS: dict[str, Algorithm] = {
    algorithm.name: algorithm for algorithm in (
        DENSE, ALLGATHER, TOPKA2A, TOPKA2A_SPARSE, GTOPK, OKTOPK, ONEBIT, ONEBIT_4,
        ONEBIT_1,
        *FEW_BIT)}
"""Every exchange of a flat buffer, by the name ``topka2a(algorithm=...)`` takes."""


@dataclasses.dataclass(frozen=True)
class LowRank:
  """An exchange of matrix leaves as low-rank products (``_src/collectives/low_rank.py``).

  It works on each leaf's shape, not on a flat bucket, so it is priced per
  step from the matrices' shapes; the leaves it does not compress go dense.

  Attributes:
    name: what ``topka2a(algorithm=...)`` takes.
    title: its printable name.
    summary: what it does, in one line.
  """

  name: str
  title: str
  summary: str

  def phases(self, shapes: Sequence[tuple[int, int]], devices: int,
             rank: int) -> tuple[Phase, ...]:
    """The two all-reduces of one step: every ``P`` (``m x r``), then every ``Q`` (``n x r``).

    Args:
      shapes: the compressed leaves as matrices ``(m, n)``.
      devices: P.
      rank: r, at most each matrix's smaller side.

    Example:
      >>> [p.bytes for p in POWERSGD.phases([(100, 50)], 4, 2)]
      [1200.0, 600.0]
    """
    ring = 2 * (devices - 1) / devices * 4
    p = sum(m * min(rank, m, n) for m, n in shapes)
    q = sum(n * min(rank, m, n) for m, n in shapes)
    return (Phase(RING, 2 * (devices - 1), ring * p),
            Phase(RING, 2 * (devices - 1), ring * q))

  def cost(self, shapes: Sequence[tuple[int, int]], devices: int, rank: int) -> Cost:
    """Messages and bytes of one step's two all-reduces.

    Example:
      >>> POWERSGD.cost([(5000, 5000)], 4, 4).bytes
      240000.0
    """
    phases = self.phases(shapes, devices, rank)
    return Cost(int(sum(phase.messages for phase in phases)),
                float(sum(phase.bytes for phase in phases)))

  def flops(self, shapes: Sequence[tuple[int, int]], rank: int) -> float:
    """Multiply-adds one device runs: ``M Q``, ``M^T P``, and the two products ``P Q^T``.

    Example:
      >>> POWERSGD.flops([(100, 50)], 2)
      40000.0
    """
    return float(sum(4 * m * n * min(rank, m, n) for m, n in shapes))


POWERSGD = LowRank(
    name="powersgd", title="PowerSGD",
    summary="each large matrix as a rank-r product: two all-reduces (P, then Q)")
"""PowerSGD (Vogels et al., NeurIPS 2019); ``topka2a(algorithm="powersgd", rank=r)``."""

NAMES: tuple[str, ...] = (*ALGORITHMS, POWERSGD.name)
"""Every name ``topka2a(algorithm=...)`` takes besides ``"auto"``."""


IGNORING_DENSITY: tuple[str, ...] = (
    POWERSGD.name, DENSE.name,
    *(name for name, entry in ALGORITHMS.items() if entry.quantizes))
"""The algorithms that send no selection, so take no ``density``."""


def ignores_density(name: str) -> bool:
  """Whether ``topka2a(algorithm=name)`` needs no ``density``.

  Example:
    >>> ignores_density("onebit"), ignores_density("topka2a")
    (True, False)
  """
  return name in IGNORING_DENSITY


def check_plan_options(algorithm: str, threshold: int | str) -> None:
  """Raises ValueError for an algorithm or threshold the planner cannot use.

  Example:
    >>> check_plan_options("topka2a", 2**20)
    >>> check_plan_options("auto", 0)
    Traceback (most recent call last):
    ValueError: threshold must be 'auto' or a positive int, got 0
  """
  if algorithm != AUTO:
    get(algorithm)
  if threshold != "auto" and (
      isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1):
    raise ValueError(f"threshold must be 'auto' or a positive int, got {threshold!r}")


def get(name: str) -> Algorithm:
  """The exchange called ``name``, or a ValueError listing the choices.

  Example:
    >>> get("topka2a").title
    'TopKA2A'
  """
  if name == AUTO:
    raise ValueError(f"no cost model for algorithm {AUTO!r}: it takes one exchange "
                     f"per bucket; name one of {', '.join(map(repr, ALGORITHMS))}")
  if name == POWERSGD.name:
    raise ValueError(f"{name!r} exchanges matrices, not flat buckets: its cost is "
                     f"algorithms.POWERSGD.cost(shapes, devices, rank); the bucket "
                     f"exchanges are {', '.join(map(repr, ALGORITHMS))}")
  if name not in ALGORITHMS:
    raise ValueError(f"unknown algorithm {name!r}; choose {AUTO!r} or one of "
                     f"{', '.join(map(repr, NAMES))}")
  return ALGORITHMS[name]
