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

Asynchronous pairs count once, at their ``-start``. Given the mesh, every
collective is also attributed to the mesh axes its replica groups span, so
that a step's traffic over ``"data"`` and over ``"model"`` can be told apart.
A collective inside a branch of a ``lax.cond`` runs only when that branch is
taken, and its row says so (:attr:`CollectiveTotal.in_branch`): a
:func:`topka2a_jax.local_steps` step holds its round's exchange there, an
:func:`topka2a_jax.accumulate_gradients` step its accumulated step's, and
:meth:`CommReport.step_bytes` spreads it over the calls that share it.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> mean = jax.jit(jax.shard_map(lambda x: jax.lax.pmean(x, "data"), mesh=mesh,
  ...                              in_specs=P("data"), out_specs=P()))
  >>> x = jax.device_put(jnp.ones(8 * 1000), NamedSharding(mesh, P("data")))
  >>> print(comm_report(mean.lower(x), mesh=mesh))
  collective                     axes  count   bytes/device
  all-reduce                     data      1          7,000
  total                                    1          7,000
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from topka2a_jax._src.rounds import round_lengths

KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter",
         "collective-permute")

_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
}
FORM_SCOPE = "topka2a_form"
"""The name scope each exchange's collectives run under, followed by their
form (``topka2a_form.quantized_8_8_fine``): XLA keeps it in every
instruction's ``op_name``, where :func:`comm_report` reads it back."""
_FORM = re.compile(r'op_name="[^"]*\b' + FORM_SCOPE + r'\.(?P<form>[\w]+)')


def form_scope(form: str) -> Any:
  """The name scope of an exchange of ``form``'s collectives (:data:`FORM_SCOPE`).

  Example:
    >>> with form_scope("dense"):
    ...   pass
  """
  return jax.named_scope(f"{FORM_SCOPE}.{form}")


