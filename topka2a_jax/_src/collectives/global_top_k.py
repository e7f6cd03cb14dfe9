"""The two sparse all-reduces that select a global top-k: gTop-k and Ok-Topk.

TopKA2A selects per shard, so that every (sender, owner) pair carries a
fixed count. The two exchanges here select the top ``k`` of each device's
whole buffer, as the papers do, and then a global top ``k`` of the sums;
their counts per message vary with the data, which XLA's fixed shapes do not
allow. This module gives each the fixed shapes below, and keeps the error
feedback exact: whatever is not delivered waits in some device's residual.

* :func:`gtopk` (Shi et al., ICDCS 2019): every device's top ``k`` pairs
  merge up a tree of recursive doubling. In round ``r`` each device swaps
  its list with the device ``2^r`` away (``lax.ppermute``), and both sum
  where indices meet and keep the top ``k`` of the merge. After
  ``log2(P)`` rounds every device holds the same global top ``k``, where
  the authors' code (in ``Shigangli/Ok-Topk``) reduces up a binomial tree
  to device 0 and broadcasts from there. What a merge drops waits in the
  residual of the merged group's first device; that code hands each device
  back its own entries outside the global top ``k``, which loses the mass
  of an index that one merge drops and a later merge keeps. With ``P`` not
  a power of two, the devices past the largest power of two first hand
  their lists to devices ``0, 1, ...`` and get the result back at the end:
  two more rounds. One all-gather of a ``1 / P`` slice from each device
  ends it (:func:`gtopk` says why).
* :func:`oktopk` (Li and Hoefler, PPoPP 2022): a sparse reduce-scatter over
  ``P`` regions of the buffer whose boundaries balance the selected entries
  across the owners, the top of each region at its owner, and an
  all-gather of those. Fixed shapes replace the paper's variable counts:
  each device sends at most ``algorithms.OKTOPK_CAPACITY`` times ``ceil(k / P)``
  entries to each owner (more stay in its residual), and each owner sends
  ``ceil(k / P)``, the top of its region (the rest stays in the owner's
  residual). The regions are balanced from this step's selection, by one
  small all-reduce of a histogram, where the paper reuses the last
  balancing for some steps: a collective carries no state from step to
  step.

gTop-k's lists hold values divided by ``P`` (partial means) and Ok-Topk's
owners send means, so that a narrow ``value_dtype`` holds what travels;
each rounds to it before a message and keeps the rounding in a residual.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> rows = jax.device_put(jnp.eye(8) * jnp.arange(8.0, 65.0, 8.0)[:, None],
  ...                       NamedSharding(mesh, P("data")))  # device i: 8(i+1) at i
  >>> jax.jit(jax.shard_map(lambda row: gtopk(row[0], "data", 1 / 8).mean,
  ...               mesh=mesh, in_specs=P("data"), out_specs=P()))(rows)  # k = 1
  Array([0., 0., 0., 0., 0., 0., 0., 8.], dtype=float32)

References:
  Shi, Wang, Chu, Li. A Distributed Synchronous SGD Algorithm with Global
  Top-k Sparsification for Low Bandwidth Networks. ICDCS 2019.

  Li, Hoefler. Near-Optimal Sparse Allreduce for Distributed Deep Learning.
  PPoPP 2022. Code: github.com/Shigangli/Ok-Topk.
"""

from __future__ import annotations

from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax

from topka2a_jax._src.axis import bound_axis_size
from topka2a_jax._src.collectives.algorithms import (
  doubling_rounds,
  oktopk_bins,
  oktopk_capacity,
)
from topka2a_jax._src.collectives.exchanges import ExchangeResult, check_buffer, gated
from topka2a_jax._src.collectives.packed_flags import set_positions
from topka2a_jax._src.collectives.received import top_of_keys
from topka2a_jax._src.collectives.selection import get_selection
from topka2a_jax._src.collectives.wire import WireFormat
from topka2a_jax._src.sizes import ceil_div, sparse_count


