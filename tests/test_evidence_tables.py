"""The evidence pages' tables are rendered from the committed JSON, not typed."""

import dataclasses
import json
import pathlib
import re

import evidence
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = pathlib.Path(__file__).resolve().parent / "data" / "training_fixture.json"


def test_a_table_is_the_json_it_names_and_changes_with_it(tmp_path):
  tables = evidence.tables()
  result = tables.Result(command="python benchmarks/network_training.py --rate 100mbit",
                         groups=(("run.json",),))
  (tmp_path / "run.json").write_text(FIXTURE.read_text())
  # By hand: 1.5 MB and 2.5 s a step; 2.6 in 25 s of dense's 100 (0.25x),
  # 2.4 in 75 s of 200 (0.38x), dense's final + 2% never; 2.05 is 2.5% above 2.0.
  assert tables.render(result, tmp_path) == (
      "| run | MB/step | s/step | to 2.6 | to 2.4 | to dense's final + 2% | final |\n"
      "|---|---|---|---|---|---|---|\n"
      "| `dense` | 40.000 | 10.000 | 10 / 100 s | 20 / 200 s | 30 / 300 s | 2.0000 |\n"
      "| `local 4` | 1.500 | 2.500 | 10 / 0.25x | 30 / 0.38x | never | 2.0500 (+2.5%) |\n"
      "\n"
      "From `python benchmarks/network_training.py --rate 100mbit`; JSON `run.json`.\n")

  changed = json.loads(FIXTURE.read_text())
  changed["rows"][1]["final"] = 1.9
  (tmp_path / "run.json").write_text(json.dumps(changed))
  assert "| 1.9000 (-5.0%) |" in tables.render(result, tmp_path)
  # Against local 4, and dense's too: 2.0 is 5.3% above 1.9, 1.9 5.0% below 2.0.
  both = tables.render(dataclasses.replace(result, against="local 4", also_against="dense"),
                       tmp_path)
  assert "| 2.0000 (+5.3%) |" in both and "| 1.9000 (-5.0% of `dense`'s) |" in both


def test_a_table_names_a_run_its_json_does_not_hold(tmp_path):
  tables = evidence.tables()
  (tmp_path / "run.json").write_text(FIXTURE.read_text())
  result = tables.Result(command="c", groups=(("run.json",),), runs=("dense", "local 8"))
  with pytest.raises(KeyError, match="local 8"):
    tables.render(result, tmp_path)
  missing = dataclasses.replace(result, groups=(("gone.json",),))
  with pytest.raises(FileNotFoundError, match="gone.json"):
    tables.render(missing, tmp_path)


def test_every_table_a_page_includes_is_a_named_result_that_renders():
  tables, results = evidence.tables(), evidence.results()
  include = re.compile(r"```\{include\} (?:\.\./)*tables/(\w+)\.md")
  included = {name for page in (ROOT / "docs").rglob("*.md")
              for name in include.findall(page.read_text())}
  assert included, "no evidence page includes a generated table"
  assert included <= set(results.RESULTS), sorted(included - set(results.RESULTS))
  unused = set(results.RESULTS) - included
  assert not unused, f"named results no page includes: {sorted(unused)}"
  for result in results.RESULTS.values():
    assert tables.render(result).count("\n|") >= 2


