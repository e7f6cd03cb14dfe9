"""The fusion planner: its threshold search against an exhaustive sweep."""

import math

import jax
import jax.numpy as jnp
import pytest

from topka2a_jax._src.planner.cost import Network
from topka2a_jax._src.planner.fusion import plan_fusion
from topka2a_jax.tools.model_shapes import MODELS

PARAMETER_COUNTS = {"resnet50": 25_557_032, "bert-base": 109_482_240,
                    "gpt2": 124_439_808}


def sizes_of(model):
  return [math.prod(shape) for _, shape in MODELS[model]()]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_model_shapes_have_the_published_sizes(model):
  assert sum(sizes_of(model)) == PARAMETER_COUNTS[model]


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("network, num_devices", [("nvlink", 32), ("eth10", 8)])
def test_search_is_within_two_percent_of_a_sweep(model, network, num_devices):
  sizes = sizes_of(model)
  planned = plan_fusion(sizes, num_devices, 0.01, network=network)
  low, high = min(sizes), sum(sizes)
  sweep = sorted({round(low * (high / low) ** (j / 1023)) for j in range(1024)})
  best = min(plan_fusion(sizes, num_devices, 0.01, network=network,
                         threshold=t).step_seconds for t in sweep)
  assert planned.step_seconds <= 1.02 * best


def test_hand_computed_plan():
  # Two 1000-element leaves and a 10-element bias, P = 2, density 0.5, no
  # latency, 1000 B/s, backward 10 s: a threshold of 1000 gives one bucket per
  # weight (the bias dense on its own). Leaf 2 is ready at 1000/2010 * 10 s.
  net = Network(latency=0.0, bandwidth=1000.0)
  plan = plan_fusion([1000, 10, 1000], 2, 0.5, network=net, algorithm="topka2a",
                     threshold=1000, min_size=100, backward_seconds=10.0,
                     selection_seconds_per_element=0.0,
                     selection_seconds_per_entry=0.0)
  assert [(b.bucket.leaves, b.bucket.algorithm) for b in plan.buckets] == [
      ((2,), "topka2a"), ((1,), "dense"), ((0,), "topka2a")]
  # topka2a of 1000 on 2 devices, 2-byte indices: 1 * (250 * 6 + 500 * 4)
  # = 3500 bytes, 3.5 s.
  first = plan.buckets[0]
  assert first.ready == pytest.approx(10 * 1000 / 2010)
  assert first.finish == pytest.approx(first.ready + 3.5)
  assert plan.buckets[-1].finish == pytest.approx(
      max(10.0, plan.buckets[1].finish) + 3.5)


def test_selection_costs_per_element_and_per_entry():
  # One 1000-element leaf, P = 2, density 0.5: k = 500, q = 250 per shard.
  # TopKA2A reads 1000 elements and selects 2 * 250 = 500 entries;
  # TopKA2A-sparse's owner selects again from its 500-element shard: 1500
  # read, 750 selected. 3.5 s on the wire, as above, for topka2a;
  # 1 * 2 * 250 * 6 = 3000 bytes, 3 s, for topka2a_sparse.
  net = Network(latency=0.0, bandwidth=1000.0)
  for algorithm, wire, read, entries in (("topka2a", 3.5, 1000, 500),
                                         ("topka2a_sparse", 3.0, 1500, 750)):
    plan = plan_fusion([1000], 2, 0.5, network=net, algorithm=algorithm,
                       threshold=1000, min_size=0, backward_seconds=0.0,
                       selection_seconds_per_element=1e-4,
                       selection_seconds_per_entry=1e-3)
    assert plan.buckets[0].seconds == pytest.approx(wire + read * 1e-4 + entries * 1e-3)


@pytest.mark.parametrize("size, num_devices, density, network, want", [
    (10_000_000, 8, 0.1, "eth10", "topka2a_sparse"),  # O(k) beats all
    (10_000_000, 32, 0.01, "eth10", "topka2a_sparse"),
    (10_000_000, 8, 0.9, "eth10", "dense"),  # above 1/2 everything sparse loses
    (2_000, 32, 0.01, "eth10", "allgather"),  # latency-bound: one phase wins
])
def test_auto_takes_the_cheapest_algorithm(size, num_devices, density, network, want):
  plan = plan_fusion([size], num_devices, density, network=network, threshold=1,
                     min_size=0, selection_seconds_per_element=0.0)
  assert plan.buckets[0].bucket.algorithm == want


def test_plan_is_printable_and_deterministic():
  sizes = sizes_of("resnet50")
  first, second = (plan_fusion(sizes, 16, 0.01, network="ib100") for _ in range(2))
  assert first == second
  text = str(first)
  assert "predicted step end" in text and "all dense" in text
  assert first.step_seconds <= first.dense_seconds


@pytest.mark.parametrize("kwargs, match", [
    ({"algorithm": "topk"}, "unknown algorithm 'topk'"),
    ({"threshold": 0}, "threshold must be 'auto' or a positive int"),
    ({"network": "wifi"}, "unknown network 'wifi'"),
])
def test_bad_planner_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    plan_fusion([100, 200], 8, 0.01, **kwargs)


def test_plans_from_a_pytree_of_shapes():
  params = {"dense": {"kernel": jax.ShapeDtypeStruct((512, 512), jnp.float32),
                      "bias": jax.ShapeDtypeStruct((512,), jnp.float32)}}
  plan = plan_fusion(params, 8, 0.1, threshold=1)
  assert plan.names == ("['dense']['bias']", "['dense']['kernel']")
  assert sorted(b.bucket.size for b in plan.buckets) == [512, 512 * 512]
