"""The two-level exchange: dense inside a node, sparse between nodes.

Checked against a NumPy model written from the description (float64, loops
over nodes and slices, the flat algorithms of ``tests/reference.py`` between
nodes), against ``lax.pmean`` over both axes at density 1.0, and for losing
nothing.
"""

import functools
import math

import jax
import numpy as np
import pytest
import reference
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax
from topka2a_jax import collectives

NODES, LOCAL = 2, 4
AXES = ("node", "local")
OUTER = {"topka2a": collectives.topka2a, "topka2a_sparse": collectives.topka2a_sparse,
         "allgather": collectives.allgather, "dense": collectives.dense}


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((NODES, LOCAL), AXES)


def reference_two_level(buffers, density, algorithm):
  """Device d = node * LOCAL + local holds buffers[d]: (mean, unsent per device)."""
  buffers = buffers.astype(np.float64)
  n = buffers.shape[1]
  width = math.ceil(n / LOCAL)
  padded = np.zeros((NODES * LOCAL, LOCAL * width))
  padded[:, :n] = buffers
  mean = np.zeros(LOCAL * width)
  unsent = np.zeros_like(padded)
  for j in range(LOCAL):  # slice j: held by device j of every node
    part = slice(j * width, (j + 1) * width)
    node_sums = np.stack([padded[node * LOCAL:(node + 1) * LOCAL, part].sum(0)
                          for node in range(NODES)])
    slice_mean, slice_unsent = reference.ALGORITHMS[algorithm](node_sums, density)
    mean[part] = slice_mean / LOCAL
    for node in range(NODES):
      unsent[node * LOCAL + j, part] = slice_unsent[node]
  return mean[:n], unsent[:, :n]


def exchange(mesh, density, algorithm):
  """The library's two-level exchange of every device's row: (mean, unsent rows)."""
  outer = OUTER[algorithm]

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(AXES),
                     out_specs=(P(), P(AXES)))
  def run(row):
    mean, unsent = collectives.two_level(row[0], AXES, density, outer=outer)
    return mean, unsent[None]

  return lambda rows: jax.tree.map(np.asarray, run(
      jax.device_put(rows, NamedSharding(mesh, P(AXES)))))


@pytest.mark.parametrize("algorithm", ["topka2a", "topka2a_sparse", "allgather"])
def test_ten_steps_with_error_feedback_match_the_numpy_model(mesh, algorithm):
  rng = np.random.default_rng(16)
  n, density = 203, 0.05  # slices of 51 entries, the last one padded
  run = exchange(mesh, density, algorithm)
  ours = np.zeros((NODES * LOCAL, n), np.float32)
  theirs = np.zeros((NODES * LOCAL, n))
  for _ in range(10):
    grads = rng.normal(size=(NODES * LOCAL, n)).astype(np.float32)
    mean, ours = run(grads + ours)
    want_mean, theirs = reference_two_level(grads + theirs, density, algorithm)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
  # each device keeps entries of its own slice only
  width = math.ceil(n / LOCAL)
  for device in range(NODES * LOCAL):
    j = device % LOCAL
    outside = np.delete(ours[device], np.arange(j * width, min(n, (j + 1) * width)))
    assert not outside.any()
  assert np.abs(ours).sum() > 0


def test_density_one_is_pmean_over_both_axes(mesh):
  rows = np.random.default_rng(1).normal(size=(NODES * LOCAL, 37)).astype(np.float32)
  mean, unsent = exchange(mesh, 1.0, "topka2a")(rows)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(AXES), out_specs=P())
  def pmean(row):
    return jax.lax.pmean(row[0], AXES)

  np.testing.assert_allclose(mean, np.asarray(pmean(
      jax.device_put(rows, NamedSharding(mesh, P(AXES))))), rtol=1e-6, atol=1e-6)
  assert not unsent.any()


@pytest.mark.parametrize("algorithm", ["topka2a", "topka2a_sparse", "allgather"])
def test_draining_loses_nothing(mesh, algorithm):
  """Zero gradients after one step: error feedback delivers all that waited."""
  rows = np.random.default_rng(2).normal(size=(NODES * LOCAL, 64)).astype(np.float32)
  run = exchange(mesh, 0.1, algorithm)
  delivered, unsent = run(rows)
  for _ in range(200):
    if not unsent.any():
      break
    mean, unsent = run(unsent)
    delivered = delivered + mean
  assert not unsent.any()
  np.testing.assert_allclose(NODES * LOCAL * delivered, rows.sum(0), rtol=1e-4,
                             atol=1e-4)


@pytest.mark.parametrize("algorithm", ["topka2a", "topka2a_sparse"])
def test_the_dense_phases_run_inside_nodes_and_the_sparse_one_between(mesh, algorithm):
  """The compiled HLO's replica groups: reduce-scatter and all-gather over "local"."""
  outer = OUTER[algorithm]

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(AXES),
                     out_specs=(P(), P(AXES)))
  def run(row):
    mean, unsent = collectives.two_level(row[0], AXES, 0.01, outer=outer)
    return mean, unsent[None]

  rows = jax.device_put(np.ones((NODES * LOCAL, 40_000), np.float32),
                        NamedSharding(mesh, P(AXES)))
  report = topka2a_jax.comm_report(run.lower(rows), mesh=mesh)
  kinds = {(row.kind, row.axes) for row in report.collectives}
  assert ("reduce-scatter", ("local",)) in kinds
  assert ("all-to-all", ("node",)) in kinds
  assert {axes for kind, axes in kinds if kind == "all-to-all"} == {("node",)}
  assert {axes for kind, axes in kinds if kind == "reduce-scatter"} == {("local",)}
  # the slow link carries one slice: 1/4 of what a flat exchange would select
  width = 40_000 // LOCAL
  assert report.bytes_of("all-to-all", "node") < 0.01 * width * 8
