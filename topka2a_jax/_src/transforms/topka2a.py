"""The optax transform: sparse mean of the gradients with error feedback.

``topka2a(density)`` goes first in an optax chain. Its update runs inside a
``jax.shard_map`` over the data axis, on per-device gradients, and replaces
the dense ``lax.pmean`` of the gradients:

1. per device, ``acc = grad + residual`` (error feedback);
2. the leaves of ``acc`` are fused into flat buckets (``planner/buckets.py``), small
   leaves apart, which go dense;
3. every bucket goes through its collective (``collectives/exchanges.py``), which
   returns the mean over the axis and what this device did not send;
4. ``residual = acc - sent`` is kept for the next step, so no gradient mass is
   lost, only delayed.

Steps 1-4 are ``error_feedback.py``, with its two run-time switches (non-finite
steps skipped everywhere, dense warm-up). Where the parameters are sharded
over other mesh axes that the partitioner handles (a shard_map manual over
the data axis only), the update runs them in a nested shard_map over those
axes, so that each device selects from, and keeps residuals for, its own
parameter shard only (``layout.py``).

:func:`topka2a_jax.train_step` and :func:`topka2a_jax.nnx_train_step` build
the shard_map for you.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> tx = optax.chain(topka2a(density=0.01, mesh=mesh), optax.adam(1e-3))
  >>> opt_state = tx.init({"w": jnp.zeros((64, 32))})  # per device, on mesh
  >>> opt_state[0].residuals["w"].sharding.spec
  P('data',)

References:
  Peng, Li, Shi, Li. The TopKA2A algorithm (shard-wise top-k, an AlltoAll
  to the shards' owners). In Proceedings of the 53rd International
  Conference on Parallel Processing (ICPP 2024). doi:10.1145/3673038.3673140.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import optax
from jax.sharding import Mesh

from topka2a_jax._src.options import (
  DEFAULT_ALGORITHM,
  DEFAULT_MIN_SIZE,
  DEFAULT_SELECTION,
  Options,
)
from topka2a_jax._src.planner.cost import AUTO_NETWORK
from topka2a_jax._src.states import TopKA2AState
from topka2a_jax._src.transforms.exchange_state import init_state, update_state


def topka2a(
    density: float | None = None,
    *,
    axis_name: Hashable = "data",
    mesh: Mesh | None = None,
    algorithm: str = DEFAULT_ALGORITHM,
    error_feedback: bool = True,
    min_size: int = DEFAULT_MIN_SIZE,
    fusion: int | str = "auto",
    network: Any = AUTO_NETWORK,
    backward_seconds: float | None = None,
    value_dtype: Any = None,
    selection: str = DEFAULT_SELECTION,
    warmup_steps: int = 0,
    skip_nonfinite: bool = True,
    rank: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Averages gradients across a mesh axis, sending only the top ``density``.

  Use it first in an optax chain. Its update runs inside a ``jax.shard_map``
  over ``axis_name`` on per-device gradients (:func:`topka2a_jax.train_step`
  and :func:`topka2a_jax.nnx_train_step` build that step; by hand,
  differentiate with respect to ``jax.lax.pcast(params, axis_name,
  to="varying")``). The updates it returns are the mean gradient across the
  axis, the scale of ``lax.pmean``, in each leaf's dtype and shape, bitwise
  identical on every device and typed invariant along the axis.

  Args:
    density: fraction of every bucket's entries each device sends, in (0, 1].
      1.0 sends everything and equals ``lax.pmean``. Leave it out only for
      ``algorithm="powersgd"``, ``"dense"`` or the ``"onebit"`` family,
      which ignore it.
    axis_name: the data-parallel mesh axis, or a pair ``(outer, inner)`` of
      them, e.g. ``("node", "local")``: then the planner prices every
      bucket both flat over all devices and two-level (reduced densely
      inside each node and exchanged between nodes, one slice per device;
      :func:`topka2a_jax.collectives.two_level`) on the two links
      (:func:`topka2a_jax.cost.cluster_cost`), and takes the cheaper. Each
      device then keeps the residual of its slice of every leaf only, 1/L of
      it for L devices per node.
    mesh: the mesh of the training step. With it, ``tx.init(params)`` (as
      ``nnx.Optimizer`` calls it) returns the state as global arrays laid out
      for the mesh: residuals per device, each holding its own parameter
      shard's, everything else replicated. Without it, ``init`` reads the
      mesh from the parameters' shardings.
    algorithm: ``"auto"`` (the default): each bucket takes the cheapest
      exchange under the cost model on ``network``, dense where compression
      does not pay (small buckets, fast links). Or one name in
      :data:`topka2a_jax.collectives.ALGORITHMS` for every large bucket: the
      paper's TopKA2A; its sparse-second-phase variant, O(k) volume; TopkA,
      whose volume grows with the number of devices; dense ``lax.pmean``,
      which ignores ``density``. Or ``"powersgd"``: every matrix leaf as a
      rank-``rank`` product in two all-reduces, vectors and small matrices
      dense (:func:`topka2a_jax.collectives.powersgd`): ``topka2a(algorithm="powersgd",
      rank=4)``. It ignores ``density``, and ``"auto"`` never picks it. Or
      ``"onebit"``: every entry's sign (one scale per chunk) to its shard's
      owner by AlltoAll, the owners' means back in 8 bits by AllGather,
      with error feedback on both phases (1-bit Adam's compressed
      all-reduce, :func:`topka2a_jax.collectives.onebit`); ``"onebit_4"``
      and ``"onebit_1"`` send the means back in 4 bits and 1 bit. They
      ignore ``density``, and ``"auto"`` never picks them.
    error_feedback: keep what was not sent and add it to the next step's
      gradient. Without it the unsent mass is dropped and accuracy suffers.
    min_size: leaves with fewer elements on a device go dense.
    fusion: leaves are fused, last first, into flat buckets of at least this
      many elements (a larger leaf gets a bucket of its own); ``"auto"``
      finds the threshold at trace time by binary search on the cost model's
      predicted step time (:func:`topka2a_jax.plan_fusion`).
    network: the link the cost model plans for: ``"auto"`` (the default:
      ``eth10`` between processes, ``nvlink`` among one process's
      accelerators; :func:`topka2a_jax.cost.detected_network`), a preset name
      (:data:`topka2a_jax.cost.NETWORKS`) or a measured :class:`topka2a_jax.cost.Network`.
      Used by ``fusion="auto"`` and ``algorithm="auto"``. For a pair of data
      axes it is the link between nodes, the one inside a node being
      ``"nvlink"``; or give both, ``network=(between, inside)``.
    backward_seconds: the backward pass's duration, which bucket exchanges
      overlap. By default :func:`topka2a_jax.train_step` estimates it from
      XLA's cost analysis of the compiled gradient against the device's rate
      (:data:`topka2a_jax.cost.DEVICES`); in a hand-written step, no overlap is
      assumed.
    value_dtype: dtype of the sparse values on the wire, e.g.
      ``jnp.bfloat16``; accumulation stays in float32 and the rounding stays
      in the residual. None sends float32. Indices always travel in the
      narrowest unsigned type that fits (uint16 for shards of up to 65,536).
    selection: ``"auto"`` (the default: the fastest for the backend,
      :func:`topka2a_jax.collectives.auto_choice`), ``"exact"`` top-k (a
      sort), ``"threshold"`` (a magnitude threshold found in a few passes,
      many times faster on large buckets; where it may keep less than 99%
      of exact top-k's magnitude mass, or miss a nonzero entry over a
      background of zeros, it sorts exactly instead) or ``"approx"`` (``lax.approx_max_k``).
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
    rank: the rank of ``algorithm="powersgd"`` (default
      ``low_rank.DEFAULT_RANK``, 4); refused with the others.
      A matrix goes low rank where its factors are at most half its size.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`topka2a_jax.TopKA2AState`.

  Raises:
    ValueError, TypeError: at construction for a bad argument; when tracing
      the update outside shard_map, for non-floating or already-summed
      gradients, or a state that does not match the gradients.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> tx = optax.chain(topka2a(density=0.01, mesh=mesh), optax.adam(1e-3))
    >>> opt_state = tx.init({"w": jnp.zeros((64, 32))})
    >>> opt_state[0].residuals["w"].shape
    (512, 32)
  """
  options = Options.create(
      density, axis_name=axis_name, mesh=mesh, algorithm=algorithm,
      error_feedback=error_feedback, min_size=min_size, fusion=fusion,
      network=network, backward_seconds=backward_seconds, value_dtype=value_dtype,
      selection=selection, warmup_steps=warmup_steps, skip_nonfinite=skip_nonfinite,
      rank=rank)

  def init_fn(params: optax.Params) -> TopKA2AState:
    return init_state(options, params)

  def update_fn(updates: optax.Updates, state: TopKA2AState,
                params: optax.Params | None = None,
                **extra_args: Any) -> tuple[optax.Updates, TopKA2AState]:
    del params
    return update_state(options, updates, state, extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
