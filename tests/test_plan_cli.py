"""The command-line planner picks the algorithm the break-even densities say."""

import json
import math
import os
import pathlib
import re
import shutil
import site
import subprocess
import sys
import venv

import pytest

from topka2a_jax.tools import plan
from topka2a_jax.tools.model_shapes import resnet50


def run(capsys, *args):
  assert plan.main(list(args)) == 0
  return capsys.readouterr().out


def chosen(out):
  [row] = [line for line in out.splitlines() if "gradient .. gradient" in line]
  return row.split()[-3]


@pytest.mark.parametrize("density, want", [
    (0.01, "allgather"),  # below 1/(2(P-1)) = 0.0714 for P = 8
    (0.2, "topka2a"),     # between the two break-evens
    (0.8, "dense"),       # above 1/2
])
def test_topka2a_choice_follows_its_breakevens(capsys, density, want):
  # Among TopkA, TopKA2A and dense, the cheapest flips at 1/(2(P-1)) and 1/2.
  def predicted(algorithm):
    out = run(capsys, "--params", "25000000", "--devices", "8", "--density",
              str(density), "--network", "eth1", "--algorithm", algorithm)
    assert ("TopKA2A beats dense below density 0.5 and beats TopkA above "
            "density 0.07") in out  # 1/14, moved up a little by latency
    return float(out.split("predicted step end: ")[1].split()[0])

  times = {a: predicted(a) for a in ("allgather", "topka2a", "dense")}
  assert min(times, key=times.get) == want


@pytest.mark.parametrize("size, devices, density, want", [
    ("25000000", "8", "0.01", "topka2a_sparse"),
    ("25000000", "8", "0.8", "dense"),
    ("2000", "32", "0.01", "allgather"),  # latency-bound: one phase wins
])
def test_auto_choice(capsys, size, devices, density, want):
  out = run(capsys, "--params", size, "--devices", devices, "--density", density,
            "--network", "eth1")
  assert chosen(out) == want


def test_model_preset_prints_speedups(capsys):
  out = run(capsys, "--model", "bert-base", "--devices", "32", "--density", "0.01",
            "--network", "ib100")
  assert "199 leaves, 109,482,240 elements" in out
  assert "speedup" in out


def test_bad_arguments_exit_with_a_message(capsys):
  with pytest.raises(SystemExit):
    plan.main(["--params", "10", "--devices", "8", "--density", "0"])
  assert "--density must be in (0, 1]" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    plan.main(["--params", "10", "--devices", "8", "--density", "0.1",
               "--network", "wifi"])
  assert "unknown network 'wifi'" in capsys.readouterr().err


@pytest.mark.parametrize("threshold", ["abc", "0", "1.5"])
def test_a_threshold_that_is_not_a_size_exits_with_a_message(capsys, threshold):
  with pytest.raises(SystemExit):
    plan.main(["--params", "10", "--devices", "8", "--density", "0.1",
               "--threshold", threshold])
  err = capsys.readouterr().err
  assert f"{threshold!r} is not a bucket size" in err
  assert "Traceback" not in err


@pytest.mark.parametrize("network, want", [("nvlink", {"dense"}),
                                           ("eth10", {"topka2a_sparse"})])
def test_resnet50_on_8_gpus_goes_dense_on_nvlink_and_sparse_on_ethernet(
    capsys, network, want):
  # The backward pass comes from ResNet-50's FLOPs on an H100, not from the
  # exchange; buckets of the large leaves take what the model says.
  out = run(capsys, "--model", "resnet50", "--devices", "8", "--density", "0.01",
            "--network", network)
  assert "backward pass: 1.327 ms (twice the forward's 8.2 GFLOP per sample" in out
  rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()
          and len(line.split()) >= 7]
  large = {row[-3] for row in rows if int(row[-4].replace(",", "")) >= 1_000_000}
  assert large == want
  assert ("compression does not pay here" in out) == (network == "nvlink")


