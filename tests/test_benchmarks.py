"""The benchmarks' own arithmetic, and the GPU script as a smoke run on CPU."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def load(name):
  """A benchmark script as a module (``benchmarks/`` is not a package)."""
  sys.path.insert(0, str(BENCHMARKS))
  try:
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
  finally:
    sys.path.remove(str(BENCHMARKS))
  return module


def test_time_to_target_sums_the_steps_before_the_first_evaluation_below_it():
  network_training = load("network_training")
  rows = [
      # Reaches 2.0 at its step-4 evaluation: 4 steps of 1 s.
      {"run": "dense", "seconds": [1.0] * 6, "evals": [(2, 3.0), (4, 2.0), (6, 1.5)]},
      # Reaches it at step 2 (0.5 + 0.25 s), then goes above it again.
      {"run": "sparse", "seconds": [0.5, 0.25, 0.25, 0.25, 0.25, 0.25],
       "evals": [(2, 1.9), (4, 2.5), (6, 2.2)]},
      # Never reaches it.
      {"run": "never", "seconds": [0.1] * 6, "evals": [(2, 3.0), (4, 2.9), (6, 2.8)]},
  ]
  dense, sparse, never = network_training.report(rows, targets=[2.0, 1.5])
  assert dense["targets"]["2.0"] == {"steps": 4, "seconds": 4.0, "ratio": 1.0}
  assert dense["targets"]["1.5"] == {"steps": 6, "seconds": 6.0, "ratio": 1.0}
  assert (sparse["targets"]["2.0"]["steps"], sparse["targets"]["2.0"]["seconds"]) == (
      2, 0.75)
  assert sparse["targets"]["2.0"]["ratio"] == pytest.approx(0.75 / 4.0)
  assert sparse["targets"]["1.5"] == {"steps": None, "seconds": None, "ratio": None}
  assert sparse["step_s"] == 0.25 and sparse["final"] == 2.2
  assert sparse["highest"] == 2.5
  assert never["targets"]["2.0"]["steps"] is None


def test_training_runs_take_any_dense_warm_up_and_name_the_choices():
  network_training = load("network_training")
  assert network_training.run_options("defaults, 20 dense steps") == {"warmup_steps": 20}
  assert network_training.run_options("dense") == {"algorithm": "dense"}
  assert network_training.run_options("updates") == {"form": "updates"}
  assert network_training.run_options("updates, 30 dense steps") == {
      "form": "updates", "warmup_steps": 30}
  with pytest.raises(ValueError, match="unknown run 'defaults, some dense steps'"):
    network_training.run_options("defaults, some dense steps")


def test_a_local_steps_runs_step_is_its_median_round_over_its_steps():
  # Three steps of 1 s and one of 9 s a round: 3 s a step, where the median says 1.
  network_training = load("network_training")
  rounds = [1.0, 1.0, 1.0, 9.0] * 5 + [1.0, 1.0]  # a partial round left out
  assert network_training.seconds_a_step("local 4", rounds) == 3.0
  assert network_training.seconds_a_step("dense", rounds) == 1.0


@pytest.mark.parametrize("only", [None, "mu", "nu"])
def test_averaging_the_inner_state_gives_every_device_the_devices_mean_moments(mesh, only):
  import jax
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import topka2a_jax

  network_training = load("network_training")
  tx = topka2a_jax.local_steps(optax.adam(0.1), every=2, mesh=mesh)
  state = topka2a_jax.init(tx, {"w": np.zeros(3, np.float32)}, mesh)
  devices = mesh.size
  mu = np.arange(devices * 3, dtype=np.float32).reshape(devices, 3)  # device d: 3d, 3d+1, 3d+2
  nu = (mu + 1) ** 2
  adam = state.inner[0]
  spread = NamedSharding(mesh, P("data"))
  adam = adam._replace(mu={"w": jax.device_put(mu, spread)},
                       nu={"w": jax.device_put(nu, spread)})
  state = state._replace(inner=(adam, *state.inner[1:]))
  averaged = jax.jit(lambda s: network_training.average_inner_state(s, only))(state)
  got = averaged.inner[0]
  want_mu = mu if only == "nu" else np.tile(mu.mean(0), (devices, 1))
  want_nu = nu if only == "mu" else np.tile(nu.mean(0), (devices, 1))
  np.testing.assert_allclose(np.asarray(got.mu["w"]), want_mu, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(got.nu["w"]), want_nu, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(got.count), np.asarray(adam.count))


def test_the_inner_state_averaged_in_few_bits_keeps_small_second_moments_near_their_size(mesh):
  # The benchmark's first try: second moments over 8 decades in every chunk
  # of 512 (each entry's alike on every device, as Adam's are) through
  # collectives.relative_mean, each mean within its two roundings of 1 part
  # in 16 on the root ((17/16)**4 - 1, 27%), where one evenly spaced 8-bit
  # code a chunk sends those below 1/255 of the largest as zero; the first
  # moments through the rotated 4-bit code, close but not exact.
  import jax
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import topka2a_jax

  network_training = load("network_training")
  devices, size = mesh.size, 3000  # a shard of whole chunks, padded
  tx = topka2a_jax.local_steps(optax.adam(0.1), every=2, mesh=mesh)
  state = topka2a_jax.init(tx, {"w": np.zeros(size, np.float32)}, mesh)
  rng = np.random.default_rng(0)
  mu = rng.normal(size=(devices, size)).astype(np.float32)
  scale = 10.0 ** rng.uniform(-10, -2, size)  # each entry's size, alike on every device
  nu = (scale * rng.uniform(0.5, 2.0, size=(devices, size))).astype(np.float32)
  spread = NamedSharding(mesh, P("data"))
  adam = state.inner[0]._replace(mu={"w": jax.device_put(mu, spread)},
                                 nu={"w": jax.device_put(nu, spread)})
  state = state._replace(inner=(adam, *state.inner[1:]))
  averaged = jax.jit(lambda s: network_training.average_inner_state(s, mesh=mesh, coded=True))
  got = averaged(state).inner[0]
  got_mu, got_nu = np.asarray(got.mu["w"]), np.asarray(got.nu["w"])
  assert (got_nu == got_nu[0]).all() and (got_mu == got_mu[0]).all()  # every device alike
  np.testing.assert_array_less(np.abs(got_nu[0] / nu.mean(0) - 1), (17 / 16) ** 4 - 1)
  error = np.sqrt(np.mean((got_mu[0] - mu.mean(0)) ** 2) / np.mean(mu.mean(0) ** 2))
  assert 0 < error < 0.25
  np.testing.assert_array_equal(np.asarray(got.count), np.asarray(adam.count))
  exact = jax.jit(lambda s: network_training.average_inner_state(s))
  sent = topka2a_jax.comm_report(averaged.lower(state)).step_bytes()
  assert 0 < sent < 0.3 * topka2a_jax.comm_report(exact.lower(state)).step_bytes()


def test_nodes_benchmark_fits_links_and_selection_that_reproduce_its_rows():
  """Rows timed by a known cluster's model: the fit recovers it, off by 0%."""
  from topka2a_jax._src.planner import cost

  nodes = load("network_nodes")
  truth = cost.Cluster(2, 4, outer=cost.Network(2e-3, 8e7), inner=cost.Network(5e-4, 3e8))
  per_element, per_entry = 1.5e-8, 6e-7
  size = 1_000_000

  def all_reduce(axis, length):  # what the calibration times: RS then AG over axis
    if axis == "node":
      return 2 * truth.outer.latency + 4 * 2 * 1 / 2 * 4 * length / truth.outer.bandwidth
    return 6 * truth.inner.latency + 2 * 3 / 4 * 4 * length / truth.inner.bandwidth

  rows = [{"kind": "calibration", "axis": axis, "length": length,
           "seconds": all_reduce(axis, length), "card_bytes": 0.0}
          for axis in ("local", "node") for length in (4096, size)]
  for algorithm, route, slices in [
      ("dense", cost.FLAT, False), ("topka2a", cost.FLAT, False),
      ("topka2a", cost.FLAT, True), ("topka2a", cost.TWO_LEVEL, True),
      ("allgather", cost.FLAT, False), ("topka2a_sparse", cost.FLAT, False),
      ("topka2a_sparse", cost.TWO_LEVEL, True)]:
    row = {"kind": "exchange", "algorithm": algorithm, "route": route,
           "slices": slices, "density": 1.0 if algorithm == "dense" else 0.01,
           "length": size}
    model = cost.cluster_cost(algorithm, size, truth, row["density"], route,
                              residual_slices=slices)
    elements, entries = ([0, 0] if algorithm == "dense"
                         else nodes.selection_terms(row, truth))
    rows.append(dict(row, seconds=model.seconds + per_element * elements
                     + per_entry * entries, card_bytes=model.outer_bytes))
  fitted = nodes.fit_cluster(rows, 2, 4)
  assert fitted.outer.latency == pytest.approx(2e-3)
  assert fitted.inner.bandwidth == pytest.approx(3e8)
  reported = nodes.report([rows, rows], 2, 4, "1gbit")
  for row in reported:
    assert row["model_seconds"] == pytest.approx(row["seconds"], rel=1e-6)
    assert row["model_card_bytes"] == row["card_bytes"]