def test_a_step_times_table_is_its_json_with_each_exchange_beside_the_next_round(tmp_path):
  tables = evidence.tables()
  (tmp_path / "steps.json").write_text(
      (FIXTURE.parent / "steps_fixture.json").read_text())
  result = tables.StepTimes(command="c", file="steps.json", against="quantized_8_8_fine",
                            alone="no exchange (compute alone)")
  # By hand: 1.2 s is 0.30x of 4.0 and 1.20x of 1.0; the first exchange (2 to 3.5 s)
  # beside the second round's steps (2 to 4 s), the second's beside the third's (4
  # to 6 s); the third has no round after it in the run.
  assert tables.render(result, tmp_path) == (
      "| run | MB/step | s/step | share of `quantized_8_8_fine`'s | "
      "multiple of the compute alone |\n"
      "|---|---|---|---|---|\n"
      "| `quantized_8_8_fine` | 10.000 | 4.000 | 1.00x | 4.00x |\n"
      "| `local 2, rotated_4_4, overlapped eager` | 1.500 | 1.200 | 0.30x | 1.20x |\n"
      "| `no exchange (compute alone)` | 0.000 | 1.000 | 0.25x | 1.00x |\n"
      "\n"
      "4 processes at 100mbit, 2 steps a run. From `c`; JSON `steps.json`.\n"
      "\n"
      "When each round's exchange ran on process 0, against the steps of the round after "
      "it (seconds from the run's first step):\n"
      "\n"
      "| run | round | its exchange | the next round's steps |\n"
      "|---|---|---|---|\n"
      "| `local 2, rotated_4_4, overlapped eager` | 1 | 2.00 to 3.50 | 2.00 to 4.00 |\n"
      "| `local 2, rotated_4_4, overlapped eager` | 2 | 4.00 to 5.50 | 4.00 to 6.00 |\n")


def test_an_exchange_times_table_puts_the_fitted_model_beside_each_measurement(tmp_path):
  tables = evidence.tables()
  # A link of α = 1 ms and 1e8 bytes/s, no selection cost; 4 processes,
  # 1,000 elements. By hand: dense is 6 messages and 1.5 * 4,000 = 6,000
  # bytes: 6 ms + 0.06 ms = 6.060 ms. TopkA at 0.01: k = 10 pairs of 4 + 2
  # bytes to 3 peers, 3 messages: 3 ms + 180 / 1e8 s = 3.002 ms.
  run = {"rate": "1gbit", "processes": 4,
         "fit": {"alpha": 1e-3, "bandwidth": 1e8, "per_element": 0.0, "per_entry": 0.0,
                 "coding": {}},
         "rows": [{"size": 1000, "algorithm": "dense", "density": 1.0, "seconds": 0.01},
                  {"size": 1000, "algorithm": "allgather", "density": 0.01,
                   "seconds": 0.004}]}
  (tmp_path / "exchanges.json").write_text(json.dumps(run))
  result = tables.ExchangeTimes(command="c", file="exchanges.json")
  assert tables.render(result, tmp_path) == (
      "| exchange | density | measured s | x dense | model s | measured / model |\n"
      "|---|---|---|---|---|---|\n"
      "| `dense` | 1 | 0.010 | 1.000x | 0.006 | 1.65 |\n"
      "| `allgather` | 0.01 | 0.004 | 0.400x | 0.003 | 1.33 |\n"
      "\n"
      "4 processes, 1,000 elements, `1gbit`. Fitted: α = 1000 µs, 100.0 MB/s per "
      "process, selection 0.0 ns per element + 0 ns per selected entry. From `c`; "
      "JSON `exchanges.json`.\n")
  # PowerSGD's model is the benchmark's ratio to dense times dense's model:
  # 0.5 x 6.060 ms = 3.030 ms; a second size adds the elements column, and
  # ``algorithms`` leaves TopkA out.
  run["rows"] += [{"size": 1000, "algorithm": "powersgd", "density": None, "rank": 2,
                   "seconds": 0.002, "model_ratio": 0.5},
                  {"size": 10, "algorithm": "dense", "density": 1.0, "seconds": 0.001}]
  (tmp_path / "exchanges.json").write_text(json.dumps(run))
  table = tables.render(dataclasses.replace(result, algorithms=("powersgd",)), tmp_path)
  assert table.splitlines()[3:5] == [
      "| 1,000 | `dense` | 1 | 0.010 | 1.000x | 0.006 | 1.65 |",
      "| 1,000 | `powersgd` | rank 2 | 0.002 | 0.200x | 0.003 | 0.66 |"]
  assert "allgather" not in table