def test_cpu_hosts_plan_no_overlap_with_the_backward_pass(capsys):
  out = run(capsys, "--model", "resnet50", "--devices", "8", "--density", "0.01",
            "--device", "cpu")
  assert ("backward pass: 0.000 ms (cpu runs collectives in line with compute: "
          "no exchange overlaps it)") in out


@pytest.mark.parametrize("network, inner, want", [
    ("eth10", "nvlink", {"two_level"}), ("nvlink", "eth1", {"flat"})])
def test_nodes_take_the_route_their_two_links_favour(capsys, network, inner, want):
  """GPT-2 small on 8 nodes of 8: two-level where the slow link is between nodes."""
  out = run(capsys, "--model", "gpt2", "--devices", "64", "--density", "0.01",
            "--devices-per-node", "8", "--network", network, "--inner-network", inner)
  assert f"; 8 nodes of 8 devices, {inner} inside a node" in out
  header = next(line for line in out.splitlines() if line.split()[:2] == ["bucket", "leaves"])
  assert header.split()[-1] == "route"  # every column has its heading
  rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()
          and len(line.split()) >= 8]
  assert {row[-1] for row in rows if row[-4] != "dense"} == want


def test_nodes_must_split_the_devices_evenly(capsys):
  with pytest.raises(SystemExit):
    plan.main(["--params", "1000", "--devices", "64", "--density", "0.01",
               "--devices-per-node", "7"])
  assert ("--devices-per-node must divide --devices (64) into whole nodes; got 7"
          in capsys.readouterr().err)


def goes_low_rank(shape, rank):
  """A matrix (all axes by the last) of 1024+ elements whose factors are at most half of it."""
  if len(shape) < 2:
    return False
  m, n = math.prod(shape[:-1]), shape[-1]
  return m * n >= 1024 and (m + n) * min(rank, m, n) * 2 <= m * n


def test_rank_prices_powersgd_on_the_models_layers(capsys):
  out = run(capsys, "--model", "resnet50", "--devices", "4", "--density", "0.01",
            "--network", "eth1", "--rank", "4")
  shapes = [shape for _, shape in resnet50()]
  low = [s for s in shapes if goes_low_rank(s, 4)]
  factors = sum((math.prod(s[:-1]) + s[-1]) * 4 for s in low)
  dense = sum(math.prod(s) for s in shapes if not goes_low_rank(s, 4))
  assert f"{len(low)} of {len(shapes)} leaves low rank, {dense:,} elements dense" in out
  # 4 processes: each all-reduce sends 2(P-1)/P = 1.5 of its float32 payload;
  # three of them (P, Q, the dense rest) of 2(P-1) = 6 messages each.
  assert f"{1.5 * 4 * (factors + dense) / 1e6:.3f} MB and 18 messages" in out
  assert "'auto' never picks it" in out


def test_rank_needs_a_model(capsys):
  with pytest.raises(SystemExit):
    plan.main(["--params", "1000000", "--devices", "4", "--density", "0.01",
               "--rank", "4"])
  assert "--rank prices PowerSGD on a model's layer shapes" in capsys.readouterr().err


