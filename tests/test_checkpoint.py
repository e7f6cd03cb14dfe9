"""Checkpoints: bitwise resume in a fresh process, restarts on other device counts."""

import errno
import functools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import resumable
from cases import LAUNCHER, claimed_by_a_process_that_ended

import topka2a_jax
from topka2a_jax._src.checkpointing import checkpoint, integrity, step_claims

SCRIPT = Path(resumable.__file__)


def run_script(*args, processes=1):
  """Runs resumable.py in a fresh process, or in several (4 devices each)."""
  launcher = [] if processes == 1 else [
      *LAUNCHER, "-n", str(processes), "--devices-per-process",
      str(8 // processes)]
  done = subprocess.run([sys.executable, *launcher, str(SCRIPT), *map(str, args)],
                        capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_save_and_resume_in_a_fresh_process_is_bitwise(tmp_path, processes):
  # 1 process holds all 8 devices; 2 hold 4 each, with gloo between them.
  run_script("straight", tmp_path / "straight.npz", processes=processes)
  run_script("first", tmp_path / "ckpt", processes=processes)
  run_script("resume", tmp_path / "ckpt", tmp_path / "resumed.npz",
             processes=processes)
  straight = np.load(tmp_path / "straight.npz")
  resumed = np.load(tmp_path / "resumed.npz")
  assert len(straight.files) == len(resumed.files) > 0
  for name in straight.files:
    np.testing.assert_array_equal(resumed[name], straight[name])


@pytest.mark.slow
def test_saved_by_two_processes_resumed_by_one(tmp_path):
  # Gloo and the in-process collectives add in different orders: float close.
  run_script("straight", tmp_path / "straight.npz")
  run_script("first", tmp_path / "ckpt", processes=2)
  run_script("resume", tmp_path / "ckpt", tmp_path / "resumed.npz")
  straight = np.load(tmp_path / "straight.npz")
  resumed = np.load(tmp_path / "resumed.npz")
  for name in straight.files:
    np.testing.assert_allclose(resumed[name], straight[name], rtol=1e-4, atol=1e-6)


def owed(state, devices):
  """Every residual summed over devices in float64: what error feedback owes."""
  return [np.asarray(r, np.float64).reshape(devices, -1).sum(0)
          for r in jax.tree.leaves(state["opt_state"][0].residuals)]


def sub_mesh(devices):
  return jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])


DRAINED = {
    "topka2a": optax.chain(topka2a_jax.topka2a(0.05, min_size=64), optax.sgd(0.1)),
    "topka2a_sparse": optax.chain(topka2a_jax.topka2a(
        0.05, algorithm="topka2a_sparse", min_size=64), optax.sgd(0.1)),
    "compress_updates": topka2a_jax.compress_updates(
        optax.sgd(0.1, momentum=0.5), density=0.05, min_size=64),
    "powersgd": optax.chain(topka2a_jax.topka2a(algorithm="powersgd", rank=4),
                            optax.sgd(0.1)),
    "topka2a, bfloat16 residuals": optax.chain(topka2a_jax.topka2a(
        0.05, min_size=64, residual_dtype=jnp.bfloat16), optax.sgd(0.1)),
}
"""Linear optimizers, so that what is delivered later does not depend on when:
the parameters after a full drain are fixed by what was owed at the save."""

GLOBAL_TOP_K = {name: optax.chain(topka2a_jax.topka2a(0.05, algorithm=name, min_size=64),
                                  optax.sgd(0.1)) for name in ("gtopk", "oktopk")}
"""The global top-k exchanges, whose merges and owners hold back mass: on two resizes."""

OPTIMIZERS = {**DRAINED, **GLOBAL_TOP_K}
"""Every optimizer a restart test drains, by name."""

DRAIN_STEPS = {"oktopk": 200}
"""Steps that drain what each owes (60 unless named): Ok-Topk's owners hold
back most of what they receive, and it comes back a step later."""


def zero_loss(params, x):
  """Gradients of exactly zero: the steps only deliver what is owed."""
  return 0.0 * resumable.loss(params, x)


def drained(state, mesh, tx, steps=60):
  """The parameters after ``steps`` steps of zero gradients (NumPy, float64)."""
  step = topka2a_jax.train_step(zero_loss, tx, mesh)
  params, opt_state = state["params"], state["opt_state"]
  for i in range(steps):
    params, opt_state, _ = step(params, opt_state, resumable.batch(i))
  return jax.tree.map(lambda p: np.asarray(p, np.float64), params)


@functools.cache
def saved_run(name, devices, directory):
  """Three real steps on ``devices``, saved; and the uninterrupted drain after them."""
  tx, mesh = OPTIMIZERS[name], sub_mesh(devices)
  state = resumable.train(resumable.fresh(mesh, tx), mesh, range(3), tx)
  at_save = jax.tree.map(lambda p: np.asarray(p, np.float64), state["params"])
  topka2a_jax.save(Path(directory) / f"{name}_{devices}", state, mesh)
  return at_save, drained(state, mesh, tx, DRAIN_STEPS.get(name, 60))


@pytest.mark.parametrize("old, new", [(8, 4), (8, 1), (4, 8), (8, 3)])
@pytest.mark.parametrize("name", list(DRAINED))
def test_a_restart_on_another_device_count_delivers_what_was_owed(
    tmp_path_factory, name, old, new):
  """Saved on ``old`` devices, restored on ``new``, drained: the uninterrupted run's parameters."""
  check_a_restart_delivers_what_was_owed(tmp_path_factory, name, old, new)


@pytest.mark.parametrize(("name", "old", "new"), [("gtopk", 8, 3), ("oktopk", 4, 2)])
def test_a_global_top_k_restart_delivers_what_was_owed(tmp_path_factory, name, old, new):
  check_a_restart_delivers_what_was_owed(tmp_path_factory, name, old, new)


def check_a_restart_delivers_what_was_owed(tmp_path_factory, name, old, new):
  directory = tmp_path_factory.getbasetemp() / "drained"
  directory.mkdir(exist_ok=True)
  at_save, want = saved_run(name, old, str(directory))
  tx, mesh = OPTIMIZERS[name], sub_mesh(new)
  restored = topka2a_jax.restore(directory / f"{name}_{old}",
                                 resumable.fresh(mesh, tx), mesh)
  got = drained(restored, mesh, tx, DRAIN_STEPS.get(name, 60))
  moved = {key: want[key] - at_save[key] for key in want}  # what was owed
  scale = max(np.abs(m).max() for m in moved.values())
  assert scale > 1e-3, "nothing was owed at the save: the test would be void"
  # bfloat16 residuals are resized and stored in bfloat16 once more than the
  # uninterrupted run stores them: one more rounding, of values up to the scale.
  rounding = np.finfo(jnp.bfloat16).eps if "bfloat16" in name else 1e-5
  for key in want:  # "b" goes dense (min_size): owed nothing, moved by nothing
    np.testing.assert_allclose(got[key] - at_save[key], moved[key], rtol=0,
                               atol=rounding * scale, err_msg=f"{name} {key}")


@pytest.mark.parametrize("old, new", [(8, 4), (4, 8), (8, 3)])
@pytest.mark.parametrize("algorithm", ["onebit", "quantized_4_8", "rotated_4_8"])
def test_codes_after_a_restart_deliver_what_was_owed_and_no_more(tmp_path, algorithm,
                                                                 old, new):
  """The few-bit exchanges drain over several steps (codes of what is owed, both
  phases' roundings fed back): the parameters' moves plus what is still owed
  equal what was owed at the save, and most of it has arrived."""
  tx = optax.chain(topka2a_jax.topka2a(algorithm=algorithm, min_size=64),
                   optax.sgd(0.1))
  mesh = sub_mesh(old)
  state = resumable.train(resumable.fresh(mesh, tx), mesh, range(3), tx)
  at_save = np.asarray(state["params"]["w"], np.float64).ravel()
  owed_at_save = owed(state, old)[0] / old  # "w"'s mean residual; "b" goes dense
  topka2a_jax.save(tmp_path / "ckpt", state, mesh)
  mesh = sub_mesh(new)
  restored = topka2a_jax.restore(tmp_path / "ckpt", resumable.fresh(mesh, tx), mesh)
  step = topka2a_jax.train_step(zero_loss, tx, mesh)
  params, opt_state = restored["params"], restored["opt_state"]
  for i in range(20):
    params, opt_state, _ = step(params, opt_state, resumable.batch(i))
  delivered = (at_save - np.asarray(params["w"], np.float64).ravel()) / 0.1
  still_owed = owed({"opt_state": opt_state}, new)[0] / new
  scale = np.abs(owed_at_save).max()
  assert scale > 1e-3, "nothing was owed at the save: the test would be void"
  # Twenty steps of float32 arithmetic on values of about ``scale``.
  np.testing.assert_allclose(delivered + still_owed, owed_at_save, rtol=0,
                             atol=20 * 8 * np.finfo(np.float32).eps * scale)
  # And it drains: less than half is still owed after 20 steps (in norm).
  assert np.linalg.norm(still_owed) < 0.5 * np.linalg.norm(owed_at_save)


@pytest.mark.parametrize("old, new", [(8, 4), (4, 8), (8, 3), (2, 1)])
def test_restart_on_another_device_count_keeps_what_is_owed(tmp_path, old, new):
  before_mesh, after_mesh = sub_mesh(old), sub_mesh(new)
  before = resumable.train(resumable.fresh(before_mesh), before_mesh, range(3))
  topka2a_jax.save(tmp_path / "ckpt", before, before_mesh)
  after = topka2a_jax.restore(tmp_path / "ckpt", resumable.fresh(after_mesh),
                              after_mesh)
  owed_before = owed(before, old)
  owed_after = owed(after, new)
  assert owed_before and any(np.abs(t).sum() > 0 for t in owed_before)
  for was, now in zip(owed_before, owed_after):
    # The sum over devices over their number, in float64: exact when the
    # device counts' ratio is a power of two, to float64 rounding otherwise
    # (to float32 rounding on one device, which holds one float32 only).
    tolerance = 1e-7 if new == 1 else 1e-15
    np.testing.assert_allclose(now / new, was / old, rtol=tolerance,
                               atol=tolerance * np.abs(was).max())
  # Everything else is replicated and comes back bitwise.
  chex.assert_trees_all_equal(after["params"], before["params"])
  chex.assert_trees_all_equal(after["opt_state"][1],
               before["opt_state"][1])
  resident = after["opt_state"][0].residuals["w"]
  assert resident.shape == (new * 40, 30)  # a (40, 30) block per device
  assert resident.sharding.mesh.shape["data"] == new
  resumable.train(after, after_mesh, range(3, 5))  # and training goes on


def test_resizing_a_residual_by_hand():
  residual = np.arange(8.0, dtype=np.float32)  # 4 devices of 2 entries
  grown = np.asarray(topka2a_jax.checkpoint.resize_residual(residual, 4, 8))
  # Twice the devices: each owes twice as much, so the mean is the same.
  np.testing.assert_array_equal(grown, [0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0])
  shrunk = np.asarray(topka2a_jax.checkpoint.resize_residual(residual, 4, 2))
  np.testing.assert_array_equal(shrunk, [6, 8, 0, 0])  # (0+2+4+6) / 2, (1+3+5+7) / 2
  # 3 devices onto 2: the sum times 2/3, which no float32 holds exactly.
  thirds = np.asarray(topka2a_jax.checkpoint.resize_residual(
      np.array([1.0, 0.0, 0.0], np.float32), 3, 2), np.float64)
  assert abs(thirds.sum() - 2 / 3) < 1e-15
  # 1 + 2**-30 + 2**-30 does not fit one float32: the pair keeps it.
  summed = np.asarray(topka2a_jax.checkpoint.resize_residual(
      np.array([1.0, 2.0**-30, 2.0**-30], np.float32), 3, 2))
  assert abs(summed[0] + np.float64(summed[1]) - (1.0 + 2.0**-29) * 2 / 3) < 2.0**-50
  assert summed[0] + np.float64(summed[1]) != np.float32((1.0 + 2.0**-29) * 2 / 3)


def test_checkpoint_of_another_model_is_refused(tmp_path, mesh):
  state = resumable.fresh(mesh)
  topka2a_jax.save(tmp_path / "ckpt", state, mesh)
  other = dict(state, params=dict(state["params"], extra=state["params"]["b"]))
  other["opt_state"] = topka2a_jax.init(resumable.TX, other["params"], mesh)
  with pytest.raises(ValueError, match=r"another pytree: leaves only in the checkpoint: "
                                       r"none; only in the state to restore into: "
                                       r"\['opt_state'\].*\['extra'\]"):
    topka2a_jax.restore(tmp_path / "ckpt", other, mesh)
  wider = {"w": np.zeros((40, 31), np.float32), "b": np.zeros(30, np.float32)}
  wide = {"params": jax.device_put(wider), "opt_state": topka2a_jax.init(
      resumable.TX, wider, mesh)}
  with pytest.raises(ValueError, match=r"leaf \['opt_state'\].*was saved as"):
    topka2a_jax.restore(tmp_path / "ckpt", wide, mesh)


def test_checkpoint_of_another_configuration_is_refused(tmp_path, mesh):
  state = resumable.fresh(mesh)
  topka2a_jax.save(tmp_path / "ckpt", state, mesh)
  tx = optax.chain(topka2a_jax.topka2a(0.05, min_size=0), optax.adam(1e-2))
  like = {"params": state["params"], "opt_state": topka2a_jax.init(
      tx, state["params"], mesh)}  # b now keeps a residual too
  with pytest.raises(ValueError, match="another pytree"):
    topka2a_jax.restore(tmp_path / "ckpt", like, mesh)


def test_save_never_overwrites_and_restore_needs_a_checkpoint(tmp_path, mesh):
  state = resumable.fresh(mesh)
  topka2a_jax.save(tmp_path / "ckpt", state, mesh)
  with pytest.raises(FileExistsError, match="nothing was written"):
    topka2a_jax.save(tmp_path / "ckpt", state, mesh)
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    topka2a_jax.restore(tmp_path, state, mesh)


def _flip_byte(path, at=None):
  data = bytearray(path.read_bytes())
  at = len(data) // 2 if at is None else at
  data[at] ^= 0xFF
  path.write_bytes(bytes(data))


def test_a_flipped_byte_in_any_file_is_refused_naming_it(tmp_path, mesh):
  state = resumable.fresh(mesh)
  saved = tmp_path / "ckpt"
  topka2a_jax.save(saved, state, mesh)
  files = sorted(p.relative_to(saved) for p in saved.rglob("*") if p.is_file())
  assert len(files) > 5 and Path(integrity.MANIFEST_FILE) in files
  for i, name in enumerate(files):
    copy = tmp_path / f"copy{i}"
    shutil.copytree(saved, copy)
    if (copy / name).stat().st_size == 0:
      continue
    _flip_byte(copy / name)
    with pytest.raises(ValueError, match="corrupted") as refused:
      topka2a_jax.restore(copy, state, mesh)
    assert str(name.name) in str(refused.value), (name, refused.value)
  restored = topka2a_jax.restore(saved, state, mesh)  # the intact one still loads
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, restored),
                              jax.tree.map(np.asarray, state))


