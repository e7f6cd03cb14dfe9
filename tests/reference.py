"""An independent NumPy model of the sparse collectives, for the tests.

Written from the algorithm's description, device by device and shard by
shard with plain loops in float64; it shares no code with the library.
"""

from __future__ import annotations

import functools
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


def _first_phase(buffers: np.ndarray, density: float):
  """TopKA2A's shard-wise selection, summed by owner: (total, unsent, sizes)."""
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
  return total, unsent, (num_devices, n, shard, per_shard)


def topka2a(buffers: np.ndarray, density: float):
  """TopKA2A: P zero-padded shards, ceil(k/P) from each, summed by owner."""
  total, unsent, (num_devices, n, _, _) = _first_phase(buffers, density)
  return total[:n] / num_devices, unsent[:, :n]


def topka2a_sparse(buffers: np.ndarray, density: float):
  """TopKA2A whose owners send only the top ceil(k/P) of their summed shard.

  What an owner does not send of its summed shard stays in its residual.
  """
  total, unsent, (num_devices, n, shard, per_shard) = _first_phase(buffers, density)
  sent = np.zeros_like(total)
  for owner in range(num_devices):
    start = owner * shard
    chosen = start + top_positions(total[start : start + shard], per_shard)
    sent[chosen] = total[chosen]
    unsent[owner, start : start + shard] += total[start : start + shard] - sent[
        start : start + shard]
  return sent[:n] / num_devices, unsent[:, :n]


def gtopk(buffers: np.ndarray, density: float):
  """gTop-k: each device's top k, merged pairwise up a tree into the global top k.

  Lists hold partial means (values over P). With P not a power of two
  (2^m the largest below it), list 2^m + j first merges into list j. In
  round r the groups [g, g + 2^r) and [g + 2^r, g + 2^(r+1)) merge: sums
  where indices meet, the k largest (ties to the lower index) kept by
  the whole group, the rest (times P) into device g's residual.
  """
  buffers = buffers.astype(np.float64)
  num_devices, n = buffers.shape
  k = count(n, density)
  unsent = buffers.copy()
  lists = []
  for device in range(num_devices):
    chosen = top_positions(buffers[device], k)
    lists.append({int(i): buffers[device, i] / num_devices for i in chosen})
    unsent[device, chosen] = 0.0

  def merge(first, second, keeper):
    summed = dict(first)
    for i, v in second.items():
      summed[i] = summed.get(i, 0.0) + v
    order = sorted(summed, key=lambda i: (-abs(summed[i]), i))
    for i in order[k:]:
      unsent[keeper, i] += num_devices * summed[i]
    return {i: summed[i] for i in order[:k]}

  active = 1 << (num_devices.bit_length() - 1)
  for j in range(num_devices - active):
    lists[j] = merge(lists[j], lists[active + j], j)
  step = 1
  while step < active:
    for group in range(0, active, 2 * step):
      merged = merge(lists[group], lists[group + step], group)
      for device in range(group, group + 2 * step):
        lists[device] = merged
    step *= 2
  mean = np.zeros(n)
  for i, v in lists[0].items():
    mean[i] = v
  return mean, unsent


