"""Which entries to send: the top ``k`` by magnitude, by the name ``selection=`` takes.

How many (``k``, and the shards TopKA2A takes them from) is
``_src/sizes.py``. One registry, :data:`SELECTIONS`, maps every name to ``(rows, k) ->
(values, indices)``; ``"auto"`` is the one for the backend
(:func:`auto_choice`), and the evidence page "Selection"
(``benchmarks/selection.py``) has the measurements behind it.

Example:
  >>> values, indices = get_selection("exact")(jnp.array([[1.0, -3.0, 2.0]]), 2)
  >>> indices.tolist()
  [[1, 2]]
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax


def approx_magnitudes(rows: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Selects ``k`` large-magnitude entries of every row with ``lax.approx_max_k``.

  On TPUs an approximate top-k that keeps about 95% of the exact top-k's
  entries; other backends run XLA's fallback, which on a CPU takes as long
  as the exact sort and returns the same entries.

  Args:
    rows: array of shape ``(..., n)``.
    k: entries per row, ``1 <= k <= n``.

  Returns:
    ``(values, indices)``, each of shape ``(..., k)``, as :func:`top_magnitudes`.

  Example:
    >>> approx_magnitudes(jnp.array([[1.0, -5.0, 3.0]]), 2)
    (Array([[-5., 3.]], dtype=float32), Array([[1, 2]], dtype=int32))
  """
  _, indices = lax.approx_max_k(jnp.abs(rows), k, recall_target=0.95)
  return jnp.take_along_axis(rows, indices, axis=-1), indices


def top_magnitudes(rows: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Selects the ``k`` largest-magnitude entries of every row, exactly.

  Ties go to the lower index, so the result is deterministic.

  Args:
    rows: array of shape ``(..., n)``.
    k: entries per row, ``1 <= k <= n``.

  Returns:
    ``(values, indices)``, each of shape ``(..., k)``: the selected entries
    with their signs, and their distinct positions within the row (int32).

  Example:
    >>> top_magnitudes(jnp.array([[1.0, -5.0, 3.0]]), 2)
    (Array([[-5., 3.]], dtype=float32), Array([[1, 2]], dtype=int32))
  """
  _, indices = lax.top_k(jnp.abs(rows), k)
  return jnp.take_along_axis(rows, indices, axis=-1), indices


Selection = Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]


def _threshold_magnitudes(rows: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """``selection="threshold"``: :func:`threshold.threshold_magnitudes`.

  Imported on call: the threshold search falls back to this module's exact
  sort, so it imports this module.
  """
  from topka2a_jax._src.collectives import threshold
  return threshold.threshold_magnitudes(rows, k)


def auto_choice() -> str:
  """The selection ``"auto"`` runs on this backend.

  ``approx_max_k`` on a TPU, the backend its documentation says it is made
  for; the threshold search elsewhere, which falls back to the exact sort
  by itself on rows too short for it to gain and for selections of more
  than a quarter of a row.
  """
  return "approx" if jax.default_backend() == "tpu" else "threshold"


def auto_magnitudes(rows: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """``selection="auto"``: :data:`SELECTIONS` of :func:`auto_choice`.

  Args:
    rows: ``(R, n)`` floating array.
    k: entries per row.

  Returns:
    ``(values, indices)`` as every selection returns them.
  """
  return SELECTIONS[auto_choice()](rows, k)


SELECTIONS: dict[str, Selection] = {
    "auto": auto_magnitudes,
    "exact": top_magnitudes,
    "threshold": _threshold_magnitudes,
    "approx": approx_magnitudes,
}
"""How the sparse collectives pick entries: ``(rows, k) -> (values, indices)``."""


def check_selection(name: str) -> None:
  """Raises a ValueError listing the choices unless ``name`` is a selection.

  Example:
    >>> check_selection("top")
    Traceback (most recent call last):
    ValueError: unknown selection 'top'; choose one of 'auto', 'exact', 'threshold', 'approx'
  """
  if name not in SELECTIONS:
    raise ValueError(f"unknown selection {name!r}; choose one of "
                     f"{', '.join(repr(n) for n in SELECTIONS)}")


def get_selection(name: str) -> Selection:
  """The selection called ``name``, or a ValueError listing the choices."""
  check_selection(name)
  return SELECTIONS[name]
