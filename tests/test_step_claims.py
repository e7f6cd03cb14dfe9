"""Step claims: one job wins a step, on regular files only, and nothing outside the root is touched.

What a restarted job's manager meets on disk (``<root>/.topka2a_claims/<step>``),
called as the manager calls it: :func:`step_claims.claim` on process 0.
"""

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import pytest

from topka2a_jax._src.checkpointing import step_claims

OLD = 2 * step_claims.ABANDONED_AFTER_SECONDS


def claim_file(root, step=1):
  folder = root / step_claims.CLAIMS
  folder.mkdir(parents=True, exist_ok=True)
  return folder / str(step)


def aged(path, seconds):
  then = time.time() - seconds
  os.utime(path, (then, then), follow_symlinks=False)
  return path


def abandoned_claim(root):
  path = claim_file(root)
  path.write_text(json.dumps({"token": "killed", "host": "elsewhere", "pid": 7, "time": 0}))
  return aged(path, OLD)


def _take_over(root, token, barrier, results):
  barrier.wait()
  results[token] = step_claims.claim(root, 1, token)


def test_two_jobs_taking_over_one_abandoned_claim_never_both_win(tmp_path):
  context = multiprocessing.get_context("fork")
  for trial in range(40):
    root = tmp_path / str(trial)
    abandoned_claim(root)
    with context.Manager() as shared:
      results, barrier = shared.dict(), context.Barrier(2)
      jobs = [context.Process(target=_take_over, args=(root, token, barrier, results))
              for token in ("job-a", "job-b")]
      for job in jobs:
        job.start()
      for job in jobs:
        job.join(30)
      outcome = dict(results)
    winners = [token for token, refused in outcome.items() if refused is None]
    assert len(winners) == 1, (trial, outcome)
    # The step's claim now names the winner, and every claim file is whole JSON.
    assert step_claims.claim(root, 1, winners[0]) is None
    for path in (root / step_claims.CLAIMS).iterdir():
      json.loads(path.read_text())


def test_a_link_to_an_old_file_outside_the_root_is_refused_and_left_alone(tmp_path):
  outside = tmp_path / "outside.txt"
  outside.write_text("the user's own file")
  aged(outside, OLD)
  root = tmp_path / "root"
  link = claim_file(root)
  link.symlink_to(outside)
  refused = step_claims.claim(root, 1, "restarted")
  assert f"{link} is a symbolic link, not a claim file" in refused
  assert f"rm {link}" in refused
  assert outside.read_text() == "the user's own file"


@pytest.mark.parametrize("make, kind", [
    (os.mkfifo, "a FIFO"), (os.mkdir, "a directory"),
    (lambda path: os.symlink(path.parent / "nowhere", path), "a symbolic link")],
    ids=["fifo", "directory", "dangling link"])
@pytest.mark.parametrize("age", [0, OLD], ids=["fresh", "old"])
def test_an_entry_that_is_not_a_regular_file_is_refused_unread(tmp_path, make, kind, age):
  path = claim_file(tmp_path)
  make(path)
  aged(path, age)
  started = time.monotonic()
  refused = step_claims.claim(tmp_path, 1, "restarted")  # a FIFO would block a read
  assert time.monotonic() - started < 5
  assert f"{path} is {kind}, not a claim file" in refused and f"rm {path}" in refused


@pytest.mark.parametrize("record", [
    {"token": "other", "host": "h", "pid": 1, "time": "yesterday"},
    {"token": "other", "host": "h", "pid": 1, "time": 1e20},
    {"token": "other", "host": "h", "pid": 1, "time": float("nan")},
    {"token": "other", "host": ["h"], "pid": "1"}, [1, 2], "just text"],
    ids=["time a string", "time 1e20", "time nan", "fields of other types", "a list",
         "a string"])
def test_a_malformed_record_is_refused_fresh_and_taken_old(tmp_path, record):
  path = claim_file(tmp_path)
  path.write_text(json.dumps(record))
  assert "is claimed by" in step_claims.claim(tmp_path, 1, "restarted")
  aged(path, OLD)
  assert step_claims.claim(tmp_path, 1, "restarted") is None


def test_a_claim_folder_that_is_a_file_is_named_with_the_fix(tmp_path):
  (tmp_path / step_claims.CLAIMS).write_text("")
  refused = step_claims.claim(tmp_path, 1, "job")
  assert f"{tmp_path / step_claims.CLAIMS} is a regular file, not the directory" in refused


def test_a_claim_whose_process_has_ended_on_this_host_is_taken_at_once(tmp_path):
  ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                         capture_output=True, text=True, check=True)
  path = claim_file(tmp_path)
  path.write_text(json.dumps({"token": "killed", "host": socket.gethostname(),
                              "pid": int(ended.stdout), "time": time.time()}))
  assert step_claims.claim(tmp_path, 1, "restarted") is None
  # A live process's fresh claim on this host stands, naming it and the way out.
  path = claim_file(tmp_path, 2)
  path.write_text(json.dumps({"token": "live", "host": socket.gethostname(),
                              "pid": os.getppid(), "time": time.time()}))
  refused = step_claims.claim(tmp_path, 2, "restarted")
  assert f"claimed by process {os.getppid()} on {socket.gethostname()}, 0 s ago" in refused
  assert "taken over once it is 120 s old" in refused and f"rm {path}" in refused


def test_a_claim_dated_in_the_future_does_not_block_the_step(tmp_path):
  path = claim_file(tmp_path)
  path.write_text(json.dumps({"token": "other", "host": "elsewhere", "pid": 7,
                              "time": time.time()}))
  aged(path, -86400)
  assert step_claims.claim(tmp_path, 1, "restarted") is None


def test_nothing_of_the_step_on_disk_is_required_for_a_takeover(tmp_path):
  abandoned_claim(tmp_path)
  (tmp_path / "1.orbax-checkpoint-tmp-123").mkdir()  # a save in flight
  assert "is claimed by" in step_claims.claim(tmp_path, 1, "restarted")


def test_claims_of_steps_gone_are_removed(tmp_path):
  for step in range(1, 6):
    assert step_claims.claim(tmp_path, step, "job") is None
  step_claims.remove_claims(tmp_path, keep=[4, 5], below=5)
  assert sorted(os.listdir(tmp_path / step_claims.CLAIMS)) == ["4", "5"]