@pytest.mark.parametrize("manifest", [True, False])
def test_links_and_special_files_in_a_checkpoint_are_refused_unread(tmp_path, mesh,
                                                                    manifest):
  """A copy whose file became a link to a host file, or that holds a FIFO."""
  state = resumable.fresh(mesh)
  saved = tmp_path / "ckpt"
  topka2a_jax.save(saved, state, mesh)
  if not manifest:  # an older version's checkpoint: still no link is followed
    (saved / integrity.MANIFEST_FILE).unlink()
  secret = tmp_path / "secret"
  secret.write_text("host data")
  linked = tmp_path / "linked"
  shutil.copytree(saved, linked)
  (linked / checkpoint.LAYOUT_FILE).unlink()
  (linked / checkpoint.LAYOUT_FILE).symlink_to(secret)
  special = tmp_path / "special"
  shutil.copytree(saved, special)
  os.mkfifo(special / "state" / "extra")
  for copy, kind in ((linked, "is a symbolic link"), (special, "not a regular file")):
    with pytest.raises(ValueError, match=f"checkpoint entry .* {kind}.*nothing was "
                                         "loaded"):
      topka2a_jax.restore(copy, state, mesh)
    if manifest:
      with pytest.raises(ValueError, match=kind):
        topka2a_jax.checkpoint.verify(copy)


