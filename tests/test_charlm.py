"""The character-level LM example: a quick run writes its table and plot."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # trains an example in a process of its own

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_charlm_quick_run_writes_its_table_and_plot(tmp_path):
  out = tmp_path / "charlm"
  done = subprocess.run(
      [sys.executable, str(EXAMPLES / "train_charlm.py"), "--quick", "--out", str(out),
       "--runs", "dense (pmean)", "local 4"],
      capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "local 4" in done.stdout and "valid loss" in done.stdout
  assert out.with_suffix(".png").stat().st_size > 10_000
  runs = json.loads(out.with_suffix(".json").read_text())["runs"]
  assert runs[0]["name"] == "dense (pmean)"
  assert all(r["scores"][0][-1] < 5.0 for r in runs)  # learnt: ln 256 is 5.55
  # A round of 4 steps sends its pseudo-gradient once, in 8 bits with a scale
  # per 256: (1 + 4/256) / 4 bytes an entry each way against dense's 4 + 4 (a
  # float32 all-reduce), about 0.064x; the loss's mean every step is not spread.
  dense, local = runs[0]["bytes_per_step"], runs[1]["bytes_per_step"]
  assert 0.05 < local / dense < 0.08
