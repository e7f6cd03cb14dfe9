"""Which entries to send: the top ``k`` by magnitude, by the name ``selection=`` takes.

How many (``k``, and the shards TopKA2A takes them from) is
``_src/sizes.py``. One registry, :data:`SELECTIONS`, maps every name to ``(rows, k) ->
(values, indices)``; ``"auto"`` is the one for the backend
(:func:`auto_choice`), and the evidence page "Selection" has the
measurements behind it.

Example:
  >>> values, indices = get_selection("exact")(jnp.array([[1.0, -3.0, 2.0]]), 2)
  >>> indices.tolist()
  [[1, 2]]
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from topka2a_jax._src.collectives.threshold import threshold_magnitudes
from topka2a_jax._src.collectives.top_k import approx_magnitudes, top_magnitudes

Selection = Callable[[jax.Array, int], tuple[jax.Array, jax.Array]]


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
    "threshold": threshold_magnitudes,
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
