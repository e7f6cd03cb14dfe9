"""What XLA really emits for a jitted training step, read from compiled HLO."""

import math
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax

PARAMS = {"w1": jnp.ones((64, 128)), "w2": jnp.ones((128, 32))}
COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter",
               "collective-permute")


def compiled_hlo(mesh, algorithm, **options):
  """Compiled HLO of a jitted training step (topka2a_jax.train_step)."""
  tx = optax.chain(topka2a_jax.topka2a(0.01, algorithm=algorithm, mesh=mesh,
                                       **options), optax.sgd(0.1))

  def loss(params, x):
    return jnp.sum(jnp.tanh(x @ params["w1"]) @ params["w2"])

  step = topka2a_jax.train_step(loss, tx, mesh)
  return step.lower(PARAMS, tx.init(PARAMS), jnp.ones((16, 64))).compile().as_text()


LOSS_MEAN_BYTES = 2 * 7 / 8 * 4  # the step's pmean of its float32 loss


def exchange_collectives(mesh, algorithm):
  """Kinds of collective in a step without the non-finite check, the loss's
  scalar mean aside."""
  report = topka2a_jax.comm_report(compiled_hlo(mesh, algorithm, skip_nonfinite=False))
  exchange = {r.kind for r in report.collectives if r.kind != "all-reduce"}
  if report.bytes_of("all-reduce") > LOSS_MEAN_BYTES:
    exchange.add("all-reduce")
  return exchange


@pytest.mark.parametrize("algorithm", ["topka2a", "topka2a_sparse"])
def test_topka2a_step_is_all_to_all_and_all_gather(mesh, algorithm):
  assert exchange_collectives(mesh, algorithm) == {"all-to-all", "all-gather"}


def test_allgather_step_is_all_gather(mesh):
  assert exchange_collectives(mesh, "allgather") == {"all-gather"}


def test_dense_step_is_all_reduce(mesh):
  assert exchange_collectives(mesh, "dense") == {"all-reduce"}


def test_nonfinite_check_adds_one_scalar_all_reduce(mesh):
  without, with_check = (
      topka2a_jax.comm_report(compiled_hlo(mesh, "topka2a", skip_nonfinite=skip))
      for skip in (False, True))
  assert with_check.count_of("all-reduce") == without.count_of("all-reduce") + 1
  assert with_check.bytes_of("all-reduce") - without.bytes_of("all-reduce") <= 8
  assert without.bytes_of("all-reduce") == LOSS_MEAN_BYTES


def update_hlo(mesh, tx, params):
  """StableHLO of tx.update in shard_map, before XLA combines anything."""
  grads = jax.device_put(jax.tree.map(lambda p: jnp.ones((8, *p.shape)), params),
                         NamedSharding(mesh, P("data")))
  state = topka2a_jax.init(tx, params, mesh)
  specs = topka2a_jax.state_specs(state)
  run = jax.jit(jax.shard_map(lambda g, s: tx.update(jax.tree.map(lambda a: a[0], g), s),
                              mesh=mesh, in_specs=(P("data"), specs),
                              out_specs=(P(), specs)))
  return run.lower(grads, state).as_text()


@pytest.mark.parametrize("algorithm", ["topka2a", "allgather"])
def test_one_message_per_bucket_carries_values_and_indices(mesh, algorithm):
  # Two buckets (one per weight at this bucket size): one exchange each.
  tx = topka2a_jax.topka2a(0.01, algorithm=algorithm, fusion=1)
  hlo = update_hlo(mesh, tx, PARAMS)
  first = "all_to_all" if algorithm == "topka2a" else "all_gather"
  assert len(re.findall(rf"stablehlo\.{first}\b", hlo)) == 2


def test_auto_plan_is_what_the_step_runs(mesh):
  # The transform plans at trace time with the same model plan_fusion prints.
  shapes = {"a": (1000, 1000), "b": (300,), "c": (3000,), "d": (20, 50)}
  params = {k: jnp.ones(s) for k, s in shapes.items()}
  tx = topka2a_jax.topka2a(0.1, algorithm="auto", fusion="auto", min_size=1000,
                           network="eth10", skip_nonfinite=False)
  sizes = [math.prod(shapes[k]) for k in sorted(shapes)]
  plan = topka2a_jax.plan_fusion(sizes, 8, 0.1, algorithm="auto", min_size=1000,
                                 network="eth10")
  chosen = [b.bucket.algorithm for b in plan.buckets]
  hlo = update_hlo(mesh, tx, params)
  two_phase = chosen.count("topka2a") + chosen.count("topka2a_sparse")
  assert len(re.findall(r"stablehlo\.all_to_all\b", hlo)) == two_phase
  assert len(re.findall(r"stablehlo\.all_gather\b", hlo)) == (
      two_phase + chosen.count("allgather"))
  assert len(re.findall(r"stablehlo\.all_reduce\b", hlo)) == chosen.count("dense")
  assert {"topka2a_sparse", "dense"} <= set(chosen)


def test_wrapped_chain_checks_for_nonfinite_once(mesh):
  # skip_nonfinite hands its decision to the topka2a inside: one flag all-reduce.
  inner = optax.chain(topka2a_jax.topka2a(0.01, fusion=1), optax.sgd(0.1))
  for tx in (inner, topka2a_jax.skip_nonfinite(inner)):
    hlo = update_hlo(mesh, tx, PARAMS)
    assert len(re.findall(r"stablehlo\.all_reduce\b", hlo)) == 1
