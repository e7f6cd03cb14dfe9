"""Tensor fusion: which gradient leaves share a flat buffer.

Every exchange pays a per-message latency, so leaves are fused into buckets
and each bucket goes through one collective. Leaves are taken in reverse
order, roughly the order in which the backward pass produces them, and a
bucket is closed once it holds at least ``bucket_size`` elements. Leaves of
different algorithms (small ones go dense) never share a bucket. A leaf is
never split, so a leaf larger than ``bucket_size`` gets a bucket of its own.

The plan depends only on static sizes, so it is computed at trace time and
every step compiles to the same fixed shapes.

Example:
  >>> [(b.leaves, b.algorithm, b.size)
  ...  for b in plan_buckets([10, 3, 10], ["sparse", "small", "sparse"], 15)]
  [((2, 0), 'sparse', 20), ((1,), 'small', 3)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Bucket(NamedTuple):
  """Leaves fused into one flat buffer and exchanged by one collective.

  Attributes:
    leaves: positions of the leaves in the flattened gradient pytree, in the
      order they are packed.
    algorithm: the collective's name, a key of
      :data:`topka2a_jax.collectives.ALGORITHMS`.
    size: total elements.
    route: ``"flat"`` over the data axis, or ``"two_level"`` where the data
      axis is a pair (:func:`topka2a_jax.collectives.two_level`).
  """

  leaves: tuple[int, ...]
  algorithm: str
  size: int
  route: str = "flat"


def plan_buckets(
    sizes: Sequence[int], algorithms: Sequence[str], bucket_size: int
) -> tuple[Bucket, ...]:
  """Fuses leaves, last first, into buckets of at least ``bucket_size``.

  Args:
    sizes: element count of every leaf, in pytree order.
    algorithms: the collective chosen for every leaf.
    bucket_size: elements at which a bucket is closed.

  Returns:
    The buckets, in the order they are closed; every leaf is in exactly one.
  """
  closed: list[Bucket] = []
  open_buckets: dict[str, Bucket] = {}
  for leaf in reversed(range(len(sizes))):
    algorithm = algorithms[leaf]
    opened = open_buckets.get(algorithm)
    members, size = (opened.leaves, opened.size) if opened else ((), 0)
    bucket = Bucket(members + (leaf,), algorithm, size + sizes[leaf])
    if bucket.size >= bucket_size:
      closed.append(bucket)
      open_buckets.pop(algorithm, None)
    else:
      open_buckets[algorithm] = bucket
  return tuple(closed) + tuple(open_buckets.values())
