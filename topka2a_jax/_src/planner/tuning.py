"""The paper's online variant: tune the fusion threshold by timing real steps.

The cost model plans from static shapes; real systems have effects it does
not see (kernel launch overheads, contention, the collective library's own
algorithms). :func:`tune_fusion` times the real jitted step for thresholds
chosen by the same sweep-then-bisect search as the planner, on a short
log-spaced grid so that only a handful of steps are compiled.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> params = {f"w{i}": jnp.zeros((64, 64)) for i in range(4)}
  >>> def loss_fn(params, x):
  ...   return sum(jnp.sum(jnp.tanh(x @ w)) for w in params.values())
  >>> def make_step(threshold):
  ...   tx = optax.chain(topka2a_jax.topka2a(0.01, fusion=threshold, mesh=mesh),
  ...                    optax.sgd(0.1))
  ...   step = topka2a_jax.train_step(loss_fn, tx, mesh, donate=False)
  ...   opt_state = tx.init(params)
  ...   return lambda: step(params, opt_state, jnp.ones((64, 64)))
  >>> best, timings = tune_fusion(make_step, low=4096, high=4 * 4096, points=2,
  ...                             repeats=1)
  >>> best in timings
  True
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

from topka2a_jax._src.planner.fusion import search_threshold


def time_call(run: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
  """Median wall time of ``run()``, waiting for its results each time.

  Args:
    run: a zero-argument callable, e.g. one jitted training step.
    repeats: timed calls.
    warmup: untimed calls first (the first one compiles).

  Returns:
    Seconds.

  Example:
    >>> step = jax.jit(lambda x: x * 2)
    >>> seconds = topka2a_jax.cost.time_call(lambda: step(jnp.ones(1000)), repeats=3)
    >>> 0 < seconds < 1
    True
  """
  for _ in range(warmup):
    jax.block_until_ready(run())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(run())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def tune_fusion(
    make_step: Callable[[int], Callable[[], Any]],
    low: int,
    high: int,
    *,
    points: int = 16,
    repeats: int = 5,
    measure: Callable[[Callable[[], Any]], float] | None = None,
) -> tuple[int, dict[int, float]]:
  """Finds the fastest fusion threshold by timing real steps.

  Args:
    make_step: builds, for a threshold, a zero-argument callable that runs
      one training step with ``topka2a(..., fusion=threshold)``.
    low: smallest threshold, in elements.
    high: largest threshold, in elements.
    points: log-spaced thresholds on the grid searched; a binary search
      visits about ``2 * log2(points)`` of them.
    repeats: timed steps per threshold (the median counts).
    measure: how to time a step; :func:`time_call` by default.

  Returns:
    ``(best threshold, {threshold: seconds for every one timed})``.

  Raises:
    ValueError: ``low`` or ``high`` out of order, or fewer than 2 points.
  """
  if not callable(make_step):
    raise TypeError(f"make_step must build a step for a threshold (threshold -> a "
                    f"zero-argument callable); got {type(make_step).__name__}")
  if not 1 <= low <= high:
    raise ValueError(f"need 1 <= low <= high, got low={low}, high={high}")
  if points < 2:
    raise ValueError(f"points must be at least 2, got {points}")
  if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
    raise ValueError(f"repeats must be at least 1 timed step per threshold, got {repeats!r}")
  measure = measure or (lambda run: time_call(run, repeats=repeats))
  timings: dict[int, float] = {}

  def evaluate(threshold: int) -> float:
    if threshold not in timings:
      seconds = measure(make_step(threshold))
      if not 0 <= seconds < math.inf:
        raise ValueError(f"the step at threshold {threshold} was timed at {seconds!r} s; "
                         "a measure must return a finite duration >= 0")
      timings[threshold] = seconds
    return timings[threshold]

  best = search_threshold(evaluate, low, high, points=points, coarse=points)
  return best, timings
