"""The optax transform: sparse mean of the gradients with error feedback.

``topka2a(density)`` goes first in an optax chain, inside the user's
``jax.shard_map`` data-parallel step. It replaces the dense ``lax.pmean`` of
the gradients:

1. per device, ``acc = grad + residual`` (error feedback);
2. the leaves of ``acc`` are fused into flat buckets (:mod:`.buckets`), small
   leaves apart, which go dense;
3. every bucket goes through its collective (:mod:`.collectives`), which
   returns the mean over the axis and what this device did not send;
4. ``residual = acc - sent`` is kept for the next step, so no gradient mass is
   lost, only delayed.

Around this, two run-time switches inside the one compiled step: a step whose
gradient holds a NaN or an infinity on any device is skipped on every device
(:mod:`.nonfinite`), and during the first ``warmup_steps`` every bucket goes
dense.

Example:
  >>> tx = optax.chain(topka2a(density=0.01), optax.adam(1e-3))
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from topka2a_jax import buckets
from topka2a_jax.axis import (
    bound_axis_size,
    is_varying,
    tracks_varying_axes,
    varying_axes,
)
from topka2a_jax.collectives import ALGORITHMS, get_selection
from topka2a_jax.cost import Network, get_network
from topka2a_jax.fusion import check_plan_options, step_model
from topka2a_jax.nonfinite import NONFINITE, nonfinite_on_any_device

DEFAULT_MIN_SIZE = 1024
"""Leaves with fewer elements go dense.

Biases and normalisation scales are this small in most models. They are a
tiny share of the bytes (a thousand such leaves of 1,000 floats are 4 MB a
step), their shard-wise selection would send nearly every entry anyway, and
keeping them exact is what users of gradient compression do to keep accuracy.
"""



class TopKA2AState(NamedTuple):
  """State of :func:`topka2a`.

  Attributes:
    residuals: per device, not replicated. Mirrors the gradient pytree: for
      every sparsified leaf, a flat buffer (float32, or float64 for float64
      leaves) of what this device has not sent yet; ``optax.MaskedNode()``
      for leaves that go dense, and for all leaves when
      ``error_feedback=False``.
    count: steps applied so far (int32, replicated); skipped steps do not
      count. ``warmup_steps`` compares against it.
    nonfinite_steps: steps skipped because some device's gradient held a NaN
      or an infinity (int32, replicated).
  """

  residuals: optax.Updates
  count: jax.Array
  nonfinite_steps: jax.Array


def _check_density(density: Any) -> float:
  if (
      not isinstance(density, numbers.Real)
      or isinstance(density, bool)
      or not math.isfinite(density)
      or not 0.0 < density <= 1.0
  ):
    raise ValueError(
        f"density must be a number in (0, 1], the fraction of gradient "
        f"entries each device sends; got {density!r}. For example "
        "density=0.01 sends 1%."
    )
  return float(density)


def _check_count(name: str, value: Any, minimum: int) -> int:
  if not isinstance(value, numbers.Integral) or isinstance(value, bool):
    raise TypeError(f"{name} must be an int, got {value!r}")
  if value < minimum:
    raise ValueError(f"{name} must be at least {minimum}, got {value}")
  return int(value)


def _check_options(
    density: Any,
    algorithm: Any,
    error_feedback: Any,
    min_size: Any,
    fusion: Any,
    backward_seconds: Any,
    axis_name: Any,
    warmup_steps: Any,
    skip_nonfinite: Any,
) -> tuple[float, int, int]:
  """Validates the constructor's arguments; returns the normalised numbers."""
  if fusion != "auto":
    _check_count("fusion", fusion, 1)
  check_plan_options(algorithm, fusion)
  for name, flag in (("error_feedback", error_feedback),
                     ("skip_nonfinite", skip_nonfinite)):
    if not isinstance(flag, bool):
      raise TypeError(f"{name} must be True or False, got {flag!r}")
  if not isinstance(axis_name, Hashable):
    raise TypeError(f"axis_name must be a mesh axis name, got {axis_name!r}")
  if backward_seconds is not None and not (
      isinstance(backward_seconds, numbers.Real) and 0 <= backward_seconds < math.inf):
    raise ValueError(
        f"backward_seconds must be None or seconds >= 0, got {backward_seconds!r}")
  return (_check_density(density), _check_count("min_size", min_size, 0),
          _check_count("warmup_steps", warmup_steps, 0))