@pytest.mark.slow
def test_the_wheel_installs_both_commands(tmp_path):
  """``pip install`` of the built wheel (not editable) into a fresh venv."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  source = tmp_path / "source"  # built from a copy: no build/ left in the tree
  shutil.copytree(root, source, ignore=shutil.ignore_patterns(
      ".git", "build", "dist", "*.egg-info", ".venv", "_build", "__pycache__"))
  built = subprocess.run(
      [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "dist"),
       str(source)], capture_output=True, text=True, check=False)
  assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
  [wheel] = (tmp_path / "dist").glob("topka2a_jax-*.whl")
  # JAX and the rest come from the interpreter running the tests (a venv's
  # too, which a nested venv's system site would miss); the package only
  # from the wheel, whose site-packages come first.
  venv.create(tmp_path / "venv", with_pip=True)
  bin_dir = tmp_path / "venv" / "bin"
  [own_site] = (tmp_path / "venv" / "lib").glob("python*/site-packages")
  (own_site / "running_interpreter.pth").write_text(
      "\n".join(site.getsitepackages()) + "\n")
  installed = subprocess.run(
      [str(bin_dir / "python"), "-m", "pip", "install", "--no-deps", str(wheel)],
      capture_output=True, text=True, check=False)
  assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  where = subprocess.run(
      [str(bin_dir / "python"), "-c", "import topka2a_jax; print(topka2a_jax.__file__)"],
      capture_output=True, text=True, cwd=tmp_path, env=env, check=False)
  assert where.returncode == 0, where.stderr[-2000:]
  assert where.stdout.startswith(str(tmp_path / "venv")), where.stdout  # not the tree
  planned = subprocess.run(
      [str(bin_dir / "topka2a-plan"), "--model", "gpt2", "--devices", "8",
       "--density", "0.01", "--network", "eth10"],
      capture_output=True, text=True, cwd=tmp_path, env=env, check=False)
  assert planned.returncode == 0, planned.stderr[-2000:]
  assert planned.stdout.startswith("fusion plan: 148 leaves, 124,439,808 elements, P=8")
  assert "predicted step end" in planned.stdout
  script = tmp_path / "hello.py"
  script.write_text("import os; print('rank', os.environ['TOPKA2A_PROCESS_ID'])")
  launched = subprocess.run(
      [str(bin_dir / "topka2a-launch"), "-n", "2", str(script)],
      capture_output=True, text=True, cwd=tmp_path, env=env, check=False)
  assert launched.returncode == 0, launched.stderr[-2000:]
  assert {"[0] rank 0", "[1] rank 1"} <= set(launched.stdout.splitlines())


def test_a_few_bit_algorithm_needs_no_density_and_the_top_k_does(capsys):
  assert plan.main(["--params", "8000000", "--devices", "4", "--network", "eth1",
                    "--algorithm", "quantized_8_8"]) == 0
  out = capsys.readouterr().out
  assert "quantized_8_8" in out and "beats dense below density" not in out
  with pytest.raises(SystemExit):
    plan.main(["--params", "8000000", "--devices", "4"])
  assert "--density is required with --algorithm auto" in capsys.readouterr().err


def test_a_few_bit_plan_is_set_beside_dense_and_the_best_top_k_not_topka_at_density_1(capsys):
  argv = ["--model", "gpt2", "--devices", "8", "--network", "eth1",
          "--algorithm", "quantized_8_8_fine"]
  assert plan.main(argv) == 0
  out = capsys.readouterr().out
  assert "density=1" not in out and "TopkA" not in out
  assert "all dense: " in out and "give --density to set the best top-k" in out
  assert plan.main([*argv, "--density", "0.01"]) == 0
  out = capsys.readouterr().out
  assert "density=" not in out.splitlines()[0]  # no bucket is a top-k
  found = re.search(r"the best top-k at density 0.01 .*: ([0-9.]+) ms \(([0-9.]+)x this "
                    r"plan's time\); before Adam's family", out)
  step = float(re.search(r"predicted step end: ([0-9.]+) ms", out)[1])
  assert found and float(found[2]) == pytest.approx(float(found[1]) / step, abs=0.01)


def test_where_no_bucket_is_compressed_the_plan_is_all_denses_own(capsys):
  assert plan.main(["--model", "resnet50", "--devices", "8", "--network", "nvlink",
                    "--density", "0.01"]) == 0
  out = capsys.readouterr().out
  assert "every bucket goes dense" in out
  found = re.search(r"predicted step end: ([0-9.]+) ms; all dense: ([0-9.]+) ms", out)
  step, dense = found.groups()
  assert float(step) == float(dense)


def test_the_readmes_planner_table_is_what_the_planner_prints(capsys):
  # Each column names the model and the --optimizer (and flags) it was planned
  # with, so a change of the forms an optimizer gets cannot leave the table behind.
  readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
  [header] = re.findall(r"^\| link \(`--network`\) \|(.*)\|$", readme, re.MULTILINE)
  columns = []
  for cell in header.split("|"):
    model = {"ResNet-50": "resnet50", "GPT-2 small": "gpt2"}[cell.split(",")[0].strip()]
    flags = re.findall(r"`([^`]+)`", cell)
    optimizer, extra = flags[0], " ".join(flags[1:]).split()
    columns.append((model, ["--optimizer", optimizer, *extra]))
  assert [c[1][1] for c in columns] == ["momentum", "adam", "adam", "sgd"]
  cell = r"([0-9.]+)x[^|]*\|"
  rows = re.findall(rf"^\| .*\(`(\w+)`\) \| {cell} {cell} {cell} {cell}$", readme,
                    re.MULTILINE)
  assert len(rows) == 5
  for network, *cells in rows:
    for (model, flags), cell in zip(columns, cells):
      assert plan.main(["--model", model, "--devices", "8", "--network", network,
                        *flags]) == 0
      out = capsys.readouterr().out
      if "--local-steps" in flags:
        printed = re.search(r"local steps' speedup [0-9.]+x and ([0-9.]+)x", out)[1]
      else:
        printed = re.search(r"all dense: [0-9.]+ ms \(speedup ([0-9.]+)x\)", out)[1]
      assert printed == cell, (network, model, flags)


def test_local_steps_are_planned_as_a_rounds_exchange_over_its_steps(capsys):
  # Hand-computed from the printed figures: the round's exchange, in the
  # default rotated 4-bit pseudo-gradient, after the last step; a step
  # pays an H-th of it besides its compute (1.5x the backward pass given).
  out = run(capsys, "--params", "25000000", "--devices", "8", "--network", "eth10",
            "--optimizer", "adam", "--backward-ms", "40", "--local-steps", "8")
  found = re.search(r"local steps, every 8 .* in rotated_4_4 once a round, "
                    r"([0-9.]+) MB per device \(([0-9.]+) MB a step\), ([0-9.]+) ms", out)
  round_mb, step_mb, round_ms = map(float, found.groups())
  # 4 bits up and 4 back, each phase with a 4-byte scale per 512 entries, 7/8 of it:
  assert round_mb == pytest.approx(25e6 * (0.5 + 0.5 + 2 * 4 / 512) * 7 / 8 / 1e6, rel=1e-3)
  assert step_mb == pytest.approx(round_mb / 8, abs=1e-3)
  step = re.search(r"= ([0-9.]+) ms, ([0-9.]+)x compute alone", out)
  assert float(step[1]) == pytest.approx(60 + round_ms / 8, abs=2e-3)
  assert float(step[2]) == pytest.approx((60 + round_ms / 8) / 60, abs=6e-3)
  per_step = float(re.search(r"predicted step end: ([0-9.]+) ms", out)[1])
  shown = re.search(r"the per-step plan above takes ([0-9.]+) ms", out)[1]
  assert float(shown) == pytest.approx(20 + per_step, abs=2e-3)  # with the forward


@pytest.mark.parametrize("network, backward_ms, bound", [
    ("eth10", 40, "the round's compute hides its exchange"),
    ("eth1", 4, "the exchange outlasts the round's compute")])
def test_an_overlapped_round_takes_the_longer_of_its_compute_and_its_exchange(
    capsys, network, backward_ms, bound):
  out = run(capsys, "--params", "25000000", "--devices", "8", "--network", network,
            "--optimizer", "adam", "--backward-ms", str(backward_ms), "--local-steps", "8")
  compute = 1.5 * backward_ms
  round_ms = float(re.search(r"once a round, .* MB a step\), ([0-9.]+) ms", out)[1])
  found = re.search(r"overlap=True\)\): .* a step ([0-9.]+) ms, ([0-9.]+)x compute alone: "
                    r"(.*)", out)
  assert float(found[1]) == pytest.approx(max(compute, round_ms / 8), abs=2e-3)
  assert float(found[2]) == pytest.approx(max(compute, round_ms / 8) / compute, abs=6e-3)
  assert found[3] == bound


def test_averaging_the_inner_state_adds_its_exchange_to_every_round(capsys):
  # Adam's two floats a parameter, 8 bits to the owners and 8 back, 7/8 of
  # them crossing the wire, one 4-byte scale per 4,096 entries and phase: a
  # round pays it beside the pseudo-gradient, a step an H-th of both.
  out = run(capsys, "--params", "25000000", "--devices", "8", "--network", "eth10",
            "--optimizer", "adam", "--backward-ms", "40", "--local-steps", "8",
            "--average-inner-state", "2")
  pseudo_ms = float(re.search(r"once a round, .* MB a step\), ([0-9.]+) ms", out)[1])
  found = re.search(r"priced as quantized_8_8\), ([0-9.]+) MB per device, ([0-9.]+) ms: "
                    r"([0-9.]+) ms a round", out)
  state_mb, state_ms, round_ms = map(float, found.groups())
  assert state_mb == pytest.approx(2 * 25e6 * (2 + 2 * 4 / 4096) * 7 / 8 / 1e6, rel=1e-3)
  assert round_ms == pytest.approx(pseudo_ms + state_ms, abs=2e-3)
  step = re.search(r"= ([0-9.]+) ms, ([0-9.]+)x compute alone", out)
  assert float(step[1]) == pytest.approx(60 + round_ms / 8, abs=2e-3)


@pytest.mark.parametrize("flags, wanted", [
    (["--local-steps", "0"], "--local-steps is the steps of a round, at least 1 and at most"),
    (["--local-steps", "4", "--algorithm", "topka2a_sparse"], "--density is required"),
    (["--average-inner-state", "2"], "give --local-steps H and the state's floats"),
    (["--local-steps", "4", "--average-inner-state", "0"], "above 0 and finite (Adam's: 2); got 0"),
    (["--local-steps", "99999999999999999999"], "at most 2,147,483,647 (local_steps counts"),
    (["--local-steps", "4", "--average-inner-state", "inf"], "above 0 and finite"),
])
def test_a_bad_local_steps_plan_exits_with_the_fix(capsys, flags, wanted):
  with pytest.raises(SystemExit):
    plan.main(["--params", "1000000", "--devices", "8", "--optimizer", "adam", *flags])
  assert wanted in capsys.readouterr().err


def test_local_steps_without_a_compute_time_say_what_to_give(capsys):
  out = run(capsys, "--params", "1000000", "--devices", "8", "--optimizer", "adam",
            "--local-steps", "4")
  assert "ms of exchange a step; give --model or --backward-ms" in out


def link_fit(path, coding_rate):
  """A fit as ``benchmarks/network.py --json`` writes it: 100 Gbit/s, one coding rate."""
  path.write_text(json.dumps({"rate": "100gbit", "processes": 4, "rows": [], "fit": {
      "alpha": 1e-5, "bandwidth": 12.5e9, "per_element": 3e-9, "per_entry": 1e-7,
      "per_matrix_element": 0.0, "per_multiply_add": 0.0,
      "coding": {"quantized_8_8_fine": coding_rate, "quantized_4_8": coding_rate}}}))
  return str(path)


@pytest.mark.parametrize(("rate", "want"), [(2e-9, "dense"), (1e-12, "quantized_8_8_fine")])
def test_a_link_fit_plans_adam_dense_where_coding_outlasts_the_wire(
    capsys, tmp_path, rate, want):
  # 25M entries on 4 devices: dense's ring 150 MB at 12.5 GB/s, 12 ms; the
  # 8-bit code's 112.5M elements of passes 225 ms at 2 ns, 0.1 ms at 1 ps.
  out = run(capsys, "--params", "25000000", "--devices", "4", "--optimizer", "adam",
            "--link-fit", link_fit(tmp_path / "fit.json", rate))
  assert chosen(out) == want
  assert "network=fitted" in out.splitlines()[0]


def test_a_link_fit_that_is_missing_or_not_a_fit_exits_with_the_fix(capsys, tmp_path):
  for path, says in ((tmp_path / "none.json", "cannot read it"),
                     (tmp_path / "rows.json", "holds no link fit (KeyError: 'fit')")):
    if path.name == "rows.json":  # an old run's rows, written before the fit was
      path.write_text(json.dumps({"rate": "1gbit", "processes": 4, "rows": []}))
    with pytest.raises(SystemExit):
      plan.main(["--params", "1000000", "--devices", "4", "--optimizer", "adam",
                 "--link-fit", str(path)])
    err = capsys.readouterr().err
    assert says in err and "--rows OLD.json --json FIT.json" in err
  with pytest.raises(SystemExit):
    plan.main(["--params", "1000000", "--devices", "4", "--optimizer", "adam",
               "--network", "eth1", "--link-fit", link_fit(tmp_path / "f.json", 1e-9)])
  assert "--network and --link-fit each set the link: give one" in capsys.readouterr().err


@pytest.mark.parametrize("field, value, says", [
    ("alpha", True, "its alpha is True, not a number"),
    ("alpha", "2e-4", "its alpha is '2e-4', not a number"),
    ("bandwidth", 1e-300, "is beyond what a link can have"),
    ("alpha", 1e308, "is beyond what a link can have"),
    ("per_element", -1e-6, "selection_seconds_per_element is -1e-06: give a duration"),
    ("per_entry", float("nan"), "selection_seconds_per_entry is nan: give a duration"),
    ("per_element", float("inf"), "selection_seconds_per_element is inf: give a duration"),
], ids=["alpha true", "alpha a string", "bandwidth 1e-300", "alpha 1e308",
        "per_element negative", "per_entry nan", "per_element inf"])
def test_a_link_fit_with_meaningless_figures_exits_naming_the_figure(
    capsys, tmp_path, field, value, says):
  path = tmp_path / "fit.json"
  written = json.loads(pathlib.Path(link_fit(path, 1e-9)).read_text())
  written["fit"][field] = value
  path.write_text(json.dumps(written))
  with pytest.raises(SystemExit) as exited:
    plan.main(["--params", "25000000", "--devices", "8", "--optimizer", "sgd",
               "--density", "0.01", "--link-fit", str(path)])
  assert exited.value.code == 2 and says in capsys.readouterr().err


def test_a_link_fit_nested_beyond_reading_exits_with_the_fix(capsys, tmp_path):
  path = tmp_path / "deep.json"
  path.write_text("[" * 100_000)
  with pytest.raises(SystemExit) as exited:
    plan.main(["--params", "1000000", "--devices", "4", "--density", "0.01",
               "--link-fit", str(path)])
  assert exited.value.code == 2 and "holds no link fit (RecursionError" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["adamw", "Adam", "lion", "adafactor", " sgd "])
def test_the_optimizers_users_name_are_planned_as_their_kind(capsys, name):
  kind = "sgd" if name.strip() == "sgd" else "adam"
  want = run(capsys, "--params", "25000000", "--devices", "8", "--density", "0.01",
             "--optimizer", kind)
  assert run(capsys, "--params", "25000000", "--devices", "8", "--density", "0.01",
             "--optimizer", name) \
      .replace(f"--optimizer {name.strip().lower()}", f"--optimizer {kind}") == want