@pytest.mark.slow
def test_training_benchmark_runs_locally_without_a_link(tmp_path):
  out = tmp_path / "training.json"
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, str(BENCHMARKS / "network_training.py"), "--local",
       "--processes", "2", "--steps", "3", "--eval-every", "1", "--b1", "0.5",
       "--runs", "dense", "defaults, 50 dense steps", "updates", "--json", str(out)],
      env=env, capture_output=True, text=True, timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  written = json.loads(out.read_text())
  assert (written["rate"], written["b1"]) == (None, 0.5)
  assert [row["run"] for row in written["rows"]] == [
      "dense", "defaults, 50 dense steps", "updates"]
  dense, warm, _ = written["rows"]
  np.testing.assert_allclose(warm["evals"], dense["evals"], rtol=1e-5)  # dense in both
  assert all(len(row["seconds"]) == 3 for row in written["rows"])


@pytest.mark.slow
def test_gpu_script_runs_small_on_cpu(tmp_path):
  out = tmp_path / "gpu.json"
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, str(BENCHMARKS / "gpu.py"), "--small", "--repeats", "1",
       "--json", str(out)], env=env, capture_output=True, text=True, timeout=600,
      check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  written = json.loads(out.read_text())
  assert written["platform"] == "cpu"
  assert [row["density"] for row in written["selection"]] == [0.001, 0.01, 0.05] * 2
  assert {row["auto"] for row in written["selection"]} == {"threshold"}
  assert [row["run"] for row in written["steps"]] == [
      "dense (nothing to send)", "defaults", "8 bits (quantized_8_8_fine)",
      "4 up, 8 back (quantized_4_8)", "4 up rotated, 8 back (rotated_4_8)",
      "topka2a, exact", "topka2a, threshold",
      "topka2a, approx"]
  assert all(row["seconds"] > 0 for row in written["steps"])
  assert written["steps"][0]["adds"] == 0
  base = written["steps"][0]["seconds"]
  for row in written["steps"]:
    assert row["adds"] == pytest.approx(row["seconds"] / base - 1)


