"""Which exchanges ``algorithm="auto"`` plans among, for each kind of optimizer after it.

A top-k with error feedback delivers each entry as a rare burst, the sum of
many steps' gradients: plain SGD does not mind when mass arrives; Adam's
moments go wrong on bursts, and momentum multiplies them by about
``1 / (1 - momentum)``. A few-bit code with error feedback sends every entry
every step, its error bounded by half a quantization step. The kinds are
told apart from the chain (``transforms/following.py``) or given to
``topka2a-plan --optimizer``; the measurements behind the rule are on the
accuracy evidence page.

Example:
  >>> FORMS[ADAPTIVE]
  ('quantized_8_8_fine', 'dense')
"""

from __future__ import annotations

from topka2a_jax._src.collectives import algorithms

ADAPTIVE, MOMENTUM, PLAIN, UNKNOWN = "adaptive", "momentum", "plain", "unknown"
"""The kinds of optimizer that can follow the exchange."""

ROUNDS = "rounds"
"""Plain SGD as :func:`topka2a_jax.local_steps`' outer step: every round starts
the local parameters again from the shared ones, so what a top-k leaves in the
residuals never reaches them that round."""

CODED_FORM = "quantized_8_8_fine"
"""The form that keeps quality before Adam: every entry in 8 bits, one scale
per 256 entries, both phases' rounding fed back (training evidence page:
within 1.5% of dense on every run of the link benchmark)."""

LOCAL_STEPS_FORM = "rotated_4_4"
"""The pseudo-gradient's form of :func:`topka2a_jax.local_steps` by default:
each 512 entries rotated by a random-sign Walsh-Hadamard transform, 4 bits to
the owners and their means back in 4, both phases' rounding fed back. Half
the bytes of :data:`CODED_FORM`; on the link benchmark's task and the
character model it ends where the 8-bit code, ``rotated_4_8`` and the exact
mean end (the training evidence page compares them with a top-k and
dense)."""

MOMENTUM_FORM = "quantized_4_8"
"""The form before momentum SGD: 4 bits to the owners, their means back in 8
(0.75x the 8-bit form's bytes). On the README's program it ends on dense's
loss at learning rates 0.01, 0.05 and 0.1, where a top-k diverges; on the
digits example it ends at or above dense's accuracy (the accuracy evidence
page)."""

FORMS: dict[str, tuple[str, ...]] = {
    ADAPTIVE: (CODED_FORM, algorithms.DENSE.name),
    MOMENTUM: (MOMENTUM_FORM, algorithms.DENSE.name),
    UNKNOWN: (CODED_FORM, algorithms.DENSE.name),
    PLAIN: tuple(entry.name for entry in (algorithms.DENSE, algorithms.ALLGATHER,
                                          algorithms.TOPKA2A, algorithms.TOPKA2A_SPARSE)),
    ROUNDS: (LOCAL_STEPS_FORM, algorithms.DENSE.name),
}
"""For each kind of optimizer after the exchange, the exchanges ``"auto"`` may
plan a bucket with (the cheapest under the cost model wins). An unknown
optimizer gets the form that is safe for both SGD and Adam. Each row names
its forms: an exchange added to the registry enters ``"auto"`` only where a
row names it."""

WHY: dict[str, str] = {
    ADAPTIVE: "an adaptive optimizer (Adam's family) follows: a top-k's bursts "
              "derail its moments, a few-bit code sends every entry every step",
    MOMENTUM: "momentum SGD follows: it multiplies a top-k's bursts by about "
              "1 / (1 - momentum), a few-bit code sends every entry every step",
    PLAIN: "plain SGD (or nothing) follows: a top-k with error feedback keeps its "
           "quality",
    UNKNOWN: "the optimizer after it is not one the library knows: the few-bit "
             "code, safe before both SGD and Adam",
    ROUNDS: "local_steps' outer step follows: each round restarts the local "
            "parameters from the shared ones, so a top-k would hold most of every "
            "round's progress back in the residuals; a few-bit code sends every entry",
}
"""Why each kind gets its forms, for the plan's line and the planner's table."""