def _check_value_dtype(value_dtype: Any) -> jnp.dtype | None:
  if value_dtype is None:
    return None
  try:
    dtype = jnp.dtype(value_dtype)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"value_dtype must be a floating dtype such as jnp.bfloat16, or None; "
        f"got {value_dtype!r}")
  return dtype


def _check_floating(leaves: Sequence[Any], paths: Sequence[str], what: str) -> None:
  for leaf, path in zip(leaves, paths):
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f"{what} leaf {path} has dtype {dtype}; topka2a exchanges floating "
          "gradients only. Keep integer and other non-float leaves out of the "
          "differentiated pytree, or skip them with optax.masked(...)."
      )


def _residual_dtype(leaf: jax.Array) -> jnp.dtype:
  return jnp.promote_types(jnp.float32, leaf.dtype)


def topka2a(
    density: float,
    *,
    axis_name: Hashable = "data",
    algorithm: str = "topka2a",
    error_feedback: bool = True,
    min_size: int = DEFAULT_MIN_SIZE,
    fusion: int | str = "auto",
    network: str | Network = "eth10",
    backward_seconds: float | None = None,
    value_dtype: Any = None,
    selection: str = "exact",
    warmup_steps: int = 0,
    skip_nonfinite: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Averages gradients across a mesh axis, sending only the top ``density``.

  Use it first in an optax chain, inside a ``jax.shard_map`` step over
  ``axis_name``, on per-device gradients (differentiate with respect to
  ``jax.lax.pcast(params, axis_name, to="varying")``; gradients of replicated
  parameters come out already summed). The updates it returns are the mean
  gradient across the axis, the scale of ``lax.pmean``, in each leaf's dtype
  and shape, bitwise identical on every device and typed invariant along the
  axis. Place the state with :func:`topka2a_jax.init` and
  :func:`topka2a_jax.state_specs`: its residuals are per device.

  Args:
    density: fraction of every bucket's entries each device sends, in (0, 1].
      1.0 sends everything and equals ``lax.pmean``.
    axis_name: the data-parallel mesh axis.
    algorithm: ``"topka2a"`` (AlltoAll, the default), ``"topka2a_sparse"``
      (TopKA2A with a sparse second phase: O(k) volume), ``"allgather"``
      (TopkA, the baseline whose volume grows with the number of devices),
      ``"dense"`` (``lax.pmean``; ``density`` is then ignored) or ``"auto"``
      (each bucket takes the cheapest under the cost model on ``network``).
    error_feedback: keep what was not sent and add it to the next step's
      gradient. Without it the unsent mass is dropped and accuracy suffers.
    min_size: leaves with fewer elements are averaged densely.
    fusion: leaves are fused, last first, into flat buckets of at least this
      many elements (a larger leaf gets a bucket of its own); ``"auto"``
      finds the threshold at trace time by binary search on the cost model's
      predicted step time (:mod:`topka2a_jax.fusion`).
    network: the link the cost model plans for: a preset name
      (:data:`topka2a_jax.NETWORKS`) or a measured :class:`topka2a_jax.Network`.
      Used by ``fusion="auto"`` and ``algorithm="auto"``.
    backward_seconds: the backward pass's duration, which bucket exchanges
      overlap; by default as long as one dense exchange of the gradient.
    value_dtype: dtype of the sparse values on the wire, e.g.
      ``jnp.bfloat16``; accumulation stays in float32 and the rounding stays
      in the residual. None sends float32. Indices always travel in the
      narrowest unsigned type that fits (uint16 for shards of up to 65,536).
    selection: ``"exact"`` top-k (a sort), or ``"threshold"``: a magnitude
      threshold found in a few passes, several times faster on large buckets
      and typically within 1% of exact top-k's magnitude mass (less close
      at densities near 0.05; :mod:`topka2a_jax.threshold`).
    warmup_steps: exchange densely (``lax.pmean``) for this many applied
      steps, then sparsely. The switch happens at run time inside the one
      compiled step; the residuals are zero when sparsification begins.
    skip_nonfinite: when any device's gradient holds a NaN or an infinity,
      every device skips the step alike: zero updates, residuals and
      ``count`` untouched, ``nonfinite_steps`` incremented. A stateful
      optimizer later in the chain (momentum, Adam) would still move on zero
      updates; wrap the whole chain in :func:`topka2a_jax.skip_nonfinite` to
      skip it too (its decision is passed down, so the check runs once).
      False lets non-finite values through (and into the residuals).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`TopKA2AState`.

  Raises:
    ValueError, TypeError: at construction for a bad argument; when tracing
      the update for an unbound axis, non-floating or already-summed
      gradients, or a state that does not match the gradients.

  Example:
    >>> tx = optax.chain(topka2a(density=0.01), optax.adam(1e-3))
    >>> opt_state = topka2a_jax.init(tx, params, mesh)
  """
  density, min_size, warmup_steps = _check_options(
      density, algorithm, error_feedback, min_size, fusion, backward_seconds,
      axis_name, warmup_steps, skip_nonfinite
  )
  network = get_network(network)
  value_dtype = _check_value_dtype(value_dtype)
  get_selection(selection)  # raises for an unknown name
  value_bytes = 4 if value_dtype is None else value_dtype.itemsize

  def keeps_residual(leaf: jax.Array) -> bool:
    return (error_feedback and algorithm != "dense" and leaf.size > 0
            and leaf.size >= min_size)

  def plan(sizes: list[int], num_devices: int) -> list[buckets.Bucket]:
    model = step_model(sizes, num_devices, density, network=network,
                       min_size=min_size, backward_seconds=backward_seconds,
                       value_bytes=value_bytes)
    threshold = model.best_threshold(algorithm) if fusion == "auto" else fusion
    return [planned.bucket for planned in model.layout(algorithm, threshold)]

  def init_fn(params: optax.Params) -> TopKA2AState:
    paths, leaves, treedef = _flatten(params)
    _check_floating(leaves, paths, "parameter")
    residuals = [
        jnp.zeros((leaf.size,), _residual_dtype(leaf))
        if keeps_residual(leaf)
        else optax.MaskedNode()
        for leaf in leaves
    ]
    zero = jnp.zeros((), jnp.int32)
    return TopKA2AState(treedef.unflatten(residuals), zero, zero)

  def exchange(
      grads: list[jax.Array], residuals: list[Any], num_devices: int, sparse: bool
  ) -> tuple[list[jax.Array], list[Any]]:
    """Means of ``grads + residuals`` over the axis, and the new residuals.

    ``sparse=False`` sends every bucket dense (warm-up): nothing stays behind.
    """
    means: list[jax.Array] = list(grads)  # empty leaves pass through as they are
    new_residuals: list[Any] = [optax.MaskedNode()] * len(grads)
    live = [i for i, g in enumerate(grads) if g.size > 0]
    for bucket in plan([grads[i].size for i in live], num_devices):
      members = [live[j] for j in bucket.leaves]
      sizes = [grads[i].size for i in members]
      dtype = jnp.result_type(*(_residual_dtype(grads[i]) for i in members))
      acc = [
          jnp.ravel(grads[i]).astype(dtype) + residuals[i]
          if keeps_residual(grads[i])
          else grads[i]
          for i in members
      ]
      result = ALGORITHMS[bucket.algorithm if sparse else "dense"](
          buckets.pack(acc, dtype), axis_name, density, value_dtype=value_dtype,
          selection=selection,
      )
      means_flat = buckets.unpack(result.mean, sizes)
      unsent_flat = buckets.unpack(result.unsent, sizes)
      for i, mean, unsent in zip(members, means_flat, unsent_flat):
        means[i] = mean.reshape(grads[i].shape).astype(grads[i].dtype)
        if keeps_residual(grads[i]):
          new_residuals[i] = unsent.astype(_residual_dtype(grads[i]))
    return means, new_residuals

  def update_fn(
      updates: optax.Updates,
      state: TopKA2AState,
      params: optax.Params | None = None,
      **extra_args: Any,
  ) -> tuple[optax.Updates, TopKA2AState]:
    del params
    paths, grads, treedef = _flatten(updates)
    _check_floating(grads, paths, "gradient")
    residuals = _matching_residuals(treedef, state, grads, paths, keeps_residual)
    num_devices = bound_axis_size(axis_name)
    _check_per_device(grads, paths, axis_name)

    if not any(g.size for g in grads):
      return updates, state

    def applied(
        grads: list[jax.Array], residuals: list[Any], count: jax.Array
    ) -> tuple[list[jax.Array], list[Any], jax.Array]:
      if warmup_steps == 0:
        means, new = exchange(grads, residuals, num_devices, sparse=True)
      else:
        means, new = jax.lax.cond(
            count < warmup_steps,
            lambda g, r: exchange(g, r, num_devices, sparse=False),
            lambda g, r: exchange(g, r, num_devices, sparse=True),
            grads, residuals)
      return means, new, count + 1

    def skipped(
        grads: list[jax.Array], residuals: list[Any], count: jax.Array
    ) -> tuple[list[jax.Array], list[Any], jax.Array]:
      zeros = [_zeros_like_mean(g, axis_name) if g.size else g for g in grads]
      return zeros, residuals, count

    bad = extra_args.get(NONFINITE)  # decided already by skip_nonfinite(...)
    if bad is None and skip_nonfinite:
      bad = nonfinite_on_any_device(grads, axis_name)
    if bad is not None:
      means, new_residuals, count = jax.lax.cond(
          bad, skipped, applied, grads, residuals, state.count)
      nonfinite_steps = state.nonfinite_steps + bad.astype(jnp.int32)
    else:
      means, new_residuals, count = applied(grads, residuals, state.count)
      nonfinite_steps = state.nonfinite_steps
    return treedef.unflatten(means), TopKA2AState(
        treedef.unflatten(new_residuals), count, nonfinite_steps)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _zeros_like_mean(grad: jax.Array, axis_name: Hashable) -> jax.Array:
  """Zeros typed like the mean of ``grad``: invariant along the axis only."""
  zeros = jnp.zeros(grad.shape, grad.dtype)
  others = tuple(varying_axes(grad) - {axis_name})
  return jax.lax.pcast(zeros, others, to="varying") if others else zeros


def _flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
  """Leaves of ``tree`` with their printable paths and the tree's structure."""
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths = [jax.tree_util.keystr(path) or "<root>" for path, _ in with_paths]
  return paths, [leaf for _, leaf in with_paths], treedef


