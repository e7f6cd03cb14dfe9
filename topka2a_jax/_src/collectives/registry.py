"""The collective of every exchange in the registry, by the name ``algorithm=`` takes.

:data:`COLLECTIVES` pairs each :class:`Algorithm
<topka2a_jax._src.collectives.algorithms.Algorithm>` with the function that
runs it: the few-bit rows are :func:`few_bit
<topka2a_jax._src.collectives.exchanges.few_bit>` at their widths, the others
the function of their name.

Example:
  >>> COLLECTIVES["topka2a"].__name__, COLLECTIVES["gtopk"].__name__
  ('topka2a', 'gtopk')
"""

from __future__ import annotations

import functools

from topka2a_jax._src.collectives import algorithms
from topka2a_jax._src.collectives.exchanges import (
  Collective,
  allgather,
  dense,
  few_bit,
  topka2a,
  topka2a_sparse,
)
from topka2a_jax._src.collectives.global_top_k import gtopk, oktopk

_SELECTING: dict[str, Collective] = {
    algorithms.DENSE.name: dense, algorithms.ALLGATHER.name: allgather,
    algorithms.TOPKA2A.name: topka2a, algorithms.TOPKA2A_SPARSE.name: topka2a_sparse,
    algorithms.GTOPK.name: gtopk, algorithms.OKTOPK.name: oktopk}
"""The collectives that send a selection (or everything), by their registry names."""


def _collective(entry: algorithms.Algorithm) -> Collective:
  if entry.codes is None:
    return _SELECTING[entry.name]
  return functools.partial(few_bit, bits=entry.codes.bits,
                           gather_bits=entry.codes.gather_bits, chunk=entry.codes.chunk,
                           rotated=entry.codes.rotated)


COLLECTIVES: dict[str, Collective] = {
    name: _collective(entry) for name, entry in algorithms.ALGORITHMS.items()}
"""The collective of every exchange in :data:`topka2a_jax.collectives.ALGORITHMS`, by name.

Read from the registry: a few-bit row is :func:`few_bit` at its widths."""