def _magnitude_keys(values: jax.Array) -> jax.Array:
  """Keys that order entries by magnitude: float32 magnitudes' bit patterns."""
  return lax.bitcast_convert_type(jnp.abs(values).astype(jnp.float32), jnp.int32)


def _top_of(values: jax.Array, keys: jax.Array, k: int) -> jax.Array:
  """Positions of the ``k`` largest ``keys``, in list order (ties to the first).

  A bisection over the keys' bits (``received.top_of_keys``), where a sort
  costs several times more on XLA's CPU backend; wider floats sort.
  """
  if values.dtype.itemsize > 4:
    _, top = lax.top_k(jnp.where(keys < 0, -1.0, jnp.abs(values)), k)
  else:
    top = top_of_keys(keys, k)  # those above the k-th first, then its ties
  taken = jnp.zeros(keys.shape[0], jnp.int32).at[top].set(1, unique_indices=True)
  return set_positions([taken[None]], k)[0]


def _merged(first: tuple[jax.Array, jax.Array], second: tuple[jax.Array, jax.Array],
            k: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Two lists of ``k`` (value, index) pairs, each sorted by distinct indices, merged.

  The lists interleave by index (``first``'s entry before ``second``'s at
  an index both hold), the values are summed where indices meet, and the
  ``k`` largest sums by magnitude are kept in index order (ties to the
  lower index). The same two lists give the same bits on every device.

  Returns:
    ``(values, indices, dropped, at)``: the ``k`` kept pairs, sorted by
    index, and ``2k`` values that the merge did not keep at their indices
    (zeros elsewhere).
  """
  slots = jnp.arange(k)
  to_first = slots + jnp.searchsorted(second[1], first[1], side="left")
  to_second = slots + jnp.searchsorted(first[1], second[1], side="right")
  at = jnp.zeros(2 * k, jnp.int32).at[to_first].set(first[1], unique_indices=True).at[
      to_second].set(second[1], unique_indices=True)
  values = jnp.zeros(2 * k, first[0].dtype).at[to_first].set(
      first[0], unique_indices=True).at[to_second].set(second[0], unique_indices=True)
  repeats_next = jnp.append(at[1:] == at[:-1], False)
  summed = values + jnp.where(repeats_next, jnp.append(values[1:], 0), 0)
  repeat = jnp.concatenate([jnp.zeros(1, bool), repeats_next[:-1]])
  summed = jnp.where(repeat, jnp.zeros_like(summed), summed)
  # A repeat is never kept: at least k indices are distinct.
  top = _top_of(summed, jnp.where(repeat, -1, _magnitude_keys(summed)), k)
  dropped = summed.at[top].set(0, unique_indices=True)
  return summed[top], at[top], dropped, at


def _swap(fmt: WireFormat, values: jax.Array, indices: jax.Array, axis_name: Hashable,
          pairs: list[tuple[int, int]], dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
  """One message of ``(value, index)`` pairs along ``pairs`` (zeros where none comes)."""
  message = lax.ppermute(fmt.encode(values[None], indices[None]), axis_name, pairs)
  got_values, got_indices = fmt.decode(message, dtype)
  return got_values[0], got_indices[0]


def _rounded(fmt: WireFormat, values: jax.Array, indices: jax.Array, unsent: jax.Array,
             keeper: jax.Array | bool, num_devices: int) -> tuple[jax.Array, jax.Array]:
  """A list of partial means as it travels; ``keeper`` keeps the rounding, times ``P``."""
  if fmt.value_dtype == values.dtype:  # nothing rounds: no scatter of zeros
    return values, unsent
  sent = fmt.rounded(values)
  owed = jnp.where(keeper, (values - sent) * num_devices, 0)
  return sent, unsent.at[indices].add(owed, unique_indices=True)


def _merge_into(ours: tuple[jax.Array, jax.Array], theirs: tuple[jax.Array, jax.Array],
                unsent: jax.Array, *, takes: jax.Array, ours_first: jax.Array,
                keeper: jax.Array, k: int, fmt: WireFormat, num_devices: int,
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One round's merge on the devices that ``take`` one (the others keep their list).

  The lower group's list goes first, so that both partners compute the same
  bits; ``keeper`` (the merged group's first device) keeps what the merge
  drops, and the rounding of the merged list, times ``P``.
  """
  first = jax.tree.map(lambda a, b: jnp.where(ours_first, a, b), ours, theirs)
  second = jax.tree.map(lambda a, b: jnp.where(ours_first, b, a), ours, theirs)
  values, indices, dropped, at = _merged(first, second, k)
  unsent = unsent.at[at].add(jnp.where(keeper & takes, dropped * num_devices, 0))
  values = jnp.where(takes, values, ours[0])
  indices = jnp.where(takes, indices, ours[1])
  values, unsent = _rounded(fmt, values, indices, unsent, keeper & takes, num_devices)
  return values, indices, unsent


def _as_one_list(fmt: WireFormat, values: jax.Array, indices: jax.Array,
                 axis_name: Hashable, num_devices: int, dtype: jnp.dtype,
                 ) -> tuple[jax.Array, jax.Array]:
  """The list every device holds, typed the same on every device.

  JAX types what a ``ppermute`` delivers as varying along the axis, and
  only a sum or an all-gather over the axis gives a value typed invariant,
  as every exchange's mean is. So each device sends its ``1 / P`` slice of
  the list (all hold the same bits) in one all-gather.
  """
  k = values.shape[0]
  per_device = ceil_div(k, num_devices)
  padding = per_device * num_devices - k
  packed = fmt.encode(jnp.pad(values, (0, padding)).reshape(num_devices, per_device),
                      jnp.pad(indices, (0, padding)).reshape(num_devices, per_device))
  own = lax.dynamic_index_in_dim(packed, lax.axis_index(axis_name), keepdims=True)
  gathered = lax.all_gather(own, axis_name, tiled=True, to="invarying")
  values, indices = fmt.decode(gathered, dtype)
  return values.reshape(-1)[:k], indices.reshape(-1)[:k]


def gtopk(
    buffer: jax.Array, axis_name: Hashable, density: float, *,
    value_dtype: jnp.dtype | None = None, selection: str = "exact",
    send: jax.Array | None = None,
) -> ExchangeResult:
  """gTop-k: every device's top-k, merged up a tree of recursive doubling.

  1. Each device selects ``k = ceil(density * n)`` entries of its whole
     buffer by magnitude and divides them by ``P``.
  2. With ``P`` not a power of two, device ``2^m + j`` (``2^m`` the largest
     power of two below ``P``) sends its list to device ``j``, which merges.
  3. For ``r = 0 .. m - 1``, device ``i < 2^m`` swaps its list with device
     ``i XOR 2^r``; both merge the two lists (sum where indices meet, keep
     the top ``k``). What the merge drops goes into the residual of the
     merged group's first device, ``i`` with ``i mod 2^(r+1) = 0``.
  4. Device ``j`` sends the result back to device ``2^m + j``.

  5. Every device then holds the same ``k`` pairs, the mean; one
     all-gather of a ``1 / P`` slice from each device gives it the type of
     a value the same on every device, which JAX gives a ``ppermute``'s
     result no matter what it holds.

  Each message of the tree is ``k`` pairs; the sequence is ``m`` rounds,
  two more when ``P`` is not a power of two, and the all-gather. Before
  each message the list is rounded to ``value_dtype`` and the rounding
  waits with the group's first device.

  Args:
    buffer: this device's 1-D floating buffer of ``n`` elements.
    axis_name: the mesh axis to average over.
    density: fraction of entries to send, in (0, 1].
    value_dtype: dtype of the values on the wire; None sends them as they are.
    selection: a key of :data:`topka2a_jax.collectives.SELECTIONS`, for step 1.
    send: as in :func:`topka2a_jax.collectives.dense`: False sends nothing.

  Returns:
    The :class:`ExchangeResult`.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> rows = jax.device_put(jnp.eye(8) * jnp.arange(8.0, 65.0, 8.0)[:, None],
    ...                       NamedSharding(mesh, P("data")))  # device i: 8(i+1) at i
    >>> jax.jit(jax.shard_map(lambda row: gtopk(row[0], "data", 1 / 8).mean,
    ...               mesh=mesh, in_specs=P("data"), out_specs=P()))(rows)  # k = 1
    Array([0., 0., 0., 0., 0., 0., 0., 8.], dtype=float32)
  """
  check_buffer(buffer)
  num_devices = bound_axis_size(axis_name)
  length, dtype = buffer.shape[0], buffer.dtype
  k = sparse_count(length, density)
  fmt = WireFormat.create(value_dtype, length, dtype)
  rank = lax.axis_index(axis_name)
  rounds, extra = doubling_rounds(num_devices)
  active = 1 << rounds

  picked, chosen = get_selection(selection)(buffer[None], k)
  indices, picked = lax.sort((chosen[0], gated(picked[0], send)), num_keys=1)
  unsent = buffer.at[indices].add(-picked, unique_indices=True)
  values, unsent = _rounded(fmt, picked / num_devices, indices, unsent, True, num_devices)
  if extra:  # devices past the power of two hand their lists down
    theirs = _swap(fmt, values, indices, axis_name,
                   [(active + j, j) for j in range(extra)], dtype)
    values, indices, unsent = _merge_into(
        (values, indices), theirs, unsent, takes=rank < extra, ours_first=True,
        keeper=rank < extra, k=k, fmt=fmt, num_devices=num_devices)
  for r in range(rounds):
    partner = 1 << r
    theirs = _swap(fmt, values, indices, axis_name,
                   [(i, i ^ partner) for i in range(active)], dtype)
    values, indices, unsent = _merge_into(
        (values, indices), theirs, unsent, takes=rank < active,
        ours_first=(rank & partner) == 0,
        keeper=(rank % (2 * partner) == 0) & (rank < active),
        k=k, fmt=fmt, num_devices=num_devices)
  if extra:  # and get the result back
    back_values, back_indices = _swap(fmt, values, indices, axis_name,
                                      [(j, active + j) for j in range(extra)], dtype)
    values = jnp.where(rank < active, values, back_values)
    indices = jnp.where(rank < active, indices, back_indices)
  values, indices = _as_one_list(fmt, values, indices, axis_name, num_devices, dtype)
  mean = jnp.zeros((length,), dtype).at[indices].add(values, unique_indices=True)
  return ExchangeResult(mean, unsent)


def _run_sums(keys: jax.Array, values: jax.Array, longest: int) -> jax.Array:
  """Each position's sum over its run of equal ``keys`` up to itself.

  A segmented scan in ``ceil(log2(longest))`` steps, ``longest`` the
  longest run: the additions' order is fixed, so the sums are the same on
  every backend (a scatter-add of equal indices is not on GPUs).
  """
  starts = jnp.concatenate([jnp.ones(1, bool), keys[1:] != keys[:-1]])
  shift = 1
  while shift < longest:
    before = jnp.concatenate([jnp.zeros(shift, values.dtype), values[:-shift]])
    started = jnp.concatenate([jnp.ones(shift, bool), starts[:-shift]])
    values = jnp.where(starts, values, values + before)
    starts = starts | started
    shift *= 2
  return values


def _regions(indices: jax.Array, length: int, num_devices: int,
             axis_name: Hashable) -> jax.Array:
  """The owner of every selected index: regions balanced by all devices' selections.

  A histogram of the selected indices over fixed bins, summed over the axis
  (one small all-reduce); the regions are runs of bins that each hold
  about ``1 / P`` of all devices' selected entries.
  """
  bins, width = oktopk_bins(length, num_devices)
  counts = lax.psum(jnp.zeros(bins, jnp.int32).at[indices // width].add(1), axis_name)
  share = jnp.maximum((jnp.sum(counts) + num_devices - 1) // num_devices, 1)
  owner_of_bin = jnp.minimum((jnp.cumsum(counts) - counts) // share, num_devices - 1)
  return owner_of_bin[indices // width]


def _within_capacity(owner: jax.Array, values: jax.Array, num_devices: int,
                     capacity: int) -> jax.Array:
  """Which of a device's selected entries go: each owner's largest ``capacity``.

  ``owner`` rises along the list. Where no owner gets more than
  ``capacity`` (as balanced regions mostly make it), all go, and nothing
  is sorted; else each owner's entries are ranked by magnitude (ties to the
  lower index) and the first ``capacity`` go.
  """
  counts = jnp.bincount(owner, length=num_devices)

  def ranked(_):
    order = jnp.arange(owner.shape[0])
    owners, _, _, order = lax.sort(
        (owner, -jnp.abs(values).astype(jnp.float32), order, order), num_keys=3)
    rank = jnp.arange(owner.shape[0]) - (jnp.cumsum(counts) - counts)[owners]
    return jnp.zeros(owner.shape, bool).at[order].set(rank < capacity,
                                                      unique_indices=True)

  return lax.cond(jnp.any(counts > capacity), ranked,
                  lambda _: owner >= 0, None)  # all, typed as the list


def _merged_rows(keys: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Rows of rising ``keys`` merged into one rising list, earlier rows first at a tie.

  Pairs of rows merge by binary search, ``log2`` of the rows' count times:
  a sort of the whole list costs several times more on XLA's CPU backend.
  """
  rows = keys.shape[0]
  padded = 1 << (rows - 1).bit_length()
  keys = jnp.pad(keys, ((0, padded - rows), (0, 0)), constant_values=jnp.iinfo(jnp.int32).max)
  values = jnp.pad(values, ((0, padded - rows), (0, 0)))

  def merge_two(key_pair, value_pair):
    (first, second), width = key_pair, key_pair.shape[1]
    to_first = jnp.arange(width) + jnp.searchsorted(second, first, side="left")
    to_second = jnp.arange(width) + jnp.searchsorted(first, second, side="right")
    merged = jnp.zeros(2 * width, keys.dtype).at[to_first].set(first).at[to_second].set(second)
    merged_values = jnp.zeros(2 * width, values.dtype).at[to_first].set(
        value_pair[0]).at[to_second].set(value_pair[1])
    return merged, merged_values

  while keys.shape[0] > 1:
    keys, values = jax.vmap(merge_two)(keys.reshape(-1, 2, keys.shape[1]),
                                       values.reshape(-1, 2, values.shape[1]))
  return keys[0], values[0]


def oktopk(
    buffer: jax.Array, axis_name: Hashable, density: float, *,
    value_dtype: jnp.dtype | None = None, selection: str = "exact",
    send: jax.Array | None = None,
) -> ExchangeResult:
  """Ok-Topk: a balanced sparse reduce-scatter, a top-k per region, an all-gather.

  1. Each device selects ``k = ceil(density * n)`` entries of its whole
     buffer by magnitude.
  2. A histogram of every device's selected positions (an all-reduce of
     ``algorithms.OKTOPK_BINS_PER_DEVICE * P`` counts) cuts the buffer into
     ``P`` contiguous regions holding about equal shares of the selections;
     device ``i`` owns region ``i``.
  3. Each device sends each owner its largest selected entries in that
     region, at most ``c = algorithms.OKTOPK_CAPACITY * ceil(k / P)``
     (one AlltoAll of ``c`` pairs a peer); the rest of its selection waits
     in its residual.
  4. Each owner sums what it received, sends the top ``ceil(k / P)`` sums
     of its region divided by ``P`` (one AllGather of pairs), and keeps the
     other sums in its residual.

  Indices address the whole buffer. Each device's entries for an owner
  travel in rising index order, then zeros at index 0 fill the message: the
  owner tells them apart by where the rise ends, and merges the rows
  without a sort. A region is balanced to within one bin
  of the histogram, so it can hold more sums than its owner sends, even at
  density 1: those wait a step in the owner's residual (this exchange is
  not ``lax.pmean`` at density 1).

  Args:
    buffer: this device's 1-D floating buffer of ``n`` elements.
    axis_name: the mesh axis to average over.
    density: fraction of entries to send, in (0, 1].
    value_dtype: dtype of the values on the wire; None sends them as they are.
    selection: a key of :data:`topka2a_jax.collectives.SELECTIONS`, for step 1.
    send: as in :func:`topka2a_jax.collectives.dense`: False sends nothing.

  Returns:
    The :class:`ExchangeResult`.

  Example:
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> rows = jax.device_put(jnp.eye(8) * 8, NamedSharding(mesh, P("data")))
    >>> jax.jit(jax.shard_map(lambda row: oktopk(row[0], "data", 1 / 8).mean,
    ...               mesh=mesh, in_specs=P("data"), out_specs=P()))(rows)
    Array([1., 1., 1., 1., 1., 1., 1., 1.], dtype=float32)
  """
  check_buffer(buffer)
  num_devices = bound_axis_size(axis_name)
  length, dtype = buffer.shape[0], buffer.dtype
  k = sparse_count(length, density)
  per_owner = ceil_div(k, num_devices)
  capacity = oktopk_capacity(k, num_devices)
  fmt = WireFormat.create(value_dtype, length, dtype)

  picked, chosen = get_selection(selection)(buffer[None], k)
  # In index order, each owner's region is one run of the list.
  chosen, picked = lax.sort((chosen[0], fmt.rounded(gated(picked[0], send))), num_keys=1)
  owner = _regions(chosen, length, num_devices, axis_name)
  goes = _within_capacity(owner, picked, num_devices, capacity)
  sent = jnp.cumsum(goes) - 1  # each going entry's rank among those going
  per_region = jnp.zeros(num_devices, jnp.int32).at[owner].add(goes.astype(jnp.int32))
  rank = sent - (jnp.cumsum(per_region) - per_region)[owner]
  # Each entry that stays gets a slot of its own past the message, which the
  # scatter drops: its indices are unique, as it promises XLA.
  slot = jnp.where(goes, owner * capacity + rank, num_devices * capacity + jnp.arange(k))
  out_values = jnp.zeros(num_devices * capacity, dtype).at[slot].set(
      picked, mode="drop", unique_indices=True)
  out_indices = jnp.zeros(num_devices * capacity, jnp.int32).at[slot].set(
      chosen, mode="drop", unique_indices=True)
  unsent = buffer.at[chosen].add(jnp.where(goes, -picked, 0), unique_indices=True)
  received = lax.all_to_all(
      fmt.encode(out_values.reshape(num_devices, capacity),
                 out_indices.reshape(num_devices, capacity)), axis_name, 0, 0, tiled=True)
  got_values, got_indices = fmt.decode(received, dtype)

  # The owner: each sender's row rises in index until its padding; merge
  # the rows in index order, sum each position's entries (in sender order),
  # keep the top.
  rising = jnp.concatenate([jnp.ones((num_devices, 1), bool),
                            got_indices[:, 1:] > got_indices[:, :-1]], axis=1)
  real = lax.cummin(rising.astype(jnp.int32), axis=1).astype(bool)
  key, got_values = _merged_rows(jnp.where(real, got_indices, length),
                                 jnp.where(real, got_values, 0))
  got_indices = jnp.minimum(key, length - 1)
  sums = _run_sums(key, got_values, num_devices)
  last = (key < length) & jnp.append(key[1:] != key[:-1], True)
  sums = jnp.where(last, sums, jnp.zeros_like(sums))
  top = _top_of(sums, jnp.where(last, _magnitude_keys(sums), -1), per_owner)
  means = fmt.rounded(sums[top] / num_devices)
  kept = sums.at[top].add(-means * num_devices, unique_indices=True)
  unsent = unsent.at[got_indices].add(kept)
  gathered = lax.all_gather(fmt.encode(means[None], got_indices[top][None]), axis_name,
                            tiled=True, to="invarying")
  all_means, all_indices = fmt.decode(gathered, dtype)
  mean = jnp.zeros((length,), dtype).at[all_indices.reshape(-1)].add(all_means.reshape(-1))
  return ExchangeResult(mean, unsent)