_INSTRUCTION = re.compile(
    r"=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(KINDS) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(
    r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(\[([0-9,]+)\]"
    r"(?:T\(([0-9,]+)\))?\))? \{([^}]*)\}")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLED = re.compile(
    r"\b(?:to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_CONDITIONAL = re.compile(r"\sconditional\(")


@dataclasses.dataclass(frozen=True)
class CollectiveTotal:
  """All collectives of one kind.

  Attributes:
    kind: e.g. ``"all-to-all"``.
    count: how many the program runs.
    bytes: bytes each device sends, over all of them.
    axes: the mesh axes their groups span (given the mesh), e.g. ``("data",)``.
    in_branch: they sit in a branch of a conditional (``lax.cond``), run only
      when it is taken: a ``local_steps`` step's round exchange, an
      ``accumulate_gradients`` step's accumulated exchange.
    form: the form of the library's exchange they carry (``"dense"``,
      ``"quantized_8_8_fine"``, ``"topka2a"``, ``"powersgd"``, ...), or ``""``
      for the step's other collectives (the loss's mean, flags). XLA may
      fuse a dense bucket's all-reduce with another: the row takes the
      first one's.
  """

  kind: str
  count: int
  bytes: float
  axes: tuple[str, ...] = ()
  in_branch: bool = False
  form: str = ""


@dataclasses.dataclass(frozen=True)
class CommReport:
  """The collectives of a compiled program.

  Attributes:
    collectives: one row per kind present (per kind and axes, given the
      mesh), in :data:`KINDS` order.
  """

  collectives: tuple[CollectiveTotal, ...]

  def _rows(self, kind: str | None, axis: str | None) -> list[CollectiveTotal]:
    return [row for row in self.collectives
            if kind in (None, row.kind) and (axis is None or axis in row.axes)]

  @property
  def total_bytes(self) -> float:
    """Bytes each device sends, all collectives together."""
    return sum(row.bytes for row in self.collectives)

  def bytes_of(self, kind: str | None = None, axis: str | None = None) -> float:
    """Bytes each device sends in collectives of ``kind`` spanning ``axis`` (0 if none).

    ``None`` for either means any.
    """
    return sum(row.bytes for row in self._rows(kind, axis))

  def count_of(self, kind: str | None = None, axis: str | None = None) -> int:
    """How many collectives of ``kind`` spanning ``axis`` the program runs."""
    return sum(row.count for row in self._rows(kind, axis))

  def step_bytes(self, every: int | Mapping[int, int] = 1, steps: int | None = None) -> float:
    """Bytes each device sends a step where the branches run once in ``every`` steps.

    For a :func:`topka2a_jax.local_steps` step, ``every`` is its round's
    length (for :func:`topka2a_jax.accumulate_gradients`, its ``every``): the
    exchange (in a branch) is spread over those steps, what runs every step
    (the loss's mean, say) is not. Rounds whose length changes,
    ``every={0: 4, 100: 2}`` as :func:`topka2a_jax.local_steps` takes it,
    are spread over the run's ``steps``.

    Raises:
      ValueError, TypeError: a bad ``every`` (as ``local_steps`` says), or
        ``every`` a dict of several lengths and no ``steps``.

    Example:
      >>> report = CommReport((CollectiveTotal("all-reduce", 1, 8.0),
      ...                      CollectiveTotal("all-to-all", 1, 400.0, in_branch=True)))
      >>> report.step_bytes(4)  # 8 every step, 400 once in 4
      108.0
      >>> round(report.step_bytes({0: 4, 100: 2}, steps=300), 2)  # 25 rounds of 4, 100 of 2
      174.67
    """
    lengths = round_lengths(every)
    if lengths.constant is None and steps is None:
      raise ValueError(f"step_bytes(every={every!r}) spreads rounds of several lengths over "
                       "a run: give its length, step_bytes(every, steps=300)")
    share = 1 / lengths.constant if steps is None else lengths.per_step(steps)
    return sum(row.bytes * share if row.in_branch else row.bytes for row in self.collectives)

  def __str__(self) -> str:
    forms = any(row.form for row in self.collectives)  # a column where an exchange ran
    lines = [f"{'collective':20s} {'axes':>14s} {'count':>6s} {'bytes/device':>14s}"
             + ("  form" if forms else "")]
    for row in self.collectives:
      kind = f"{row.kind} *" if row.in_branch else row.kind
      lines.append(f"{kind:20s} {','.join(row.axes) or '-':>14s} {row.count:6d} "
                   f"{row.bytes:14,.0f}" + (f"  {row.form or '-'}" if forms else ""))
    lines.append(f"{'total':20s} {'':>14s} {sum(r.count for r in self.collectives):6d} "
                 f"{self.total_bytes:14,.0f}")
    if any(row.in_branch for row in self.collectives):
      lines.append("* in a branch of a conditional: runs only when it is taken "
                   "(PowerSGD: every step not skipped; local_steps: once a round; "
                   "accumulate_gradients: once every `every` calls, which "
                   "step_bytes(every) spreads)")
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


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def _iota(dims: list[int], perm: str | None) -> np.ndarray:
  ids = np.arange(math.prod(dims)).reshape(dims)
  return ids if perm is None else ids.transpose(_ints(perm))


def replica_groups(line: str) -> list[list[int]] | None:
  """The device groups of one HLO collective, or None where the line names none.

  Reads the three forms XLA prints: explicit lists (``{{0,2},{1,3}}``), iota
  (``[2,2]<=[4]`` or ``[2,2]<=[2,2]T(1,0)``) and mesh axes
  (``mesh['axis_0'=2,'axis_1'=2], device_ids=(...) {'axis_1'}``). Ids are
  positions in the program's device assignment: for a jitted step, the
  mesh's devices in order.

  Example:
    >>> replica_groups("all-reduce(x), replica_groups=[2,2]<=[2,2]T(1,0)")
    [[0, 2], [1, 3]]
  """
  listed = _GROUPS_LIST.search(line)
  if listed:
    groups = [_ints(g) for g in re.findall(r"\{([0-9,]*)\}", listed.group(1))]
    return [g for g in groups if g] or None
  iota = _GROUPS_IOTA.search(line)
  if iota:
    count, size = int(iota.group(1)), int(iota.group(2))
    return _iota(_ints(iota.group(3)), iota.group(4)).reshape(count, size).tolist()
  mesh = _GROUPS_MESH.search(line)
  if mesh:
    axes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    ids = (np.arange(math.prod(sizes)) if mesh.group(2) is None
           else _iota(_ints(mesh.group(2)), mesh.group(3))).reshape(sizes)
    within = [names.index(a) for a in re.findall(r"'([^']+)'", mesh.group(4))]
    outer = [i for i in range(len(names)) if i not in within]
    size = math.prod(sizes[i] for i in within)
    return ids.transpose(outer + within).reshape(-1, size).tolist()
  return None


def _axes_spanned(groups: list[list[int]] | None, mesh: Any,
                  num_devices: int) -> tuple[str, ...]:
  """Mesh axes along which members of a group differ; all axes with no groups."""
  shape = tuple(mesh.devices.shape)
  if groups is None:
    groups = [list(range(num_devices))]
  coords = [np.array(np.unravel_index(g, shape)) for g in groups if len(g) > 1]
  return tuple(name for i, name in enumerate(mesh.axis_names)
               if any(len(set(c[i])) > 1 for c in coords))


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


def comm_report(program: Any, num_devices: int | None = None,
                mesh: Any = None) -> CommReport:
  """Counts the collectives of a jitted program and the bytes they send.

  Args:
    program: a ``jax.stages.Lowered`` (it is compiled), a
      ``jax.stages.Compiled``, or compiled HLO text.
    num_devices: group size for collectives whose HLO names no replica
      groups; by default the module's ``num_partitions``.
    mesh: the program's mesh; with it, rows are split by the mesh axes each
      collective spans (:attr:`CollectiveTotal.axes`).

  Returns:
    The :class:`CommReport`.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> swap = jax.jit(jax.shard_map(
    ...     lambda x: jax.lax.all_to_all(x, "data", 0, 0, tiled=True), mesh=mesh,
    ...     in_specs=P("data"), out_specs=P("data")))
    >>> x = jax.device_put(jnp.ones(8 * 800), NamedSharding(mesh, P("data")))
    >>> comm_report(swap.lower(x)).bytes_of("all-to-all")  # 7/8 of 800 floats
    2800.0
  """
  if hasattr(program, "compile"):
    program = program.compile()
  if not (isinstance(program, str) or callable(getattr(program, "as_text", None))):
    raise TypeError(f"comm_report reads a lowered or compiled program (step.lower(...) of "
                    f"a jitted step) or its HLO text; got {type(program).__name__}")
  text = program if isinstance(program, str) else program.as_text()
  if "HloModule" not in text:
    raise ValueError("comm_report got text that is not HLO (no 'HloModule' in it): give "
                     "the step's step.lower(...), its .compile(), or their .as_text()")
  if num_devices is None:
    partitions = _PARTITIONS.search(text)
    num_devices = int(partitions.group(1)) if partitions else 1
  branched = _branch_computations(text)
  counts: dict[tuple[str, tuple[str, ...], bool, str], list[float]] = {}
  computation = None
  for line in text.splitlines():
    opened = _COMPUTATION.match(line)
    if opened:
      computation = opened.group("name")
    match = _INSTRUCTION.search(line)
    if not match:
      continue
    kind = match.group("op")
    groups = replica_groups(line)
    size = len(groups[0]) if groups else num_devices
    sent = _sent_bytes(kind, bool(match.group("start")), match.group("shape"), size)
    axes = () if mesh is None else _axes_spanned(groups, mesh, num_devices)
    form = _FORM.search(line)
    row = counts.setdefault((kind, axes, computation in branched,
                             form.group("form") if form else ""), [0, 0.0])
    row[0] += 1
    row[1] += sent
  return CommReport(tuple(
      CollectiveTotal(kind, int(count), sent, axes, in_branch, form)
      for kind in KINDS
      for (row_kind, axes, in_branch, form), (count, sent) in sorted(counts.items())
      if row_kind == kind))


def _branch_computations(text: str) -> set[str]:
  """Names of the computations that run only inside a conditional's branch.

  The branches a ``conditional`` names, and every computation they call
  (fusions, reductions, loops), transitively.
  """
  calls: dict[str, set[str]] = {}
  roots: set[str] = set()
  computation = None
  for line in text.splitlines():
    opened = _COMPUTATION.match(line)
    if opened:
      computation = opened.group("name")
      continue
    called = set(_CALLED.findall(line))
    listed = _BRANCHES.search(line)
    if listed:
      called |= {name.strip().lstrip("%") for name in listed.group(1).split(",")}
    if _CONDITIONAL.search(line):
      roots |= called - set(re.findall(r"\b(?:to_apply|calls)=%?([\w.\-]+)", line))
    calls.setdefault(computation, set()).update(called)
  branched, pending = set(), list(roots)
  while pending:
    name = pending.pop()
    if name not in branched:
      branched.add(name)
      pending.extend(calls.get(name, ()))
  return branched
