"""Skipping steps whose gradients hold a NaN or an infinity, on every device alike.

One device's overflow must not reach the residuals (it would come back at
every later step) nor make replicas disagree. The test is global: the step is
bad when any device's gradient is non-finite, decided by one ``lax.pmax`` of a
flag, so every device decides alike.

:func:`topka2a_jax.topka2a` guards its own state this way by default: on a
bad step its exchange runs with nothing sent, so its residuals stay as they
were without a branch (``_src/transforms/exchange_step.py``). Optimizers, whose
state would move on zero updates, are switched by :func:`applied_or_skipped`.
:func:`skip_nonfinite` wraps a whole optax chain, so that a stateful optimizer
after it (momentum, Adam) skips the step too; it hands its decision to the
chain as the extra argument :data:`extra_args.NONFINITE`, so a ``topka2a`` inside takes
it instead of checking again.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> tx = skip_nonfinite(optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh),
  ...                                 optax.adam(1e-3)))
  >>> state = tx.init({"w": jnp.zeros(4)})
  >>> int(state.nonfinite_steps)
  0
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from topka2a_jax._src import layout
from topka2a_jax._src.arguments import checked_optimizer, keywords_after_inner
from topka2a_jax._src.axis import (
  DataAxis,
  bound_axis_size,
  is_varying,
  tracks_varying_axes,
  varying_axes,
)
from topka2a_jax._src.transforms.extra_args import NONFINITE


def _holds_nonfinite(leaf: jax.Array, devices: int) -> jax.Array:
  """Whether ``leaf`` holds a NaN, an infinity, or a magnitude whose sum over ``devices`` overflows.

  The largest magnitude, plus a sum of every entry times zero: the sum is
  zero, or NaN where an entry is NaN or infinite. The maximum alone is not
  enough: XLA's CPU backend reduces float32 arrays of 4096 entries or more
  in vectorized pieces that drop NaN (one NaN gives the largest of the rest,
  an all-NaN array ``-inf``). Reading NaN as infinity inside the maximum
  stops its vectorization there (several times a read of the leaf), and
  ``jnp.any(~jnp.isfinite(leaf))`` writes a flag per entry first; two plain
  reductions read the leaf at about a read each. An entry above the largest
  float32 (float64 for float64 leaves) over ``devices`` could make the
  exchange's sum infinite from finite gradients; such a step counts as bad
  too.
  """
  wide = jnp.promote_types(jnp.float32, leaf.dtype)  # the sum's dtype, and the limit's
  largest = jnp.max(jnp.abs(leaf)).astype(wide) + jnp.sum(leaf * 0).astype(wide)
  return ~(largest <= jnp.asarray(float(jnp.finfo(wide).max) / devices, wide))


def nonfinite_on_any_device(tree: Any, axis_name: Hashable) -> jax.Array:
  """Whether any device's ``tree`` holds a NaN or an infinity (or an entry whose sum overflows).

  Args:
    tree: a pytree of arrays, per device, inside ``jax.shard_map``.
    axis_name: the mesh axis to agree over.

  Returns:
    A boolean scalar, the same on every device of the axis and of every other
    axis the gradients vary along.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> grads = jnp.ones(8).at[5].set(jnp.nan)  # device 5's gradient
    >>> jax.shard_map(lambda g: nonfinite_on_any_device(g, "data"), mesh=mesh,
    ...               in_specs=P("data"), out_specs=P())(
    ...     jax.device_put(grads, NamedSharding(mesh, P("data"))))
    Array(True, dtype=bool)
  """
  devices = bound_axis_size(axis_name)
  local = jnp.zeros((), jnp.int32)
  for leaf in jax.tree.leaves(tree):
    if leaf.size:
      local = jnp.maximum(local, _holds_nonfinite(leaf, devices).astype(jnp.int32))
  if tracks_varying_axes(axis_name) and not is_varying(local, axis_name):
    local = lax.pcast(local, axis_name, to="varying")
  # Over every axis the gradients vary along (on a 2-D mesh, the model axis
  # too), so that all shards of the model skip together.
  names = DataAxis.parse(axis_name).names
  axes = (*names, *sorted(varying_axes(local) - set(names), key=str))
  return lax.pmax(local, axes) > 0


def step_is_bad(decided: jax.Array | None, tree: Any, axis_name: Hashable,
                check: bool) -> jax.Array | None:
  """Whether this step is skipped: the decision given, else this transform's own.

  Args:
    decided: :func:`skip_nonfinite`'s decision, handed down as :data:`extra_args.NONFINITE`,
      or None.
    tree: this device's gradients.
    axis_name: the data axis.
    check: whether the transform checks by itself (its ``skip_nonfinite``).

  Returns:
    A boolean scalar, the same everywhere, or None when nothing is checked.
  """
  if decided is None and check:
    return nonfinite_on_any_device(tree, axis_name)
  return decided


def counted(count: jax.Array, happened: jax.Array) -> jax.Array:
  """``count`` plus one where ``happened``, held at its largest value, never wrapped.

  Example:
    >>> int(counted(jnp.int32(2**31 - 1), jnp.bool_(True)))
    2147483647
  """
  return jnp.where(happened, optax.safe_increment(count), count)


def applied_or_skipped(bad: jax.Array | None, applied: Any, skipped: Any, *args: Any) -> Any:
  """``applied(*args)``, or ``skipped(*args)`` where ``bad``, chosen at run time.

  ``bad`` is the same on every device, so every device takes the same branch;
  with None there is no switch at all.

  Example:
    >>> applied_or_skipped(jnp.bool_(True), lambda x: x + 1, lambda x: x, 1)
    Array(1, dtype=int32, weak_type=True)
  """
  if bad is None:
    return applied(*args)
  return lax.cond(bad, skipped, applied, *args)


class SkipNonFiniteState(NamedTuple):
  """State of :func:`skip_nonfinite`.

  Attributes:
    inner_state: the wrapped optimizer's state.
    nonfinite_steps: steps skipped so far (int32, replicated).
  """

  inner_state: optax.OptState
  nonfinite_steps: jax.Array


@keywords_after_inner("axis_name")
def skip_nonfinite(
    inner: optax.GradientTransformation, *, axis_name: Hashable = "data"
) -> optax.GradientTransformationExtraArgs:
  """Skips the whole step when any device's gradient is non-finite.

  Like ``optax.apply_if_finite``, but the decision is taken across the mesh
  axis, so replicas never diverge: on a bad step every device returns zero
  updates and keeps the wrapped state exactly as it was.

  Args:
    inner: the optimizer to guard, typically
      ``optax.chain(topka2a(...), optax.adam(...))``.
    axis_name: the data-parallel mesh axis (the update runs inside
      ``jax.shard_map`` over it).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`SkipNonFiniteState`.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> tx = skip_nonfinite(optax.chain(topka2a_jax.topka2a(0.01), optax.adam(1e-3)))
    >>> opt_state = topka2a_jax.init(tx, {"w": jnp.zeros(4)}, mesh)
  """
  inner = optax.with_extra_args_support(checked_optimizer("inner", inner))

  def init_fn(params: optax.Params) -> SkipNonFiniteState:
    state = inner.init(params)
    layout.check_laid_out_over(state, DataAxis.parse(axis_name), "skip_nonfinite")
    return SkipNonFiniteState(state, jnp.zeros((), jnp.int32))

  def update_fn(
      updates: optax.Updates,
      state: SkipNonFiniteState,
      params: optax.Params | None = None,
      **extra_args: Any,
  ) -> tuple[optax.Updates, SkipNonFiniteState]:
    bad = nonfinite_on_any_device(updates, axis_name)
    new_updates, new_inner = inner.update(
        updates, state.inner_state, params, **{**extra_args, NONFINITE: bad})
    keep = lambda old, new: jnp.where(bad, old, new)
    return (
        jax.tree.map(lambda u: jnp.where(bad, jnp.zeros_like(u), u), new_updates),
        SkipNonFiniteState(
            jax.tree.map(keep, state.inner_state, new_inner),
            counted(state.nonfinite_steps, bad)),
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