def test_a_coding_table_is_each_few_bit_exchange_beside_its_coding_and_wire(tmp_path):
  tables = evidence.tables()
  run = {"rate": "1gbit", "processes": 4, "rows": [
      {"size": 8, "algorithm": "quantized_8_8", "density": 1.0, "seconds": 0.5},
      {"size": 8, "algorithm": "quantized_8_8", "density": 1.0, "kind": "codes",
       "seconds": 0.25, "link_seconds": 0.5, "wire_seconds": 0.125,
       "latency_seconds": 0.001}]}
  (tmp_path / "codes.json").write_text(json.dumps(run))
  table = tables.render(tables.CodingTimes(command="c", file="codes.json"), tmp_path)
  assert table.splitlines()[2] == "| `quantized_8_8` | 0.500 | 0.250 | 0.125 | 0.001 |"
  assert len(table.splitlines()) == 5  # the exchange's own row is not a coding row


def test_step_updates_and_interleaved_runs_are_their_jsons_side_by_side(tmp_path):
  tables = evidence.tables()
  header = {"rate": "1gbit", "processes": 4, "density": 0.01}
  for name, seconds in (("a.json", 0.5), ("b.json", 0.25)):
    (tmp_path / name).write_text(json.dumps({**header, "flat_limit_s": 0.1, "rows": [
        {"gradient": "flat", "run": "dense", "seconds": 5.0, "ratio": 1.0},
        {"gradient": "flat", "run": "defaults", "seconds": seconds,
         "ratio": seconds / 5.0}]}))
  table = tables.render(tables.StepUpdates(
      command="c", files=(("before", "a.json"), ("after", "b.json"))), tmp_path)
  assert table.splitlines()[3] == "| flat | `defaults` | 0.500 | 0.100x | 0.250 | 0.050x |"

  runs = [{"version": v, "revision": r, "round": i, "ratio": x}
          for i, (v, r, x) in enumerate([("a", "old", 0.1), ("b", "new", 0.2),
                                          ("b", "new", 0.4), ("a", "old", 0.3)])]
  (tmp_path / "ab.json").write_text(json.dumps(
      {"gradient": "gpt2", "processes": 4, "rate": "1gbit", "density": 0.01, "runs": runs}))
  table = tables.render(tables.Interleaved(command="c", file="ab.json"), tmp_path)
  # By hand: a's rounds 0.1 and 0.3, median 0.2; b's 0.2 and 0.4, median 0.3.
  assert table.splitlines()[2:4] == ["| a | `old` | 0.100x, 0.300x | 0.200x |",
                                     "| b | `new` | 0.200x, 0.400x | 0.300x |"]


def test_a_rows_table_is_each_key_in_its_format(tmp_path):
  tables = evidence.tables()
  (tmp_path / "rows.json").write_text(json.dumps({"rows": [
      {"form": "x", "seconds": 0.01234, "seen": "yes"}, {"form": "y", "seconds": 2.0}]}))
  result = tables.Rows(command="c", file="rows.json",
                       columns=(("form", "form", ""), ("s", "seconds", ".3f"),
                                ("sees", "seen", "")))
  assert tables.render(result, tmp_path).splitlines()[:4] == [
      "| form | s | sees |", "|---|---|---|", "| x | 0.012 | yes |", "| y | 2.000 |  |"]
  only_y = dataclasses.replace(result, where=(("form", ("y", "z")),))
  assert tables.render(only_y, tmp_path).splitlines()[2:4] == ["| y | 2.000 |  |", ""]


