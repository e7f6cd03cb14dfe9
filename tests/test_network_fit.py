"""The network benchmark's model fit, on timings made from a known link."""

import pytest
from test_benchmarks import load

from topka2a_jax._src.collectives.algorithms import ALGORITHMS
from topka2a_jax._src.planner.cost import Network, exchange_cost

network_benchmark = load("network")  # as it runs: its folder on the path, for link.py


def synthetic_rows(link, processes, per_element=0.0, per_entry=0.0, per_matrix=0.0,
                   per_flop=0.0, coding=None):
  """Timings of the planner's model: α-β on ``link`` plus selection's and PowerSGD's
  passes, and each few-bit code's passes at its rate in ``coding`` (else
  ``per_element``)."""
  coding = coding or {}
  rows = []
  for size in (1_000_000, 8_000_000):
    for rank in (1, 4):
      m, n = network_benchmark.matrix_of(size)
      assert m * n == size
      # Two all-reduces of the factors; passes over the m x n matrix; four
      # products of m x n by rank.
      p, q = m * rank, n * rank
      ring = 2 * (processes - 1)
      seconds = (2 * ring * link.latency + ring / processes * 4 * (p + q) / link.bandwidth
                 + per_matrix * m * n + per_flop * 4 * m * n * rank)
      rows.append({"size": size, "algorithm": "powersgd", "density": None, "rank": rank,
                   "seconds": seconds})
    for algorithm in ALGORITHMS:
      for density in [1.0] if algorithm == "dense" else [0.01, 0.1]:
        k = round(density * size)  # a multiple of 4: every shard gets k / 4
        # gTop-k: its own k, then 2k in each of log2(4) merges; Ok-Topk: its
        # own k, then 2k / 4 from each of 4 senders at the owner.
        entries = {"dense": 0, "allgather": k, "topka2a": k,
                   "topka2a_sparse": k + k // processes, "gtopk": k + 2 * k * 2,
                   "oktopk": k + 2 * k}.get(algorithm, 0)
        seconds = exchange_cost(algorithm, size, processes, density).seconds(link)
        # The quantizing exchanges pass over the buffer four times (codes,
        # residual, the owner's sum, the final decoding), the owner's shard
        # twice; a rotated code three times more (the rotation and two
        # inverse rotations), the owner's shard once more.
        rotated = algorithm.startswith("rotated")
        read = {"dense": 0, "allgather": size, "topka2a": size,
                "topka2a_sparse": size + size // processes, "gtopk": size,
                "oktopk": size}.get(
            algorithm, (7 if rotated else 4) * size + (3 if rotated else 2) * (
                size // processes))
        seconds += coding.get(algorithm, per_element) * read + per_entry * entries
        rows.append({"size": size, "algorithm": algorithm, "density": density,
                     "seconds": seconds})
  return rows


@pytest.mark.parametrize(("per_element", "per_entry", "per_matrix", "per_flop"),
                         [(0.0, 0.0, 0.0, 0.0), (2e-9, 0.0, 5e-9, 0.0),
                          (2e-9, 1e-7, 5e-9, 3e-10)])
def test_fit_recovers_a_known_link(per_element, per_entry, per_matrix, per_flop):
  link = Network(latency=2e-4, bandwidth=1.25e8)
  fitted = network_benchmark.fit(
      synthetic_rows(link, 4, per_element, per_entry, per_matrix, per_flop), 4)
  assert fitted.alpha == pytest.approx(2e-4, rel=1e-6)
  assert fitted.bandwidth == pytest.approx(1.25e8, rel=1e-6)
  assert fitted.per_element == pytest.approx(per_element, abs=1e-15)
  assert fitted.per_entry == pytest.approx(per_entry, abs=1e-13)
  assert fitted.per_matrix_element == pytest.approx(per_matrix, abs=1e-15)
  assert fitted.per_multiply_add == pytest.approx(per_flop, abs=1e-17)
  coded = [name for name, entry in ALGORITHMS.items() if entry.quantizes]
  assert sorted(fitted.coding) == sorted(coded)  # one rate per few-bit code timed
  assert all(rate == pytest.approx(per_element, abs=1e-15)
             for rate in fitted.coding.values())


def test_fit_gives_each_few_bit_code_its_own_rate():
  coding = {"quantized_8_8_fine": 1.3e-9, "quantized_4_8": 0.9e-9, "rotated_4_8": 2e-9}
  fitted = network_benchmark.fit(synthetic_rows(
      Network(latency=2e-4, bandwidth=1.25e8), 4, 3e-9, 1e-7, coding=coding), 4)
  assert fitted.per_element == pytest.approx(3e-9, rel=1e-6)
  for name, rate in coding.items():
    assert fitted.coding[name] == pytest.approx(rate, rel=1e-6)
  assert fitted.coding["quantized_4_4"] == pytest.approx(3e-9, rel=1e-6)


def test_report_says_what_auto_plans_under_the_fit(capsys):
  # On 100 Gbit/s a few-bit code's passes at 2 ns outlast the wire it saves:
  # before Adam and momentum SGD one bucket goes dense, which the synthetic
  # timings make the fastest too; before plain SGD a top-k wins at 1%.
  rows = synthetic_rows(Network(latency=1e-5, bandwidth=12.5e9), 4,
                        coding={name: 2e-9 for name, entry in ALGORITHMS.items()
                                if entry.quantizes})
  network_benchmark.report(rows, 4, "100gbit")
  plans = capsys.readouterr().out.split('plans for one bucket')[1].splitlines()[2:]
  cells = [line.split() for line in plans if line.strip()]
  assert {(c[1], c[3]) for c in cells if c[1] != "plain"} == {
      ("adaptive", "dense"), ("momentum", "dense"), ("rounds", "dense")}
  assert all(c[-1] == "1.000x" for c in cells)  # the plan is the fastest each time
  assert {c[3] for c in cells if c[1] == "plain" and c[2] == "0.01"} <= {
      "allgather", "topka2a", "topka2a_sparse"}


def test_report_puts_measured_beside_predicted(capsys):
  rows = network_benchmark.report(
      synthetic_rows(Network(latency=1e-4, bandwidth=1e8), 4), 4, "800mbit")
  assert all(r["ratio"] == pytest.approx(r["model_ratio"]) for r in rows)
  out = capsys.readouterr().out
  assert "fitted α = 100 µs" in out and "NOT as" not in out
  assert "at 0.01: TopkA faster by" in out and "tie" not in out


def test_a_density_at_the_crossover_is_called_a_tie(capsys):
  # 6 processes: TopkA and TopKA2A send equal bytes at 1/(2 * 5) = 0.1.
  network_benchmark.report(
      synthetic_rows(Network(latency=1e-4, bandwidth=1e8), 6), 6, "500mbit")
  out = capsys.readouterr().out
  assert out.count("at the crossover itself: the model predicts a tie") == 2
  assert "NOT as" not in out


def test_the_coding_rows_stay_out_of_the_fit_and_split_the_link_time(capsys):
  link = Network(latency=1e-4, bandwidth=1e8)
  rows = synthetic_rows(link, 4)
  coding = {"size": 1_000_000, "algorithm": "quantized_8_8", "density": 1.0,
            "kind": "codes", "seconds": 0.05}
  rows = network_benchmark.report([*rows, coding], 4, "800mbit")
  assert all(r["ratio"] == pytest.approx(r["model_ratio"]) for r in rows
             if r.get("kind") != "codes")  # the fit is the synthetic link's alone
  # 250,000 entries a shard: 62 chunks of 4,064 one-byte codes and a float32
  # scale each, to 3 other owners, and the owners' means as many back.
  assert coding["wire_seconds"] == pytest.approx(2 * 3 * 62 * (4064 + 4) / 1e8, rel=1e-6)
  out = capsys.readouterr().out
  assert "Where the few-bit exchanges' time goes" in out
  assert "quantized_8_8" in out.split("time goes")[1]


def test_the_json_it_writes_is_what_topka2a_plan_reads(tmp_path, capsys):
  # The user's path: `network.py --json fit.json` on the link, then
  # `topka2a-plan --link-fit fit.json`. On 100 Gbit/s with 2 ns a coded
  # element, dense wins before Adam, as the report says.
  from topka2a_jax.tools import plan

  rows = synthetic_rows(Network(latency=1e-5, bandwidth=12.5e9), 4,
                        coding={name: 2e-9 for name, entry in ALGORITHMS.items()
                                if entry.quantizes})
  path = tmp_path / "fit.json"
  network_benchmark.write(str(path), {"rate": "100gbit", "processes": 4, "rows": rows}, 4)
  assert plan.main(["--params", "25000000", "--devices", "4", "--optimizer", "adam",
                    "--link-fit", str(path)]) == 0
  out = capsys.readouterr().out
  [row] = [line for line in out.splitlines() if "gradient .. gradient" in line]
  assert row.split()[-3] == "dense"
  assert "every bucket goes dense" in out