def test_a_lost_manifest_still_leaves_every_array_checked(tmp_path, mesh):
  # Random floats, which compression leaves as they are: the data file holds
  # the array's bytes, as the corrupted residual did.
  weights = np.random.default_rng(0).normal(size=(256, 256)).astype(np.float32)
  state = {"w": jax.device_put(weights)}
  saved = tmp_path / "ckpt"
  topka2a_jax.save(saved, state, mesh)
  (saved / integrity.MANIFEST_FILE).unlink()
  data = max((p for p in saved.rglob("*") if p.is_file() and "d" == p.parent.name),
             key=lambda p: p.stat().st_size)  # the OCDBT data file of w
  _flip_byte(data)
  with pytest.warns(UserWarning, match="cannot be checked"), pytest.raises(
      ValueError, match=r"leaf \['w'\] reads back other bytes"):
    topka2a_jax.restore(saved, state, mesh)


def test_fingerprint_changes_with_any_byte():
  rng = np.random.default_rng(0)
  for dtype in (np.float32, np.float16, np.int32, np.uint8, np.bool_):
    array = rng.normal(size=(37, 5)).astype(dtype)
    base = int(integrity.fingerprint(jnp.asarray(array)))
    raw = array.view(np.uint8).reshape(-1)
    for at in rng.choice(raw.size, 16, replace=False):
      changed = raw.copy()
      changed[at] ^= 1 << int(rng.integers(8))
      flipped = changed.view(array.dtype).reshape(array.shape)
      if dtype == np.bool_:
        continue  # not every byte is a valid bool
      assert int(integrity.fingerprint(jnp.asarray(flipped))) != base


