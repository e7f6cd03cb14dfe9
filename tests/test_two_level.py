"""The two-level exchange: dense inside a node, sparse between nodes.

Checked against a NumPy model written from the description (float64, loops
over nodes and slices, the flat algorithms of ``tests/reference.py`` between
nodes), against ``lax.pmean`` over both axes at density 1.0, and for losing
nothing.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax
from topka2a_jax import collectives, cost

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
  # Per device: the slice is 10,000 floats; 100 of them are selected, 50 per
  # node-owner, each a float32 value and a uint16 index. The dense phases
  # move 3/4 of the 40,000 floats each way inside the node.
  width, per_owner = 40_000 // LOCAL, 100 // NODES
  second = (NODES - 1) * (width // NODES * 4 if algorithm == "topka2a"
                          else per_owner * 6)
  assert report.bytes_of("all-to-all", "node") == (NODES - 1) * per_owner * 6
  assert report.bytes_of("all-gather", "node") == second  # 20,000 or 300
  assert report.bytes_of(axis="local") == 2 * (LOCAL - 1) * width * 4  # 240,000


@pytest.mark.parametrize("algorithm", ["topka2a", "topka2a_sparse", "allgather"])
def test_the_cost_model_counts_what_the_compiled_exchange_sends(mesh, algorithm):
  """cluster_cost's bytes per link against the HLO's, axis by axis."""
  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(AXES), out_specs=P())
  def run(row):
    return collectives.two_level(row[0], AXES, 0.01, outer=OUTER[algorithm]).mean

  rows = jax.device_put(np.ones((NODES * LOCAL, 40_000), np.float32),
                        NamedSharding(mesh, P(AXES)))
  report = topka2a_jax.comm_report(run.lower(rows), mesh=mesh)
  cluster = cost.Cluster(NODES, LOCAL, outer=cost.NETWORKS["eth10"],
                         inner=cost.NETWORKS["nvlink"])
  model = cost.cluster_cost(algorithm, 40_000, cluster, 0.01)
  assert report.bytes_of(axis="local") == model.inner_bytes
  assert LOCAL * report.bytes_of(axis="node") == model.outer_bytes  # per card


def _transform_steps(mesh, tx, grads_per_step):
  """tx.update in a hand-written step over both axes; updates and state per step."""
  params = jax.tree.map(lambda g: jax.ShapeDtypeStruct(g.shape[1:], g.dtype),
                        grads_per_step[0])
  state = topka2a_jax.init(tx, params, mesh, axis_name=AXES)
  specs = topka2a_jax.state_specs(state, AXES)
  run = jax.jit(jax.shard_map(
      lambda g, s: tx.update(jax.tree.map(lambda x: x[0], g), s), mesh=mesh,
      in_specs=(P(AXES), specs), out_specs=(P(), specs)))
  history = []
  for grads in grads_per_step:
    updates, state = run(jax.device_put(grads, NamedSharding(mesh, P(AXES))), state)
    history.append((jax.tree.map(np.asarray, updates), state))
  return history


@pytest.mark.parametrize("algorithm", ["topka2a", "topka2a_sparse", "allgather"])
def test_the_transform_over_a_pair_of_axes_matches_the_numpy_model(mesh, algorithm):
  """topka2a(axis_name=("node", "local")): each leaf its own bucket, 10 steps."""
  rng = np.random.default_rng(3)
  grads = [{"w": rng.normal(size=(NODES * LOCAL, 30, 7)).astype(np.float32),
            "b": rng.normal(size=(NODES * LOCAL, 50)).astype(np.float32)}
           for _ in range(10)]
  tx = topka2a_jax.topka2a(0.05, axis_name=AXES, algorithm=algorithm, min_size=0,
                           fusion=1)
  residuals = {k: np.zeros((NODES * LOCAL, g[0].size)) for k, g in grads[0].items()}
  for step_grads, (updates, state) in zip(grads, _transform_steps(mesh, tx, grads)):
    for k, g in step_grads.items():
      flat = g.reshape(NODES * LOCAL, -1) + residuals[k]
      mean, residuals[k] = reference_two_level(flat, 0.05, algorithm)
      np.testing.assert_allclose(updates[k].ravel(), mean, rtol=1e-5, atol=1e-5)
      kept = np.asarray(state.residuals[k]).reshape(NODES * LOCAL, -1)
      np.testing.assert_allclose(kept, residuals[k], rtol=1e-5, atol=1e-5)


def test_the_transform_at_density_one_is_pmean_over_both_axes(mesh):
  rng = np.random.default_rng(4)
  grads = [{"w": rng.normal(size=(NODES * LOCAL, 9, 5)).astype(np.float32)}]
  tx = topka2a_jax.topka2a(1.0, axis_name=AXES, algorithm="topka2a", min_size=0)
  (updates, _), = _transform_steps(mesh, tx, grads)
  np.testing.assert_allclose(updates["w"], grads[0]["w"].mean(0), rtol=1e-6, atol=1e-6)


def test_train_step_over_a_pair_of_axes_trains_every_replica_alike(mesh):
  """The batch splits over both axes; every device ends with the same parameters."""
  rng = np.random.default_rng(5)
  params = {"w": rng.normal(size=(32, 4)).astype(np.float32)}
  tx = optax.chain(topka2a_jax.topka2a(0.1, axis_name=AXES, mesh=mesh,
                                       algorithm="topka2a", min_size=0),
                   optax.sgd(0.1))
  step = topka2a_jax.train_step(lambda p, x: jnp.mean((x @ p["w"]) ** 2), tx, mesh,
                                axis_name=AXES)
  state = tx.init(params)
  for _ in range(3):
    params, state, loss = step(params, state, rng.normal(size=(16, 32)).astype(
        np.float32))
  copies = [np.asarray(s.data) for s in params["w"].addressable_shards]
  assert len(copies) == NODES * LOCAL
  for copy in copies[1:]:
    np.testing.assert_array_equal(copy, copies[0])
  assert state[0].residuals["w"].shape == (NODES * LOCAL * 32, 4)
  assert float(loss) > 0


SLOW_INSIDE = ("nvlink", topka2a_jax.Network(1e-6, 1e8, "slow inside"))
"""Links for which every sparse bucket costs less flat: fast between nodes."""


def _update_report(mesh, tx, size):
  """comm_report of tx.update on one leaf of ``size`` elements per device."""
  params = {"w": jax.ShapeDtypeStruct((size,), np.float32)}
  state = topka2a_jax.init(tx, params, mesh, axis_name=AXES)
  specs = topka2a_jax.state_specs(state, AXES)
  run = jax.jit(jax.shard_map(lambda g, s: tx.update({"w": g[0]}, s)[0]["w"],
                              mesh=mesh, in_specs=(P(AXES), specs), out_specs=P()))
  grads = jax.device_put(np.ones((NODES * LOCAL, size), np.float32),
                         NamedSharding(mesh, P(AXES)))
  return topka2a_jax.comm_report(run.lower(grads, state), mesh=mesh)


def test_the_planner_routes_by_the_two_links(mesh):
  """Slow between nodes, fast inside: two-level. Fast between, slow inside: flat."""
  kinds = {}
  for links in [("eth10", "nvlink"), SLOW_INSIDE]:
    tx = topka2a_jax.topka2a(0.01, axis_name=AXES, algorithm="topka2a", min_size=0,
                             network=links, skip_nonfinite=False)
    report = _update_report(mesh, tx, 400_000)
    kinds[links] = {(row.kind, row.axes) for row in report.collectives}
  assert kinds[("eth10", "nvlink")] == {("reduce-scatter", ("local",)),
                                        ("all-to-all", ("node",)),
                                        ("all-gather", ("node",)),
                                        ("all-gather", ("local",))}
  assert kinds[SLOW_INSIDE] == {("all-to-all", AXES), ("all-gather", AXES)}
  # The default: the detected link between nodes, nvlink inside.
  default = topka2a_jax.topka2a(0.01, axis_name=AXES, algorithm="topka2a", min_size=0)
  assert ("reduce-scatter", ("local",)) in {
      (row.kind, row.axes) for row in _update_report(mesh, default, 400_000).collectives}


@pytest.mark.parametrize("algorithm", ["topka2a", "topka2a_sparse"])
def test_the_flat_route_over_a_pair_is_the_exchange_over_all_devices(mesh, algorithm):
  """Routed flat, the pair acts as one axis of 8: the flat NumPy model, 5 steps."""
  rng = np.random.default_rng(8)
  grads = [{"w": rng.normal(size=(NODES * LOCAL, 64, 500)).astype(np.float32)}
           for _ in range(5)]
  tx = topka2a_jax.topka2a(0.05, axis_name=AXES, algorithm=algorithm, min_size=0,
                           network=SLOW_INSIDE)
  residual = np.zeros((NODES * LOCAL, 32_000))
  for step_grads, (updates, state) in zip(grads, _transform_steps(mesh, tx, grads)):
    mean, residual = reference.ALGORITHMS[algorithm](
        step_grads["w"].reshape(NODES * LOCAL, -1) + residual, 0.05)
    np.testing.assert_allclose(updates["w"].ravel(), mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(state.residuals["w"]).reshape(NODES * LOCAL, -1), residual,
        rtol=1e-5, atol=1e-5)


def test_a_small_dense_bucket_goes_two_level_and_equals_pmean(mesh):
  """Between slow nodes, one all-reduce of 2 node messages beats a ring of 14."""
  rng = np.random.default_rng(9)
  grads = [{"w": rng.normal(size=(NODES * LOCAL, 6, 4)).astype(np.float32)}]
  tx = topka2a_jax.topka2a(0.01, axis_name=AXES, algorithm="dense",
                           network=("eth10", "nvlink"), skip_nonfinite=False)
  kinds = {(row.kind, row.axes) for row in _update_report(mesh, tx, 24).collectives}
  assert kinds == {("reduce-scatter", ("local",)), ("all-reduce", ("node",)),
                   ("all-gather", ("local",))}
  (updates, _), = _transform_steps(mesh, tx, grads)
  np.testing.assert_allclose(updates["w"], grads[0]["w"].mean(0), rtol=1e-6, atol=1e-6)


def test_a_pair_of_networks_needs_a_pair_of_axes():
  with pytest.raises(ValueError, match=r"network=\('eth10', 'nvlink'\) is a pair of "
                                       r"links .* with axis_name='data' give one"):
    topka2a_jax.topka2a(0.1, network=("eth10", "nvlink"))
  with pytest.raises(ValueError, match="unknown network 'fast'"):
    topka2a_jax.topka2a(0.1, axis_name=AXES, network=("eth10", "fast"))


def test_a_data_axis_of_three_names_is_refused():
  with pytest.raises(ValueError, match="one mesh axis, or a pair"):
    topka2a_jax.topka2a(0.1, axis_name=("a", "b", "c"))


def test_a_checkpoint_restores_onto_fewer_nodes_keeping_what_is_owed(tmp_path, mesh):
  rng = np.random.default_rng(6)
  grads = [{"w": rng.normal(size=(NODES * LOCAL, 40)).astype(np.float32)}]
  tx = topka2a_jax.topka2a(0.05, axis_name=AXES, algorithm="topka2a", min_size=0)
  (_, state), = _transform_steps(mesh, tx, grads)
  owed = np.asarray(state.residuals["w"], np.float64).reshape(NODES * LOCAL, -1).sum(0)
  assert np.abs(owed).sum() > 0
  topka2a_jax.save(tmp_path / "ckpt", {"opt_state": state}, mesh, axis_name=AXES)
  one_node = jax.make_mesh((1, LOCAL), AXES, devices=jax.devices()[:LOCAL])
  like = {"opt_state": topka2a_jax.init(
      tx, {"w": jax.ShapeDtypeStruct((40,), np.float32)}, one_node, axis_name=AXES)}
  restored = topka2a_jax.restore(tmp_path / "ckpt", like, one_node, axis_name=AXES)
  now = np.asarray(restored["opt_state"].residuals["w"], np.float64).reshape(LOCAL, -1)
  np.testing.assert_array_equal(now.sum(0), owed)


def test_a_checkpoint_restores_onto_other_node_sizes_and_trains_on(tmp_path, mesh):
  """2 nodes of 4 saved, 4 nodes of 2 restored: what is owed arrives, none is lost."""
  rng = np.random.default_rng(10)
  grads = [{"w": rng.normal(size=(NODES * LOCAL, 40)).astype(np.float32)}]
  tx = topka2a_jax.topka2a(0.05, axis_name=AXES, algorithm="topka2a", min_size=0,
                           network=("eth10", "nvlink"))
  (_, state), = _transform_steps(mesh, tx, grads)
  owed = np.asarray(state.residuals["w"], np.float64).reshape(NODES * LOCAL, -1).sum(0)
  assert np.abs(owed).sum() > 0
  topka2a_jax.save(tmp_path / "ckpt", {"opt_state": state}, mesh, axis_name=AXES)
  other = jax.make_mesh((4, 2), AXES)
  like = {"opt_state": topka2a_jax.init(
      tx, {"w": jax.ShapeDtypeStruct((40,), np.float32)}, other, axis_name=AXES)}
  restored = topka2a_jax.restore(tmp_path / "ckpt", like, other, axis_name=AXES)
  params = {"w": jax.ShapeDtypeStruct((40,), np.float32)}
  specs = topka2a_jax.state_specs(topka2a_jax.init(tx, params, other, axis_name=AXES),
                                  AXES)
  run = jax.jit(jax.shard_map(
      lambda g, s: tx.update(jax.tree.map(lambda x: x[0], g), s), mesh=other,
      in_specs=(P(AXES), specs), out_specs=(P(), specs)))
  more = {"w": rng.normal(size=(8, 40)).astype(np.float32)}
  updates, after = run(jax.device_put(more, NamedSharding(other, P(AXES))),
                       restored["opt_state"])
  left = np.asarray(after.residuals["w"], np.float64).reshape(8, -1).sum(0)
  np.testing.assert_allclose(8 * np.asarray(updates["w"], np.float64) + left,
                             more["w"].sum(0) + owed, rtol=1e-5, atol=1e-5)


def test_the_sharded_optimizer_refuses_a_pair_of_axes():
  with pytest.raises(ValueError, match="shards over one data axis"):
    topka2a_jax.sharded_optimizer(optax.adam(1e-3), 0.1, axis_name=AXES)
