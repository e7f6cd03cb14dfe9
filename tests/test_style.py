"""The code's style: ruff's checks as pyproject.toml configures them."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
  done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                        capture_output=True, text=True, check=False, cwd=ROOT)
  assert done.returncode == 0, done.stdout + done.stderr