def test_a_model_table_is_the_cost_model_by_device_count():
  tables = evidence.tables()
  result = tables.ModelTimes(algorithms=("dense", "allgather"), devices=(2, 4),
                             length=1_000_000, density=0.01, network="eth10")
  table = tables.render(result)
  # By hand, on 50 µs and 1.25e9 bytes/s: dense on 2 devices, 2 messages and
  # 4e6 bytes, 0.1 + 3.2 ms; on 4, 6 messages and 6e6 bytes, 0.3 + 4.8 ms.
  # TopkA: 10,000 pairs of 4 + 4 bytes to each peer, one message each: on 2,
  # 0.05 + 0.064 ms; on 4, 0.15 + 0.192 ms.
  assert table.splitlines()[2] == "| dense | 3.30 ms | 5.10 ms |"
  assert table.splitlines()[3] == "| TopkA | 0.11 ms | 0.34 ms |"


def test_an_accuracy_table_is_the_comparisons_json(tmp_path):
  tables = evidence.tables()
  run = {"meta": {"steps": 10, "seeds": [0, 1]},
         "runs": [{"name": "a", "scores": [[0.5, 0.9], [0.5, 0.95]], "bytes_per_step": 1000.0},
                  {"name": "b", "scores": [[0.5, 0.92], [0.5, 0.9]], "bytes_per_step": 10.0}]}
  (tmp_path / "scores.json").write_text(json.dumps(run))
  table = tables.render(tables.Accuracy(command="c", file="scores.json", against="a"),
                        tmp_path)
  # By hand: a's mean 92.5%, b's 91%: 1.5 points below; over both evaluations
  # (fewer than five) a's mean is 71.25%, b's 70.5%.
  assert table.splitlines()[2:4] == [
      "| `a` | 92.50% | 90.00% / 95.00% |  | 71.25% | 1,000 |",
      "| `b` | 91.00% | 92.00% / 90.00% | -1.50 | 70.50% | 10 |"]


STILL_TYPED_BY_HAND = {"accuracy.md", "compressed_tensor.md"}
"""Evidence pages whose tables are still typed; each leaves this set as it is generated."""


def test_no_evidence_page_types_a_table_by_hand_beyond_those_still_to_move():
  typed = {page.name for page in (ROOT / "docs" / "evidence").glob("*.md")
           if re.search(r"^\|.*\|\s*$", page.read_text(), re.MULTILINE)}
  assert typed <= STILL_TYPED_BY_HAND, (
      f"{sorted(typed - STILL_TYPED_BY_HAND)} type a table by hand: name the result in "
      "docs/tables.py and include its generated table")
  assert typed == STILL_TYPED_BY_HAND, (
      f"{sorted(STILL_TYPED_BY_HAND - typed)} no longer type a table: drop them from the set")


def test_a_finals_table_is_each_seeds_final_loss_and_one_runs_steps(tmp_path):
  tables = evidence.tables()
  for seed, (dense, coded) in enumerate([(2.0, 2.05), (2.2, 2.09)]):
    rows = [{"run": "dense", "final": dense,
             "targets": {"2.6": {"steps": 10}, "2.4": {"steps": 20}}},
            {"run": "coded", "final": coded, "targets": {"2.6": {"steps": 30}}}]
    (tmp_path / f"s{seed}.json").write_text(
        json.dumps({"seed": seed, "targets": [2.6, 2.4], "rows": rows}))
  result = tables.Finals(command="c", groups=(("s0.json",), ("s1.json",)),
                         runs=("dense", "coded"), steps_of="coded")
  # By hand: 2.05 is 2.5% above 2.0, 2.09 5.0% below 2.2; coded never reached 2.4.
  assert tables.render(result, tmp_path).splitlines()[2:4] == [
      "| 0 | 2.0000 | 2.0500 (+2.5%) | 30 / never (10 / 20) |",
      "| 1 | 2.2000 | 2.0900 (-5.0%) | 30 / never (10 / 20) |"]


