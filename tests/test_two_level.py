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
from topka2a_jax._src.collectives import exchanges, registry
from topka2a_jax._src.planner import cost

NODES, LOCAL = 2, 4
AXES = ("node", "local")
OUTER = {"topka2a": exchanges.topka2a, "topka2a_sparse": exchanges.topka2a_sparse,
         "allgather": exchanges.allgather, "dense": exchanges.dense,
         "onebit": exchanges.onebit,
         "quantized_4_8": registry.COLLECTIVES["quantized_4_8"],
         "rotated_4_8": registry.COLLECTIVES["rotated_4_8"]}


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((NODES, LOCAL), AXES)


def reference_two_level(buffers, density, algorithm, nodes=NODES, local=LOCAL):
  """Device d = node * local + j holds buffers[d].

  Returns:
    (mean, kept): kept[d] is device d's slice j of its node's unsent sum,
    ``ceil(n / local)`` entries, zero in the padding.
  """
  buffers = buffers.astype(np.float64)
  n = buffers.shape[1]
  width = math.ceil(n / local)
  padded = np.zeros((nodes * local, local * width))
  padded[:, :n] = buffers
  mean = np.zeros(local * width)
  kept = np.zeros((nodes * local, width))
  for j in range(local):  # slice j: held by device j of every node
    part = slice(j * width, (j + 1) * width)
    node_sums = np.stack([padded[node * local:(node + 1) * local, part].sum(0)
                          for node in range(nodes)])
    slice_mean, slice_unsent = reference.ALGORITHMS[algorithm](node_sums, density)
    mean[part] = slice_mean / local
    for node in range(nodes):
      kept[node * local + j] = slice_unsent[node]
  return mean[:n], kept


def placed(kept, n, local=LOCAL):
  """Every device's slice residual set in its slice of an n-entry row."""
  width = kept.shape[1]
  rows = np.zeros((kept.shape[0], local * width), kept.dtype)
  for device, row in enumerate(kept):
    j = device % local
    rows[device, j * width:(j + 1) * width] = row
  return rows[:, :n]


def owed(kept, n, local=LOCAL):
  """What error feedback still owes, summed over devices: n entries, float64."""
  return placed(np.asarray(kept, np.float64), n, local).sum(0)


def exchange(mesh, density, algorithm):
  """The library's two-level exchange of every device's row: (mean, kept slices)."""
  outer = OUTER[algorithm]

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(AXES),
                     out_specs=(P(), P(AXES)))
  def run(row):
    mean, unsent = exchanges.two_level(row[0], AXES, density, outer=outer)
    return mean, unsent[None]

  return lambda rows: jax.tree.map(np.asarray, run(
      jax.device_put(rows, NamedSharding(mesh, P(AXES)))))


@pytest.mark.parametrize("algorithm", ["topka2a", "topka2a_sparse", "allgather"])
def test_ten_steps_with_error_feedback_match_the_numpy_model(mesh, algorithm):
  rng = np.random.default_rng(16)
  n, density = 203, 0.05  # slices of 51 entries, the last one padded
  run = exchange(mesh, density, algorithm)
  ours = np.zeros((NODES * LOCAL, 51), np.float32)
  theirs = np.zeros((NODES * LOCAL, 51))
  for _ in range(10):
    grads = rng.normal(size=(NODES * LOCAL, n)).astype(np.float32)
    mean, ours = run(grads + placed(ours, n))
    want_mean, theirs = reference_two_level(grads + placed(theirs, n), density,
                                            algorithm)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
  # a slice of 51 entries per device; the last slice's padding keeps nothing
  assert ours.shape == (NODES * LOCAL, 51)
  assert not ours[LOCAL - 1::LOCAL, -1].any()
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
    mean, unsent = run(placed(unsent, 64))
    delivered = delivered + mean
  assert not unsent.any()
  np.testing.assert_allclose(NODES * LOCAL * delivered, rows.sum(0), rtol=1e-4,
                             atol=1e-4)