def test_a_save_that_fails_leaves_nothing_and_can_be_retried(tmp_path, mesh, monkeypatch):
  import orbax.checkpoint as ocp

  state = resumable.fresh(mesh)
  real_save = ocp.StandardCheckpointer.save

  def disk_full(self, directory, *args, **kwargs):
    partial = Path(str(directory) + ".orbax-checkpoint-tmp-1")
    partial.mkdir(parents=True)
    (partial / "part").write_bytes(b"half")
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(ocp.StandardCheckpointer, "save", disk_full)
  with pytest.raises(OSError, match="No space left"):
    topka2a_jax.save(tmp_path / "ckpt", state, mesh)
  assert not (tmp_path / "ckpt").exists()
  monkeypatch.setattr(ocp.StandardCheckpointer, "save", real_save)
  topka2a_jax.save(tmp_path / "ckpt", state, mesh)
  topka2a_jax.restore(tmp_path / "ckpt", state, mesh)


def test_two_jobs_saving_to_one_directory_keep_the_one_that_reported_success(
    tmp_path, mesh, monkeypatch):
  """Another job's save runs while this one computes its fingerprints."""
  mine, theirs = resumable.fresh(mesh), resumable.fresh(mesh)
  theirs = jax.tree.map(lambda leaf: leaf + 1 if jnp.issubdtype(leaf.dtype, jnp.floating)
                        else leaf, theirs)
  directory, outcomes = tmp_path / "ckpt", {}
  real_describe = checkpoint.describe

  def other_job_saves_meanwhile(*args, **kwargs):
    if "theirs" not in outcomes:
      outcomes["theirs"] = None
      try:
        topka2a_jax.save(directory, theirs, mesh)
        outcomes["theirs"] = "saved"
      except FileExistsError:
        outcomes["theirs"] = "refused"
    return real_describe(*args, **kwargs)

  monkeypatch.setattr(checkpoint, "describe", other_job_saves_meanwhile)
  try:
    topka2a_jax.save(directory, mine, mesh)
    outcomes["mine"] = "saved"
  except (FileExistsError, ValueError):
    outcomes["mine"] = "refused"
  monkeypatch.setattr(checkpoint, "describe", real_describe)
  winners = [job for job in ("mine", "theirs") if outcomes[job] == "saved"]
  assert len(winners) == 1, outcomes
  restored = topka2a_jax.restore(directory, mine, mesh)
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, restored), jax.tree.map(
      np.asarray, mine if winners == ["mine"] else theirs))


def test_a_model_with_an_empty_leaf_is_saved_and_restored_onto_fewer_devices(
    tmp_path, mesh):
  small = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  make = lambda m: optax.chain(topka2a_jax.topka2a(0.1, min_size=0, mesh=m),
                               optax.sgd(0.1))
  loss = lambda p, x: jnp.mean((x @ p["w"]) ** 2) + jnp.sum(p["empty"])
  x = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
  params = {"w": jnp.ones((64, 16)) / 8, "empty": jnp.zeros((0, 16))}
  state, step = make(mesh).init(params), topka2a_jax.train_step(loss, make(mesh), mesh)
  for _ in range(3):
    params, state, _ = step(params, state, x)
  topka2a_jax.save(tmp_path / "ckpt", {"params": params, "opt_state": state}, mesh)
  with topka2a_jax.CheckpointManager(tmp_path / "managed", mesh) as manager:
    manager.save(3, {"params": params, "opt_state": state})
  owed_before = np.asarray(state[0].residuals["w"]).reshape(8, 64, 16).sum(0) / 8
  assert np.abs(owed_before).max() > 0
  like = {"params": params, "opt_state": make(small).init(params)}
  with topka2a_jax.CheckpointManager(tmp_path / "managed", small) as manager:
    managed = manager.restore(like)
  for restored in (topka2a_jax.restore(tmp_path / "ckpt", like, small), managed):
    assert restored["params"]["empty"].shape == (0, 16)
    np.testing.assert_array_equal(restored["params"]["w"], params["w"])
    owed_after = np.asarray(restored["opt_state"][0].residuals["w"]).reshape(
        4, 64, 16).sum(0) / 4
    np.testing.assert_allclose(owed_after, owed_before, rtol=0, atol=1e-6)
    topka2a_jax.train_step(loss, make(small), small)(
        restored["params"], restored["opt_state"], x)


def test_a_corrupted_layout_file_is_named(tmp_path, mesh):
  state = resumable.fresh(mesh)
  saved = tmp_path / "ckpt"
  topka2a_jax.save(saved, state, mesh)
  (saved / integrity.MANIFEST_FILE).unlink()  # a copy that lost it, then
  _flip_byte(saved / checkpoint.LAYOUT_FILE, at=0)  # a bad first byte
  with pytest.warns(UserWarning), pytest.raises(
      ValueError, match="layout description .*topka2a_layout.json is corrupted"):
    topka2a_jax.restore(saved, state, mesh)


def test_the_manager_keeps_the_last_steps_and_restores_onto_fewer_devices(tmp_path, mesh):
  small = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  state = resumable.train(resumable.fresh(mesh), mesh, range(3))  # owes something
  assert any(np.abs(t).sum() > 0 for t in owed(state, 8))
  with topka2a_jax.CheckpointManager(tmp_path, mesh, max_to_keep=2) as manager:
    for step in (1, 2, 3):
      manager.save(step, state)
    manager.wait_until_finished()
    assert manager.all_steps() == [2, 3] and manager.latest_step() == 3
  # After a restart on 4 devices: the latest complete step, residuals resized.
  with topka2a_jax.CheckpointManager(tmp_path, small) as manager:
    restored = manager.restore(resumable.fresh(small))
    with pytest.raises(FileNotFoundError, match="no complete checkpoint of step 1"):
      manager.restore(resumable.fresh(small), step=1)
  for now, was in zip(owed(restored, 4), owed(state, 8)):  # per device, the mean
    np.testing.assert_array_equal(now / 4, was / 8)
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, restored["params"]),
                              jax.tree.map(np.asarray, state["params"]))


