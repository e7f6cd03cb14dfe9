"""The communication report against the cost model and hand-written HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax
from topka2a_jax._src.collectives.registry import COLLECTIVES
from topka2a_jax._src.planner.cost import exchange_cost


def lowered_exchange(mesh, algorithm, length, density):
  fn = COLLECTIVES[algorithm]
  run = jax.jit(jax.shard_map(lambda b: tuple(fn(b, "data", density)), mesh=mesh,
                              in_specs=P("data"), out_specs=(P(), P("data"))))
  x = jax.device_put(np.ones(8 * length, np.float32), NamedSharding(mesh, P("data")))
  return run.lower(x)


@pytest.mark.parametrize("algorithm", ["dense", "allgather", "topka2a",
                                       "topka2a_sparse"])
@pytest.mark.parametrize("length", [1000, 12345, 100_003])
@pytest.mark.parametrize("density", [0.01, 0.05, 0.3])
def test_report_matches_the_model(mesh, algorithm, length, density):
  report = topka2a_jax.comm_report(lowered_exchange(mesh, algorithm, length, density))
  model = exchange_cost(algorithm, length, 8, density)
  assert report.total_bytes == pytest.approx(model.bytes, rel=0.05)


def test_report_rows(mesh):
  report = topka2a_jax.comm_report(lowered_exchange(mesh, "topka2a", 1000, 0.01))
  assert [(r.kind, r.count) for r in report.collectives] == [
      ("all-gather", 1), ("all-to-all", 1)]
  # all-to-all: 8 rows of 2 (float32 value, uint16 index) pairs; all-gather:
  # 8 shards of 125 float32.
  assert report.bytes_of("all-to-all") == 7 / 8 * (8 * 2 * 6)
  assert report.bytes_of("all-gather") == 7 / 8 * (8 * 125 * 4)
  assert "total" in str(report)


HLO = """
HloModule step, num_partitions=4
  %a = f32[100]{0} all-reduce(f32[100]{0} %x), replica_groups={{0,1,2,3}}, to_apply=%add
  %b = (f32[10]{0}, bf16[20]{0}) all-reduce(%y, %z), replica_groups=[1,4]<=[4]
  %c = (f32[25]{0}, f32[100]{0}) all-gather-start(f32[25]{0} %p), dimensions={0}
  %d = f32[100]{0} all-gather-done(%c)
  %e = u8[4,16]{1,0} all-to-all(u8[4,16]{1,0} %q), replica_groups={{0,1},{2,3}}
  %f = f32[8]{0} collective-permute(f32[8]{0} %r), source_target_pairs={{0,1}}
  %g = f32[5]{0} reduce-scatter(f32[20]{0} %s), replica_groups={}, dimensions={0}
"""


def test_hand_written_hlo():
  report = topka2a_jax.comm_report(HLO)
  assert report.count_of("all-reduce") == 2
  assert report.bytes_of("all-reduce") == 2 * 3 / 4 * (400 + 40 + 40)
  assert report.count_of("all-gather") == 1
  assert report.bytes_of("all-gather") == 3 / 4 * 400
  assert report.bytes_of("all-to-all") == 1 / 2 * 64  # groups of 2
  assert report.bytes_of("collective-permute") == 32
  assert report.bytes_of("reduce-scatter") == 3 / 4 * 80


BRANCHED_HLO = """HloModule m, num_partitions=4

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(f32[] %a, f32[] %b)
}

%exchange (p: f32[100]) -> f32[100] {
  %p = f32[100]{0} parameter(0)
  ROOT %x = f32[100]{0} all-to-all(f32[100]{0} %p), replica_groups={{0,1,2,3}}
}

%ends (t: (f32[100])) -> f32[100] {
  %t = (f32[100]{0}) parameter(0)
  %g = f32[100]{0} get-tuple-element(%t), index=0
  ROOT %y = f32[100]{0} call(f32[100]{0} %g), to_apply=%exchange
}

%goes_on (u: (f32[100])) -> f32[100] {
  %u = (f32[100]{0}) parameter(0)
  ROOT %z = f32[100]{0} get-tuple-element(%u), index=0
}

