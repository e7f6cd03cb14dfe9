"""The owner's re-selection: exact top-k of a shard from the positions it received."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from topka2a_jax._src.collectives import exchanges
from topka2a_jax._src.collectives.received import top_of_received

select = jax.jit(top_of_received, static_argnums=2)


def received_shard(rng, length, senders, per_sender, values="normal", shared=0.5):
  """A shard summed from ``senders`` rows of distinct positions, as an owner holds it.

  About ``shared`` of every row's positions come from a common pool, so
  positions repeat across senders as the gradients' largest entries do.
  """
  pool = rng.choice(length, per_sender, replace=False)
  rows = []
  for _ in range(senders):
    common = rng.choice(pool, int(shared * per_sender), replace=False)
    rest = rng.choice(np.setdiff1d(np.arange(length), common),
                      per_sender - len(common), replace=False)
    rows.append(np.concatenate([common, rest]))
  received = np.stack(rows).astype(np.int32)
  pieces = {"normal": lambda: rng.standard_normal(received.shape),
            "integers": lambda: rng.integers(-2, 3, received.shape),  # ties, zeros
            "zeros": lambda: np.zeros(received.shape)}[values]()
  shard = np.zeros(length, np.float32)
  np.add.at(shard, received, pieces.astype(np.float32))
  return shard, received


def check_exact(shard, received, k):
  values, indices = select(jnp.asarray(shard), jnp.asarray(received), k)
  values, indices = np.asarray(values)[0], np.asarray(indices)[0]
  assert len(set(indices.tolist())) == k and 0 <= indices.min() <= indices.max() < len(shard)
  np.testing.assert_array_equal(values, shard[indices])
  # The magnitudes are exact top-k's (NumPy's sort), whatever the ties.
  np.testing.assert_array_equal(np.sort(np.abs(values)), np.sort(np.abs(shard))[-k:])
  return indices


@pytest.mark.parametrize("values", ["normal", "integers", "zeros"])
@pytest.mark.parametrize(("length", "senders", "per_sender", "k"), [
    (50, 1, 5, 5), (1000, 3, 40, 40), (20_000, 8, 300, 300), (20_000, 8, 300, 17),
    (33, 4, 33, 33),  # every sender sent the whole shard
])
def test_magnitudes_are_exact_top_ks(values, length, senders, per_sender, k):
  rng = np.random.default_rng(length + senders + k)
  shard, received = received_shard(rng, length, senders, per_sender, values)
  check_exact(shard, received, k)


def test_every_nonzero_goes_when_fewer_than_k_are_nonzero():
  shard = np.zeros(100, np.float32)
  received = np.array([[3, 50, 7], [50, 9, 3]], np.int32)
  shard[[3, 50]] = [2.0, -1.0]  # 7 and 9 were sent but summed to zero
  indices = check_exact(shard, received, 3)
  assert {3, 50} <= set(indices.tolist())
  assert set(indices.tolist()) <= {3, 50, 7, 9}  # filled from what was received


def test_narrow_floats_rank_as_float32():
  rng = np.random.default_rng(5)
  shard, received = received_shard(rng, 5000, 4, 100)
  narrow = shard.astype(jnp.bfloat16).astype(np.float32)
  values, indices = select(jnp.asarray(narrow, jnp.bfloat16), jnp.asarray(received), 60)
  values = np.asarray(values, np.float32)[0]
  np.testing.assert_array_equal(values, narrow[np.asarray(indices)[0]])
  np.testing.assert_array_equal(np.sort(np.abs(values)), np.sort(np.abs(narrow))[-60:])


def test_the_sparse_exchange_runs_one_threshold_search():
  """The owner's pick sorts nothing: only the senders' search samples and sorts.

  Each threshold search sorts a sample of its group maxima, and falls back to
  an exact top-k; an owner re-selecting its whole shard that way compiled a
  second search, as many kernels again.
  """
  mesh = jax.make_mesh((8,), ("data",))
  rows = jax.device_put(jnp.zeros((8, 400_000)), NamedSharding(mesh, P("data")))
  step = jax.jit(jax.shard_map(
      lambda row: exchanges.topka2a_sparse(row[0], "data", 0.01,
                                           selection="threshold").mean,
      mesh=mesh, in_specs=P("data"), out_specs=P()))
  text = step.lower(rows).compile().as_text()
  assert text.count(" sort(") == 1
