"""The two top-k primitives every selection is built on: exact, and XLA's approximate one.

``selection.py`` names them (and the threshold search, ``threshold.py``,
which falls back to the exact sort) for ``selection=``; both modules import
them from here.

Example:
  >>> top_magnitudes(jnp.array([[1.0, -5.0, 3.0]]), 1)
  (Array([[-5.]], dtype=float32), Array([[1]], dtype=int32))
"""

from __future__ import annotations

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
