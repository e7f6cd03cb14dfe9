"""The fusion planner: its threshold search against an exhaustive sweep."""

import math

import jax
import jax.numpy as jnp
import pytest

from topka2a_jax._src.planner.cost import Network
from topka2a_jax._src.planner.forms import ADAPTIVE, FORMS
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


@pytest.mark.parametrize(("algorithm", "read"), [
    # One 1,000,000-entry leaf on P = 4: a few-bit code passes over the buffer
    # four times and over the owner's 250,000-entry shard twice; a rotated
    # code over the buffer three times more and over the shard once more.
    ("quantized_8_8_fine", 4 * 1_000_000 + 2 * 250_000),
    ("rotated_4_8", 7 * 1_000_000 + 3 * 250_000),
])
def test_each_few_bit_code_is_charged_its_own_coding_rate(algorithm, read):
  net = Network(latency=0.0, bandwidth=1e9)

  def seconds(**rates):
    return plan_fusion([1_000_000], 4, 0.01, network=net, algorithm=algorithm,
                       threshold=1_000_000, min_size=0, **rates).buckets[0].seconds

  wire = seconds(selection_seconds_per_element=0.0)
  assert seconds(selection_seconds_per_element=0.0, coding_seconds_per_element={
      algorithm: 2e-9}) == pytest.approx(wire + read * 2e-9)
  # A form not named is charged the selection's rate; another form's rate
  # does not reach it.
  assert seconds(selection_seconds_per_element=3e-9, coding_seconds_per_element={
      "quantized_4_4": 1.0}) == pytest.approx(wire + read * 3e-9)


@pytest.mark.parametrize(("rate", "want"), [(2e-9, "dense"), (1e-11, "quantized_8_8_fine")])
def test_before_adam_auto_plans_dense_where_coding_outlasts_the_wire(rate, want):
  # 25M entries on 4 devices over 12.5 GB/s (100 Gbit/s): dense's ring sends
  # 2 * 3/4 * 100 MB, 12 ms; the 8-bit code about a quarter of that, but its
  # coding passes over 4 * 25M + 2 * 6.25M entries: 225 ms at 2 ns each, 1.1 ms
  # at 0.01 ns.
  net = Network(latency=1e-5, bandwidth=12.5e9)
  plan = plan_fusion([25_000_000], 4, 0.01, network=net, forms=FORMS[ADAPTIVE],
                     min_size=0, coding_seconds_per_element={"quantized_8_8_fine": rate})
  assert [b.bucket.algorithm for b in plan.buckets] == [want]


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
    ({"coding_seconds_per_element": {"topka2a": 1e-9}},
     "names 'topka2a', which codes no entries; give rates for the few-bit"),
    ({"coding_seconds_per_element": {"quantized_8_8_fine": -1e-9}},
     "is -1e-09: give a duration in seconds, finite and at least 0"),
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


@pytest.mark.parametrize("options, says", [
    ({"selection_seconds_per_entry": float("nan")}, "selection_seconds_per_entry is nan"),
    ({"selection_seconds_per_element": -1e-9}, "selection_seconds_per_element is -1e-09"),
    ({"backward_seconds": -5}, "backward_seconds is -5"),
    ({"names": ["a"]}, "names has 1 entries for 2 leaves"),
], ids=["nan rate", "negative rate", "negative backward", "names short"])
def test_plan_fusion_refuses_figures_no_step_has(options, says):
  with pytest.raises(ValueError, match=says):
    plan_fusion([100, 200], 8, 0.01, **options)
