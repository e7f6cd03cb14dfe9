"""Whole-number arithmetic of sizes: shards, chunks and words rounded up.

Example:
  >>> ceil_div(10, 4), round_up(10, 4)
  (3, 12)
"""

from __future__ import annotations


def ceil_div(numerator: int, denominator: int) -> int:
  """``numerator / denominator`` rounded up, for positive ``denominator``."""
  return -(-numerator // denominator)


def round_up(value: int, multiple: int) -> int:
  """The smallest multiple of ``multiple`` that is at least ``value``."""
  return ceil_div(value, multiple) * multiple
