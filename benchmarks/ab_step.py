"""Two versions of the library on the same link, interleaved: which one's update is faster.

Exports ``topka2a_jax/`` of two git revisions (or takes two directories
holding it) and runs ``benchmarks/network_step.py`` (this checkout's) once
per version per round, alternating which goes first, with the workers
importing that version (``PYTHONPATH``). Each run times ``lax.pmean`` and
the update of ``topka2a(density)`` with no other option, applied with its
state kept, on the same gradient, so every ratio is against a dense
exchange measured minutes apart at most. Prints every run's ratio and each
version's median, and can write JSON.

Run (as root, the link is a shaped network namespace):
  python benchmarks/ab_step.py --a 06f68f3 --b HEAD [--rounds 3]
      [--gradient gpt2] [--repeats 5] [--processes 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def exported(version: str, into: Path) -> Path:
  """A directory whose ``topka2a_jax/`` is ``version``'s: a git revision, or a path."""
  given = Path(version)
  if (given / "topka2a_jax").is_dir():
    return given.resolve()
  archive = into / f"{version.replace('/', '_')}.tar"
  with archive.open("wb") as out:
    subprocess.run(["git", "archive", "--format=tar", version, "topka2a_jax"], cwd=ROOT,
                   stdout=out, check=True)
  target = into / version.replace("/", "_")
  with tarfile.open(archive) as tar:
    tar.extractall(target, filter="data")
  return target


def one_run(library: Path, args: argparse.Namespace) -> dict:
  """One ``network_step.py`` run with the workers on ``library``; its rows."""
  with tempfile.TemporaryDirectory() as scratch:
    out = Path(scratch) / "rows.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "network_step.py"),
               "--rate", args.rate, "--processes", str(args.processes),
               "--density", str(args.density), "--repeats", str(args.repeats),
               "--gradients", args.gradient, "--runs", "dense", "defaults", "--no-fit",
               "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(library)}
    subprocess.run(command, env=env, check=True)
    return json.loads(out.read_text())


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--a", required=True, help="a git revision, or a directory")
  parser.add_argument("--b", required=True, help="a git revision, or a directory")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--gradient", default="gpt2", choices=("flat", "gpt2", "resnet50"))
  parser.add_argument("--rate", default="1gbit")
  parser.add_argument("--processes", type=int, default=4)
  parser.add_argument("--density", type=float, default=0.01)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--json", help="also write every run here")
  args = parser.parse_args()
  scratch = Path(tempfile.mkdtemp())
  libraries = {name: exported(version, scratch)
               for name, version in (("a", args.a), ("b", args.b))}
  runs = []
  for round_ in range(args.rounds):
    for name in ("a", "b") if round_ % 2 == 0 else ("b", "a"):
      rows = one_run(libraries[name], args)["rows"]
      dense = next(r for r in rows if r["run"] == "dense")
      mine = next(r for r in rows if r["run"] == "defaults")
      runs.append({"version": name, "revision": getattr(args, name), "round": round_,
                   "dense_s": dense["seconds"], "defaults_s": mine["seconds"],
                   "ratio": mine["seconds"] / dense["seconds"]})
      print(f"round {round_} {name} ({getattr(args, name)}): defaults "
            f"{mine['seconds']:.4f} s, dense {dense['seconds']:.4f} s, "
            f"{runs[-1]['ratio']:.3f}x", flush=True)
  print(f"\n{args.gradient}, {args.processes} processes at {args.rate}, density "
        f"{args.density}: the defaults' update against lax.pmean, state kept")
  print(f"{'version':10s} {'revision':12s} {'ratios':32s} {'median':>7s}")
  summary = {}
  for name in ("a", "b"):
    ratios = [r["ratio"] for r in runs if r["version"] == name]
    summary[name] = statistics.median(ratios)
    print(f"{name:10s} {getattr(args, name):12s} "
          f"{', '.join(f'{x:.3f}' for x in ratios):32s} {summary[name]:6.3f}x")
  if args.json:
    Path(args.json).write_text(json.dumps(
        {"gradient": args.gradient, "processes": args.processes, "rate": args.rate,
         "density": args.density, "runs": runs, "medians": summary}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
