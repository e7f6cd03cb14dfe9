"""Compressing the optimizer's step: the optimizer runs per device, its updates are exchanged.

``optax.chain(topka2a(density), optax.adam(lr))`` sparsifies the raw
gradient: error feedback then hands Adam each entry as a rare burst, the sum
of many steps' gradients, which its moments were not made for (its first
moment keeps pushing an entry for about ``1 / (1 - b1)`` steps after a
burst while the entry's newer gradients wait in the residual, and its
second moment sees zeros between bursts). :func:`compress_updates` moves the
exchange after the optimizer instead:

1. every device runs ``inner`` (Adam, momentum, ...) on its own gradient,
   with its own copy of ``inner``'s state;
2. the updates go through an exchange of :func:`topka2a_jax.topka2a` with
   error feedback: by default every entry's sign and one scale per chunk,
   the owners' means back in 4 bits (``"onebit_4"``), or, given a density,
   the top-k; what a device does not
   send of its update waits in its residual;
3. the mean of what was sent is the step every device applies, identical
   everywhere, so the parameters stay replicated.

So each entry's step keeps the scale the optimizer gave it, whenever it
arrives. ``inner``'s state differs from device to device: it is laid out per
device, one copy per data index along a new leading dimension
(:class:`topka2a_jax.CompressedUpdatesState`). Restored onto another number of devices
(:func:`topka2a_jax.restore`), every new device starts from the mean of the
saved copies, and the residuals keep what they owe the parameters (their
sum over devices divided by the number of devices).

Why the sign by default: Adam's step has about the same size on every entry
that moves, so a top-k of it delays nearly all of them (for up to a hundred
steps at 1%), the more so the cleaner the gradient; a sign sends every entry
every step and error feedback corrects its size over the next ones.

With a density and ``"auto"``, the planner takes only exchanges whose mean
holds every device's whole selection: TopKA2A-sparse's owners hold back part of each
summed shard, which would then arrive later as a burst of steps already
normalised by the optimizer.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> tx = compress_updates(optax.adam(1e-3), mesh=mesh)  # signs, 4-bit means back
  >>> opt_state = tx.init({"w": jnp.zeros((64, 32))})
  >>> opt_state.inner[0].mu["w"].shape  # one (64, 32) moment per device
  (8, 64, 32)

References:
  Lin, Han, Mao, Wang, Dally. "Deep Gradient Compression" (momentum
  correction: compress what the optimizer accumulated). ICLR 2018.

  Tang et al. "1-bit Adam: Communication Efficient Large-Scale Training with
  Adam's Convergence Speed" (compress after the optimizer's moments, with
  error feedback). ICML 2021.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax

from topka2a_jax._src.arguments import checked_optimizer, keywords_after_inner
from topka2a_jax._src.axis import (
  as_varying,
  bound_axis_size,
  is_bound,
  per_device_blocks,
)
from topka2a_jax._src.collectives.algorithms import AUTO, ONEBIT_4
from topka2a_jax._src.options import Options
from topka2a_jax._src.states import CompressedUpdatesState
from topka2a_jax._src.transforms.exchange_state import (
  checked_residuals,
  init_state,
  layout_mesh,
  update_state,
)
from topka2a_jax._src.transforms.exchange_step import held_where
from topka2a_jax._src.transforms.extra_args import NONFINITE, PARAM_SPECS
from topka2a_jax._src.transforms.leaves import check_per_device, given_specs, leaves_of
from topka2a_jax._src.transforms.marks import marked
from topka2a_jax._src.transforms.nonfinite import nonfinite_on_any_device
from topka2a_jax._src.transforms.per_device import (
  per_device_state,
  warn_if_a_zero_step_is_not_finite,
)
from topka2a_jax._src.transforms.signatures import (
  CompressUpdatesOptions,
  Unpack,
  refuse_options,
  takes_options,
)

DEFAULT_ALGORITHM = ONEBIT_4.name
"""What ``compress_updates(inner)`` sends without a density: every entry's
sign, the owners' means back in 4 bits. Chosen on the link benchmark's
training task against the top-k of the step and the signs with 8 bits back
(the training evidence page)."""


@keywords_after_inner("density")
@takes_options(CompressUpdatesOptions, defaults={"algorithm": None}, docs={
    "algorithm": (
        "by default ``\"onebit_4\"`` without a density (every entry's sign to its "
        "shard's owner, the owners' means back in 4 bits; 1-bit Adam's exchange) and "
        "``\"auto\"`` with one (each bucket's top-k by the cheapest exchange under the "
        "cost model among those whose mean holds every device's whole selection: "
        "TopKA2A, TopkA, dense). Or any name of "
        ":data:`topka2a_jax.collectives.ALGORITHMS`, or ``\"powersgd\"`` (see "
        ":func:`topka2a_jax.topka2a`)."),
    "skip_nonfinite": (
        "a non-finite gradient on any device skips the step everywhere, leaving "
        "``inner``'s state as it was on every device."),
})
def compress_updates(inner: optax.GradientTransformation, *, density: float | None = None,
                     **options: Unpack[CompressUpdatesOptions]
                     ) -> optax.GradientTransformationExtraArgs:
  """``inner`` run on every device's own gradient, its updates averaged sparsely.

  Use it as the whole optimizer of a data-parallel step (it replaces
  ``optax.chain(topka2a(density), inner)``): each device runs ``inner`` on
  its gradient, and the updates, not the gradients, go through the sparse
  exchange of :func:`topka2a_jax.topka2a` with error feedback. The updates
  it returns are the mean of what was sent, bitwise identical on every
  device; with Adam they keep pace with dense training where sparsifying
  the gradient falls behind (the training evidence page).

  Args:
    inner: any optax transform, with its schedules, masks and weight decay
      (``optax.adam(1e-3)``, ``optax.adamw(schedule, weight_decay=...)``,
      ``optax.inject_hyperparams(optax.adam)(...)``); it must not hold an
      exchange of its own.
    density: fraction of every sparse bucket of updates each device sends
      as its top-k, in (0, 1]; 1.0 applies the mean of the devices'
      updates. Without it (the default) every entry goes as its sign
      (:data:`DEFAULT_ALGORITHM`), which no density shapes.
    **options: the options of :func:`topka2a_jax.topka2a`, below.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`topka2a_jax.CompressedUpdatesState`.

  Raises:
    ValueError, TypeError: a bad option (as :func:`topka2a_jax.topka2a`); at
      ``init``, an inner transform that holds an exchange.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> tx = compress_updates(optax.adam(1e-2), density=0.01, mesh=mesh)
    >>> params = {"w": jnp.ones((64, 4))}
    >>> step = topka2a_jax.train_step(lambda p, x: jnp.sum(x @ p["w"]), tx, mesh)
    >>> params, opt_state, loss = step(params, tx.init(params), jnp.ones((8, 64)))
    >>> int(opt_state.exchange.count)
    1
  """
  refuse_options("compress_updates", options, {
      "follows": "it runs inner on every device itself, and the exchange sends inner's steps"})
  if options.get("algorithm") is None:
    options["algorithm"] = DEFAULT_ALGORITHM if density is None else AUTO
  checked = dataclasses.replace(Options.create(density, caller="compress_updates", **options),
                                whole_selection=True)
  inner = optax.with_extra_args_support(checked_optimizer("inner", inner))

  def init_fn(params: optax.Params) -> CompressedUpdatesState:
    exchange = init_state(checked, params)
    state = CompressedUpdatesState(exchange, per_device_state(
        checked, inner.init, params, layout_mesh(checked, jax.tree.leaves(params)),
        "compress_updates"))
    if not is_bound(checked.axis_name):
      warn_if_a_zero_step_is_not_finite(inner, params, "compress_updates")
    return state

  def update_fn(updates: optax.Updates, state: CompressedUpdatesState,
                params: optax.Params | None = None,
                **extra_args: Any) -> tuple[optax.Updates, CompressedUpdatesState]:
    return _update(checked, inner, updates, state, params, extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, marked(update_fn, checked.axis_name))


def _update(options: Options, inner: optax.GradientTransformationExtraArgs,
            updates: optax.Updates, state: CompressedUpdatesState,
            params: optax.Params | None, extra_args: dict[str, Any]):
  """One device's step: ``inner`` on its own gradient, then the sparse exchange."""
  bound_axis_size(options.axis_name)  # refuses outside shard_map, naming the fix
  if not isinstance(state, CompressedUpdatesState):
    raise TypeError(f"expected the CompressedUpdatesState made by this transform's "
                    f"init, got {type(state).__name__}")
  tree = leaves_of(updates)
  paths, grads = tree.paths, tree.values
  check_per_device(grads, paths, options.axis_name)
  # A state made for other parameters is refused, naming the leaf, before
  # the inner step would meet it.
  checked_residuals(options, tree.structure, state.exchange, grads, paths,
                    given_specs(tree.structure, extra_args.get(PARAM_SPECS)))
  decided = extra_args.get(NONFINITE)  # by skip_nonfinite around this transform
  own = jax.tree.map(lambda x: x[0], state.inner)

  steps, new_own = inner.update(updates, own, params, **extra_args)
  new_own = jax.tree.map(lambda x: as_varying(x, options.axis_name), new_own)
  if decided is not None or options.skip_nonfinite:
    # One check, after the inner step, of the steps and of the gradients
    # (unless skip_nonfinite around this transform has checked them): finite
    # gradients can still give a non-finite step (Adam in float16, whose eps
    # is 0 there), which is skipped too, inner state and all.
    checked = leaves_of(steps).values + ([] if decided is not None else grads)
    bad = nonfinite_on_any_device(checked, options.axis_name)
    if decided is not None:
      bad = bad | decided
    extra_args = {**extra_args, NONFINITE: bad}  # the exchange takes the same decision
  exchanged = update_state(options, steps, state.exchange, extra_args)
  # Wherever the exchange skips (this decision, or means that overflow),
  # the inner optimizer's state stays as it was.
  own = held_where(exchanged.skipped, own, new_own)
  return exchanged.means, CompressedUpdatesState(
      exchanged.state, per_device_blocks(own, options.axis_name))
