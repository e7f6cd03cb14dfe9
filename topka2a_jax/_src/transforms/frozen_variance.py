"""Adam with its momentum compressed and its variance frozen (1-bit Adam's form).

1-bit Adam (Tang et al., ICML 2021) runs dense Adam for a warm-up, then
freezes the second moment ``v`` and compresses only the momentum with error
feedback. Momentum is linear in the gradient, so the mean over devices of
each device's own momentum is the momentum of the mean gradient; with ``v``
the same everywhere, the step stays Adam's. :func:`frozen_variance_adam`
builds it from optax pieces:

1. :func:`topka2a_jax.compress_updates` over ``optax.ema(b1, debias=False)``:
   every device's momentum of its own gradient, averaged sparsely with error
   feedback (densely for the first ``freeze_after`` steps);
2. :func:`scale_by_frozen_rms`, replicated: during the warm-up it recovers
   the mean gradient from two consecutive mean momenta,
   ``g_t = (m_t - b1 m_{t-1}) / (1 - b1)``, and updates ``v`` from it; then
   ``v`` is frozen, with a floor (a share of each leaf's mean) so that
   entries the warm-up never saw (embedding rows of absent tokens) do not get
   steps of ``lr m / eps``;
3. ``optax.scale_by_learning_rate``.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> tx = frozen_variance_adam(1e-3, 0.01, freeze_after=30, mesh=mesh)
  >>> state = tx.init({"w": jnp.zeros((64, 32))})
  >>> state[1].nu["w"].shape  # replicated: one v for every device
  (64, 32)

References:
  Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He. "1-bit Adam:
  Communication Efficient Large-Scale Training with Adam's Convergence
  Speed". ICML 2021.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from topka2a_jax._src.transforms.signatures import (
  FrozenVarianceAdamOptions,
  Unpack,
  refuse_options,
  takes_options,
)
from topka2a_jax._src.transforms.update_compression import compress_updates


class FrozenRmsState(NamedTuple):
  """State of :func:`scale_by_frozen_rms` (replicated).

  Attributes:
    count: steps seen (int32).
    previous: the mean momentum of the last step.
    nu: the second moment of the mean gradient, frozen after the warm-up.
  """

  count: jax.Array
  previous: optax.Updates
  nu: optax.Updates


def scale_by_frozen_rms(b1: float, b2: float = 0.999, eps: float = 1e-8, *,
                        freeze_after: int,
                        variance_floor: float = 0.01) -> optax.GradientTransformation:
  """Scales mean momenta by a second moment learnt during a warm-up, then frozen.

  Its input is the mean over devices of every device's momentum
  ``m = b1 m + (1 - b1) g`` (exact while the exchange is dense, for the
  first ``freeze_after`` steps); its output is Adam's direction
  ``m_hat / (sqrt(v_hat) + eps)`` with both moments bias-corrected.

  Args:
    b1: the momentum's decay, as given to the momentum before the exchange.
    b2: the second moment's decay.
    eps: added to ``sqrt(v_hat)``.
    freeze_after: steps during which ``v`` learns; the exchange must be
      dense for them (``warmup_steps=freeze_after``).
    variance_floor: after the warm-up, ``v_hat`` is at least this share of
      its leaf's mean.

  Returns:
    An ``optax.GradientTransformation``.

  Example:
    >>> tx = scale_by_frozen_rms(0.9, freeze_after=2)
    >>> state = tx.init({"w": jnp.zeros(3)})
    >>> step, state = tx.update({"w": jnp.array([0.1, -0.1, 0.0])}, state)
    >>> jnp.round(step["w"], 4)  # first step: m_hat / sqrt(v_hat), the sign
    Array([ 1., -1.,  0.], dtype=float32)
  """
  if (isinstance(freeze_after, bool) or not isinstance(freeze_after, numbers.Integral)
      or freeze_after < 1):
    raise ValueError(f"freeze_after={freeze_after!r}: the variance needs a whole "
                     "number of dense steps to learn from, at least one")
  for name, value in (("b1", b1), ("b2", b2)):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
      raise ValueError(f"{name}={value!r}: a moment's decay is a number in [0, 1) "
                       "(Adam's are 0.9 and 0.999)")
  if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 <= eps < math.inf:
    raise ValueError(f"eps={eps!r}: Adam's eps is added to a square root, a number >= 0 "
                     "(1e-8 by default)")
  if (isinstance(variance_floor, bool) or not isinstance(variance_floor, numbers.Real)
      or not 0 <= variance_floor < math.inf):
    raise ValueError(f"variance_floor={variance_floor!r}: the floor is a share of the mean "
                     "variance, a number >= 0 (0.01 by default, 0 for none)")

  def init_fn(params: optax.Params) -> FrozenRmsState:
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # two buffers: both donated
    return FrozenRmsState(jnp.zeros((), jnp.int32), zeros(), zeros())

  def update_fn(momenta: optax.Updates, state: FrozenRmsState,
                params: optax.Params | None = None) -> tuple[Any, FrozenRmsState]:
    del params
    count = optax.safe_increment(state.count)
    learning = count <= freeze_after

    def moment(m, previous, nu):
      gradient = (m - b1 * previous) / (1 - b1)
      return jnp.where(learning, b2 * nu + (1 - b2) * gradient ** 2, nu)

    nu = jax.tree.map(moment, momenta, state.previous, state.nu)
    seen = jnp.minimum(count, freeze_after).astype(jnp.float32)

    def direction(m, v):
      v_hat = v / (1 - b2 ** seen)
      floor = jnp.where(learning, 0.0, variance_floor * jnp.mean(v_hat))
      m_hat = m / (1 - b1 ** count.astype(jnp.float32))
      return (m_hat / (jnp.sqrt(jnp.maximum(v_hat, floor)) + eps)).astype(m.dtype)

    return (jax.tree.map(direction, momenta, nu),
            FrozenRmsState(count, momenta, nu))

  return optax.GradientTransformation(init_fn, update_fn)


@takes_options(FrozenVarianceAdamOptions)
def frozen_variance_adam(learning_rate: optax.ScalarOrSchedule,
                         density: float | None = None, *,
                         freeze_after: int, b1: float = 0.9, b2: float = 0.999,
                         eps: float = 1e-8, variance_floor: float = 0.01,
                         **options: Unpack[FrozenVarianceAdamOptions]
                         ) -> optax.GradientTransformation:
  """Adam whose momentum is compressed and whose variance freezes (1-bit Adam).

  Args:
    learning_rate: a float or an optax schedule.
    density: fraction of every sparse bucket of momenta each device sends;
      left out with ``algorithm="onebit"``, which sends every entry's sign.
    freeze_after: dense steps during which the variance learns.
    b1, b2, eps: Adam's.
    variance_floor: see :func:`scale_by_frozen_rms`.
    **options: the options of :func:`topka2a_jax.compress_updates` but
      ``warmup_steps``, which is ``freeze_after``, below.

  Returns:
    ``optax.chain(compress_updates(ema(b1)), scale_by_frozen_rms(...),
    scale_by_learning_rate(learning_rate))``.
  """
  refuse_options("frozen_variance_adam", options, {
      "warmup_steps": "it exchanges densely for its first freeze_after steps, its warm-up",
      "follows": "the exchange sends its momentum, in the form compress_updates sends"})
  if not callable(learning_rate) and (
      isinstance(learning_rate, bool) or not isinstance(learning_rate, numbers.Real)
      or not math.isfinite(learning_rate)):
    raise ValueError(f"learning_rate={learning_rate!r}: give a finite number (1e-3) or an "
                     "optax schedule")
  frozen_rms = scale_by_frozen_rms(b1, b2, eps, freeze_after=freeze_after,
                                   variance_floor=variance_floor)  # checks freeze_after
  return optax.chain(
      compress_updates(optax.ema(b1, debias=False), density=density,
                       warmup_steps=freeze_after, **options),
      frozen_rms,
      optax.scale_by_learning_rate(learning_rate))