def test_the_manager_takes_orbaxs_policies_and_skips_the_steps_they_skip(tmp_path, mesh):
  import orbax.checkpoint as ocp

  state = resumable.fresh(mesh)
  options = ocp.CheckpointManagerOptions(save_interval_steps=2, max_to_keep=2)
  with topka2a_jax.CheckpointManager(tmp_path, mesh, options=options) as manager:
    saved = [manager.save(step, state) for step in range(6)]
    manager.wait_until_finished()
    assert saved == [True, False, True, False, True, False]
    assert manager.all_steps() == [2, 4]
    restored = manager.restore(resumable.fresh(mesh))
  for step in (2, 4):  # every kept step is sealed and verifies
    topka2a_jax.checkpoint.verify(tmp_path / str(step))
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, restored["params"]),
                              jax.tree.map(np.asarray, state["params"]))
  with pytest.raises(ValueError, match="max_to_keep=3 and options.max_to_keep=2 both"):
    topka2a_jax.CheckpointManager(tmp_path / "other", mesh, max_to_keep=3,
                                  options=options)
  with pytest.raises(TypeError, match="CheckpointManagerOptions, got dict"):
    topka2a_jax.CheckpointManager(tmp_path / "other", mesh, options={"max_to_keep": 2})


def test_the_manager_never_lists_a_partial_step(tmp_path, mesh):
  state = resumable.fresh(mesh)
  with topka2a_jax.CheckpointManager(tmp_path, mesh, async_save=False) as manager:
    manager.save(1, state)
  # A crash in the middle of step 2's save leaves Orbax's temporary directory.
  partial = tmp_path / "2.orbax-checkpoint-tmp-1234"
  partial.mkdir()
  (partial / "state").mkdir()
  with topka2a_jax.CheckpointManager(tmp_path, mesh) as manager:
    assert manager.latest_step() == 1
    manager.restore(state)


def test_a_second_job_on_a_managers_root_is_refused_and_the_first_jobs_steps_kept(
    tmp_path, mesh):
  """Job B starts on job A's root (or a run restarts into an old run's root)."""
  first = resumable.fresh(mesh)
  second = jax.tree.map(lambda leaf: leaf + 1 if jnp.issubdtype(leaf.dtype, jnp.floating)
                        else leaf, first)
  with topka2a_jax.CheckpointManager(tmp_path, mesh) as job_a, \
       topka2a_jax.CheckpointManager(tmp_path, mesh) as job_b:
    job_a.save(1, first)
    job_a.wait_until_finished()
    with pytest.raises(FileExistsError, match="already holds step 1.*Nothing was "
                                              "written"):
      job_b.save(1, second)
    job_a.save(2, first)
    job_a.wait_until_finished()
    with pytest.raises(FileExistsError, match="already holds step 2, later than 0"):
      job_b.save(0, second)  # nothing older than the root's latest step either
  with topka2a_jax.CheckpointManager(tmp_path, mesh) as fresh:
    assert fresh.all_steps() == [1, 2]
    for step in (1, 2):
      chex.assert_trees_all_equal(jax.tree.map(np.asarray, fresh.restore(first, step)),
                                  jax.tree.map(np.asarray, first))


def test_a_job_whose_step_another_finishes_during_its_save_is_refused_not_overwriting(
    tmp_path, mesh):
  """Job B finishes step 1 after job A has checked the root and before A writes.

  Orbax saves with ``force=True``, which would remove B's finished step; A's
  claim on the step is refused instead, and B's step restores.
  """
  first = resumable.fresh(mesh)
  second = jax.tree.map(lambda leaf: leaf + 1 if jnp.issubdtype(leaf.dtype, jnp.floating)
                        else leaf, first)
  job_a = topka2a_jax.CheckpointManager(tmp_path, mesh)
  checked = job_a._manager.should_save  # the last thing save() asks before writing

  def other_job_saves_first(step):
    job_a._manager.should_save = checked  # once: Orbax's save asks again
    with topka2a_jax.CheckpointManager(tmp_path, mesh, async_save=False) as job_b:
      assert job_b.save(step, second)
    return checked(step)

  job_a._manager.should_save = other_job_saves_first
  with pytest.raises(FileExistsError, match=r"step 1 of .* is claimed by process \d+ on .*"
                                            "Nothing was written"):
    job_a.save(1, first)
  job_a.close()
  with topka2a_jax.CheckpointManager(tmp_path, mesh) as fresh:
    assert fresh.all_steps() == [1]
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, fresh.restore(first)),
                                jax.tree.map(np.asarray, second))


def test_a_step_claimed_by_a_job_killed_before_writing_it_is_taken_over_later(tmp_path, mesh):
  """A job killed during its save of step 2 leaves a claim and no step; its restart saves 2."""
  state = resumable.fresh(mesh)
  with topka2a_jax.CheckpointManager(tmp_path, mesh) as killed:
    killed.save(1, state)
  claims = tmp_path / step_claims.CLAIMS
  (claims / "2").write_text('{"token": "the killed job", "host": "h", "pid": 1, "time": 0}')
  with topka2a_jax.CheckpointManager(tmp_path, mesh) as restarted:
    with pytest.raises(FileExistsError, match="claimed by process 1 on h"):
      restarted.save(2, state)  # a fresh claim: that job may still be writing
    old = time.time() - 2 * step_claims.ABANDONED_AFTER_SECONDS
    os.utime(claims / "2", (old, old))
    assert restarted.save(2, state)
  with topka2a_jax.CheckpointManager(tmp_path, mesh) as fresh:
    assert fresh.all_steps() == [1, 2]


def test_a_restart_after_a_kill_during_a_save_saves_at_once(tmp_path, mesh):
  """The killed job's process is gone from this host: its claim and its partial step are
  taken over, no two-minute wait."""
  state = resumable.fresh(mesh)
  claimed_by_a_process_that_ended(tmp_path)
  (tmp_path / "1.orbax-checkpoint-tmp" / "state").mkdir(parents=True)  # cut short
  with topka2a_jax.CheckpointManager(tmp_path, mesh) as restarted:
    assert restarted.save(1, state)
  with topka2a_jax.CheckpointManager(tmp_path, mesh, read_only=True) as fresh:
    assert fresh.all_steps() == [1]
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, fresh.restore(state)),
                                jax.tree.map(np.asarray, state))
  assert sorted(os.listdir(tmp_path)) == [".topka2a_claims", "1"]


def test_a_full_disk_at_the_claim_is_named_and_the_same_jobs_retry_saves(
    tmp_path, mesh, monkeypatch):
  state = resumable.fresh(mesh)
  written = os.write

  def full(descriptor, data):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  with topka2a_jax.CheckpointManager(tmp_path, mesh, async_save=False) as manager:
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="its file system is full .* no claim is left"):
      manager.save(1, state)
    monkeypatch.setattr(os, "write", written)  # space freed
    assert manager.save(1, state)
  with topka2a_jax.CheckpointManager(tmp_path, mesh, read_only=True) as fresh:
    assert fresh.all_steps() == [1]


