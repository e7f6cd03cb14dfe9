"""The command-line planner picks the algorithm the break-even densities say."""

import pytest

from topka2a_jax import plan


def run(capsys, *args):
  assert plan.main(list(args)) == 0
  return capsys.readouterr().out


@pytest.mark.parametrize("density, want", [
    (0.01, "allgather"),  # below 1/(2(P-1)) = 0.0714 for P = 8
    (0.2, "topka2a"),     # between the two break-evens
    (0.8, "dense"),       # above 1/2
])
def test_choice_follows_the_breakevens(capsys, density, want):
  out = run(capsys, "--params", "25000000", "--devices", "8", "--density",
            str(density), "--network", "eth1")
  [row] = [line for line in out.splitlines() if "gradient .. gradient" in line]
  assert row.split()[-3] == want
  assert "beats TopkA above density 0.07" in out  # 1/14, moved up by latency


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
