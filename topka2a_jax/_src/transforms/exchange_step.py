"""One device's step of the exchange, the one every transform runs: its run-time switches.

Called inside ``jax.shard_map`` on this device's gradient leaves (its shards,
where the parameters are sharded over other mesh axes) and residuals, with
the trace's :class:`ExchangePlan <exchange_plan.ExchangePlan>`:

* the plan fuses the leaves into buckets (``planner/buckets.py``), planned by
  the cost model (``planner/fusion.py``), once per step;
* ``bucket_exchange.py`` adds every leaf's residual (error feedback),
  packs each bucket into one flat buffer, runs its collective
  (``collectives/exchanges.py``) and returns the means and what stays
  behind;
* :func:`step` wraps that in the run-time switches of the one compiled
  step: a step with a non-finite gradient anywhere is skipped everywhere
  (``nonfinite.py``), so is one whose means overflow, and the first
  ``warmup_steps`` go dense. It takes the state as a :class:`Carried`
  record and returns a :class:`Stepped` one, which says whether it skipped.

Example:
  >>> from topka2a_jax._src.options import Options
  >>> from topka2a_jax._src.transforms.exchange_plan import ExchangePlan
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> plan = ExchangePlan.create(Options.create(0.5, min_size=0), ["w"], [(4,)])
  >>> def one_step(grad, residual):
  ...   zero = jnp.zeros((), jnp.int32)
  ...   stepped = step(plan, [grad[0]], Carried([residual[0]], None, zero, zero), bad=None)
  ...   return stepped.means[0], stepped.carried.residuals[0][None], stepped.carried.count
  >>> grads, zeros = jax.device_put(
  ...     (jnp.arange(32.0).reshape(8, 4), jnp.zeros((8, 4))),
  ...     NamedSharding(mesh, P("data")))
  >>> mean, residuals, count = jax.shard_map(
  ...     one_step, mesh=mesh, in_specs=P("data"),
  ...     out_specs=(P(), P("data"), P()))(grads, zeros)
  >>> bool(jnp.allclose(8 * mean + residuals.sum(0), grads.sum(0))), int(count)
  (True, 1)
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from topka2a_jax._src.axis import bound_axis_size, varying_axes
from topka2a_jax._src.transforms.bucket_exchange import (
  ENDS,
  MEANS,
  OWNERS,
  Sent,
  exchange_low_rank,
  low_rank_positions,
  zeros_like_mean,
)
from topka2a_jax._src.transforms.exchange_plan import describe, say_once
from topka2a_jax._src.transforms.nonfinite import (
  applied_or_skipped,
  counted,
  step_is_bad,
)

if TYPE_CHECKING:
  from topka2a_jax._src.transforms.exchange_plan import ExchangePlan


def _exchange(plan: ExchangePlan, buckets: list, grads: list, residuals: list,
              factors: list, sparse: bool, end: str = MEANS) -> Sent:
  """The buckets' exchange for ``end`` (:data:`ENDS`), or PowerSGD's with factors."""
  if all(isinstance(factor, optax.MaskedNode) for factor in factors):
    return ENDS[end](plan, buckets, grads, residuals, sparse)._replace(factors=factors)
  return exchange_low_rank(plan, buckets, grads, residuals, factors, sparse)


def dense_while_warming_up(warmup_steps: int, count: jax.Array, run: Any,
                           *args: Any) -> Any:
  """``run(*args, sparse=False)`` while ``count < warmup_steps``, else ``sparse=True``.

  A run-time switch (``lax.cond``): the compiled step holds both branches.
  """
  if warmup_steps == 0:
    return run(*args, sparse=True)
  return jax.lax.cond(count < warmup_steps,
                      functools.partial(run, sparse=False),
                      functools.partial(run, sparse=True), *args)


def _applied(plan: ExchangePlan, buckets: list, end: str, grads: list, residuals: list,
             factors: list, count: jax.Array) -> tuple[list, list, list, jax.Array]:
  """The exchange, dense while ``count < warmup_steps``; one more applied step."""
  run = functools.partial(_exchange, plan, buckets, end=end)
  sent = dense_while_warming_up(plan.options.warmup_steps, count, run, grads, residuals,
                                factors)
  return sent.means, sent.residuals, sent.factors, optax.safe_increment(count)


def _applied_or_held(plan: ExchangePlan, buckets: list, end: str, bad: jax.Array,
                     grads: list, residuals: list, count: jax.Array
                     ) -> tuple[list, list, jax.Array]:
  """The exchange, or a skipped step where ``bad``, without a branch.

  On a bad step every device's gradient counts as zero and the collectives
  send nothing (``send=False``), so the means are zero and every residual
  comes back as it was; the count stays. The selection and the collectives
  run either way. A ``lax.cond`` between the two steps would keep each
  branch's outputs apart and copy every residual out of it on every step,
  a full pass over the model that this avoids, and the residuals are
  updated in place.
  """
  live = [jnp.where(bad, jnp.zeros_like(g), g) for g in grads]
  run = functools.partial(ENDS[end], plan, buckets, send=jnp.logical_not(bad))
  sent = dense_while_warming_up(plan.options.warmup_steps, count, run, live, residuals)
  return sent.means, sent.residuals, counted(count, jnp.logical_not(bad))


def _skipped(plan: ExchangePlan, buckets: list, grads: list, residuals: list,
             factors: list, count: jax.Array) -> tuple[list, list, list, jax.Array]:
  """Zero updates; residuals, factors and count as they were."""
  del buckets
  return [zeros_like_mean(g, plan.options.axis) for g in grads], residuals, factors, count


def may_overflow(plan: ExchangePlan, grads: Sequence[jax.Array]) -> bool:
  """Whether a step's means can come out non-finite from finite gradients.

  Leaves or wire values narrower than float32 can
  (:meth:`ExchangePlan.wire_limit`), and so can the exchanges that send
  few-bit codes: their owners add ``P`` decoded shards, whose sum overflows
  from finite values near float32's largest.
  """
  return plan.quantizes or any(plan.wire_limit([g.dtype]) is not None for g in grads)


def overflowed(values: Sequence[jax.Array], over: Sequence[Hashable] = ()) -> jax.Array:
  """Whether any of ``values`` holds a NaN or an infinity, alike on every device.

  The step's exchange decides from its results this way when
  :func:`may_overflow`: the means, the same on every data device, or an
  owner phase's shards, which differ from device to device. The flag is
  reduced over ``over`` and over every axis the values vary along (pieces
  of the parameters over ``"model"``), so that every device skips together.

  Args:
    values: this device's arrays.
    over: the mesh axes the values differ along that the trace may not
      track (an owner phase's data axis).

  Returns:
    A boolean scalar, the same on every device.
  """
  broke = jnp.zeros((), bool)
  for value in values:
    if value.size:
      broke = broke | jnp.any(~jnp.isfinite(value))
  axes = (*over, *sorted(varying_axes(broke) - set(over), key=str))
  if axes:
    broke = jax.lax.pmax(broke.astype(jnp.int32), axes) > 0
  return broke


def held_where(broke: jax.Array, old: Any, new: Any) -> Any:
  """``old`` where ``broke``, else ``new``: a pytree of state kept through a skipped step."""
  return jax.tree.map(lambda o, m: jnp.where(broke, o, m), old, new)


class Carried(NamedTuple):
  """What the exchange carries on one device from a step to the next.

  Attributes:
    residuals: every leaf's residual (``optax.MaskedNode()`` where none is
      kept).
    factors: for ``algorithm="powersgd"``, every leaf's ``Q``
      (``optax.MaskedNode()`` where it goes dense); None otherwise.
    count: applied steps so far.
    nonfinite_steps: skipped steps so far (held at the int32 maximum).
  """

  residuals: list
  factors: list | None
  count: jax.Array
  nonfinite_steps: jax.Array


class Stepped(NamedTuple):
  """One step of the exchange on one device.

  Attributes:
    means: every leaf's whole mean, or this device's flat shard of it
      (:data:`OWNERS`); zeros where the step was skipped.
    carried: the :class:`Carried` state after the step.
    skipped: a boolean scalar, the same on every device: the step was
      skipped (a non-finite gradient, or means that overflowed) and
      ``carried`` is as it was but for ``nonfinite_steps``. False wherever
      nothing can skip it.
  """

  means: list
  carried: Carried
  skipped: jax.Array


def step(plan: ExchangePlan, grads: list, carried: Carried, bad: jax.Array | None,
         end: str = MEANS) -> Stepped:
  """One applied or skipped step of the transform on this device.

  The buckets are planned here, once for the step and every branch of it.
  Every exchange goes through it: :func:`topka2a_jax.topka2a`,
  :func:`topka2a_jax.compress_updates` and :func:`topka2a_jax.local_steps`
  end at the means (:data:`MEANS`), :func:`topka2a_jax.sharded_optimizer`
  at the owners' shards (:data:`OWNERS`), so the clip to the wire, the
  non-finite and overflow skips, warm-up and the residuals are the same for
  all of them.

  Args:
    plan: the trace's plan (:class:`ExchangePlan`).
    grads: this device's gradient leaves.
    carried: what the last step left (:class:`Carried`).
    bad: whether some device's gradient is non-finite, decided already by
      :func:`topka2a_jax.skip_nonfinite`; None to decide here (when
      ``plan.options.skip_nonfinite``). With a decision, a step whose means come
      out non-finite (an overflow, :func:`may_overflow`) is skipped too.
    end: :data:`MEANS`, or :data:`OWNERS` for each leaf's owned shard of
      its mean (a plan with ``fusion=1``, no PowerSGD).
  """
  residuals, factors, count, nonfinite_steps = carried
  num_devices = bound_axis_size(plan.options.axis.name)
  bad = step_is_bad(bad, grads, plan.options.axis.name, plan.options.skip_nonfinite)
  # PowerSGD's other leaves are bucketed alone: the low-rank ones go apart.
  low = [] if factors is None else low_rank_positions(factors)
  rest = [i for i in range(len(grads)) if i not in set(low)]
  buckets = plan.buckets([grads[i] for i in rest], num_devices)
  say_once(describe([bucket for _, bucket in buckets], plan.options.density,
                    [grads[i].size for i in low], plan.rank))
  if bad is not None and factors is None:
    means, new, new_count = _applied_or_held(plan, buckets, end, bad, grads, residuals,
                                             count)
    new_factors = None
  else:  # PowerSGD's factors move on zeros too: its skipped step is a branch
    factor_leaves = factors if factors is not None else [optax.MaskedNode()] * len(grads)
    means, new, new_factors, new_count = applied_or_skipped(
        bad, functools.partial(_applied, plan, buckets, end),
        functools.partial(_skipped, plan, buckets), grads, residuals, factor_leaves, count)
    if factors is None:
      new_factors = None
  if bad is None:
    return Stepped(means, Carried(new, new_factors, new_count, nonfinite_steps),
                   jnp.bool_(False))
  if not may_overflow(plan, grads):
    return Stepped(means, Carried(new, new_factors, new_count,
                                  counted(nonfinite_steps, bad)), bad)
  # The means may overflow from finite inputs. Whole, they are identical on
  # every data device; shards differ, and the flag is taken over the axis.
  broke = overflowed(means, over=plan.options.axis.names if end == OWNERS else ())
  means = [jnp.where(broke, jnp.zeros_like(m), m) for m in means]
  return Stepped(means, Carried(
      held_where(broke, residuals, new),
      new_factors if factors is None else held_where(broke, factors, new_factors),
      held_where(broke, count, new_count), counted(nonfinite_steps, bad | broke)),
      bad | broke)