READER = Path(__file__).with_name("checkpoint_reader.py")


@pytest.mark.parametrize("async_save, read_only", [(True, False), (False, False),
                                                   (True, True)],
                         ids=["async, plain reader", "sync, plain reader",
                              "async, read-only reader"])
def test_an_evaluation_job_polling_the_root_leaves_every_save_restorable(
    tmp_path, mesh, async_save, read_only):
  """Another process builds a manager on the root every 0.2 s while this job saves 6 steps."""
  root, stop = tmp_path / "ckpt", tmp_path / "stop"
  reader = subprocess.Popen(
      [sys.executable, str(READER), str(root), str(stop), *(["read-only"] * read_only)],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 120
    while not Path(f"{root}.ready").exists():
      assert reader.poll() is None and time.monotonic() < deadline, reader.communicate()
      time.sleep(0.1)
    def saved(step):
      return {"w": np.random.default_rng(step).normal(size=1 << 20).astype(np.float32)}
    with topka2a_jax.CheckpointManager(root, mesh, async_save=async_save) as manager:
      returned = [manager.save(step, jax.tree.map(jnp.asarray, saved(step)))
                  for step in range(1, 7)]
  finally:
    stop.touch()
    out, err = reader.communicate(timeout=120)
  assert returned == [True] * 6
  assert reader.returncode == 0, err[-3000:]
  assert int(out.split()[-1]) >= 2, out  # it polled while the job saved
  like = {"w": jnp.zeros((1 << 20,), jnp.float32)}
  with topka2a_jax.CheckpointManager(root, mesh, read_only=True) as fresh:
    assert fresh.all_steps() == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
      np.testing.assert_array_equal(np.asarray(fresh.restore(like, step)["w"]),
                                    saved(step)["w"])


def test_a_read_only_manager_writes_nothing_and_sees_steps_completed_since(tmp_path, mesh):
  state = resumable.fresh(mesh)
  missing = tmp_path / "not yet"
  with topka2a_jax.CheckpointManager(missing, mesh, read_only=True) as reader:
    assert reader.latest_step() is None and not missing.exists()  # nothing created
  partial = tmp_path / "2.orbax-checkpoint-tmp"  # a save of another job, in flight
  partial.mkdir()
  (partial / "state").mkdir()
  with topka2a_jax.CheckpointManager(tmp_path, mesh, read_only=True) as reader, \
       topka2a_jax.CheckpointManager(tmp_path, mesh, async_save=False) as writer:
    assert reader.latest_step() is None
    writer.save(1, state)
    assert reader.latest_step() == 1 and reader.all_steps() == [1]  # read anew
    with pytest.raises(PermissionError, match="read_only=True: it never writes. "
                                              "Nothing was written"):
      reader.save(3, state)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, reader.restore(state)),
                                jax.tree.map(np.asarray, state))
  assert partial.is_dir() and sorted(os.listdir(tmp_path)) == [
      ".topka2a_claims", "1", "2.orbax-checkpoint-tmp"]


def test_orbax_clean_up_on_building_is_refused_naming_why(tmp_path, mesh):
  import orbax.checkpoint as ocp

  with pytest.raises(ValueError, match="cleanup_tmp_directories=True removes every step "
                                       "being written .* another live job's save"):
    topka2a_jax.CheckpointManager(tmp_path, mesh, options=ocp.CheckpointManagerOptions(
        cleanup_tmp_directories=True))
  with pytest.raises(ValueError, match="read_only=True and options.read_only=True both"):
    topka2a_jax.CheckpointManager(tmp_path, mesh, read_only=True,
                                  options=ocp.CheckpointManagerOptions(read_only=True))


def test_the_claims_of_steps_the_manager_removed_are_removed(tmp_path, mesh):
  state = resumable.fresh(mesh)
  with topka2a_jax.CheckpointManager(tmp_path, mesh, max_to_keep=2, async_save=False) as manager:
    for step in range(1, 7):
      manager.save(step, state)
  assert sorted(os.listdir(tmp_path / step_claims.CLAIMS)) == ["5", "6"]


def test_a_step_directory_that_links_into_another_root_is_refused(tmp_path, mesh):
  state = resumable.fresh(mesh)
  for root in ("a", "b"):
    with topka2a_jax.CheckpointManager(tmp_path / root, mesh, async_save=False) as manager:
      for step in (1, 2):
        manager.save(step, state)
  shutil.rmtree(tmp_path / "a" / "2")
  (tmp_path / "a" / "2").symlink_to(tmp_path / "b" / "2")
  with topka2a_jax.CheckpointManager(tmp_path / "a", mesh) as manager:
    with pytest.raises(ValueError, match=r"a[/\\]2 is a symbolic link .*nothing outside the root"):
      manager.restore(state)
    manager.restore(state, step=1)  # its own steps still read


def test_the_manager_refuses_steps_and_settings_it_could_not_restore(tmp_path, mesh):
  state = resumable.fresh(mesh)
  for keep in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match=f"max_to_keep={keep!r} keeps no step"):
      topka2a_jax.CheckpointManager(tmp_path / "root", mesh, max_to_keep=keep)
  afile = tmp_path / "afile"
  afile.write_text("")
  with pytest.raises(NotADirectoryError, match="is a file, not a directory"):
    topka2a_jax.CheckpointManager(afile, mesh)
  with topka2a_jax.CheckpointManager(tmp_path / "root", mesh) as manager:
    for step in (-1, 1.5, "7", None, True):
      with pytest.raises(ValueError, match="step must be a non-negative int"):
        manager.save(step, state)
    manager.save(np.int64(3), state)
  with topka2a_jax.CheckpointManager(tmp_path / "root", mesh) as fresh:
    assert fresh.all_steps() == [3]


def _manager_layout(directory, step):
  """The layout description a CheckpointManager keeps beside a step's state."""
  found = [p for p in (Path(directory) / str(step) / "layout").rglob("*")
           if p.is_file() and p.read_bytes().lstrip().startswith(b"{")]
  assert len(found) == 1, found
  return found[0]