@pytest.mark.parametrize("algorithm", ["quantized_4_8", "onebit", "rotated_4_8"])
def test_few_bits_between_nodes_lose_nothing_and_send_each_node_sum_once(mesh, algorithm):
  """Codes of each node's sum, not of every device's row: one quantization a boundary."""
  rows = np.random.default_rng(3).normal(size=(NODES * LOCAL, 203)).astype(np.float32)
  mean, unsent = exchange(mesh, 1.0, algorithm)(rows)
  np.testing.assert_allclose(NODES * LOCAL * mean + owed(unsent, 203), rows.sum(0),
                             rtol=0, atol=1e-5 * np.abs(rows).sum(0).max())
  # The outer exchange codes each slice of the node sums, across the nodes.
  node_sums = rows.astype(np.float64).reshape(NODES, LOCAL, -1).sum(1)
  width = -(-203 // LOCAL)
  padded = np.zeros((NODES, LOCAL * width))
  padded[:, :203] = node_sums
  want = np.concatenate([
      reference.ALGORITHMS[algorithm](padded[:, j * width:(j + 1) * width], 1.0)[0]
      for j in range(LOCAL)])[:203] / LOCAL
  np.testing.assert_allclose(mean, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("algorithm", ["topka2a", "topka2a_sparse"])
def test_the_dense_phases_run_inside_nodes_and_the_sparse_one_between(mesh, algorithm):
  """The compiled HLO's replica groups: reduce-scatter and all-gather over "local"."""
  outer = OUTER[algorithm]

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(AXES),
                     out_specs=(P(), P(AXES)))
  def run(row):
    mean, unsent = exchanges.two_level(row[0], AXES, 0.01, outer=outer)
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
    return exchanges.two_level(row[0], AXES, 0.01, outer=OUTER[algorithm]).mean

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
  kept = {k: np.zeros((NODES * LOCAL, math.ceil(g[0].size / LOCAL)))
          for k, g in grads[0].items()}  # slices of 53 and 13 entries
  for step_grads, (updates, state) in zip(grads, _transform_steps(mesh, tx, grads)):
    for k, g in step_grads.items():
      flat = g.reshape(NODES * LOCAL, -1)
      mean, kept[k] = reference_two_level(flat + placed(kept[k], flat.shape[1]),
                                          0.05, algorithm)
      np.testing.assert_allclose(updates[k].ravel(), mean, rtol=1e-5, atol=1e-5)
      ours = np.asarray(state.residuals[k])
      assert ours.shape == (kept[k].size,)
      np.testing.assert_allclose(ours.reshape(NODES * LOCAL, -1), kept[k],
                                 rtol=1e-5, atol=1e-5)


def reference_fused_two_level(leaves, density, algorithm):
  """Leaves fused into one two-level bucket, packed slice by slice.

  ``leaves``: per leaf, (devices, n_i) buffers. Returns the means and kept
  slices per leaf.
  """
  widths = [math.ceil(leaf.shape[1] / LOCAL) for leaf in leaves]
  padded = [np.pad(leaf, ((0, 0), (0, LOCAL * w - leaf.shape[1])))
            for leaf, w in zip(leaves, widths)]
  interleaved = np.concatenate(
      [np.concatenate([p[:, j * w:(j + 1) * w] for p, w in zip(padded, widths)], 1)
       for j in range(LOCAL)], 1)
  mean, kept = reference_two_level(interleaved, density, algorithm)
  total = sum(widths)
  means, slices, start = [], [], 0
  for leaf, w in zip(leaves, widths):
    means.append(np.concatenate([mean[j * total + start:j * total + start + w]
                                 for j in range(LOCAL)])[:leaf.shape[1]])
    slices.append(kept[:, start:start + w])
    start += w
  return means, slices


@pytest.mark.parametrize("algorithm", ["topka2a", "topka2a_sparse"])
def test_leaves_fused_into_a_two_level_bucket_keep_their_own_slices(mesh, algorithm):
  """Two leaves, one bucket: packed slice by slice, against the NumPy model."""
  rng = np.random.default_rng(11)
  grads = [{"a": rng.normal(size=(NODES * LOCAL, 9, 5)).astype(np.float32),
            "b": rng.normal(size=(NODES * LOCAL, 30)).astype(np.float32)}
           for _ in range(6)]
  tx = topka2a_jax.topka2a(0.1, axis_name=AXES, algorithm=algorithm, min_size=0,
                           fusion=10_000, network=("eth10", "nvlink"),
                           skip_nonfinite=False)
  keys = ["b", "a"]  # packed last leaf first
  kept = {"a": np.zeros((NODES * LOCAL, 12)), "b": np.zeros((NODES * LOCAL, 8))}
  for step_grads, (updates, state) in zip(grads, _transform_steps(mesh, tx, grads)):
    flats = [step_grads[k].reshape(NODES * LOCAL, -1) for k in keys]
    means, slices = reference_fused_two_level(
        [f + placed(kept[k], f.shape[1]) for f, k in zip(flats, keys)], 0.1, algorithm)
    for k, mean, mine in zip(keys, means, slices):
      kept[k] = mine
      np.testing.assert_allclose(updates[k].ravel(), mean, rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(np.asarray(state.residuals[k]).reshape(
          NODES * LOCAL, -1), mine, rtol=1e-5, atol=1e-5)


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
  assert state[0].residuals["w"].shape == (NODES * LOCAL * 32,)  # slices of 32
  assert float(loss) > 0


SLOW_INSIDE = ("nvlink", topka2a_jax.cost.Network(1e-6, 1e8, "slow inside"))
"""Links for which every sparse bucket costs less flat: fast between nodes."""


def _update_report(mesh, tx, size):
  """comm_report of tx.update on one leaf of ``size`` elements per device.

  The new state is an output too: what only the residuals need is counted.
  """
  params = {"w": jax.ShapeDtypeStruct((size,), np.float32)}
  state = topka2a_jax.init(tx, params, mesh, axis_name=AXES)
  specs = topka2a_jax.state_specs(state, AXES)
  run = jax.jit(jax.shard_map(lambda g, s: tx.update({"w": g[0]}, s),
                              mesh=mesh, in_specs=(P(AXES), specs),
                              out_specs=(P(), specs)))
  grads = jax.device_put(np.ones((NODES * LOCAL, size), np.float32),
                         NamedSharding(mesh, P(AXES)))
  return topka2a_jax.comm_report(run.lower(grads, state), mesh=mesh)


@pytest.mark.slow  # over 9 s: left out of the quick subset
def test_the_planner_routes_by_the_two_links(mesh):
  """Slow between nodes, fast inside: two-level. Fast between, slow inside: flat."""
  kinds = {}
  for links in [("eth10", "nvlink"), SLOW_INSIDE]:
    tx = topka2a_jax.topka2a(0.01, axis_name=AXES, algorithm="topka2a_sparse",
                             min_size=0, network=links, skip_nonfinite=False)
    report = _update_report(mesh, tx, 400_000)
    kinds[links] = {(row.kind, row.axes) for row in report.collectives}
  assert kinds[("eth10", "nvlink")] == {("reduce-scatter", ("local",)),
                                        ("all-to-all", ("node",)),
                                        ("all-gather", ("node",)),
                                        ("all-gather", ("local",))}
  # flat, and the node's unsent summed onto the slices that keep it
  assert kinds[SLOW_INSIDE] == {("all-to-all", AXES), ("all-gather", AXES),
                                ("reduce-scatter", ("local",))}
  sliced = report.bytes_of("reduce-scatter", "local")
  assert sliced == (LOCAL - 1) * 100_000 * 4  # three quarters of the buffer
  cluster = cost.Cluster(NODES, LOCAL, outer=SLOW_INSIDE[1], inner=SLOW_INSIDE[1])
  flat = cost.cluster_cost("topka2a_sparse", 400_000, cluster, 0.01, cost.FLAT)
  # the ring all-gather's every edge, and 3 of each device's 7 AlltoAll peers
  assert flat.inner_bytes == pytest.approx(
      sliced + report.bytes_of("all-gather", "local")
      + (LOCAL - 1) / (NODES * LOCAL - 1) * report.bytes_of("all-to-all", "local"))
  # The default: the detected link between nodes, nvlink inside.
  default = topka2a_jax.topka2a(0.01, axis_name=AXES, algorithm="topka2a", min_size=0)
  assert ("reduce-scatter", ("local",)) in {
      (row.kind, row.axes) for row in _update_report(mesh, default, 400_000).collectives}


@pytest.mark.slow  # over 9 s: left out of the quick subset
def test_without_error_feedback_the_flat_route_keeps_nothing_and_sends_nothing_more(
    mesh):
  tx = topka2a_jax.topka2a(0.01, axis_name=AXES, algorithm="topka2a_sparse",
                           min_size=0, network=SLOW_INSIDE, skip_nonfinite=False,
                           error_feedback=False)
  kinds = {(row.kind, row.axes) for row in _update_report(mesh, tx, 400_000).collectives}
  assert kinds == {("all-to-all", AXES), ("all-gather", AXES)}


def test_flat_topka2a_sends_more_than_two_level_on_both_links():
  """Its dense all-gather crosses every link anyway, and the unsent is
  reduce-scattered inside the node: two-level moves fewer bytes on both (its
  phases do not overlap, so on a slow inner link it may still take longer)."""
  for outer, inner in [("eth1", "nvlink"), ("nvlink", "eth1"), ("eth10", "eth10")]:
    for nodes, per_node in [(2, 4), (8, 8), (4, 2)]:
      cluster = cost.Cluster(nodes, per_node, outer=cost.NETWORKS[outer],
                             inner=cost.NETWORKS[inner])
      flat = cost.cluster_cost("topka2a", 10**6, cluster, 0.01, cost.FLAT)
      two = cost.cluster_cost("topka2a", 10**6, cluster, 0.01, cost.TWO_LEVEL)
      assert two.outer_bytes < flat.outer_bytes
      assert two.inner_bytes <= flat.inner_bytes


@pytest.mark.parametrize("algorithm", ["topka2a_sparse", "allgather"])
def test_the_flat_route_over_a_pair_is_the_exchange_over_all_devices(mesh, algorithm):
  """Routed flat, the pair acts as one axis of 8 (the flat NumPy model), and
  each node's unsent sum is kept as slices, 5 steps."""
  rng = np.random.default_rng(8)
  grads = [{"w": rng.normal(size=(NODES * LOCAL, 64, 500)).astype(np.float32)}
           for _ in range(5)]
  tx = topka2a_jax.topka2a(0.05, axis_name=AXES, algorithm=algorithm, min_size=0,
                           network=SLOW_INSIDE, selection="exact")
  n, width = 32_000, 8_000
  kept = np.zeros((NODES * LOCAL, width))
  for step_grads, (updates, state) in zip(grads, _transform_steps(mesh, tx, grads)):
    mean, unsent = reference.ALGORITHMS[algorithm](
        step_grads["w"].reshape(NODES * LOCAL, -1) + placed(kept, n), 0.05)
    node_sums = unsent.reshape(NODES, LOCAL, n).sum(1)
    kept = node_sums.reshape(NODES, LOCAL, width).reshape(NODES * LOCAL, width)
    np.testing.assert_allclose(updates["w"].ravel(), mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(state.residuals["w"]).reshape(NODES * LOCAL, -1), kept,
        rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("links", [("eth10", "nvlink"), SLOW_INSIDE],
                         ids=["two-level", "flat"])
@pytest.mark.parametrize("algorithm", ["topka2a_sparse", "topka2a"])
def test_a_float16_wire_over_a_pair_trains_without_a_skipped_step(mesh, links, algorithm):
  """Gradients up to float16's range, whose node sums are four times that."""
  rng = np.random.default_rng(11)
  grads = [{"w": rng.uniform(-6e4, 6e4, size=(NODES * LOCAL, 4000)).astype(np.float32)}
           for _ in range(4)]
  total = sum(g["w"].astype(np.float64).sum(0) for g in grads)
  for value_dtype in (jnp.float16, None):
    tx = topka2a_jax.topka2a(0.05, axis_name=AXES, algorithm=algorithm, min_size=0,
                             network=links, value_dtype=value_dtype)
    history = _transform_steps(mesh, tx, grads)
    for updates, state in history:
      assert int(state.nonfinite_steps) == 0, value_dtype
      assert np.isfinite(updates["w"]).all()
    delivered = sum(np.asarray(u["w"], np.float64) for u, _ in history)
    left = owed(np.asarray(history[-1][1].residuals["w"]).reshape(NODES * LOCAL, -1),
                4000)
    # Nothing lost, in float16 as in float32: what the clip held back waits.
    np.testing.assert_allclose(NODES * LOCAL * delivered + left, total, rtol=0,
                               atol=1e-5 * 4 * 8 * 6e4)


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
  before = owed(np.asarray(state.residuals["w"]).reshape(NODES * LOCAL, -1), 40)
  assert np.abs(before).sum() > 0
  topka2a_jax.save(tmp_path / "ckpt", {"opt_state": state}, mesh, axis_name=AXES)
  one_node = jax.make_mesh((1, LOCAL), AXES, devices=jax.devices()[:LOCAL])
  like = {"opt_state": topka2a_jax.init(
      tx, {"w": jax.ShapeDtypeStruct((40,), np.float32)}, one_node, axis_name=AXES)}
  restored = topka2a_jax.restore(tmp_path / "ckpt", like, one_node, axis_name=AXES)
  now = np.asarray(restored["opt_state"].residuals["w"]).reshape(LOCAL, -1)
  # One node keeps each entry once: the two nodes' sum over their 8 devices,
  # times its own 4, rounded to float32. The mean over devices is kept.
  np.testing.assert_array_equal(owed(now, 40), (before / 2).astype(np.float32))


def test_a_checkpoint_restores_onto_other_node_sizes_and_trains_on(tmp_path, mesh):
  """2 nodes of 4 saved, 4 nodes of 2 restored: what is owed arrives, none is lost."""
  rng = np.random.default_rng(10)
  grads = [{"w": rng.normal(size=(NODES * LOCAL, 40)).astype(np.float32)}]
  tx = topka2a_jax.topka2a(0.05, axis_name=AXES, algorithm="topka2a", min_size=0,
                           network=("eth10", "nvlink"))
  (_, state), = _transform_steps(mesh, tx, grads)
  before = owed(np.asarray(state.residuals["w"]).reshape(NODES * LOCAL, -1), 40)
  assert np.abs(before).sum() > 0
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
  assert restored["opt_state"].residuals["w"].shape == (8 * 20,)  # slices of 20
  left = owed(np.asarray(after.residuals["w"]).reshape(8, -1), 40, local=2)
  np.testing.assert_allclose(8 * np.asarray(updates["w"], np.float64) + left,
                             more["w"].sum(0) + before, rtol=1e-5, atol=1e-5)


def test_the_sharded_optimizer_refuses_a_pair_of_axes():
  with pytest.raises(ValueError, match="shards over one data axis"):
    topka2a_jax.sharded_optimizer(optax.adam(1e-3), density=0.1, axis_name=AXES)


MODEL_SPECS = {"w": P(None, "model"), "b": P("model")}
"""Parameters split over "model" on a (node, local, model) mesh."""


def _model_problem():
  rng = np.random.default_rng(12)
  params = {"w": rng.normal(size=(16, 64)).astype(np.float32) / 4,
            "b": rng.normal(size=64).astype(np.float32)}
  x = rng.normal(size=(32, 16)).astype(np.float32)
  t = rng.normal(size=(32, 64)).astype(np.float32)
  return params, x, t


def _model_loss(params, x, t):
  return jnp.sum((jnp.tanh(x @ params["w"] + params["b"]) - t) ** 2)


def _model_step(mesh, tx, state, problem, route="shard_map"):
  """One step on a (node, local, model) mesh: the update and the new state.

  ``"shard_map"``: a hand-written step manual over all three axes, ``tx`` the
  transform alone. ``"train_step"``: ``topka2a_jax.train_step``, manual over
  the pair only (the transform then splits over "model" itself), ``tx``
  chained with SGD at rate 1, so that the update is the parameters' change.
  """
  params, x, t = problem
  placed_params = jax.device_put(
      params, jax.tree.map(lambda s: NamedSharding(mesh, s), MODEL_SPECS))
  if route == "train_step":
    step = topka2a_jax.train_step(lambda p, b: _model_loss(p, *b), tx, mesh,
                                  axis_name=AXES, param_specs=MODEL_SPECS)
    new_params, state, _ = step(placed_params, state, (x, t))
    return jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), params,
                        new_params), state
  specs = topka2a_jax.state_specs(state, AXES, param_specs=MODEL_SPECS)
  batch = P(AXES, "model")

  def one_step(params, state, x, t):
    grads = jax.grad(_model_loss)(jax.lax.pcast(params, AXES, to="varying"), x, t)
    return tx.update(grads, state, params)

  run = jax.jit(jax.shard_map(one_step, mesh=mesh,
                              in_specs=(MODEL_SPECS, specs, P(AXES), batch),
                              out_specs=(MODEL_SPECS, specs)))
  updates, state = run(placed_params, state,
                       jax.device_put(x, NamedSharding(mesh, P(AXES))),
                       jax.device_put(t, NamedSharding(mesh, batch)))
  return jax.tree.map(np.asarray, updates), state


def _owed_by_parameter(residuals, nodes, local):
  """A (node, local, model=2) state's residuals summed into parameter shapes."""
  owed = {}
  for key, shape in (("w", (16, 64)), ("b", (64,))):
    shard = (shape[0], shape[1] // 2) if len(shape) == 2 else (shape[0] // 2,)
    blocks = np.asarray(residuals[key], np.float64).reshape(nodes, local, 2, -1)
    pieces = [sum(blocks[a, :, p].ravel()[:math.prod(shard)].reshape(shard)
                  for a in range(nodes)) for p in range(2)]
    owed[key] = np.concatenate(pieces, axis=-1)
  return owed


def _dense_gradient(problem, devices):
  params, x, t = problem
  rows = x.shape[0] // devices
  grads = [jax.grad(_model_loss)(params, x[i * rows:(i + 1) * rows],
                                 t[i * rows:(i + 1) * rows]) for i in range(devices)]
  return jax.tree.map(lambda *g: np.sum(np.stack(g), 0), *grads)


@pytest.mark.parametrize("algorithm,route", [
    ("topka2a", "shard_map"), ("topka2a_sparse", "shard_map"),
    ("topka2a", "train_step")])
def test_a_pair_with_parameters_split_over_a_model_axis_loses_nothing(algorithm, route):
  """Each device keeps the slice of its own parameter shard: 1/L of it."""
  mesh = jax.make_mesh((2, 2, 2), (*AXES, "model"))
  problem = _model_problem()
  tx = topka2a_jax.topka2a(0.1, axis_name=AXES, algorithm=algorithm, min_size=0,
                           skip_nonfinite=False)
  if route == "train_step":
    tx = optax.chain(tx, optax.sgd(1.0))
  state = topka2a_jax.init(tx, problem[0], mesh, axis_name=AXES,
                           param_specs=MODEL_SPECS)
  residuals = state.residuals if route == "shard_map" else state[0].residuals
  # w: a shard of 16 x 32 = 512 entries, slices of 256; b: 32, slices of 16.
  assert residuals["w"].shape == (4 * 2 * 256,)
  assert residuals["w"].sharding.spec == P(("node", "local", "model"))
  updates, state = _model_step(mesh, tx, state, problem, route)
  residuals = state.residuals if route == "shard_map" else state[0].residuals
  owed = _owed_by_parameter(residuals, 2, 2)
  want = _dense_gradient(problem, 4)
  for k in ("w", "b"):
    np.testing.assert_allclose(4 * updates[k] + owed[k], want[k], rtol=1e-4, atol=1e-4)
    assert np.abs(owed[k]).sum() > 0


def test_a_model_split_state_restores_onto_other_nodes_keeping_what_is_owed(tmp_path):
  """(2 nodes x 2) x model 2 saved, (4 nodes x 1) x model 2 restored: exact."""
  mesh = jax.make_mesh((2, 2, 2), (*AXES, "model"))
  problem = _model_problem()
  tx = topka2a_jax.topka2a(0.1, axis_name=AXES, algorithm="topka2a", min_size=0)
  state = topka2a_jax.init(tx, problem[0], mesh, axis_name=AXES,
                           param_specs=MODEL_SPECS)
  _, state = _model_step(mesh, tx, state, problem)
  before = _owed_by_parameter(state.residuals, 2, 2)
  topka2a_jax.save(tmp_path / "ckpt", {"opt_state": state}, mesh, axis_name=AXES)
  other = jax.make_mesh((4, 1, 2), (*AXES, "model"))
  like = {"opt_state": topka2a_jax.init(tx, problem[0], other, axis_name=AXES,
                                        param_specs=MODEL_SPECS)}
  restored = topka2a_jax.restore(tmp_path / "ckpt", like, other, axis_name=AXES)
  now = restored["opt_state"].residuals
  assert now["w"].shape == (4 * 2 * 512,)
  after = _owed_by_parameter(now, 4, 1)
  for k in ("w", "b"):
    np.testing.assert_array_equal(after[k], before[k])


def test_resizing_slices_by_hand():
  """2 nodes of 2 devices, slices of 3 (a shard of 5, padded) onto 1 node of 3."""
  from topka2a_jax._src.checkpointing.resize import Devices, resize_slices
  saved = jnp.array([1.0, 2, 3, 4, 5, 0,  # node 0: slices [1 2 3], [4 5 .]
                     10, 20, 30, 40, 50, 0])  # node 1
  # 4 devices onto 3: each owes 3/4 of the nodes' sum, so the mean is the same.
  moved = resize_slices(saved, Devices(2, 2), Devices(1, 3), 6)  # slices of 2
  np.testing.assert_allclose(moved, np.array([11, 22, 33, 44, 55, 0]) * 3 / 4,
                             rtol=1e-7)
  grown = resize_slices(saved, Devices(2, 2), Devices(3, 1), 15)  # 3 nodes of 1
  np.testing.assert_allclose(
      grown, np.array([1, 2, 3, 4, 5, 10, 20, 30, 40, 50] + [0] * 5) * 3 / 4, rtol=1e-7)


def test_a_checkpoint_of_one_data_axis_is_refused_on_a_pair(tmp_path, mesh):
  """A user moving a run from one axis onto (node, local) hears why and how."""
  flat_mesh = jax.make_mesh((8,), ("data",))
  params = {"w": jax.ShapeDtypeStruct((40,), np.float32)}
  tx = topka2a_jax.topka2a(0.05, min_size=0)
  topka2a_jax.save(tmp_path / "ckpt",
                   {"opt_state": topka2a_jax.init(tx, params, flat_mesh)}, flat_mesh)
  pair_tx = topka2a_jax.topka2a(0.05, axis_name=AXES, min_size=0)
  like = {"opt_state": topka2a_jax.init(pair_tx, params, mesh, axis_name=AXES)}
  with pytest.raises(ValueError, match=r"saved with one data axis \(data\), and is "
                                       r"restored onto a pair of data axes"):
    topka2a_jax.restore(tmp_path / "ckpt", like, mesh, axis_name=AXES)


def test_a_nonfinite_gradient_on_one_device_skips_the_step_on_every_node(mesh):
  """A NaN on one device of one node: zero updates, slices untouched, counted."""
  rng = np.random.default_rng(13)
  good = rng.normal(size=(NODES * LOCAL, 40)).astype(np.float32)
  bad = rng.normal(size=(NODES * LOCAL, 40)).astype(np.float32)
  bad[5, 7] = np.nan  # node 1, device 1
  tx = topka2a_jax.topka2a(0.05, axis_name=AXES, algorithm="topka2a", min_size=0)
  (_, first), (updates, second) = _transform_steps(mesh, tx, [{"w": good},
                                                              {"w": bad}])
  assert not updates["w"].any()
  np.testing.assert_array_equal(second.residuals["w"], first.residuals["w"])
  assert int(second.nonfinite_steps) == 1 and int(second.count) == 1
  assert np.abs(np.asarray(first.residuals["w"])).sum() > 0


@pytest.mark.parametrize("links", [("eth10", "nvlink"), SLOW_INSIDE],
                         ids=["two-level", "flat"])
@pytest.mark.parametrize("warmup_steps", [0, 2])
def test_a_bad_step_over_a_pair_is_as_if_it_never_came(mesh, links, warmup_steps):
  """A NaN on one device, in the dense warm-up or after it: zero updates, every
  device's residual slice kept, and the steps after it as in a run without it."""
  rng = np.random.default_rng(12)
  grads = [{"w": rng.normal(size=(NODES * LOCAL, 64, 50)).astype(np.float32)}
           for _ in range(3)]
  bad = {"w": rng.normal(size=(NODES * LOCAL, 64, 50)).astype(np.float32)}
  bad["w"][5, 3, 7] = np.nan
  tx = topka2a_jax.topka2a(0.05, axis_name=AXES, min_size=0, network=links,
                           warmup_steps=warmup_steps)
  clean = _transform_steps(mesh, tx, grads)
  dirty = _transform_steps(mesh, tx, [grads[0], bad, *grads[1:]])
  (_, before), (skipped, during) = dirty[:2]
  assert not skipped["w"].any()
  np.testing.assert_array_equal(np.asarray(during.residuals["w"]),
                                np.asarray(before.residuals["w"]))
  assert (int(during.count), int(during.nonfinite_steps)) == (1, 1)
  for (want, want_state), (got, got_state) in zip(clean[1:], dirty[2:]):
    np.testing.assert_array_equal(got["w"], want["w"])
    np.testing.assert_array_equal(np.asarray(got_state.residuals["w"]),
                                  np.asarray(want_state.residuals["w"]))
  if warmup_steps == 0:  # the kept residual was not trivially zero
    assert np.abs(np.asarray(before.residuals["w"])).max() > 0
