"""Mean of a flat buffer across a mesh axis, dense or top-k sparse.

Each function here is called inside ``jax.shard_map`` on one device's 1-D
buffer and returns an :class:`ExchangeResult`: the mean over the axis (identical on
every device, typed invariant along the axis) and what this device did not
send, which error feedback keeps for the next step.

* :func:`dense`: ``lax.pmean``, the reference.
* :func:`allgather` ("TopkA"): every device's top-k (value, global index) pairs
  are all-gathered and summed. Each device receives ``k * (P - 1)`` pairs,
  which grows with P.
* :func:`topka2a` (TopKA2A, Peng et al. 2024): shard-wise top-k, one AlltoAll to the
  shards' owners, a scatter-add there, and an AllGather of the dense shards.
  The volume no longer grows with P.
* :func:`topka2a_sparse`: TopKA2A whose owners re-select the top of their
  summed shard, so the second phase is a sparse AllGather too: O(k) volume.
* :func:`few_bit`: every entry in a few bits (with one scale per chunk) to
  the shards' owners by AlltoAll, and the owners' means back in a few bits,
  the rounding of both phases fed back; :func:`onebit` sends signs (1-bit
  Adam's compressed all-reduce, with the second phase's precision kept).
  With ``rotated=True`` each chunk is rotated first (``rotation.py``), so
  that a few bits lose less of it.
* :func:`two_level`: for clusters, a dense reduce-scatter inside each node,
  one of the above between nodes on one slice per device, and an all-gather
  inside the node.

The sparse ones take ``selection`` (``"exact"`` top-k, or ``"threshold"``, a
magnitude threshold found in a few passes) and ``value_dtype`` (values on the wire,
e.g. bfloat16; accumulation stays in the buffer's dtype and the rounding
stays in the residual), and send indices in the narrowest unsigned type that
fits.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> rows = jax.device_put(jnp.arange(8 * 100.0).reshape(8, 100),
  ...                       NamedSharding(mesh, P("data")))  # row i: device i's
  >>> @jax.jit
  ... @jax.shard_map(mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data")))
  ... def exchange(row):
  ...   mean, unsent = topka2a(row[0], "data", density=0.1)
  ...   return mean, unsent[None]
  >>> mean, unsent = exchange(rows)
  >>> bool(jnp.allclose(8 * mean + unsent.sum(0), rows.sum(0)))  # nothing lost
  True

References:
  Peng, Li, Shi, Li. The TopKA2A algorithm (shard-wise top-k, an AlltoAll
  to the shards' owners). In Proceedings of the 53rd International
  Conference on Parallel Processing (ICPP 2024). doi:10.1145/3673038.3673140.

  Shi et al. gTop-k S-SGD: global top-k sparsification, whose aggregated
  entries not sent stay with the aggregating worker, as in
  :func:`topka2a_sparse`. ICDCS 2019.

  Renggli, Ashkboos, Aghagolzadeh, Alistarh, Hoefler. "SparCML: High-Performance
  Sparse Communication for Machine Learning" (the allgather of top-k pairs).
  SC 2019.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from topka2a_jax._src.axis import bound_axis_size
from topka2a_jax._src.buffers import padded_rows
from topka2a_jax._src.collectives import quantized, rotation
from topka2a_jax._src.collectives.received import top_of_received
from topka2a_jax._src.collectives.selection import Selection, get_selection
from topka2a_jax._src.collectives.wire import WireFormat
from topka2a_jax._src.sizes import CHUNK, Chunking, ShardLayout, ceil_div, chunking, sparse_count


class Collective(Protocol):
  """The signature every exchange shares."""

  def __call__(self, buffer: jax.Array, axis_name: Hashable, density: float, *,
               value_dtype: jnp.dtype | None = None, selection: str = "exact",
               send: jax.Array | None = None) -> ExchangeResult: ...


class ExchangeResult(NamedTuple):
  """Result of one collective on one device.

  Attributes:
    mean: the mean of every device's buffer as aggregated, shape ``(n,)``;
      bitwise identical on all devices of the axis.
    unsent: this device's buffer minus what it sent, shape ``(n,)``; adding
      it to the next step's gradient is error feedback.
  """

  mean: jax.Array
  unsent: jax.Array


class OwnedShard(NamedTuple):
  """What TopKA2A's first phase (:func:`to_owners`) leaves one device.

  Attributes:
    layout: the buffer's shard layout.
    fmt: the wire format of its pairs.
    owned: this device's shard summed over every sender, ``(shard_length,)``.
    unsent: this device's unsent entries, ``(P, shard_length)``.
    received: the shard positions the senders sent, ``(P, per_shard)``, each
      row's distinct; ``owned`` is zero elsewhere.
  """

  layout: ShardLayout
  fmt: WireFormat
  owned: jax.Array
  unsent: jax.Array
  received: jax.Array


def check_buffer(buffer: jax.Array) -> None:
  """Raises a ValueError or TypeError unless ``buffer`` is a non-empty 1-D float array."""
  if buffer.ndim != 1 or buffer.shape[0] == 0:
    raise ValueError(
        f"expected a non-empty 1-D buffer, got shape {buffer.shape}; flatten "
        "the gradient first (the optax transform does this for you)"
    )
  if not jnp.issubdtype(buffer.dtype, jnp.floating):
    raise TypeError(f"expected a floating buffer, got dtype {buffer.dtype}")


def gated(values: jax.Array, send: jax.Array | None) -> jax.Array:
  """``values``, or zeros where ``send`` is False (a skipped step sends nothing)."""
  return values if send is None else jnp.where(send, values, jnp.zeros_like(values))


def _scatter_add_rows(
    length: int, indices: jax.Array, values: jax.Array
) -> jax.Array:
  """Sums sparse rows into a dense ``(length,)`` array, row 0 first.

  Indices are distinct within a row, so every row is a conflict-free scatter
  and the order of additions is fixed: the result is deterministic on every
  backend (a single scatter with duplicate indices is not on GPUs).
  """

  def add_row(row, dense):
    return dense.at[indices[row]].add(values[row], unique_indices=True)

  zeros = jnp.zeros_like(values, shape=(length,))  # same varying axes
  return lax.fori_loop(0, indices.shape[0], add_row, zeros)


def dense(
    buffer: jax.Array, axis_name: Hashable, density: float, *,
    value_dtype: jnp.dtype | None = None, selection: str = "exact",
    send: jax.Array | None = None,
) -> ExchangeResult:
  """The dense mean, ``lax.pmean``; sends everything, so nothing is unsent.

  Args:
    buffer: this device's 1-D floating buffer.
    axis_name: the mesh axis to average over.
    density: ignored; every entry is sent.
    value_dtype: ignored: an all-reduce adds in transit, so it runs in the
      buffer's dtype.
    selection: ignored; nothing is selected.
    send: a boolean scalar, the same on every device, or None (True). False
      sends nothing: the mean is zero and the whole buffer stays unsent (a
      skipped step).

  Returns:
    The :class:`ExchangeResult`.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> rows = jax.device_put(jnp.arange(8.0)[:, None] * jnp.ones((8, 3)),
    ...                       NamedSharding(mesh, P("data")))
    >>> jax.jit(jax.shard_map(lambda row: dense(row[0], "data", 1.0).mean, mesh=mesh,
    ...               in_specs=P("data"), out_specs=P()))(rows)
    Array([3.5, 3.5, 3.5], dtype=float32)
  """
  del density, value_dtype, selection
  check_buffer(buffer)
  bound_axis_size(axis_name)
  if send is None:
    return ExchangeResult(lax.pmean(buffer, axis_name), jnp.zeros_like(buffer))
  zeros = jnp.zeros_like(buffer)
  return ExchangeResult(lax.pmean(jnp.where(send, buffer, zeros), axis_name),
                        jnp.where(send, zeros, buffer))


def allgather(
    buffer: jax.Array, axis_name: Hashable, density: float, *,
    value_dtype: jnp.dtype | None = None, selection: str = "exact",
    send: jax.Array | None = None,
) -> ExchangeResult:
  """TopkA: all-gather every device's top-k pairs and sum them everywhere.

  Each device selects ``k = ceil(density * n)`` entries of its whole buffer
  by magnitude and all-gathers them with their global indices (one message);
  every device then adds the ``P * k`` pairs into a dense buffer, in device
  order, and divides by ``P``.

  Args:
    buffer: this device's 1-D floating buffer of ``n`` elements.
    axis_name: the mesh axis to average over.
    density: fraction of entries to send, in (0, 1].
    value_dtype: dtype of the values on the wire; None sends them as they are.
    selection: a key of :data:`topka2a_jax.collectives.SELECTIONS` (``"auto"``, ``"exact"``,
      ``"threshold"`` or ``"approx"``).
    send: as in :func:`dense`: False sends nothing.

  Returns:
    The :class:`ExchangeResult`.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> rows = jax.device_put(jnp.eye(8) * 8, NamedSharding(mesh, P("data")))
    >>> jax.jit(jax.shard_map(lambda row: allgather(row[0], "data", 1 / 8).mean,
    ...               mesh=mesh, in_specs=P("data"), out_specs=P()))(rows)
    Array([1., 1., 1., 1., 1., 1., 1., 1.], dtype=float32)
  """
  check_buffer(buffer)
  num_devices = bound_axis_size(axis_name)
  length = buffer.shape[0]
  fmt = WireFormat.create(value_dtype, length, buffer.dtype)
  select = get_selection(selection)
  values, indices = select(buffer[None], sparse_count(length, density))
  values = gated(fmt.rounded(values), send)
  gathered = lax.all_gather(fmt.encode(values, indices), axis_name, tiled=True,
                            to="invarying")
  all_values, all_indices = fmt.decode(gathered, buffer.dtype)
  total = _scatter_add_rows(length, all_indices, all_values)
  unsent = buffer.at[indices[0]].add(-values[0], unique_indices=True)
  return ExchangeResult(total / num_devices, unsent)


def to_owners(
    buffer: jax.Array, axis_name: Hashable, density: float,
    value_dtype: jnp.dtype | None, select: Selection, send: jax.Array | None = None,
) -> OwnedShard:
  """TopKA2A's first phase: shard-wise top-k, one AlltoAll, sum at the owner.

  ``send=False`` sends zeros: every owned shard sums to zero and the whole
  buffer stays unsent.

  Returns:
    The :class:`OwnedShard`: this device's summed shard, its unsent entries
    and the positions it received.
  """
  check_buffer(buffer)
  num_devices = bound_axis_size(axis_name)
  layout = ShardLayout.create(buffer.shape[0], num_devices, density)
  fmt = WireFormat.create(value_dtype, layout.shard_length, buffer.dtype)
  shards = padded_rows(buffer, num_devices)  # (P, shard_length)
  values, indices = select(shards, layout.per_shard)
  values = gated(fmt.rounded(values), send)
  received = lax.all_to_all(fmt.encode(values, indices), axis_name, 0, 0,
                            tiled=True)
  from_values, from_indices = fmt.decode(received, buffer.dtype)
  owned = _scatter_add_rows(layout.shard_length, from_indices, from_values)
  # One scatter at flat positions: in place, where a scatter over (row,
  # column) pairs copies the whole buffer first on XLA's CPU backend.
  flat = indices + layout.shard_length * jnp.arange(num_devices)[:, None]
  unsent = shards.reshape(-1).at[flat.ravel()].add(
      -values.ravel(), unique_indices=True).reshape(shards.shape)
  return OwnedShard(layout, fmt, owned, unsent, from_indices)


def add_to_own_row(rows: jax.Array, axis_name: Hashable, row: jax.Array) -> jax.Array:
  """``rows`` with ``row`` added to row ``i``, for device ``i`` of the axis.

  Used for an owner's shard-sized leftover, and for a device's slice of a
  residual: one update of a row at a dynamic index, in place.
  """
  return rows.at[lax.axis_index(axis_name)].add(row)


def topka2a(
    buffer: jax.Array, axis_name: Hashable, density: float, *,
    value_dtype: jnp.dtype | None = None, selection: str = "exact",
    send: jax.Array | None = None,
) -> ExchangeResult:
  """TopKA2A: shard-wise top-k, AlltoAll to owners, AllGather of the shards.

  1. Pad the buffer to ``P`` equal contiguous shards; shard ``i`` is owned by
     device ``i``. Select the top ``ceil(k / P)`` of every shard by
     magnitude, so each (sender, owner) pair carries the same number of
     entries.
  2. One ``all_to_all`` sends shard ``i``'s values and shard-local indices to
     device ``i``.
  3. Each owner adds the ``P`` received pieces into a dense zero shard: the
     exact sum of everyone's selection for that shard.
  4. A tiled ``all_gather`` of the dense shards, divided by ``P``, gives every
     device the whole, identical mean. With a narrower ``value_dtype`` the
     owner keeps the rounding of its shard in its own residual.

  Args:
    buffer: this device's 1-D floating buffer of ``n`` elements.
    axis_name: the mesh axis to average over.
    density: fraction of entries to send, in (0, 1].
    value_dtype: dtype of the values on the wire; None sends them as they are.
    selection: a key of :data:`topka2a_jax.collectives.SELECTIONS` (``"auto"``, ``"exact"``,
      ``"threshold"`` or ``"approx"``).
    send: as in :func:`dense`: False sends nothing.

  Returns:
    The :class:`ExchangeResult`.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> rows = jax.device_put(jnp.eye(8) * 8, NamedSharding(mesh, P("data")))
    >>> jax.jit(jax.shard_map(lambda row: topka2a(row[0], "data", 1 / 8).mean,
    ...               mesh=mesh, in_specs=P("data"), out_specs=P()))(rows)
    Array([1., 1., 1., 1., 1., 1., 1., 1.], dtype=float32)
  """
  layout, fmt, owned, unsent, _ = to_owners(buffer, axis_name, density, value_dtype,
                                             get_selection(selection), send)
  shard_mean = owned / layout.num_shards
  if fmt.value_dtype != buffer.dtype:
    sent = fmt.rounded(shard_mean)
    unsent = add_to_own_row(unsent, axis_name, owned - sent * layout.num_shards)
    shard_mean = sent
  gathered = fmt.decode_values(
      lax.all_gather(fmt.encode_values(shard_mean), axis_name, tiled=True,
                     to="invarying"), buffer.dtype)
  return ExchangeResult(gathered[: layout.length], unsent.reshape(-1)[: layout.length])


def topka2a_sparse(
    buffer: jax.Array, axis_name: Hashable, density: float, *,
    value_dtype: jnp.dtype | None = None, selection: str = "exact",
    send: jax.Array | None = None,
) -> ExchangeResult:
  """TopKA2A with a sparse second phase: O(k) volume, independent of n and P.

  Steps 1 to 3 are :func:`topka2a`'s. Then each owner selects the top
  ``ceil(k / P)`` of its summed shard, exactly and whatever ``selection``
  says: the shard is zero outside the positions it received, so the search
  runs over those alone. One tiled ``all_gather`` of those
  (value, index) pairs, divided by ``P`` before they travel (so a narrow
  ``value_dtype`` holds them), gives every device the mean. What the owner did not
  send of its summed shard stays in the owner's residual, so across the axis
  nothing is lost.

  Args:
    buffer: this device's 1-D floating buffer of ``n`` elements.
    axis_name: the mesh axis to average over.
    density: fraction of entries to send, in (0, 1], in each phase.
    value_dtype: dtype of the values on the wire; None sends them as they are.
    selection: a key of :data:`topka2a_jax.collectives.SELECTIONS` (``"auto"``, ``"exact"``,
      ``"threshold"`` or ``"approx"``).
    send: as in :func:`dense`: False sends nothing.

  Returns:
    The :class:`ExchangeResult`.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> rows = jax.device_put(jnp.eye(8) * 8, NamedSharding(mesh, P("data")))
    >>> jax.jit(jax.shard_map(lambda row: topka2a_sparse(row[0], "data", 1 / 8).mean,
    ...               mesh=mesh, in_specs=P("data"), out_specs=P()))(rows)
    Array([1., 1., 1., 1., 1., 1., 1., 1.], dtype=float32)
  """
  layout, fmt, owned, unsent, received = to_owners(
      buffer, axis_name, density, value_dtype, get_selection(selection), send)
  # Exact whatever the selection: owned is zero outside what was received.
  values, indices = top_of_received(owned, received, layout.per_shard)
  # Means, not sums, on the wire: a sum of P values that each fit a narrow
  # value_dtype need not fit it.
  values = fmt.rounded(values / layout.num_shards)
  unsent = add_to_own_row(unsent, axis_name, owned.at[indices[0]].add(
      -values[0] * layout.num_shards, unique_indices=True))
  gathered = lax.all_gather(fmt.encode(values, indices), axis_name, tiled=True,
                            to="invarying")
  from_values, from_indices = fmt.decode(gathered, buffer.dtype)
  positions = from_indices + layout.shard_length * jnp.arange(layout.num_shards)[:, None]
  # Owners' positions never collide; positions in the padding hold zeros.
  mean = jnp.zeros((layout.length,), buffer.dtype).at[positions.ravel()].set(
      from_values.ravel(), mode="drop", unique_indices=True)
  return ExchangeResult(mean, unsent.reshape(-1)[: layout.length])


def _sum_of_decoded_rows(words: jax.Array, scales: jax.Array, bits: int,
                         valid: jax.Array | None, dtype: jnp.dtype) -> jax.Array:
  """The sum over senders of their decoded codes, ``(chunks, chunk)``.

  One row at a time, in sender order: each row's decoding fuses into the
  addition, where decoding all rows first and reducing over them makes XLA
  write every decoded row out (four times slower on a CPU).
  """
  def decoded(row):
    return quantized.decode(words[row][None], scales[row][None], bits, valid, dtype)[0]

  return lax.fori_loop(1, words.shape[0], lambda row, total: total + decoded(row),
                       decoded(0))


def _codes_to_owners(
    shards: jax.Array, valid: jax.Array | None, cut: Chunking, bits: int,
    axis_name: Hashable, send: jax.Array | None, rotated: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """The first phase of the few-bit exchanges: codes by AlltoAll, summed at the owner.

  Args:
    shards: ``(P, chunks, chunk)``, row ``i`` the entries owned by device ``i``.
    valid: where ``shards`` holds entries (the rest is padding), or None.
    cut: the rows' chunking.
    bits: bits per entry of the codes.
    axis_name: the mesh axis.
    send: False sends nothing.
    rotated: code each chunk rotated (``rotation.rotate``; ``valid`` must
      then be None: a rotated chunk's padding holds real values). ``owned``
      is then the sum of the rotated rows; ``unsent`` is in the buffer's own
      coordinates.

  Returns:
    ``(owned, unsent, own)``: this device's row summed over every sender,
    ``(chunks, chunk)``; ``shards`` minus what was sent of them; and the
    ``(1, chunks, chunk)`` slice of ``valid`` for the owned row (or None).
  """
  dtype = shards.dtype
  words, scales = quantized.encode(rotation.rotate(shards) if rotated else shards,
                                   bits, valid)
  if send is not None:
    scales = jnp.where(send, scales, jnp.zeros_like(scales))
  decoded = quantized.decode(words, scales, bits, valid, dtype)
  unsent = shards - (rotation.unrotate(decoded) if rotated else decoded)
  received = lax.all_to_all(quantized.message(words, scales), axis_name, 0, 0,
                            tiled=True)
  own = (None if valid is None else
         lax.dynamic_index_in_dim(valid, lax.axis_index(axis_name), keepdims=True))
  owned = _sum_of_decoded_rows(*quantized.split(received, cut, bits), bits, own, dtype)
  return owned, unsent, own


def codes_to_owners(
    buffer: jax.Array, axis_name: Hashable, bits: int, *,
    chunk: int = CHUNK, send: jax.Array | None = None, rotated: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Every entry in ``bits`` bits to its owner, summed there: a few-bit reduce-scatter.

  The first phase of :func:`few_bit` on :func:`to_owners`' shards: device
  ``i`` owns entries ``[i m, (i + 1) m)`` of the buffer, ``m = ceil(n / P)``
  (each shard cut into chunks with their own scales). No second phase: the
  owner keeps the exact sum of what the devices sent, so the only rounding
  is each device's own, and it waits in the returned unsent entries.

  Args:
    buffer: this device's 1-D floating buffer of ``n`` elements.
    axis_name: the mesh axis to sum over.
    bits: bits per entry, 1, 2, 4 or 8.
    chunk: entries per scale.
    send: a boolean scalar, the same on every device, or None (True). False
      sends nothing: every owned shard sums to zero and the whole buffer
      stays unsent.
    rotated: rotate each chunk before its code (``rotation.py``); the owner
      rotates its sum back.

  Returns:
    ``(owned, unsent)``: this device's shard summed over every device,
    ``(m,)``, and this device's buffer minus its decoded codes, ``(n,)``.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> rows = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data")))
    >>> jax.jit(jax.shard_map(lambda row: codes_to_owners(row[0], "data", 4)[0],
    ...                       mesh=mesh, in_specs=P("data"), out_specs=P("data")))(rows)
    Array([8., 8., 8., 8., 8., 8., 8., 8., 8., 8., 8., 8., 8., 8., 8., 8.], dtype=float32)
  """
  check_buffer(buffer)
  num_devices = bound_axis_size(axis_name)
  length, dtype = buffer.shape[0], jnp.promote_types(buffer.dtype, jnp.float32)
  width = ceil_div(length, num_devices)
  cut = chunking(width, chunk, powers_of_two=rotated)
  rows = jnp.pad(padded_rows(buffer.astype(dtype), num_devices),
                 ((0, 0), (0, cut.padded - width)))
  shape = (num_devices, cut.chunks, cut.chunk)
  positions = jnp.arange(cut.padded)
  valid = None if rotated or cut.padded * num_devices == length else (  # None: no padding
      (positions < width)[None] & (positions[None] + width * jnp.arange(
          num_devices)[:, None] < length)).reshape(shape)
  owned, unsent, _ = _codes_to_owners(rows.reshape(shape), valid, cut, bits, axis_name,
                                      send, rotated)
  if rotated:
    owned = rotation.unrotate(owned)
  unsent = unsent.reshape(num_devices, cut.padded)[:, :width].reshape(-1)[:length]
  return (owned.reshape(-1)[:width].astype(buffer.dtype), unsent.astype(buffer.dtype))


def few_bit(
    buffer: jax.Array, axis_name: Hashable, density: float = 1.0, *,
    value_dtype: jnp.dtype | None = None, selection: str = "exact",
    send: jax.Array | None = None, bits: int = 4, gather_bits: int = 8,
    chunk: int = CHUNK, rotated: bool = False,
) -> ExchangeResult:
  """Every entry in ``bits`` bits to its shard's owner, the owners' means back in ``gather_bits``.

  TopKA2A's structure with a quantizer in place of the top-k, and error
  feedback on both phases (1-bit Adam's compressed all-reduce at
  ``bits=1``; ZeRO++'s 4-bit AlltoAll with the rounding kept):

  1. Pad the buffer to ``P`` equal shards, each cut into chunks of ``chunk``
     entries (a shorter shard is one chunk, rounded up to 32 entries).
     Each chunk goes as one code of ``bits`` bits per entry and one float32
     scale (``quantized.encode``: signs times the mean magnitude at one
     bit, symmetric integers up to the largest magnitude above).
  2. One ``all_to_all`` sends shard ``i``'s codes and scales to device ``i``.
  3. Each owner decodes and adds the ``P`` pieces: the exact sum of what the
     devices sent for its shard.
  4. The owner rounds its shard's mean to ``gather_bits`` bits per entry
     (chunk scales again), keeps the rounding in its own residual, and one
     tiled ``all_gather`` gives every device the same mean.

  Every entry is sent every step, at about ``bits + gather_bits`` bits per
  entry in all; what the rounding leaves out waits in the residuals: each
  device keeps its buffer minus its decoded codes, and on its own shard
  also the owners' rounding (times ``P``, as the sum it came from). Each
  entry's error is therefore bounded by half a quantization step, not
  carried for many steps as a top-k carries it.

  Args:
    buffer: this device's 1-D floating buffer of ``n`` elements.
    axis_name: the mesh axis to average over.
    density: ignored: every entry is sent.
    value_dtype: ignored: codes and float32 scales are the wire format.
    selection: ignored; nothing is selected.
    send: as in :func:`dense`: False sends nothing.
    bits: bits per entry of the first phase, 1, 2, 4 or 8.
    gather_bits: bits per entry of the second phase, 1, 2, 4 or 8.
    chunk: entries per scale, in both phases.
    rotated: rotate each chunk by a random-sign Walsh-Hadamard transform
      before its code, in both phases (``rotation.py``), so that one large
      entry does not set a coarse step for the whole chunk. The owners add
      the rotated codes; every device rotates the gathered means back. The
      chunks are then a power of two long (``chunk`` itself must be one),
      and a chunk's padding is coded with it: the rounding the rotation
      puts there is no entry's, so nothing owed is lost.

  Returns:
    The :class:`ExchangeResult`.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> row = np.linspace(-1.0, 1.0, 64, dtype=np.float32)  # every device's
    >>> same = jax.device_put(np.tile(row, (8, 1)), NamedSharding(mesh, P("data")))
    >>> exchange = jax.jit(jax.shard_map(
    ...     lambda rows: few_bit(rows[0], "data", bits=8).mean, mesh=mesh,
    ...     in_specs=P("data"), out_specs=P()))
    >>> bool(np.abs(np.asarray(exchange(same)) - row).max() <= 0.5 / 127)  # half a step
    True
  """
  del density, value_dtype, selection
  check_buffer(buffer)
  num_devices = bound_axis_size(axis_name)
  length, dtype = buffer.shape[0], jnp.promote_types(buffer.dtype, jnp.float32)
  cut = chunking(ceil_div(length, num_devices), chunk, powers_of_two=rotated)
  shape, total = (num_devices, cut.chunks, cut.chunk), num_devices * cut.padded
  valid = (None if rotated or total == length else
           jnp.arange(total).reshape(shape) < length)
  shards = jnp.pad(buffer.astype(dtype), (0, total - length)).reshape(shape)
  owned, unsent, own = _codes_to_owners(shards, valid, cut, bits, axis_name, send,
                                        rotated)
  mean = (owned / num_devices)[None]
  mean_words, mean_scales = quantized.encode(mean, gather_bits, own)
  delivered = quantized.decode(mean_words, mean_scales, gather_bits, own, dtype)[0]
  owed = owned - delivered * num_devices
  unsent = add_to_own_row(unsent, axis_name,
                          rotation.unrotate(owed) if rotated else owed)
  gathered = lax.all_gather(quantized.message(mean_words, mean_scales), axis_name,
                            tiled=True, to="invarying")
  means = quantized.decode(*quantized.split(gathered, cut, gather_bits), gather_bits,
                           valid, dtype)
  if rotated:
    means = rotation.unrotate(means)
  return ExchangeResult(means.reshape(-1)[:length].astype(buffer.dtype),
                        unsent.reshape(-1)[:length].astype(buffer.dtype))


def onebit(
    buffer: jax.Array, axis_name: Hashable, density: float = 1.0, *,
    value_dtype: jnp.dtype | None = None, selection: str = "exact",
    send: jax.Array | None = None, gather_bits: int = 8,
    chunk: int = CHUNK,
) -> ExchangeResult:
  """Every entry's sign to its shard's owner, the owners' means back in few bits.

  :func:`few_bit` with ``bits=1``: each chunk goes as its signs, packed 32
  to a word, and one scale, its mean magnitude (1-bit Adam's compressed
  all-reduce, Tang et al. 2021, with the second phase's precision kept).

  Its arguments are :func:`few_bit`'s without ``bits``; ``gather_bits=1`` is
  DeepSpeed's, 8 keeps what the first phase sent (see the Adam guide).

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> rows = jax.device_put(jnp.ones((8, 40)) * jnp.arange(1.0, 9.0)[:, None],
    ...                       NamedSharding(mesh, P("data")))  # device i: all i + 1
    >>> mean = jax.jit(jax.shard_map(lambda row: onebit(row[0], "data").mean,
    ...                  mesh=mesh, in_specs=P("data"), out_specs=P()))(rows)
    >>> mean[:3]  # 4.5 in 8 bits: 127 steps of 4.5 / 127 in float32
    Array([4.4999995, 4.4999995, 4.4999995], dtype=float32)
  """
  return few_bit(buffer, axis_name, density, value_dtype=value_dtype,
                 selection=selection, send=send, bits=1, gather_bits=gather_bits,
                 chunk=chunk)


def two_level(
    buffer: jax.Array, axis_name: tuple[Hashable, Hashable], density: float, *,
    value_dtype: jnp.dtype | None = None, selection: str = "exact",
    outer: Callable[..., ExchangeResult] = topka2a, send: jax.Array | None = None,
    limit: float | jax.Array | None = None,
) -> ExchangeResult:
  """Dense inside a node, sparse between nodes: reduce-scatter, exchange, all-gather.

  ``axis_name`` is ``(outer axis, inner axis)``, e.g. ``("node", "local")``:
  the inner axis joins the devices of one node by a fast link, the outer
  axis the nodes by a slow one. With ``L`` devices per node:

  1. ``lax.psum_scatter`` over the inner axis: device ``j`` of a node gets
     its node's sum of slice ``j`` of the buffer (``m = ceil(n / L)``
     entries; the buffer is zero-padded to ``L m``).
  2. ``outer`` (a sparse exchange of this module) over the outer axis on that
     slice, with the devices that hold slice ``j`` in the other nodes.
  3. ``lax.all_gather`` over the inner axis of the slices' means.

  The slow link then carries one slice per device instead of the whole
  buffer, and what the outer exchange does not send is this device's slice
  of its node's unsent sum: adding it to slice ``j`` of the next buffer
  (error feedback) puts it back into that slice's node sum. So each device
  keeps ``m`` unsent entries, not ``n``.

  Args:
    buffer: this device's 1-D floating buffer of ``n`` elements.
    axis_name: ``(outer, inner)`` mesh axes.
    density: fraction of each slice sent over the outer axis, in (0, 1].
    value_dtype: dtype of the values on the outer wire; None sends them as
      they are.
    selection: a key of :data:`topka2a_jax.collectives.SELECTIONS`.
    outer: the exchange over the outer axis: :func:`topka2a` (the default),
      :func:`topka2a_sparse`, :func:`allgather` or :func:`dense`.
    send: as in :func:`dense`, for the exchange between nodes: False makes
      the mean zero and leaves each device its slice of its node's sum.
    limit: the largest magnitude the outer wire carries (a narrow
      ``value_dtype``'s range), or None: each node's sum is clipped to it
      before the outer exchange, and the excess stays in this device's slice.

  Returns:
    The :class:`ExchangeResult`: the mean over both axes (``n`` entries), and what
    was not sent of this device's slice (``m`` entries, zero in the padding).

  Example:
    >>> mesh = jax.make_mesh((2, 4), ("node", "local"))
    >>> rows = jax.device_put(jnp.arange(8 * 16.0).reshape(8, 16),
    ...                       NamedSharding(mesh, P(("node", "local"))))
    >>> @jax.jit
    ... @jax.shard_map(mesh=mesh, in_specs=P(("node", "local")),
    ...                out_specs=(P(), P(("node", "local"))))
    ... def exchange(row):
    ...   mean, unsent = two_level(row[0], ("node", "local"), density=0.5)
    ...   return mean, unsent[None]
    >>> mean, unsent = exchange(rows)  # unsent: (8, 4), one slice per device
    >>> owed = np.asarray(unsent).reshape(2, 16).sum(0)  # nodes' slices, side by side
    >>> bool(jnp.allclose(8 * mean + owed, rows.sum(0)))  # nothing lost
    True
  """
  check_buffer(buffer)
  outer_axis, inner_axis = axis_name
  per_node = bound_axis_size(inner_axis)
  length = buffer.shape[0]
  rows = padded_rows(buffer, per_node)
  node_sum = lax.psum_scatter(rows, inner_axis, scatter_dimension=0, tiled=True)[0]
  sent = node_sum if limit is None else jnp.clip(node_sum, -limit, limit)
  result = outer(sent, outer_axis, density, value_dtype=value_dtype,
                 selection=selection, send=send)
  mean = lax.all_gather(result.mean / per_node, inner_axis, tiled=True, to="invarying")
  unsent = result.unsent if limit is None else result.unsent + (node_sum - sent)
  return ExchangeResult(mean[:length], unsent)