def test_a_manager_step_without_fingerprints_is_refused_unless_it_is_older(tmp_path,
                                                                         mesh):
  import json
  state = resumable.train(resumable.fresh(mesh), mesh, range(2))
  with topka2a_jax.CheckpointManager(tmp_path, mesh, async_save=False) as manager:
    manager.save(1, state)
  path = _manager_layout(tmp_path, 1)
  layout = json.loads(path.read_text())
  assert layout["version"] == checkpoint.LAYOUT_VERSION and "fingerprints" in layout
  del layout["fingerprints"]  # a flipped byte in the key does the same
  path.write_text(json.dumps(layout))
  with topka2a_jax.CheckpointManager(tmp_path, mesh) as manager:
    with pytest.raises(ValueError, match="topka2a_layout.json|layout.* is corrupted"):
      manager.restore(resumable.fresh(mesh))  # the manifest sees the edit
    (tmp_path / "1" / integrity.MANIFEST_FILE).unlink()  # and loses its manifest
    with pytest.warns(UserWarning, match="no topka2a_manifest.json"), pytest.raises(
        ValueError, match="lacks the arrays' fingerprints"):
      manager.restore(resumable.fresh(mesh))
    del layout["version"]  # as an older version wrote it
    path.write_text(json.dumps(layout))
    with pytest.warns(UserWarning, match="no topka2a_manifest.json"), pytest.warns(
        UserWarning, match="older topka2a_jax, without the arrays'"):
      restored = manager.restore(resumable.fresh(mesh))
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, restored["params"]),
                              jax.tree.map(np.asarray, state["params"]))


def test_a_manager_step_is_sealed_and_a_damaged_file_is_named(tmp_path, mesh):
  """Saved in the background; then one file of the step flipped, or deleted."""
  state = resumable.train(resumable.fresh(mesh), mesh, range(2))
  root = tmp_path / "root"
  with topka2a_jax.CheckpointManager(root, mesh) as manager:
    for step in (1, 2):
      manager.save(step, state)
  step = root / "2"
  topka2a_jax.checkpoint.verify(step)  # the manifest lists every file
  files = sorted(p.relative_to(step) for p in step.rglob("*")
                 if p.is_file() and p.name != integrity.MANIFEST_FILE)
  data = max(files, key=lambda name: (step / name).stat().st_size)
  damaged = [data, _manager_layout(root, 2).relative_to(step),
             Path("state") / "_METADATA"]
  for i, name in enumerate(damaged):
    for how in ("flipped", "deleted"):
      copy = tmp_path / f"copy{i}{how}"
      shutil.copytree(root, copy)
      if how == "flipped":
        _flip_byte(copy / "2" / name)
      else:
        (copy / "2" / name).unlink()
      problem = "is corrupted" if how == "flipped" else "is missing"
      with topka2a_jax.CheckpointManager(copy, mesh) as manager, pytest.raises(
          ValueError, match=f"checkpoint file .*{name.name} {problem}"):
        manager.restore(resumable.fresh(mesh))
  # A step without its manifest (an older version's): Orbax's error, named.
  (step / integrity.MANIFEST_FILE).unlink()
  (step / "state" / "_METADATA").unlink()
  with topka2a_jax.CheckpointManager(root, mesh) as manager, pytest.warns(
      UserWarning, match="cannot be checked"), pytest.raises(
          ValueError, match=f"{step} cannot be read: .* missing or damaged"):
    manager.restore(resumable.fresh(mesh), step=2)
  with topka2a_jax.CheckpointManager(root, mesh) as manager:  # step 1 still loads
    restored = manager.restore(resumable.fresh(mesh), step=1)
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, restored),
                              jax.tree.map(np.asarray, state))


def test_a_seal_cut_short_leaves_the_step_restorable_and_a_damaged_one_points_back(
    tmp_path, mesh, monkeypatch):
  """The disk fills up while the manifest is written: the arrays are intact."""
  state = resumable.train(resumable.fresh(mesh), mesh, range(2))
  real_replace = os.replace

  def disk_full_at_the_seal(source, target):
    if Path(target).name == integrity.MANIFEST_FILE:
      raise OSError(28, "No space left on device")
    return real_replace(source, target)

  manager = topka2a_jax.CheckpointManager(tmp_path, mesh, async_save=False)
  manager.save(1, state)
  monkeypatch.setattr(os, "replace", disk_full_at_the_seal)
  with pytest.raises(OSError, match="No space left"):
    manager.save(2, state)
  with pytest.raises(OSError, match="No space left"):  # still full: sealed again
    manager.close()
  monkeypatch.setattr(os, "replace", real_replace)
  left = sorted(p.name for p in (tmp_path / "2").iterdir())
  assert "layout" in left and not [name for name in left if "manifest" in name], left
  with topka2a_jax.CheckpointManager(tmp_path, mesh) as fresh:
    assert fresh.latest_step() == 2
    with pytest.warns(UserWarning, match="cannot be checked"):
      restored = fresh.restore(resumable.fresh(mesh))
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, restored),
                              jax.tree.map(np.asarray, state))
  # A manifest left empty (by an older version): the error names the step before.
  (tmp_path / "2" / integrity.MANIFEST_FILE).write_text("")
  with topka2a_jax.CheckpointManager(tmp_path, mesh) as fresh, pytest.raises(
      ValueError, match=r"step 2: .*manifest.* is corrupted.*earlier steps \[1\]: "
                        r"restore\(like, step=1\)"):
    fresh.restore(resumable.fresh(mesh))


