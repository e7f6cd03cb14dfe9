"""How long the command-line tools and the package take to start, against ``import jax``.

Each command runs in a fresh interpreter, ``--trials`` times (5 by default),
the commands interleaved so that a busy machine slows each alike:

- ``import jax``: the floor any JAX program pays, the baseline of the ratios;
- ``topka2a-plan --help`` and ``topka2a-launch --help``: what a user waits
  for to read a tool's options (neither imports JAX);
- ``import topka2a_jax``: the face alone (each name is imported on first use);
- ``topka2a_jax.topka2a``: the face and the transform, which import JAX, optax
  and the library's exchanges.

The table gives each command's median wall time, its median ratio to the
``import jax`` of the same trial, and the range of those ratios. With
``--checkout DIR`` each command but the baseline also runs on the library
in another checkout (``DIR`` first on ``PYTHONPATH``), in the same trials.

Run:
  python benchmarks/startup.py [--trials 5] [--checkout DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASELINE = "import jax"
COMMANDS = {
    BASELINE: [sys.executable, "-c", "import jax"],
    "topka2a-plan --help": [sys.executable, "-m", "topka2a_jax.tools.plan", "--help"],
    "topka2a-launch --help": [sys.executable, "-m", "topka2a_jax.tools.launch", "--help"],
    "import topka2a_jax": [sys.executable, "-c", "import topka2a_jax"],
    "topka2a_jax.topka2a": [sys.executable, "-c", "import topka2a_jax; topka2a_jax.topka2a"],
}
"""Each row's name and the command it times in a fresh interpreter."""


def seconds(command: list[str], checkout: str | None = None) -> float:
  """Wall time of one run of ``command`` (on the library in ``checkout``), which must succeed.

  It runs in an empty directory: Python puts the working directory first on
  the path, where a checkout there would shadow the one asked for.
  """
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  if checkout:
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.abspath(checkout), env.get("PYTHONPATH")]))
  with tempfile.TemporaryDirectory() as empty:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env, cwd=empty)
    return time.perf_counter() - start


def trial(checkout: str | None) -> dict[str, float]:
  """One run of every command; with ``checkout``, the library's again on it."""
  times = {name: seconds(command) for name, command in COMMANDS.items()}
  if checkout:
    times |= {f"{name} [{checkout}]": seconds(command, checkout)
              for name, command in COMMANDS.items() if name != BASELINE}
  return times


def table(trials: list[dict[str, float]]) -> list[dict]:
  """Each command's median seconds and its ratios to the same trial's baseline."""
  rows = []
  for name in trials[0]:
    ratios = [trial[name] / trial[BASELINE] for trial in trials]
    rows.append({"command": name,
                 "seconds": statistics.median(trial[name] for trial in trials),
                 "ratio": statistics.median(ratios),
                 "ratio_range": [min(ratios), max(ratios)]})
  return rows


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--trials", type=int, default=5)
  parser.add_argument("--checkout", help="also time the library in this checkout")
  parser.add_argument("--json", help="also write the rows here")
  args = parser.parse_args()
  trials = [trial(args.checkout) for _ in range(args.trials)]
  rows = table(trials)
  width = max(len(row["command"]) for row in rows)
  print(f"{'command':{width}s} {'median s':>9s} {'vs import jax':>14s}  range")
  for row in rows:
    low, high = row["ratio_range"]
    print(f"{row['command']:{width}s} {row['seconds']:9.3f} {row['ratio']:13.2f}x  "
          f"{low:.2f}x to {high:.2f}x")
  if args.json:
    Path(args.json).write_text(json.dumps(
        {"trials": trials, "rows": rows, "load": os.getloadavg()}, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
