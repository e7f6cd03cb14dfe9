"""The α-β cost model: hand-computed cases and the paper's break-even points."""

import pytest

from topka2a_jax._src.planner.cost import (
    FLAT,
    NETWORKS,
    TWO_LEVEL,
    Cluster,
    Network,
    breakeven_density,
    cluster_cost,
    elements_read,
    exchange_cost,
    get_network,
    selected_entries,
)

NO_LATENCY = Network(latency=0.0, bandwidth=1e9)


def test_hand_computed_costs():
  # d = 1000, P = 8, density 0.01: k = 10, s = 125, q = 2; 4-byte values and
  # 2-byte indices (at most 65,536 positions addressed).
  assert exchange_cost("dense", 1000, 8, 0.01).bytes == 2 * 7 / 8 * 1000 * 4
  assert exchange_cost("allgather", 1000, 8, 0.01).bytes == 7 * 10 * 6
  assert exchange_cost("topka2a", 1000, 8, 0.01).bytes == 7 * (2 * 6 + 125 * 4)
  assert exchange_cost("topka2a_sparse", 1000, 8, 0.01).bytes == 7 * 2 * 2 * 6
  # bfloat16 values; TopkA's indices need 4 bytes past 65,536 elements, a
  # shard's only past 65,536 elements per shard.
  assert exchange_cost("allgather", 100_000, 8, 0.01, value_bytes=2).bytes == (
      7 * 1000 * 6)
  assert exchange_cost("topka2a", 100_000, 8, 0.01, value_bytes=2).bytes == (
      7 * (125 * 4 + 12_500 * 2))
  assert exchange_cost("topka2a", 800_000, 8, 0.01).bytes == 7 * (1000 * 8 + 100_000 * 4)
  assert [exchange_cost(a, 1000, 8, 0.01).messages
          for a in ("dense", "allgather", "topka2a", "topka2a_sparse")] == [14, 7, 14, 14]
  assert exchange_cost("topka2a", 1000, 1, 0.01).bytes == 0


def test_hand_counted_selected_entries():
  # d = 1000, P = 8, density 0.01: k = 10, q = 2 per shard.
  assert [selected_entries(a, 1000, 8, 0.01)
          for a in ("dense", "allgather", "topka2a", "topka2a_sparse")] == [
              0, 10, 8 * 2, 8 * 2 + 2]
  # d = 10, P = 4, density 0.5: k = 5, q = 2 (the last shard has padding).
  assert selected_entries("topka2a_sparse", 10, 4, 0.5) == 4 * 2 + 2


def test_hand_counted_elements_read():
  # d = 1000, P = 8: every sparse selection reads the buffer once; the
  # sparse owner reads its 125-element shard again. d = 10, P = 4: s = 3.
  assert [elements_read(a, 1000, 8)
          for a in ("dense", "allgather", "topka2a", "topka2a_sparse")] == [
              0, 1000, 1000, 1125]
  assert elements_read("topka2a_sparse", 10, 4) == 10 + 3


def test_seconds_add_latency_and_bandwidth():
  cost = exchange_cost("dense", 1000, 8, 0.01)
  net = Network(latency=1e-5, bandwidth=1e6)
  assert cost.seconds(net) == pytest.approx(14 * 1e-5 + 7000 / 1e6)


@pytest.mark.parametrize("num_devices", [2, 4, 8, 32, 256])
def test_bandwidth_only_breakevens(num_devices):
  d = 1e8
  assert breakeven_density("topka2a", "dense", d, num_devices, NO_LATENCY) == (
      pytest.approx(0.5, rel=1e-6))
  assert breakeven_density("topka2a", "allgather", d, num_devices, NO_LATENCY) == (
      pytest.approx(1 / (2 * (num_devices - 1)), rel=1e-6))


def test_latency_moves_the_topka_breakeven_up_for_small_buffers():
  # TopKA2A pays two phases, TopkA one: latency favours TopkA on small buffers.
  big = breakeven_density("topka2a", "allgather", 1e8, 8, "eth10", index_bytes=4)
  small = breakeven_density("topka2a", "allgather", 1e4, 8, "eth10", index_bytes=4)
  assert 1 / 14 <= big < small


def test_no_crossing_is_none():
  # On a 100-element buffer TopKA2A's extra phase of latency always loses.
  assert breakeven_density("topka2a", "allgather", 100, 8, "eth1") is None


def test_presets_and_errors():
  assert get_network("eth10").bandwidth == 10e9 / 8
  assert all(net.source for net in NETWORKS.values())
  with pytest.raises(ValueError, match="unknown network 'eth100'.*eth10"):
    get_network("eth100")
  with pytest.raises(ValueError, match="bandwidth must be bytes/s > 0"):
    Network(latency=1e-6, bandwidth=0)
  with pytest.raises(ValueError, match="no cost model for algorithm 'auto'"):
    exchange_cost("auto", 10, 2, 0.5)


