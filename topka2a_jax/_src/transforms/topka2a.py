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

Steps 1-4 are ``bucket_exchange.py``, run by ``exchange_step.py`` with its
run-time switches (non-finite steps skipped everywhere, dense warm-up).
Where the parameters are sharded over other mesh axes that the partitioner
handles (a shard_map manual over the data axis only), the update runs them
in a nested shard_map over those axes, so that each device selects from,
and keeps residuals for, its own parameter shard only (``layout.py``).

:func:`topka2a_jax.train_step` and :func:`topka2a_jax.nnx_train_step` build
the shard_map for you.

With ``algorithm="auto"`` (the default) the exchange's form follows the
optimizer after it in the chain (``following.py``): the gradient in 8 bits
before Adam, a top-k before plain SGD.

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

from typing import Any

import optax

from topka2a_jax._src.options import Options
from topka2a_jax._src.states import TopKA2AState
from topka2a_jax._src.transforms.exchange_state import init_state, update_state
from topka2a_jax._src.transforms.following import (
  follower,
  for_follower,
  refuse_state_before,
)
from topka2a_jax._src.transforms.marks import marked
from topka2a_jax._src.transforms.signatures import TopKA2AOptions, Unpack, takes_options


@takes_options(TopKA2AOptions)
def topka2a(density: float | None = None,
            **options: Unpack[TopKA2AOptions]) -> optax.GradientTransformationExtraArgs:
  """Averages gradients across a mesh axis in the form the optimizer after it trains with.

  Use it first in an optax chain. With the default ``algorithm="auto"`` it
  reads the optimizer after it in its chain: before Adam's family (or an
  optimizer it does not know) it sends every entry in 8 bits, before
  momentum SGD in 4 bits with 8-bit means back, both roundings fed back,
  which train on dense's curve; before plain SGD it sends the top
  ``density`` of every bucket, with error feedback. The cost model may plan
  a bucket dense where compression does not pay.

  Its update runs inside a ``jax.shard_map``
  over ``axis_name`` on per-device gradients (:func:`topka2a_jax.train_step`
  and :func:`topka2a_jax.nnx_train_step` build that step; by hand,
  differentiate with respect to ``jax.lax.pcast(params, axis_name,
  to="varying")``). The updates it returns are the mean gradient across the
  axis, the scale of ``lax.pmean``, in each leaf's dtype and shape, bitwise
  identical on every device and typed invariant along the axis.

  Args:
    density: fraction of every bucket's entries each device sends where a
      top-k is chosen, in (0, 1]. 1.0 sends everything and equals
      ``lax.pmean``. Leave it out with ``algorithm="auto"`` before Adam's
      family or momentum SGD (no top-k is chosen there; before plain SGD it
      is asked for), and for ``"powersgd"``, ``"dense"`` and the exchanges
      that send codes (``"quantized_A_B"``, ``"onebit"``...), which ignore it.
    **options: every option of the exchange, below.

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
  checked = Options.create(density, forms_follow=True, **options)
  said: set[str] = set()  # what the transform has said of the optimizer after it

  def init_fn(params: optax.Params) -> TopKA2AState:
    refuse_state_before(init_fn)
    return init_state(for_follower(checked, follower(init_fn), said, at_init=True),
                      params)

  def update_fn(updates: optax.Updates, state: TopKA2AState,
                params: optax.Params | None = None,
                **extra_args: Any) -> tuple[optax.Updates, TopKA2AState]:
    del params
    exchanged = update_state(for_follower(checked, follower(update_fn), said), updates,
                             state, extra_args)
    return exchanged.means, exchanged.state

  return optax.GradientTransformationExtraArgs(init_fn, marked(update_fn, checked.axis_name))
