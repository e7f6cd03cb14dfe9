"""An independent NumPy model of the sparse collectives, for the tests.

Written from the algorithm's description, device by device and shard by
shard with plain loops in float64; it shares no code with the library.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np


def count(n: int, density: float) -> int:
  """k = ceil(density * n) in exact arithmetic, clipped to [1, n]."""
  return min(n, max(1, math.ceil(Fraction(str(density)) * n)))


def top_positions(row: np.ndarray, k: int) -> np.ndarray:
  """Positions of the k largest |row|, ties to the lower position."""
  order = sorted(range(len(row)), key=lambda i: (-abs(row[i]), i))
  return np.array(order[:k], dtype=int)


def dense(buffers: np.ndarray, density: float):
  """Every device's buffer, (P, n): mean over devices, nothing unsent."""
  del density
  return buffers.astype(np.float64).mean(0), np.zeros(buffers.shape)


def allgather(buffers: np.ndarray, density: float):
  """TopkA: each device's global top-k, summed over devices, divided by P."""
  buffers = buffers.astype(np.float64)
  num_devices, n = buffers.shape
  total = np.zeros(n)
  unsent = buffers.copy()
  for device in range(num_devices):
    chosen = top_positions(buffers[device], count(n, density))
    total[chosen] += buffers[device, chosen]
    unsent[device, chosen] = 0.0
  return total / num_devices, unsent


def topka2a(buffers: np.ndarray, density: float):
  """TopKA2A: P zero-padded shards, ceil(k/P) from each, summed by owner."""
  buffers = buffers.astype(np.float64)
  num_devices, n = buffers.shape
  shard = math.ceil(n / num_devices)
  per_shard = math.ceil(count(n, density) / num_devices)
  padded = np.zeros((num_devices, num_devices * shard))
  padded[:, :n] = buffers
  total = np.zeros(num_devices * shard)
  unsent = padded.copy()
  for device in range(num_devices):
    for owner in range(num_devices):
      start = owner * shard
      piece = padded[device, start : start + shard]
      chosen = start + top_positions(piece, per_shard)
      total[chosen] += padded[device, chosen]
      unsent[device, chosen] = 0.0
  return total[:n] / num_devices, unsent[:, :n]


ALGORITHMS = {"dense": dense, "allgather": allgather, "topka2a": topka2a}
