"""Where a warning points: the user's own call, however deep inside the library it is raised.

A warning raised while ``tx.init`` runs is met from ``topka2a_jax.init``,
from ``tx.init`` itself, or from inside ``optax.chain``: a fixed
``stacklevel`` points at the right line for one of them only.

Example:
  >>> user_stacklevel() >= 1  # 1 where its caller's caller is outside the library
  True
"""

from __future__ import annotations

import sys

LIBRARIES = frozenset({"topka2a_jax", "optax", "jax", "flax", "chex"})
"""The packages whose frames a warning looks past."""


def user_stacklevel() -> int:
  """The ``stacklevel`` of ``warnings.warn`` at the first frame outside :data:`LIBRARIES`.

  Call it from the function that warns; 1 is that function itself.
  """
  frame, level = sys._getframe(1), 1
  while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in LIBRARIES:
    frame, level = frame.f_back, level + 1
  return level