SAVE_INTO_A_READ_ONLY_ROOT = """
import sys
import time
import jax, jax.numpy as jnp, topka2a_jax
mesh = jax.make_mesh((2,), ("data",))
manager = topka2a_jax.CheckpointManager(sys.argv[1], mesh)  # saves in the background
try:
  manager.save(1, {"w": jnp.ones((8, 8))})
except OSError as error:
  print("refused:", error, flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a read-only file system")
def test_a_save_into_a_read_only_root_is_refused_and_the_process_exits(tmp_path):
  root = tmp_path / "mounted"
  root.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(root)],
                    capture_output=True, check=False).returncode:
    pytest.skip("cannot mount a tmpfs here")
  try:
    done = subprocess.run(
        [sys.executable, "-c", SAVE_INTO_A_READ_ONLY_ROOT, str(root)],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
  finally:
    subprocess.run(["umount", str(root)], check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "refused: cannot write to" in done.stdout and "nothing was written" in done.stdout


def test_a_mismatch_names_the_shape_each_side_needs(tmp_path, mesh):
  """Saved on 8 devices with a (16, 64) leaf, restored on 4 into a (32, 64) one:
  both residuals are (128, 64) as global arrays, which alone says nothing."""
  small = sub_mesh(4)
  tx = optax.chain(topka2a_jax.topka2a(0.05, min_size=0), optax.sgd(0.1))

  def state_of(shape, on):
    params = jax.device_put({"w": np.zeros(shape, np.float32)})
    return {"params": params, "opt_state": topka2a_jax.init(tx, params, on)}

  with topka2a_jax.CheckpointManager(tmp_path, mesh, async_save=False) as manager:
    manager.save(1, state_of((16, 64), mesh))
  with topka2a_jax.CheckpointManager(tmp_path, small) as manager, pytest.raises(
      ValueError, match=r"saved as float32\[128, 64\] on 8 devices; the state to "
      r"restore into holds float32\[128, 64\] on 4, which on 8 devices would have "
      r"been saved as float32\[256, 64\]"):
    manager.restore(state_of((32, 64), small))


@pytest.mark.parametrize("state, match", [
    (None, "holds no array"),
    ({"params": {"w": jnp.ones(4)}, "step": 3.0}, r"leaf \['step'\] is a float, not a JAX array"),
], ids=["None", "a-python-float"])
def test_a_state_that_cannot_be_saved_is_refused_before_anything_is_written(
    tmp_path, mesh, state, match):
  directory = tmp_path / "ckpt"
  with pytest.raises(ValueError, match=match):
    topka2a_jax.save(directory, state, mesh)
  assert not directory.exists()
  with topka2a_jax.CheckpointManager(tmp_path / "root", mesh) as manager:
    with pytest.raises(ValueError, match=match):
      manager.save(1, state)
    assert manager.all_steps() == []


@pytest.mark.parametrize("new", [8, 4, 3])
def test_local_steps_restored_mid_round_deliver_the_rounds_mean_progress(tmp_path, new):
  """Saved two steps into a round of four on 8 devices, restored onto ``new``: with zero
  gradients after the restore (plain SGD inside: no motion of its own), the round's end
  moves the shared parameters by the saved local parameters' mean distance, no more."""
  tx = topka2a_jax.local_steps(optax.sgd(0.1), every=4, algorithm="dense")
  mesh = sub_mesh(8)
  state = resumable.train(resumable.fresh(mesh, tx), mesh, range(2), tx)
  assert int(state["opt_state"].step) == 2
  at_save = {k: np.asarray(v, np.float64) for k, v in state["params"].items()}
  travelled = {k: np.asarray(o, np.float64).mean(0)
               for k, o in state["opt_state"].offset.items()}
  assert max(np.abs(t).max() for t in travelled.values()) > 1e-3  # else the test is void
  topka2a_jax.save(tmp_path / "ckpt", state, mesh)
  mesh = sub_mesh(new)
  restored = topka2a_jax.restore(tmp_path / "ckpt", resumable.fresh(mesh, tx), mesh)
  step = topka2a_jax.train_step(zero_loss, tx, mesh)
  params, opt_state = restored["params"], restored["opt_state"]
  for i in range(2):
    params, opt_state, _ = step(params, opt_state, resumable.batch(i))
  assert int(opt_state.step) == 0 and int(opt_state.exchange.count) == 1
  for k, moved_to in params.items():
    np.testing.assert_allclose(np.asarray(moved_to, np.float64), at_save[k] + travelled[k],
                               rtol=0, atol=8 * np.finfo(np.float32).eps)


def test_a_local_steps_checkpoint_restored_into_another_round_length_is_refused(tmp_path):
  """Saved mid-round by ``every=4``; the user rebuilds with ``every=8``: refused, naming both."""
  mesh = sub_mesh(8)
  saved_by = topka2a_jax.local_steps(optax.sgd(0.1), every=4, algorithm="dense")
  state = resumable.train(resumable.fresh(mesh, saved_by), mesh, range(2), saved_by)
  with topka2a_jax.CheckpointManager(tmp_path / "root", mesh) as manager:
    manager.save(2, state)
    manager.wait_until_finished()
    other = topka2a_jax.local_steps(optax.sgd(0.1), every=8, algorithm="dense")
    with pytest.raises(ValueError, match=r"saved by local_steps\(\.\.\., every=4\) and is "
                       r"restored into the state of local_steps\(\.\.\., every=8\).*2 steps "
                       r"in.*Build the optimizer with every=4"):
      manager.restore(resumable.fresh(mesh, other))
    restored = manager.restore(resumable.fresh(mesh, saved_by))  # the right one still loads
  assert int(restored["opt_state"].step) == 2 and int(restored["opt_state"].every) == 4


def test_rounds_that_shorten_go_on_shortened_after_a_restore(tmp_path):
  """``every={0: 2, 4: 1}``, saved after 5 steps (into the rounds of one step) and
  restored into a fresh state: two more steps end two rounds, as in the run that was
  not interrupted (five rounds in seven steps; rounds of 2 throughout would make three),
  and land on its shared parameters."""
  tx = topka2a_jax.local_steps(optax.sgd(0.1), every={0: 2, 4: 1}, algorithm="dense")
  mesh = sub_mesh(8)
  whole = resumable.train(resumable.fresh(mesh, tx), mesh, range(7), tx)
  saved = resumable.train(resumable.fresh(mesh, tx), mesh, range(5), tx)
  topka2a_jax.save(tmp_path / "ckpt", saved, mesh)
  restored = topka2a_jax.restore(tmp_path / "ckpt", resumable.fresh(mesh, tx), mesh)
  resumed = resumable.train(restored, mesh, range(5, 7), tx)
  assert int(whole["opt_state"].exchange.count) == 5
  assert int(resumed["opt_state"].exchange.count) == 5
  for k, want in whole["params"].items():
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(np.asarray(resumed["params"][k], np.float64), want, rtol=0,
                               atol=8 * np.finfo(np.float32).eps * max(1.0, np.abs(want).max()))