def test_step_benchmark_fits_the_link_and_bounds_the_flat_update_by_its_alpha_beta_time():
  """Dense rows made from a known α and bandwidth: the fit recovers both, and the
  flat buffer's limit is the planned exchange's α-β time at that link."""
  from topka2a_jax._src.planner.cost import exchange_cost

  network_step = load("network_step")
  alpha, bandwidth, processes = 200e-6, 30e6, 4
  seconds = lambda c: c.messages * alpha + c.bytes / bandwidth
  rows = [{"gradient": f"fit {n}", "run": "dense", "elements": n,
           "seconds": seconds(exchange_cost("dense", n, processes, 1.0))}
          for n in network_step.FIT_SIZES]
  flat = network_step.FIT_SIZES[-1]
  rows += [{"gradient": "flat", "run": "dense", "elements": flat, "seconds": 6.0},
           {"gradient": "flat", "run": "defaults", "elements": flat, "seconds": 0.9}]
  result = network_step.report(rows, processes, 0.01)
  assert result["alpha"] == pytest.approx(alpha, rel=1e-6)
  assert result["bandwidth"] == pytest.approx(bandwidth, rel=1e-6)
  sparse = exchange_cost("topka2a_sparse", flat, processes, 0.01)
  assert result["flat_limit_s"] == pytest.approx(seconds(sparse), rel=1e-6)
  assert [r["ratio"] for r in result["rows"]] == pytest.approx([1.0, 0.15])


def test_startup_ratios_are_to_the_same_trials_import_of_jax():
  startup = load("startup")
  names = list(startup.COMMANDS)
  trials = [dict.fromkeys(names, 1.0) | {"import jax": 2.0, "topka2a-plan --help": 0.5},
            dict.fromkeys(names, 1.0) | {"import jax": 1.0, "topka2a-plan --help": 0.25},
            dict.fromkeys(names, 1.0) | {"import jax": 4.0, "topka2a-plan --help": 3.0}]
  rows = {row["command"]: row for row in startup.table(trials)}
  assert rows["import jax"] == {"command": "import jax", "seconds": 2.0, "ratio": 1.0,
                                "ratio_range": [1.0, 1.0]}
  # Each trial's own ratio (0.25, 0.25, 0.75), not the ratio of the medians (0.5 / 2.0).
  assert rows["topka2a-plan --help"]["seconds"] == 0.5
  assert rows["topka2a-plan --help"]["ratio"] == 0.25
  assert rows["topka2a-plan --help"]["ratio_range"] == [0.25, 0.75]


def test_every_benchmark_is_listed_in_its_family_with_evidence_that_exists():
  layout = (BENCHMARKS.parent / "docs" / "layout.md").read_text()
  table = layout[layout.index("| family | scripts | evidence |"):]
  table = table[:table.index("\n\n")]
  for script in sorted(BENCHMARKS.glob("*.py")):
    assert f"`{script.name}`" in table, f"{script.name} has no family in docs/layout.md"
  for row in table.splitlines()[2:]:
    for page in row.rstrip(" |").rsplit("|", 1)[1].split(","):
      assert (BENCHMARKS.parent / "docs" / page.strip()).exists(), page