# A cluster of 2 nodes x 4 devices: 1 µs and 1 GB/s inside a node, 100 µs and
# 100 MB/s per card between nodes.
CLUSTER = Cluster(2, 4, outer=Network(1e-4, 1e8), inner=Network(1e-6, 1e9))


def test_hand_computed_flat_costs_on_a_cluster():
  # d = 800 on P = 8, density 0.1: k = 80, s = 100, q = 10; 4-byte values,
  # 2-byte indices (the narrowest the wire uses).
  pair = 4 + 2
  # A ring crosses each card once: one device's bytes leave each node.
  dense = cluster_cost("dense", 800, CLUSTER, 0.1, FLAT)
  assert dense.outer_bytes == dense.inner_bytes == 2 * 7 / 8 * 800 * 4
  assert dense.seconds == pytest.approx(14 * 1e-4 + 1400 * 4 / 1e8)
  # AlltoAll: each of a node's 4 devices sends q pairs to each of the 4
  # devices of the other node through the card, and to 3 devices inside.
  # Then the unsent is reduce-scattered inside the node onto slices of 200.
  topka2a = cluster_cost("topka2a", 800, CLUSTER, 0.1, FLAT)
  assert topka2a.outer_bytes == 4 * 4 * 10 * pair + 7 * 100 * 4
  assert topka2a.inner_bytes == 3 * 10 * pair + 7 * 100 * 4 + 3 * 200 * 4
  assert topka2a.seconds == pytest.approx(
      max(7 * 1e-4 + 16 * 10 * pair / 1e8, 7 * 1e-6 + 3 * 10 * pair / 1e9)
      + 7 * 1e-4 + 2800 / 1e8 + 3 * 1e-6 + 2400 / 1e9)
  # Over one data axis of all 8 devices the residuals are whole: no more.
  whole = cluster_cost("topka2a", 800, CLUSTER, 0.1, FLAT, residual_slices=False)
  assert whole.inner_bytes == 3 * 10 * pair + 7 * 100 * 4
  assert whole.outer_bytes == topka2a.outer_bytes


def test_hand_computed_two_level_costs_on_a_cluster():
  # d = 800, L = 4: slices of 200 between 2 nodes at density 0.1: k = 20,
  # s = 100, q = 10; every node's 4 devices send through its card at once.
  pair = 4 + 2
  topka2a = cluster_cost("topka2a", 800, CLUSTER, 0.1, TWO_LEVEL)
  outer_per_device = 10 * pair + 100 * 4
  assert topka2a.outer_bytes == 4 * outer_per_device
  assert topka2a.inner_bytes == 2 * 3 * 200 * 4  # reduce-scatter, all-gather
  assert topka2a.seconds == pytest.approx(
      2 * (3 * 1e-6 + 3 * 200 * 4 / 1e9) + 2 * 1e-4 + 4 * outer_per_device / 1e8)
  sparse = cluster_cost("topka2a_sparse", 800, CLUSTER, 0.1, TWO_LEVEL)
  assert sparse.outer_bytes == 4 * 2 * 10 * pair


@pytest.mark.parametrize("algorithm", ["allgather", "topka2a", "topka2a_sparse"])
def test_one_device_per_node_is_the_flat_exchange_between_nodes(algorithm):
  """With L = 1 both routes send what the flat model says, all of it between nodes."""
  nodes = Cluster(8, 1, outer=NETWORKS["eth10"], inner=NETWORKS["nvlink"])
  flat = exchange_cost(algorithm, 1_000_000, 8, 0.01)
  for route in (FLAT, TWO_LEVEL):
    cost = cluster_cost(algorithm, 1_000_000, nodes, 0.01, route)
    assert cost.outer_bytes == flat.bytes
    assert cost.seconds == pytest.approx(flat.seconds(NETWORKS["eth10"]))


def test_hand_computed_hierarchical_all_reduce():
  # Two-level dense: a ring all-reduce of each 200-element slice between 2
  # nodes (2 messages, 2 * 1/2 * 200 floats per device), 4 devices per card.
  dense = cluster_cost("dense", 800, CLUSTER, 1.0, TWO_LEVEL)
  assert dense.outer_bytes == 4 * 200 * 4  # against 2 * 7/8 * 800 * 4 flat
  assert dense.inner_bytes == 2 * 3 * 200 * 4
  assert dense.seconds == pytest.approx(
      2 * (3 * 1e-6 + 3 * 200 * 4 / 1e9) + 2 * 1e-4 + 4 * 200 * 4 / 1e8)


def test_cluster_errors():
  with pytest.raises(ValueError, match="unknown route 'ring'"):
    cluster_cost("topka2a", 800, CLUSTER, 0.1, "ring")
  with pytest.raises(ValueError, match="per_node must be an int >= 1, got 0"):
    Cluster(2, 0, outer=NETWORKS["eth10"], inner=NETWORKS["nvlink"])
