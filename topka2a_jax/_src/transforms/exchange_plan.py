"""What one trace of the exchange does, decided once: every leaf's part and the buckets.

The transform's options say what the user asked for; the plan says what it
means for these gradients. :meth:`ExchangePlan.create` reads the options and
the leaves' shapes on one device once per trace of the update, decides
which leaves keep a residual and which go as low-rank products, and resolves
what the step itself passes (the backward pass's estimate). The state is
checked against the plan once; below that, the state says which leaves
hold a residual or a factor, and the plan carries the exchange's settings.
:meth:`ExchangePlan.buckets` fuses the leaves into buckets, once per step.

Example:
  >>> options = Options.create(0.01, min_size=100)
  >>> plan = ExchangePlan.create(options, ["['w']", "['b']"], [(64, 32), (32,)])
  >>> [leaf.keeps_residual for leaf in plan.leaves]
  [True, False]
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from topka2a_jax._src.axis import grouped_by_varying_axes
from topka2a_jax._src.collectives import algorithms
from topka2a_jax._src.options import Options
from topka2a_jax._src.planner.buckets import Bucket
from topka2a_jax._src.planner.fusion import PlannerSettings, StepModel

_LOG = logging.getLogger("topka2a_jax")
_SAID: set[str] = set()
"""The plans said already in this process: each distinct one is said once."""


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """One gradient leaf's part in the exchange.

  Attributes:
    path: where the leaf sits in the pytree, for messages.
    local_shape: its shape on one device: its shard, where other mesh axes
      split the parameter.
    keeps_residual: whether it is compressed with error feedback; else it
      goes dense, or without error feedback, and keeps no residual.
    low_rank: whether it goes as a PowerSGD product, keeping a factor.
  """

  path: str
  local_shape: tuple[int, ...]
  keeps_residual: bool
  low_rank: bool


def leaf_plans(options: Options, paths: Sequence[str],
               local_shapes: Sequence[tuple[int, ...]]) -> tuple[LeafPlan, ...]:
  """Every leaf's part from the options and its shape on one device.

  The one rule of what each leaf keeps: the state is made by it (``init``)
  and checked against it (the update's :class:`ExchangePlan`).
  """
  return tuple(
      LeafPlan(path, tuple(shape), options.keeps_residual(math.prod(shape), shape),
               options.sends_low_rank(tuple(shape)))
      for path, shape in zip(paths, local_shapes))


@dataclasses.dataclass(frozen=True)
class ExchangePlan:
  """One trace's exchange: its settings, every leaf's part, and how leaves fuse into buckets.

  Attributes:
    options: the transform's options, as the user gave them (the axis,
      density, selection, wire dtype, warm-up and non-finite switch the
      step reads from them).
    quantizes: whether the exchange sends few-bit codes, whose owners' sums
      can overflow from finite inputs.
    rank: the rank of the low-rank leaves' factors; None unless PowerSGD.
    leaves: every gradient leaf's part, in the pytree's order.
    algorithm: every large bucket's exchange, or ``"auto"`` (the cost
      model's cheapest of ``planner.forms``).
    fusion: the bucket size threshold in elements, or ``"auto"``.
    planner: what the cost model prices the buckets with.
  """

  options: Options
  quantizes: bool
  rank: int | None
  leaves: tuple[LeafPlan, ...]
  algorithm: str
  fusion: int | str
  planner: PlannerSettings

  @classmethod
  def create(cls, options: Options, paths: Sequence[str],
             local_shapes: Sequence[tuple[int, ...]],
             backward_seconds: float | None = None) -> ExchangePlan:
    """Decides every leaf's part from the options and its shape on one device.

    Args:
      options: the transform's options.
      paths: every leaf's path.
      local_shapes: every leaf's shape on one device.
      backward_seconds: the step's estimate of its backward pass; an explicit
        ``backward_seconds=`` option wins over it.
    """
    leaves = leaf_plans(options, paths, local_shapes)
    if options.backward_seconds is not None:
      backward_seconds = options.backward_seconds
    planner = PlannerSettings(
        network=options.outer_network(), cluster=options.cluster(),
        min_size=options.min_size, backward_seconds=backward_seconds,
        value_bytes=options.value_bytes, residual_slices=options.error_feedback,
        whole_selection=options.whole_selection, forms=options.auto_forms)
    names = (planner.forms or () if options.algorithm == algorithms.AUTO
             else (options.algorithm,))
    return cls(options=options,
               quantizes=any(algorithms.ALGORITHMS[name].quantizes for name in names
                             if name in algorithms.ALGORITHMS),
               rank=options.rank if options.is_low_rank else None, leaves=leaves,
               algorithm=(algorithms.DENSE.name if options.is_low_rank  # its other leaves
                          else options.algorithm),
               fusion=options.fusion, planner=planner)

  def buckets(self, grads: Sequence[jax.Array], num_devices: int
              ) -> list[tuple[list[int], Bucket]]:
    """The buckets of ``grads`` with their leaf positions, empty leaves left out.

    Leaves that differ across other mesh axes (shards of a parameter split
    over ``"model"``) never share a bucket with leaves that do not (a
    parameter replicated over it): a replicated leaf then gets the same
    update on every device of those axes.
    """
    nonempty = [i for i, grad in enumerate(grads) if grad.size > 0]
    groups = [[nonempty[j] for j in group] for group in
              grouped_by_varying_axes([grads[i] for i in nonempty])]
    return [([live[j] for j in bucket.leaves], bucket)
            for live in groups
            for bucket in self._plan([grads[i].size for i in live], num_devices)]

  def _plan(self, sizes: Sequence[int], num_devices: int) -> list[Bucket]:
    """The buckets for leaves of ``sizes``, as the cost model or ``fusion`` sets them."""
    model = StepModel(tuple(sizes), num_devices, self.options.density, self.planner)
    _, planned = (model.best_layout(self.algorithm) if self.fusion == "auto"
                  else (self.fusion, model.layout(self.algorithm, self.fusion)))
    return [bucket.bucket for bucket in planned]

  def wire_limit(self, dtypes: Sequence[Any]) -> float | None:
    """The largest magnitude a sparse bucket of ``dtypes`` may send, or None.

    What a device sends must fit the values' wire dtype (``value_dtype``:
    float16 ends at 65,504, float8_e4m3fn at 448) and, once averaged, the
    leaves' own dtype (a float16 parameter's mean update). Error feedback's
    bursts, many steps' gradients summed, can exceed both; they are clipped
    to this limit and the excess stays in the residual.
    """
    value_dtype = self.options.value_dtype
    wire = [*dtypes, *([value_dtype] if value_dtype is not None else [])]
    limit = min(float(jnp.finfo(dtype).max) for dtype in wire)
    return None if limit >= float(jnp.finfo(jnp.float32).max) else limit


def describe(buckets: Sequence[Bucket], density: float, low_rank: Sequence[int] = (),
             rank: int | None = None) -> str:
  """What one exchange sends, form by form: entries and buckets.

  Args:
    buckets: the step's buckets.
    density: the fraction a top-k sends.
    low_rank: the sizes of the leaves sent as PowerSGD's products.
    rank: their rank.

  Example:
    >>> describe([Bucket((0,), "quantized_8_8_fine", 5120), Bucket((1, 2), "dense", 260)], 0.01)
    '5,120 entries in quantized_8_8_fine (1 bucket), 260 dense (1 bucket)'
    >>> describe([Bucket((0,), "topka2a", 5120), Bucket((1,), "topka2a", 512)], 0.01)
    'the top 1% of 5,632 entries by topka2a (2 buckets)'
    >>> describe([], 0.01, low_rank=(4096, 1024), rank=4)
    '5,120 entries as rank-4 products (powersgd, 2 leaves)'
  """
  entries: dict[str, int] = {}
  counts: dict[str, int] = {}
  for bucket in buckets:
    entries[bucket.algorithm] = entries.get(bucket.algorithm, 0) + bucket.size
    counts[bucket.algorithm] = counts.get(bucket.algorithm, 0) + 1

  def form(name: str) -> str:
    many = f"({counts[name]} bucket{'s' if counts[name] > 1 else ''})"
    if name == algorithms.DENSE.name:
      return f"{entries[name]:,} dense {many}"
    algorithm = algorithms.ALGORITHMS[name]
    if algorithm.sparse and not algorithm.quantizes:
      return f"the top {100 * density:g}% of {entries[name]:,} entries by {name} {many}"
    return f"{entries[name]:,} entries in {name} {many}"

  parts = [form(name) for name in sorted(entries, key=lambda name: -entries[name])]
  if low_rank:
    parts.insert(0, f"{sum(low_rank):,} entries as rank-{rank} products (powersgd, "
                    f"{len(low_rank)} {'leaves' if len(low_rank) > 1 else 'leaf'})")
  return ", ".join(parts) or "nothing"


def say_once(description: str) -> None:
  """Says what the exchange sends, once per distinct plan in this process.

  An INFO line on the ``topka2a_jax`` logger (``logging.basicConfig(level=
  logging.INFO)`` shows it; :func:`topka2a_jax.comm_report` reads the bytes
  from the compiled step); said when the step is traced (its first call, or
  ``step.lower``), not at every step. WARNING is for likely mistakes.
  """
  if description in _SAID:
    return
  _SAID.add(description)
  _LOG.info("topka2a_jax: each exchange sends %s. (Said once per plan on the "
               "'topka2a_jax' logger.)", description)