def oktopk(buffers: np.ndarray, density: float, capacity: int = 2,
           bins_per_device: int = 64):
  """Ok-Topk: each device's top k to the owners of balanced regions, each region's top back.

  Bins of ``ceil(n / min(n, bins_per_device * P))`` positions; a bin goes to
  owner ``min(P - 1, s // ceil(S / P))``, ``s`` the selected entries of all
  devices in the bins before it and ``S`` all of them. Each device sends
  each owner its largest ``min(k, capacity * ceil(k / P))`` selected entries
  there (ties to the lower index); the rest stay. Each owner sums what it
  got, sends the top ``ceil(k / P)`` sums over P, and keeps the other sums.
  """
  buffers = buffers.astype(np.float64)
  num_devices, n = buffers.shape
  k = count(n, density)
  per_owner = math.ceil(k / num_devices)
  per_pair = min(k, capacity * per_owner)
  width = math.ceil(n / min(n, bins_per_device * num_devices))
  chosen = [top_positions(buffers[device], k) for device in range(num_devices)]
  hist = np.zeros(math.ceil(n / width), dtype=int)
  for positions in chosen:
    for i in positions:
      hist[i // width] += 1
  share = max(1, math.ceil(hist.sum() / num_devices))
  before = np.cumsum(hist) - hist
  owner_of = [min(num_devices - 1, int(before[i // width]) // share) for i in range(n)]
  unsent = buffers.copy()
  got = [{} for _ in range(num_devices)]
  for device in range(num_devices):
    row = buffers[device]
    for owner in range(num_devices):
      mine = sorted((i for i in chosen[device] if owner_of[i] == owner),
                    key=lambda i: (-abs(row[i]), i))
      for i in mine[:per_pair]:
        got[owner][int(i)] = got[owner].get(int(i), 0.0) + row[i]
        unsent[device, i] = 0.0
  mean = np.zeros(n)
  for owner in range(num_devices):
    order = sorted(got[owner], key=lambda i: (-abs(got[owner][i]), i))
    for i in order[:per_owner]:
      mean[i] = got[owner][i] / num_devices
    for i in order[per_owner:]:
      unsent[owner, i] += got[owner][i]
  return mean, unsent


def _chunk_codes(values: np.ndarray, bits: int) -> tuple[np.ndarray, float]:
  """One chunk's decoded values and its scale, rounded to float32 as it travels.

  1 bit: the sign (zero counts as positive) times the mean magnitude.
  b bits: round(x / scale) in [-L, L], L = 2^(b-1) - 1, scale = max |x| / L.
  """
  if bits == 1:
    scale = float(np.float32(np.abs(values).mean()))
    return np.where(values >= 0, scale, -scale), scale
  levels = 2 ** (bits - 1) - 1
  scale = float(np.float32(np.abs(values).max() / levels))
  if scale == 0:
    return np.zeros(len(values)), scale
  # np.round, as Python's round, takes a half to the even neighbour.
  return np.clip(np.round(values / scale), -levels, levels) * scale, scale


def _coded(row: np.ndarray, start: int, n: int, bits: int, chunk: int) -> np.ndarray:
  """A shard's entries decoded chunk by chunk; only positions below ``n`` count."""
  out = np.zeros(len(row))
  for first in range(0, len(row), chunk):
    real = [i for i in range(first, min(first + chunk, len(row))) if start + i < n]
    if real:
      out[real] = _chunk_codes(row[real], bits)[0]
  return out


def _chunk_length(shard: int, chunk: int, rotated: bool = False) -> int:
  """Entries per chunk: the shard split evenly, rounded up to 32 (sizes.chunking).

  Rotated: the power of two from 32 to ``chunk`` whose padded length plus 8
  entries a scale is least (the larger on a tie).
  """
  if rotated:
    costs = {size: math.ceil(shard / size) * (size + 8)
             for size in (32, 64, 128, 256, 512, 1024, 2048, 4096) if size <= chunk}
    return min(sorted(costs, reverse=True), key=costs.get)
  count = math.ceil(shard / chunk)
  return math.ceil(math.ceil(shard / count) / 32) * 32


ROTATION_SEED = 20240701
"""The documented seed of the rotation's signs (numpy's ``default_rng``)."""


@functools.cache
def rotation(length: int) -> tuple[np.ndarray, np.ndarray]:
  """The rotation of one chunk and its inverse, as float64 matrices (read-only, made once).

  ``2^-ceil(m/2) H D`` and ``2^-floor(m/2) D H``, ``H`` the Sylvester
  Hadamard matrix of ``length = 2^m`` and ``D`` the diagonal of signs: -1
  where the seeded draw of 0 or 1 gave 1.
  """
  m = int(math.log2(length))
  h = np.ones((1, 1))
  for _ in range(m):
    h = np.block([[h, h], [h, -h]])
  d = np.diag(np.where(np.random.default_rng(ROTATION_SEED).integers(0, 2, length) == 1,
                       -1.0, 1.0))
  forward, inverse = h @ d * 2.0 ** -math.ceil(m / 2), d @ h * 2.0 ** -(m // 2)
  forward.flags.writeable = inverse.flags.writeable = False
  return forward, inverse


def _rotated_codes(row: np.ndarray, bits: int, chunk: int):
  """A padded shard rotated chunk by chunk and coded, every entry counted.

  Returns the decoded codes (rotated) and what they stand for (rotated back).
  """
  forward, inverse = rotation(chunk)
  codes, back = np.zeros(len(row)), np.zeros(len(row))
  for first in range(0, len(row), chunk):
    span = slice(first, first + chunk)
    codes[span] = _chunk_codes(forward @ row[span], bits)[0]
    back[span] = inverse @ codes[span]
  return codes, back


def few_bit(buffers: np.ndarray, density: float, bits: int = 4, gather_bits: int = 8,
            chunk: int = 4096, rotated: bool = False):
  """Codes of ``bits`` bits to the owners, their means back in ``gather_bits`` bits.

  Each shard (``ceil(n / P)`` cut into chunks of at most ``chunk`` entries,
  each rounded up to 32) goes from every device decoded chunk by chunk; the
  owner adds them up, rounds the mean chunk by chunk to ``gather_bits`` bits,
  and keeps the rounding, times P, in its own residual.

  Rotated: every chunk (padding included) is rotated before its code, the
  owner adds and codes the rotated chunks, and what is delivered and kept
  is rotated back.
  """
  del density
  buffers = buffers.astype(np.float64)
  num_devices, n = buffers.shape
  shard = math.ceil(n / num_devices)
  per_chunk = _chunk_length(shard, chunk, rotated)
  shard = -(-shard // per_chunk) * per_chunk
  padded = np.zeros((num_devices, num_devices * shard))
  padded[:, :n] = buffers
  unsent = padded.copy()
  if rotated:
    return _rotated_few_bit(padded, n, shard, bits, gather_bits, per_chunk)
  total = np.zeros(num_devices * shard)
  for device in range(num_devices):
    for owner in range(num_devices):
      span = slice(owner * shard, (owner + 1) * shard)
      sent = _coded(padded[device, span], owner * shard, n, bits, per_chunk)
      total[span] += sent
      unsent[device, span] -= sent
  mean = np.zeros(num_devices * shard)
  for owner in range(num_devices):
    span = slice(owner * shard, (owner + 1) * shard)
    own = total[span] / num_devices
    mean[span] = _coded(own, owner * shard, n, gather_bits, per_chunk)
    unsent[owner, span] += total[span] - num_devices * mean[span]
  return mean[:n], unsent[:, :n]


def _rotated_few_bit(padded, n, shard, bits, gather_bits, chunk):
  num_devices = padded.shape[0]
  unsent, total = padded.copy(), np.zeros(padded.shape[1])
  for device in range(num_devices):
    for owner in range(num_devices):
      span = slice(owner * shard, (owner + 1) * shard)
      codes, back = _rotated_codes(padded[device, span], bits, chunk)
      total[span] += codes
      unsent[device, span] -= back
  mean = np.zeros(padded.shape[1])
  _, inverse = rotation(chunk)
  for owner in range(num_devices):
    span = slice(owner * shard, (owner + 1) * shard)
    # The owner's sum is already rotated: its mean is coded as it is.
    codes = np.concatenate([_chunk_codes(total[span][i:i + chunk] / num_devices,
                                         gather_bits)[0] for i in range(0, shard, chunk)])
    mean[span] = np.concatenate([inverse @ codes[i:i + chunk] for i in range(0, shard, chunk)])
    owed = total[span] - num_devices * codes
    unsent[owner, span] += np.concatenate([inverse @ owed[i:i + chunk]
                                           for i in range(0, shard, chunk)])
  return mean[:n], unsent[:, :n]


def codes_to_owners(buffers: np.ndarray, bits: int, chunk: int = 4096,
                    rotated: bool = False):
  """Every entry in ``bits`` bits to its owner, summed there exactly (no second phase).

  Owner ``i`` holds entries ``[i m, (i + 1) m)``, ``m = ceil(n / P)``, cut
  into chunks as :func:`few_bit`'s shards are. Returns the sum over devices of
  what they sent, ``(n,)``, and what each did not send, ``(P, n)``. Rotated:
  each owned piece is zero-padded to whole chunks, rotated and coded, and
  what the codes stand for is rotated back.
  """
  buffers = buffers.astype(np.float64)
  num_devices, n = buffers.shape
  shard = math.ceil(n / num_devices)
  per_chunk = _chunk_length(shard, chunk, rotated)
  total, unsent = np.zeros(n), buffers.copy()
  for device in range(num_devices):
    for owner in range(num_devices):
      span = slice(owner * shard, min(n, (owner + 1) * shard))
      if rotated:
        row = np.zeros(-(-shard // per_chunk) * per_chunk)
        piece = buffers[device, span]
        row[:len(piece)] = piece
        sent = _rotated_codes(row, bits, per_chunk)[1][:len(piece)]
      else:
        sent = _coded(buffers[device, span], 0, n, bits, per_chunk)
      total[span] += sent
      unsent[device, span] -= sent
  return total, unsent


def onebit(buffers: np.ndarray, density: float, gather_bits: int = 8,
           chunk: int = 4096):
  """Signs to the owners, their means back in ``gather_bits`` bits."""
  return few_bit(buffers, density, 1, gather_bits, chunk)


ALGORITHMS = {"dense": dense, "allgather": allgather, "topka2a": topka2a,
              "topka2a_sparse": topka2a_sparse, "gtopk": gtopk, "oktopk": oktopk,
              "onebit": onebit,
              "onebit_4": functools.partial(onebit, gather_bits=4),
              "onebit_1": functools.partial(onebit, gather_bits=1),
              **{f"quantized_{up}_{back}": functools.partial(few_bit, bits=up,
                                                             gather_bits=back)
                 for up, back in ((4, 8), (4, 4), (2, 8), (8, 8), (8, 4))},
              "quantized_8_8_fine": functools.partial(few_bit, bits=8, gather_bits=8,
                                                      chunk=256),
              **{f"rotated_4_{back}": functools.partial(few_bit, bits=4, gather_bits=back,
                                                        chunk=512, rotated=True)
                 for back in (8, 4)},
              "rotated_1_1": functools.partial(few_bit, bits=1, gather_bits=1, chunk=512,
                                               rotated=True)}


def leafwise(algorithm, grads, residuals, density):
  """Every leaf of per-device ``grads`` (leading device axis) in a bucket of its own.

  Returns:
    ``(means, unsent)`` by leaf: the mean in the leaf's shape, and what each
    device keeps, ``(P, n)``.
  """
  means, unsent = {}, {}
  for k, g in grads.items():
    devices = g.shape[0]
    acc = g.reshape(devices, -1).astype(np.float64) + residuals.get(k, 0.0)
    mean, rest = ALGORITHMS[algorithm](acc, density)
    means[k], unsent[k] = mean.reshape(g.shape[1:]), rest
  return means, unsent


def orthonormal_columns(p: np.ndarray) -> np.ndarray:
  """The columns of ``p`` orthonormalised in order: QR with a positive diagonal."""
  q, r = np.linalg.qr(p)
  return q * np.where(np.diag(r) < 0, -1.0, 1.0)


def powersgd(grads: np.ndarray, residuals: np.ndarray, q: np.ndarray):
  """One PowerSGD step of one matrix (Vogels et al. 2019, Algorithms 1 and 2).

  Args:
    grads: every device's gradient as a matrix, (P, m, n).
    residuals: every device's error feedback, (P, m, n).
    q: the warm-started factor, (n, r), the same on every device.

  Returns:
    ``(mean, residuals, q)``: the decompressed mean (m, n), every device's
    new error ``M_w - P Q_w^T`` (P, m, n), and the averaged ``Q`` (n, r).
  """
  m = grads.astype(np.float64) + residuals
  p = np.mean([m[w] @ q for w in range(len(m))], axis=0)
  p = orthonormal_columns(p)
  local_qs = [m[w].T @ p for w in range(len(m))]
  q = np.mean(local_qs, axis=0)
  errors = np.stack([m[w] - p @ local_qs[w].T for w in range(len(m))])
  return p @ q.T, errors, q
