"""The exchanges themselves, for a step you write with ``jax.shard_map``.

Each collective is called inside ``jax.shard_map`` on one device's 1-D
buffer and returns an :class:`ExchangeResult`: the mean over the data axis
(identical on every device) and what this device did not send, which error
feedback keeps for the next step. :func:`topka2a_jax.topka2a` runs them for
you, with error feedback, buckets and a plan; call them directly to build
your own.

* :func:`dense`: ``lax.pmean``, the reference.
* :func:`allgather` ("TopkA"): every device's top-k pairs all-gathered.
* :func:`topka2a`: TopKA2A (Peng et al., ICPP 2024): shard-wise top-k, one
  AlltoAll to the shards' owners, an AllGather of the dense shards.
* :func:`topka2a_sparse`: TopKA2A whose second phase is sparse too.
* :func:`gtopk`: gTop-k (Shi et al., ICDCS 2019): every device's top-k
  merged up a tree of recursive doubling into the global top-k.
* :func:`oktopk`: Ok-Topk (Li and Hoefler, PPoPP 2022): a sparse
  reduce-scatter over balanced regions, each region's top at its owner, an
  all-gather of those.
* :func:`few_bit`: every entry in a few bits (2 to 8, one scale per chunk)
  to its shard's owner, the owners' means back in a few bits, both
  roundings fed back; in :data:`COLLECTIVES`, ``"quantized_A_B"`` sends ``A``
  bits to the owners and ``B`` back.
* :func:`onebit`: :func:`few_bit` with signs to the owners, the means back
  in 8 bits (1-bit Adam's compressed all-reduce); in :data:`COLLECTIVES`,
  ``"onebit_4"`` and ``"onebit_1"`` send them back in 4 bits and 1.
* :func:`two_level`: over a pair of mesh axes ``(node, local)``: dense
  inside each node, one of the above between nodes.
* :func:`powersgd`: PowerSGD's rank-r exchange of matrices.
* :func:`relative_mean`: the mean in 8 bits an entry, each entry kept to
  about 1 part in 8 of its own size, nothing fed back: for an optimizer's
  state (``local_steps(..., average_inner_state=True)``), not a gradient.

:data:`ALGORITHMS` names every exchange with its cost terms; the
collective of each is :data:`COLLECTIVES` of the same name. :data:`SELECTIONS`
names the ways of choosing the top entries.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> rows = jax.device_put(jax.random.normal(jax.random.key(0), (8, 1000)),
  ...                       NamedSharding(mesh, P("data")))  # row i: device i's
  >>> def mean(algorithm, density):
  ...   exchange = topka2a_jax.collectives.COLLECTIVES[algorithm]
  ...   per_device = lambda row: exchange(row[0], "data", density).mean
  ...   return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data"),
  ...                                out_specs=P()))(rows)
  >>> [bool(jnp.allclose(mean(name, 1.0), rows.mean(0), atol=1e-6))
  ...  for name, entry in topka2a_jax.collectives.ALGORITHMS.items()
  ...  if not entry.quantizes and name != "oktopk"]  # density 1: the mean
  [True, True, True, True, True]
  >>> error = mean("onebit", 1.0) - rows.mean(0)  # signs: the error fed back later
  >>> bool(jnp.abs(error).mean() < jnp.abs(rows.mean(0)).mean())
  True
  >>> 0 < int(jnp.count_nonzero(mean("topka2a_sparse", 0.01))) <= 0.02 * 1000  # O(k)
  True
"""

from typing import TYPE_CHECKING

from topka2a_jax._src import lazy as _lazy

if TYPE_CHECKING:  # the namespace; at run time each name is imported on first use
  from topka2a_jax._src.collectives import algorithms as _algorithms
  from topka2a_jax._src.collectives import registry as _registry
  from topka2a_jax._src.collectives import selection as _selection
  from topka2a_jax._src.collectives.algorithms import Algorithm
  from topka2a_jax._src.collectives.exchanges import (
    ExchangeResult,
    allgather,
    codes_to_owners,
    dense,
    few_bit,
    onebit,
    topka2a,
    topka2a_sparse,
    two_level,
  )
  from topka2a_jax._src.collectives.global_top_k import gtopk, oktopk
  from topka2a_jax._src.collectives.low_rank import initial_factor, powersgd
  from topka2a_jax._src.collectives.relative import relative_mean
  from topka2a_jax._src.collectives.selection import auto_choice, get_selection

  ALGORITHMS = _algorithms.ALGORITHMS
  """Every exchange of a flat buffer by the name ``topka2a(algorithm=...)`` takes:
  an :class:`Algorithm` (its phases, cost terms and where unsent entries wait)."""

  COLLECTIVES = _registry.COLLECTIVES
  """The collective of every name in :data:`ALGORITHMS`, by that name
  (``COLLECTIVES["topka2a"]`` is :func:`topka2a`)."""

  SELECTIONS = _selection.SELECTIONS
  """The ways of choosing which entries to send, by the name ``selection=``
  takes: ``"exact"`` (``lax.top_k``), ``"threshold"`` (a magnitude bound found
  without a sort), ``"approx"`` (``lax.approx_max_k``) and ``"auto"`` (the
  fastest for the backend, :func:`auto_choice`)."""

_LAZY = {  # each name, its module (":attribute" where the name differs); the
    # block above says the same to type checkers, and tests/test_package.py
    # holds the two equal
    "Algorithm": "topka2a_jax._src.collectives.algorithms",
    "ExchangeResult": "topka2a_jax._src.collectives.exchanges",
    "allgather": "topka2a_jax._src.collectives.exchanges",
    "codes_to_owners": "topka2a_jax._src.collectives.exchanges",
    "dense": "topka2a_jax._src.collectives.exchanges",
    "few_bit": "topka2a_jax._src.collectives.exchanges",
    "onebit": "topka2a_jax._src.collectives.exchanges",
    "topka2a": "topka2a_jax._src.collectives.exchanges",
    "topka2a_sparse": "topka2a_jax._src.collectives.exchanges",
    "two_level": "topka2a_jax._src.collectives.exchanges",
    "gtopk": "topka2a_jax._src.collectives.global_top_k",
    "oktopk": "topka2a_jax._src.collectives.global_top_k",
    "initial_factor": "topka2a_jax._src.collectives.low_rank",
    "powersgd": "topka2a_jax._src.collectives.low_rank",
    "relative_mean": "topka2a_jax._src.collectives.relative",
    "auto_choice": "topka2a_jax._src.collectives.selection",
    "get_selection": "topka2a_jax._src.collectives.selection",
    "ALGORITHMS": "topka2a_jax._src.collectives.algorithms",
    "COLLECTIVES": "topka2a_jax._src.collectives.registry",
    "SELECTIONS": "topka2a_jax._src.collectives.selection",
}

__all__ = [
  "ALGORITHMS",
  "COLLECTIVES",
  "SELECTIONS",
  "Algorithm",
  "ExchangeResult",
  "allgather",
  "auto_choice",
  "codes_to_owners",
  "dense",
  "few_bit",
  "get_selection",
  "gtopk",
  "initial_factor",
  "oktopk",
  "onebit",
  "powersgd",
  "relative_mean",
  "topka2a",
  "topka2a_sparse",
  "two_level",
]

__getattr__, __dir__ = _lazy.attach(__name__, _LAZY)
del _lazy  # help() lists the face's names, not the loader
