"""What a compiled program puts on the wire, read from its HLO.

:func:`comm_report` lists every collective XLA emitted, with its count and
the bytes each device sends under a bandwidth-optimal implementation, the
same convention as :mod:`topka2a_jax.cost`, so the model can be checked
against what the compiler really does. For a group of ``P`` devices:

| op | bytes sent per device |
|---|---|
| all-reduce of B bytes | 2(P-1)/P · B |
| all-gather with a B-byte result | (P-1)/P · B |
| all-to-all of B bytes | (P-1)/P · B |
| reduce-scatter of a B-byte operand | (P-1)/P · B |
| collective-permute of B bytes | B |

Asynchronous pairs count once, at their ``-start``.

Example:
  >>> print(comm_report(jax.jit(step).lower(params, opt_state, batch)))
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter",
         "collective-permute")

_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
}
_INSTRUCTION = re.compile(
    r"=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(KINDS) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")


@dataclasses.dataclass(frozen=True)
class CollectiveTotal:
  """All collectives of one kind.

  Attributes:
    kind: e.g. ``"all-to-all"``.
    count: how many the program runs.
    bytes: bytes each device sends, over all of them.
  """

  kind: str
  count: int
  bytes: float


@dataclasses.dataclass(frozen=True)
class CommReport:
  """The collectives of a compiled program.

  Attributes:
    collectives: one row per kind present, in :data:`KINDS` order.
  """

  collectives: tuple[CollectiveTotal, ...]

  @property
  def total_bytes(self) -> float:
    """Bytes each device sends, all collectives together."""
    return sum(row.bytes for row in self.collectives)

  def bytes_of(self, kind: str) -> float:
    """Bytes each device sends in collectives of ``kind`` (0 if none)."""
    return sum(row.bytes for row in self.collectives if row.kind == kind)

  def count_of(self, kind: str) -> int:
    """How many collectives of ``kind`` the program runs."""
    return sum(row.count for row in self.collectives if row.kind == kind)

  def __str__(self) -> str:
    lines = [f"{'collective':20s} {'count':>6s} {'bytes/device':>14s}"]
    for row in self.collectives:
      lines.append(f"{row.kind:20s} {row.count:6d} {row.bytes:14,.0f}")
    lines.append(f"{'total':20s} {sum(r.count for r in self.collectives):6d} "
                 f"{self.total_bytes:14,.0f}")
    return "\n".join(lines)


def _arrays_bytes(arrays: list[tuple[str, str]]) -> int:
  """Bytes of (dtype, dims) arrays parsed from an HLO shape."""
  total = 0
  for dtype, dims in arrays:
    elements = 1
    for dim in filter(None, dims.split(",")):
      elements *= int(dim)
    total += elements * _BYTES.get(dtype, 0)
  return total


def _group_size(line: str, default: int) -> int:
  listed = _GROUPS_LIST.search(line)
  if listed:
    return len([d for d in listed.group(1).split(",") if d])
  iota = _GROUPS_IOTA.search(line)
  if iota:
    return int(iota.group(2))
  return default


def _sent_bytes(kind: str, is_start: bool, shape: str, group: int) -> float:
  arrays = _ARRAY.findall(shape)
  if is_start and kind == "all-gather":
    arrays = arrays[len(arrays) // 2 :]  # (operands, results): the results
  elif is_start and kind == "collective-permute":
    arrays = arrays[:1]  # (operand, result, context): the operand
  payload = _arrays_bytes(arrays)
  share = (group - 1) / group if group else 0.0
  if kind == "all-reduce":
    return 2 * share * payload
  if kind == "reduce-scatter":
    return share * payload * group  # the result is 1/P of the operand
  if kind == "collective-permute":
    return float(payload)
  return share * payload


def comm_report(program: Any, num_devices: int | None = None) -> CommReport:
  """Counts the collectives of a jitted program and the bytes they send.

  Args:
    program: a ``jax.stages.Lowered`` (it is compiled), a
      ``jax.stages.Compiled``, or compiled HLO text.
    num_devices: group size for collectives whose HLO names no replica
      groups; by default the module's ``num_partitions``.

  Returns:
    The :class:`CommReport`.

  Example:
    >>> report = comm_report(jax.jit(step).lower(params, opt_state, batch))
    >>> report.bytes_of("all-to-all")
  """
  if hasattr(program, "compile"):
    program = program.compile()
  text = program if isinstance(program, str) else program.as_text()
  if num_devices is None:
    partitions = _PARTITIONS.search(text)
    num_devices = int(partitions.group(1)) if partitions else 1
  counts: dict[str, list[float]] = {}
  for line in text.splitlines():
    match = _INSTRUCTION.search(line)
    if not match:
      continue
    kind = match.group("op")
    sent = _sent_bytes(kind, bool(match.group("start")), match.group("shape"),
                       _group_size(line, num_devices))
    row = counts.setdefault(kind, [0, 0.0])
    row[0] += 1
    row[1] += sent
  return CommReport(tuple(CollectiveTotal(kind, int(counts[kind][0]), counts[kind][1])
                          for kind in KINDS if kind in counts))
