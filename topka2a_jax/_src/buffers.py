"""Flat buffers: padded into equal rows, and split back by widths.

Every exchange cuts a flat buffer into ``P`` shards (or ``L`` slices) and
puts leaves side by side in one buffer; these are the two moves.

Example:
  >>> padded_rows(jnp.arange(5.0), 2)
  Array([[0., 1., 2.],
         [3., 4., 0.]], dtype=float32)
  >>> [piece.tolist() for piece in split_by_widths(jnp.arange(5.0), [2, 3])]
  [[0.0, 1.0], [2.0, 3.0, 4.0]]
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from topka2a_jax._src.sizes import ceil_div


def padded_rows(flat: jax.Array, rows: int) -> jax.Array:
  """``flat`` (1-D, ``n`` entries) zero-padded into equal rows: ``(rows, ceil(n / rows))``."""
  width = ceil_div(flat.shape[0], rows)
  return jnp.pad(flat, (0, rows * width - flat.shape[0])).reshape(rows, width)


def split_by_widths(buffer: jax.Array, widths: Sequence[int], axis: int = -1
                    ) -> list[jax.Array]:
  """Consecutive pieces of ``buffer`` along ``axis``, ``widths`` wide, left to right."""
  ends = list(itertools.accumulate(widths))
  return [jax.lax.slice_in_dim(buffer, end - width, end, axis=axis)
          for end, width in zip(ends, widths)]
