"""How many inner steps each of :func:`topka2a_jax.local_steps`' rounds takes.

One length for the whole run (``every=4``), or a length for each stretch of
training, from the step where it starts (``every={0: 4, 100: 2}``: rounds
of 4 steps, then of 2 from step 100): AdaComm's schedule, which shortens
the rounds as the loss falls, to spend bytes where shorter rounds may
still gain (the training evidence page measures it).

Example:
  >>> lengths = round_lengths({0: 4, 100: 2})
  >>> lengths.first, [int(lengths.at(jnp.asarray(r))) for r in (0, 24, 25)]
  (4, [4, 4, 2])

References:
  Wang and Joshi. "Adaptive Communication Strategies to Achieve the Best
  Error-Runtime Trade-off in Local-Update SGD." SysML 2019, arXiv 1810.08313.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from topka2a_jax._src.arguments import INT32_MAX, checked_count


class RoundLengths(NamedTuple):
  """Round lengths by stretch: ``lengths[i]`` steps a round from ``rounds[i]`` rounds on.

  Attributes:
    rounds: the rounds taken before each stretch starts (the first is 0).
    lengths: each stretch's steps a round.
  """

  rounds: tuple[int, ...]
  lengths: tuple[int, ...]

  @property
  def first(self) -> int:
    """The first round's length."""
    return self.lengths[0]

  @property
  def constant(self) -> int | None:
    """The one length of every round, or None where the stretches differ."""
    return self.lengths[0] if len(set(self.lengths)) == 1 else None

  def per_step(self, steps: int) -> float:
    """Rounds a step over the first ``steps`` steps, a round cut short counted in part.

    So one length ``every`` gives ``1 / every`` whatever ``steps``.

    Example:
      >>> round(round_lengths({0: 4, 100: 2}).per_step(300) * 300)  # 25 rounds, then 100
      125
    """
    steps = checked_count("steps", steps, 1)
    rounds, start = 0.0, 0
    for i, length in enumerate(self.lengths):
      end = (start + (self.rounds[i + 1] - self.rounds[i]) * length
             if i + 1 < len(self.rounds) else steps)
      rounds += max(0, min(end, steps) - start) / length
      start = end
    return rounds / steps

  def at(self, rounds: jax.Array) -> jax.Array:
    """The length (int32) of the round that follows ``rounds`` rounds taken."""
    if self.constant is not None:
      return jnp.asarray(self.constant, jnp.int32)
    stretch = jnp.searchsorted(jnp.asarray(self.rounds), rounds, side="right") - 1
    return jnp.asarray(self.lengths, jnp.int32)[stretch]


def round_lengths(every: Any) -> RoundLengths:
  """``every`` (an int, or a dict of starting step to length) as :class:`RoundLengths`.

  Raises:
    TypeError: ``every`` neither an int nor a dict of ints.
    ValueError: a length below 1, no stretch from step 0, or a stretch that
      starts inside a round of the one before (naming the steps where it could).
  """
  if isinstance(every, numbers.Integral) and not isinstance(every, bool):
    return RoundLengths((0,), (checked_count("every", every, 1, INT32_MAX),))
  if not isinstance(every, Mapping) or not every:
    raise TypeError("every must be an int, or a dict from the step where a stretch of rounds "
                    f"starts to its rounds' length, e.g. {{0: 4, 100: 2}}; got {every!r}")
  for start, length in every.items():
    if not isinstance(start, numbers.Integral) or isinstance(start, bool):
      raise TypeError(f"every's keys are the steps where a stretch starts (ints); got "
                      f"{start!r} in {every!r}")
    checked_count(f"every's key {start}", start, 0, INT32_MAX)
    checked_count(f"every[{start}]", length, 1, INT32_MAX)
  starts = sorted(every)
  if starts[0] != 0:
    raise ValueError(f"every={every!r} says nothing of the rounds before step {starts[0]}: "
                     f"give their length at key 0, e.g. {{0: 4, **every}}")
  rounds = [0]
  for start, end in itertools.pairwise(starts):
    length = every[start]
    if (end - start) % length:
      before = start + (end - start) // length * length
      raise ValueError(
          f"every={every!r}: rounds of {length} steps from step {start} end at steps "
          f"{before} and {before + length}, not at {end}, where the next stretch starts: "
          "start it at one of those")
    rounds.append(rounds[-1] + (end - start) // length)
  return RoundLengths(tuple(rounds), tuple(int(every[start]) for start in starts))