def test_a_losses_table_is_each_seeds_final_loss_against_one_run(tmp_path):
  tables = evidence.tables()
  run = lambda name, finals, sent: {"name": name, "eval_steps": [5, 10], "bytes_per_step": sent,
                                    "scores": [[3.0, final] for final in finals]}
  (tmp_path / "a.json").write_text(json.dumps({"meta": {"seeds": [0, 1]}, "runs": [
      run("dense", [2.0, 4.0], 400.0), run("coded", [2.1, 3.8], 100.0)]}))
  result = tables.Losses(command="c", files=("a.json",), against="dense")
  # By hand: 2.1 is 5.0% above 2.0, 3.8 5.0% below 4.0; a quarter of the bytes.
  assert tables.render(result, tmp_path).splitlines()[3] == (
      "| `coded` | 2.1000 | 3.8000 | +5.0% / -5.0% | 100 | 0.250 |")
  with pytest.raises(ValueError, match="one seed"):
    tables.render(dataclasses.replace(result, at=(5,)), tmp_path)


def test_a_pivot_table_lays_one_key_down_and_another_across(tmp_path):
  tables = evidence.tables()
  (tmp_path / "grid.json").write_text(json.dumps({"rows": [
      {"opt": "sgd", "form": "a", "ratio": 1.0}, {"opt": "sgd", "form": "b", "ratio": 2.5},
      {"opt": "adam", "form": "b", "ratio": 1234.5}]}))
  result = tables.Pivot(command="c", file="grid.json", down="opt", across="form",
                        columns=("a", "b"), cell="{ratio:,.1f}x")
  assert tables.render(result, tmp_path).splitlines()[:4] == [
      "| opt | a | b |", "|---|---|---|", "| `sgd` | 1.0x | 2.5x |", "| `adam` |  | 1,234.5x |"]


def test_a_selections_table_is_each_selections_milliseconds_and_mass(tmp_path):
  tables = evidence.tables()
  (tmp_path / "sel.json").write_text(json.dumps([{
      "elements": 1000, "density": 0.01, "pass_s": 0.0005, "exact_s": 0.012, "threshold_s": 0.004,
      "approx_s": 0.013, "threshold_mass": 0.99885, "approx_mass": 1.0, "auto": "threshold"}]))
  table = tables.render(tables.Selections(command="c", file="sel.json"), tmp_path)
  # By hand: 12 ms over 4 ms is 3.0x.
  assert table.splitlines()[2] == (
      "| 1,000 | 0.01 | 0.5 | 12.0 | 4.0 | 13.0 | 3.0x | 0.9989 | 1.0000 | threshold |")


def test_a_startups_table_is_each_command_on_both_revisions_against_import_jax(tmp_path):
  tables = evidence.tables()
  trials = [{"import jax": 1.0, "plan": 0.1, "plan [old]": 1.2},
            {"import jax": 2.0, "plan": 0.3, "plan [old]": 2.0}]
  rows = [{"command": "import jax", "seconds": 1.5, "ratio": 1.0, "ratio_range": [1.0, 1.0]},
          {"command": "plan", "seconds": 0.2, "ratio": 0.125, "ratio_range": [0.1, 0.15]},
          {"command": "plan [old]", "seconds": 1.6, "ratio": 1.1, "ratio_range": [1.0, 1.2]}]
  (tmp_path / "s.json").write_text(json.dumps({"trials": trials, "rows": rows}))
  result = tables.Startups(command="c", file="s.json", revisions=("new", "old"))
  # By hand: plan's ratios 0.1 and 0.15 (median 0.125 shown as 0.12x, round half to even).
  assert tables.render(result, tmp_path).splitlines()[:4] == [
      "| command | `new` (median) | vs `import jax` | `old` (median) | vs `import jax` |",
      "|---|---|---|---|---|",
      "| `import jax` | 1.50 s | 1.00x |  |  |",
      "| `plan` | 0.20 s | 0.12x (0.10x to 0.15x) | 1.60 s | 1.10x (1.00x to 1.20x) |"]
