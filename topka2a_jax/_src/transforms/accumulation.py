"""Gradient accumulation over calls: one small batch a call, one exchange every ``every`` calls.

``train_step(..., micro_batches=N)`` accumulates within one call, so the
whole accumulated batch must be in memory at once. A data loader that
yields one small batch at a time needs the accumulation to live in the
optimizer's state, as ``optax.MultiSteps`` keeps it. ``MultiSteps`` cannot
wrap an exchange: it would add up each device's own gradients in a state
laid out as if it were the same on every device. :func:`accumulate_gradients`
keeps that sum per device instead:

1. every call adds the device's gradient to its own running sum (float32 at
   least) and returns zero updates, leaving the wrapped optimizer's state
   (exchange, residuals, Adam's moments, its step count) untouched;
2. on the ``every``-th call the mean of the sums goes through the wrapped
   optimizer once: one exchange, of the bytes one call of the whole batch
   sends, and one step of the optimizer after it.

So ``every`` calls with a quarter of the batch each give the parameters of
one call with the whole batch, to float32 rounding.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> tx = accumulate_gradients(
  ...     optax.chain(topka2a_jax.topka2a(mesh=mesh), optax.adam(1e-2)), every=4)
  >>> params = {"w": jnp.zeros((64, 4))}
  >>> step = topka2a_jax.train_step(lambda p, x: jnp.mean((x @ p["w"] - 1) ** 2), tx, mesh)
  >>> state = tx.init(params)
  >>> for _ in range(4):  # one quarter of the batch each call
  ...   params, state, loss = step(params, state, jnp.ones((8, 64)))
  >>> int(state.step), bool(params["w"][0, 0] > 0)  # one exchange, one Adam step
  (0, True)
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from topka2a_jax._src.arguments import (
  INT32_MAX,
  checked_count,
  checked_optimizer,
  keywords_after_inner,
)
from topka2a_jax._src.axis import (
  DataAxis,
  as_varying,
  bound_axis_size,
  is_bound,
  per_device_blocks,
)
from topka2a_jax._src.caller import user_stacklevel
from topka2a_jax._src.options import DEFAULT_AXIS, Options
from topka2a_jax._src.states import AccumulatedGradientsState, holds_exchange
from topka2a_jax._src.transforms.exchange_state import layout_mesh
from topka2a_jax._src.transforms.following import follower, refuse_followers
from topka2a_jax._src.transforms.leaves import check_per_device, leaves_of
from topka2a_jax._src.transforms.marks import exchange_axes
from topka2a_jax._src.transforms.per_device import (
  counters,
  per_device_state,
  zeros_in_float32,
)

_AROUND = ("Wrap the whole optimizer in it, exchange first: accumulate_gradients("
           "optax.chain(topka2a_jax.topka2a(...), optax.adam(...)), every=N).")


@keywords_after_inner("every", renamed={"tx": "inner"})
def accumulate_gradients(inner: optax.GradientTransformation, *, every: int,
                         axis_name: Hashable | None = None
                         ) -> optax.GradientTransformationExtraArgs:
  """Adds up ``every`` calls' gradients on each device, then runs ``inner`` once on their mean.

  Use it around the whole optimizer, exchange included, where you would
  have used ``optax.MultiSteps``: ``accumulate_gradients(optax.chain(
  topka2a(...), optax.adam(lr)), every=4)``. A call before the ``every``-th
  returns zero updates and changes nothing but the sum; the ``every``-th
  runs ``inner`` on the mean of the ``every`` gradients, which exchanges it
  once. A non-finite gradient in any of the calls makes the mean
  non-finite, so the exchange skips that one accumulated step
  (``skip_nonfinite``, on by default), and the sums start again. The data
  axis is the exchange's, read from ``inner``.

  Args:
    inner: the optimizer, holding one of the library's exchanges
      (:func:`topka2a_jax.topka2a`, :func:`topka2a_jax.compress_updates`,
      :func:`topka2a_jax.sharded_optimizer` or :func:`topka2a_jax.local_steps`).
    every: calls accumulated per step of ``inner``, at least 1.
    axis_name: deprecated: the axis is read from the exchange in ``inner``;
      a different one is refused.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`topka2a_jax.AccumulatedGradientsState`.

  Raises:
    TypeError, ValueError: ``inner`` not an optax transform, ``every`` not an
      int of at least 1, exchanges over several axes in ``inner``; at
      ``init``, an ``inner`` that holds no exchange (each device would step
      alone), or an exchange on no mesh.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> tx = accumulate_gradients(
    ...     optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh), optax.sgd(0.1)), every=8)
  """
  tx = optax.with_extra_args_support(checked_optimizer("inner", inner))
  every = checked_count("every", every, 1, INT32_MAX)
  axes = exchange_axes(inner)
  if len(axes) > 1:
    raise ValueError(f"accumulate_gradients wraps exchanges over several data axes "
                     f"({', '.join(map(repr, sorted(map(str, axes))))}); one optimizer "
                     "averages over one")
  if axis_name is not None:
    warnings.warn("accumulate_gradients(..., axis_name=...) is no longer needed: it reads "
                  "the axis from the exchange it wraps; leave axis_name out (it goes in "
                  "the next version)", DeprecationWarning, stacklevel=user_stacklevel())
    if axes and DataAxis.parse(axis_name).name != DataAxis.parse(next(iter(axes))).name:
      raise ValueError(f"accumulate_gradients(..., axis_name={axis_name!r}) wraps an "
                       f"exchange over {next(iter(axes))!r}; leave axis_name out")
  axis = next(iter(axes)) if axes else (DEFAULT_AXIS.name if axis_name is None else axis_name)
  options = Options.create(None, algorithm="dense", axis_name=axis)

  def init_fn(params: optax.Params) -> AccumulatedGradientsState:
    refuse_followers(follower(init_fn), "accumulate_gradients(...)", _AROUND)
    inner = tx.init(params)
    nested = lambda node: isinstance(node, AccumulatedGradientsState)
    if any(map(nested, jax.tree.leaves(inner, is_leaf=nested))):
      raise ValueError(
          "accumulate_gradients wraps another accumulate_gradients: the calls would be "
          "counted twice, each window inside the other's. Use one, with every= the "
          "product of the two")
    if not holds_exchange(inner):
      raise ValueError(
          "accumulate_gradients wraps an optimizer that holds no topka2a exchange, "
          "so each device would step on its own gradients alone. Wrap the whole "
          "optimizer, exchange first: accumulate_gradients(optax.chain("
          "topka2a_jax.topka2a(...), optax.adam(...)), every=N).")
    leaves = jax.tree.leaves(params)
    on = None
    if not is_bound(options.axis_name):
      on = layout_mesh(options, jax.tree.leaves(inner) + leaves)
      if on is None:
        raise ValueError(
            f"accumulate_gradients found no mesh with the data axis {axis!r} "
            "to lay each device's sum out on. Give the exchange its mesh, "
            "topka2a(..., mesh=mesh), or make the state with "
            "topka2a_jax.init(tx, params, mesh).")
    sums = per_device_state(options, zeros_in_float32, params, on, "accumulate_gradients")
    step, length = counters(every, on, leaves)
    return AccumulatedGradientsState(inner, sums, step, length)

  def update_fn(updates: optax.Updates, state: AccumulatedGradientsState,
                params: optax.Params | None = None,
                **extra_args: Any) -> tuple[optax.Updates, AccumulatedGradientsState]:
    refuse_followers(follower(update_fn), "accumulate_gradients(...)", _AROUND)
    return _update(tx, every, options.axis_name, updates, state, params, extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _update(tx: optax.GradientTransformationExtraArgs, every: int, axis: Hashable,
            grads: optax.Updates, state: AccumulatedGradientsState,
            params: optax.Params | None, extra_args: dict[str, Any]
            ) -> tuple[optax.Updates, AccumulatedGradientsState]:
  """One device's call: add its gradient; on the ``every``-th, ``tx`` on the mean."""
  bound_axis_size(axis)  # refuses outside shard_map, naming the fix
  if not isinstance(state, AccumulatedGradientsState):
    raise TypeError("expected the AccumulatedGradientsState made by "
                    f"accumulate_gradients' init, got {type(state).__name__}")
  tree = leaves_of(grads)
  check_per_device(tree.values, tree.paths, axis)
  sums = jax.tree.map(lambda s, g: as_varying(s[0] + g.astype(s.dtype), axis),
                      state.grads, grads)
  step = state.step + 1

  def accumulated(sums: Any) -> tuple[Any, ...]:
    mean = jax.tree.map(lambda s, g: (s / every).astype(g.dtype), sums, grads)
    updates, inner = tx.update(mean, state.inner, params, **extra_args)
    restart = jax.tree.map(lambda s: as_varying(jnp.zeros_like(s), axis), sums)
    return updates, inner, restart, jnp.zeros_like(step)

  def adding(sums: Any) -> tuple[Any, ...]:
    # What the wrapped optimizer returns, zero.
    zeros = jax.tree.map(lambda u: jnp.zeros(u.shape, u.dtype),
                         jax.eval_shape(lambda: accumulated(sums)[0]))
    return zeros, state.inner, sums, step

  if every == 1:
    updates, inner, sums, step = accumulated(sums)
  else:
    updates, inner, sums, step = lax.cond(step >= every, accumulated, adding, sums)
  return updates, AccumulatedGradientsState(inner, per_device_blocks(sums, axis), step,
                                            state.every)
