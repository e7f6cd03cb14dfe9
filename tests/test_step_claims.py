"""Step claims: one job wins a step, on regular files only, and nothing outside the root is touched.

What a restarted job's manager meets on disk (``<root>/.topka2a_claims/<step>``),
called as the manager calls it: :func:`step_claims.claim` on process 0.
"""

import errno
import json
import multiprocessing
import os
import socket
import time

import pytest
from cases import claimed_by_a_process_that_ended

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
  remove = "rm -r" if kind == "a directory" else "rm"  # a removal that works on it
  assert f"{path} is {kind}, not a claim file" in refused and f"{remove} {path})" in refused


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
  claimed_by_a_process_that_ended(tmp_path)
  partial = tmp_path / "1.orbax-checkpoint-tmp"  # what the killed job had written
  (partial / "state").mkdir(parents=True)
  assert step_claims.claim(tmp_path, 1, "restarted") is None
  assert not partial.exists()  # the winner removes it; nothing else of the root
  # A live process's fresh claim on this host stands, naming it and the way out.
  path = claim_file(tmp_path, 2)
  path.write_text(json.dumps({"token": "live", "host": socket.gethostname(),
                              "pid": os.getppid(), "time": time.time()}))
  refused = step_claims.claim(tmp_path, 2, "restarted")
  assert f"claimed by process {os.getppid()} on {socket.gethostname()}, 0 s ago" in refused
  assert "taken over once it and its step's temporary files are 120 s old" in refused
  assert f"rm {path}" in refused


def test_a_live_jobs_save_in_flight_is_never_taken_over(tmp_path):
  """An old claim whose step's temporary files are still being written stays."""
  abandoned_claim(tmp_path)
  partial = tmp_path / "1.orbax-checkpoint-tmp"
  (partial / "state").mkdir(parents=True)
  aged(partial / "state", OLD)
  aged(partial, OLD)
  (partial / "state" / "chunk").write_bytes(b"written now")
  assert "is claimed by" in step_claims.claim(tmp_path, 1, "restarted")
  assert (partial / "state" / "chunk").exists()
  aged(partial / "state" / "chunk", OLD)  # nothing written for two minutes: abandoned
  aged(partial / "state", OLD)
  assert step_claims.claim(tmp_path, 1, "restarted") is None
  assert not partial.exists()


def test_a_claim_from_another_pid_namespace_is_judged_by_age(tmp_path):
  """Containers sharing the host's name see none of each other's processes."""
  path = claimed_by_a_process_that_ended(tmp_path)
  record = json.loads(path.read_text())
  path.write_text(json.dumps({**record, "pid_namespace": "pid:[4026531836]-another"}))
  assert "is claimed by" in step_claims.claim(tmp_path, 1, "restarted")
  aged(path, OLD)
  assert step_claims.claim(tmp_path, 1, "restarted") is None


@pytest.mark.parametrize("pid", [2**31, 2**63, 2**70], ids=["2**31", "2**63", "2**70"])
def test_a_pid_no_host_can_test_is_judged_by_age(tmp_path, pid):
  path = claimed_by_a_process_that_ended(tmp_path)
  path.write_text(json.dumps({**json.loads(path.read_text()), "pid": pid}))
  assert f"claimed by process {pid}" in step_claims.claim(tmp_path, 1, "restarted")
  aged(path, OLD)
  assert step_claims.claim(tmp_path, 1, "restarted") is None


def test_a_full_disk_at_the_claim_is_named_and_leaves_no_claim(tmp_path, monkeypatch):
  written = os.write

  def full(descriptor, data):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(os, "write", full)
  refused = step_claims.claim(tmp_path, 2, "job")
  assert "its file system is full (No space left on device)" in refused
  assert "no claim is left" in refused
  assert os.listdir(tmp_path / step_claims.CLAIMS) == []
  monkeypatch.setattr(os, "write", written)  # space freed: the same job's retry works
  assert step_claims.claim(tmp_path, 2, "job") is None


@pytest.mark.parametrize("stray", ["01", "1~0", "1~01", "001~2", "1~", "~1", "1.tmp"])
def test_names_that_no_claim_has_are_ignored(tmp_path, stray):
  claim_file(tmp_path).parent.joinpath(stray).write_text("{}")
  assert step_claims.claim(tmp_path, 1, "job") is None
  assert step_claims.claim(tmp_path, 1, "another") is not None  # the claim is job's


def test_a_writer_removes_older_steps_partials_only_where_no_live_job_writes(tmp_path):
  """A job killed while saving step 3 (a partial left), a live job saving step 4."""
  claimed_by_a_process_that_ended(tmp_path, 3)
  (tmp_path / "3.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
  assert step_claims.claim(tmp_path, 4, "live") is None
  (tmp_path / "4.orbax-checkpoint-tmp" / "state").mkdir(parents=True)
  (tmp_path / "2.orbax-checkpoint-tmp").mkdir()  # no claim names it: written just now
  step_claims.remove_abandoned_partials(tmp_path, "writer", below=6)
  assert sorted(os.listdir(tmp_path)) == [
      ".topka2a_claims", "2.orbax-checkpoint-tmp", "4.orbax-checkpoint-tmp"]
  assert sorted(os.listdir(tmp_path / step_claims.CLAIMS)) == ["4"]
  aged(tmp_path / "2.orbax-checkpoint-tmp", OLD)  # unchanged for two minutes
  step_claims.remove_abandoned_partials(tmp_path, "writer", below=6)
  assert sorted(os.listdir(tmp_path)) == [".topka2a_claims", "4.orbax-checkpoint-tmp"]


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