ENTRY %main (q: f32[100], k: s32[]) -> f32[100] {
  %q = f32[100]{0} parameter(0)
  %k = s32[] parameter(1)
  %loss = f32[] all-reduce(f32[] %q), replica_groups={{0,1,2,3}}, to_apply=%sum
  %tq = (f32[100]{0}) tuple(%q)
  ROOT %r = f32[100]{0} conditional(s32[] %k, %tq, %tq), branch_computations={%ends, %goes_on}
}
"""


def test_collectives_in_a_branch_are_told_apart_and_spread_over_a_round():
  # Hand-counted: the all-reduce of one float runs every step, 2 * 3/4 * 4 bytes;
  # the all-to-all of 100 floats, called from a branch, 3/4 * 400 bytes when taken.
  report = topka2a_jax.comm_report(BRANCHED_HLO)
  rows = {(row.kind, row.in_branch): row.bytes for row in report.collectives}
  assert rows == {("all-reduce", False): 6.0, ("all-to-all", True): 300.0}
  assert report.total_bytes == 306.0
  assert report.step_bytes() == 306.0
  assert report.step_bytes(4) == 6.0 + 300.0 / 4
  assert "all-to-all *" in str(report) and "runs only when it is taken" in str(report)
  with pytest.raises(ValueError, match="every must be at least 1"):
    report.step_bytes(0)


@pytest.mark.parametrize("steps, rounds", [(300, 100 / 4 + 200 / 2), (50, 50 / 4),
                                           (150, 100 / 4 + 50 / 2), (101, 25 + 0.5)])
def test_rounds_that_shorten_are_spread_over_the_run(steps, rounds):
  # Hand-counted rounds of local_steps(every={0: 4, 100: 2}) in the first
  # `steps` steps, a round cut short counted in part; 300 bytes each.
  report = topka2a_jax.comm_report(BRANCHED_HLO)
  got = report.step_bytes({0: 4, 100: 2}, steps=steps)
  assert got == pytest.approx(6.0 + 300.0 * rounds / steps, rel=1e-12)
  assert report.step_bytes({0: 4}, steps=steps) == pytest.approx(6.0 + 300.0 / 4, rel=1e-12)


def test_rounds_that_shorten_without_the_runs_length_are_refused():
  report = topka2a_jax.comm_report(BRANCHED_HLO)
  with pytest.raises(ValueError, match=r"give its length, step_bytes\(every, steps=300\)"):
    report.step_bytes({0: 4, 100: 2})
  with pytest.raises(ValueError, match="start it at one of those"):
    report.step_bytes({0: 4, 6: 2}, steps=300)
  with pytest.raises(ValueError, match="steps must be at least 1"):
    report.step_bytes({0: 4, 100: 2}, steps=0)


@pytest.mark.parametrize("algorithm", ["allgather", "topka2a", "topka2a_sparse"])
@pytest.mark.parametrize("length", [4096, 600_000])  # uint16, then uint32 indices
def test_narrow_wire_formats_send_fewer_bytes(mesh, algorithm, length):
  fn = COLLECTIVES[algorithm]

  def report(**options):
    run = jax.jit(jax.shard_map(lambda b: tuple(fn(b, "data", 0.01, **options)),
                                mesh=mesh, in_specs=P("data"),
                                out_specs=(P(), P("data"))))
    x = jax.device_put(np.ones(8 * length, np.float32),
                       NamedSharding(mesh, P("data")))
    return topka2a_jax.comm_report(run.lower(x))

  wide = report()
  narrow = report(value_dtype=jnp.bfloat16)
  model = exchange_cost(algorithm, length, 8, 0.01, value_bytes=2)
  assert narrow.total_bytes == pytest.approx(model.bytes, rel=0.05)
  assert narrow.total_bytes < wide.total_bytes
  # Indices: 2 bytes while the addressed range fits 65,536 positions.
  addressed = length if algorithm == "allgather" else length // 8
  index_bytes = 2 if addressed <= 65536 else 4
  assert exchange_cost(algorithm, length, 8, 0.01, value_bytes=2) == exchange_cost(
      algorithm, length, 8, 0.01, value_bytes=2, index_bytes=index_bytes)


def test_sparse_second_phase_is_under_five_percent_of_dense(mesh):
  length = 1_000_000
  dense = topka2a_jax.comm_report(lowered_exchange(mesh, "dense", length, 0.01))
  sparse = topka2a_jax.comm_report(
      lowered_exchange(mesh, "topka2a_sparse", length, 0.01))
  assert sparse.total_bytes < 0.05 * dense.total_bytes


def test_each_row_names_the_form_of_the_exchange_it_carries(mesh):
  """A hand-written HLO line's op_name scope, and a whole step: the README's chain on a
  (64, 64) weight and an 8-entry bias sends the weight's 8-bit code (its all-to-all and
  all-gather, the cost model's bytes), the bias dense (an all-reduce, as the loss's mean,
  which carries no form)."""
  line = ('  %a = u8[4,16]{1,0} all-to-all(u8[4,16]{1,0} %q), replica_groups={{0,1,2,3}}, '
          'metadata={op_name="jit(_run)/shard_map/cond/topka2a_form.rotated_4_8/all_to_all"}')
  (row,) = topka2a_jax.comm_report("HloModule step, num_partitions=4\n" + line).collectives
  assert row.form == "rotated_4_8"
  params = {"w": jnp.zeros((64, 64)), "b": jnp.zeros(8)}
  tx = optax.chain(topka2a_jax.topka2a(mesh=mesh), optax.adam(1e-2))
  step = topka2a_jax.train_step(lambda p, x: jnp.mean((x @ p["w"] + p["b"][0] - 1) ** 2),
                                tx, mesh)
  report = topka2a_jax.comm_report(step.lower(params, tx.init(params),
                                              np.ones((16, 64), np.float32)))
  forms = {(row.kind, row.form) for row in report.collectives}
  assert {("all-to-all", "quantized_8_8_fine"), ("all-gather", "quantized_8_8_fine")} <= forms
  # The bias's all-reduce and the loss's: XLA may fuse them, and the row takes one name.
  assert {form for kind, form in forms if kind == "all-reduce"} <= {"dense", ""}
  coded = sum(row.bytes for row in report.collectives if row.form == "quantized_8_8_fine")
  assert coded == exchange_cost("quantized_8_8_fine", 4096, 8, 1.0).bytes
  assert "  form" in str(report).splitlines()[0]