def _matching_residuals(
    treedef: Any,
    state: TopKA2AState,
    grads: Sequence[jax.Array],
    paths: Sequence[str],
    keeps_residual: Any,
) -> list[Any]:
  """The state's residuals, one per gradient leaf, checked against the grads."""
  if not isinstance(state, TopKA2AState):
    raise TypeError(
        f"expected the TopKA2AState made by this transform's init, got "
        f"{type(state).__name__}"
    )
  try:
    residuals = treedef.flatten_up_to(state.residuals)
  except (ValueError, TypeError) as error:
    raise ValueError(
        "the optimizer state does not match the gradients' pytree: was it "
        "initialised for another model? Re-create it with "
        f"topka2a_jax.init(tx, params, mesh). ({error})"
    ) from None
  for grad, residual, path in zip(grads, residuals, paths):
    if keeps_residual(grad):
      if not hasattr(residual, "shape") or residual.shape != (grad.size,):
        raise ValueError(
            f"residual for leaf {path} has shape "
            f"{getattr(residual, 'shape', type(residual).__name__)}, expected "
            f"({grad.size},) on each device. Pass the state through shard_map "
            "with in_specs/out_specs from topka2a_jax.state_specs(opt_state) "
            "(its residuals are per device), and create it for this model and "
            "these options with topka2a_jax.init. A state saved on another "
            "number of devices is resized by topka2a_jax.restore."
        )
    elif not isinstance(residual, optax.MaskedNode):
      raise ValueError(
          f"the state holds a residual for leaf {path}, which these options "
          "send dense or without error feedback: the state was made with "
          "other options (min_size, algorithm or error_feedback). Re-create "
          "it with topka2a_jax.init for this transform."
      )
  return residuals


def _check_per_device(
    grads: Sequence[jax.Array], paths: Sequence[str], axis_name: Hashable
) -> None:
  """Rejects gradients that JAX already summed across the axis."""
  if not grads or not tracks_varying_axes(axis_name):
    return
  for grad, path in zip(grads, paths):
    if not is_varying(grad, axis_name):
      raise ValueError(
          f"gradient leaf {path} is identical on every device of "
          f"{axis_name!r} (typed invariant along it), so it was already "
          "summed across devices: jax.grad adds a dense psum when it "
          "differentiates with respect to replicated parameters inside "
          "shard_map. Differentiate with respect to per-device copies: "
          f"jax.grad(loss)(jax.lax.pcast(params, {axis_name!r}, "
          "to='varying'), batch)."
      )
