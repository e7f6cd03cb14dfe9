"""The keys the library passes through optax's extra arguments, in one place.

optax hands every ``GradientTransformationExtraArgs`` in a chain the keyword
arguments of ``update(updates, state, params, **extra_args)``. The training
steps and :func:`topka2a_jax.skip_nonfinite` pass these; each has a default
when absent, since a hand-written ``shard_map`` step passes none. They are
prefixed so that no user transform's own argument is taken for one.

Example:
  >>> tx = topka2a_jax.topka2a(0.01)
  >>> extra = {PARAM_SPECS: None, BACKWARD_SECONDS: 0.05}  # as train_step passes them
  >>> sorted(extra)
  ['topka2a_backward_seconds', 'topka2a_param_specs']
"""

from __future__ import annotations

from typing import Any, NamedTuple

PARAM_SPECS = "topka2a_param_specs"
"""The parameters' ``PartitionSpec`` pytree, read by the exchange's update.

:func:`topka2a_jax.train_step` passes it where the partitioner lays the
parameters out over other mesh axes and their types do not say how."""

BACKWARD_SECONDS = "topka2a_backward_seconds"
"""The backward pass's estimated duration, read by the planner.

:func:`topka2a_jax.train_step` passes it, from XLA's cost analysis of the
compiled gradient (``_src/planner/compute.py``); an explicit
``backward_seconds=`` option wins over it."""

NONFINITE = "topka2a_nonfinite_step"
"""Whether some device's gradient is non-finite, decided once by
:func:`topka2a_jax.skip_nonfinite` (or :func:`topka2a_jax.compress_updates`)
for the transforms inside, which then do not decide again."""

GRADIENT_AT = "topka2a_gradient_at"
"""Where the gradient was taken: ``"local_params"`` says at
:func:`topka2a_jax.local_params` (the shared parameters plus this device's
offset in :func:`topka2a_jax.local_steps`' state). The training steps pass it;
``local_steps`` refuses an update without it, since a gradient taken at the
shared parameters runs another algorithm. A hand-written step passes it
itself: ``tx.update(grads, state, params, topka2a_gradient_at="local_params")``."""

AT_LOCAL_PARAMS = "local_params"
"""The value of :data:`GRADIENT_AT` for a gradient taken at ``local_params``."""

ARRIVED = "topka2a_arrived"
"""With ``local_steps(..., overlap=...)``, the :class:`RoundArrived` of the
round in flight: the mean its exchange delivered, which the training step
hands to the update at the end of the next round (and placeholders of the
same shapes at every other step). The training steps pass it; a hand-written
step runs ``local_steps`` without overlap."""


class RoundArrived(NamedTuple):
  """What the exchange of a round in flight delivers.

  Attributes:
    means: the devices' mean pseudo-gradient, replicated, laid out as the
      parameters.
    exchange: the exchange's state after it (residuals, counts).
    dropped: whether the mean was not finite (a replicated bool).
  """

  means: Any
  exchange: Any
  dropped: Any
