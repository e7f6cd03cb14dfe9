"""Several processes (gloo over loopback) against one, and the launcher itself."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).parent / "multiprocess_train.py"


def run(command, **env):
  done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                        check=False, env={**os.environ, **env})
  return done


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, route, files, per_process", [
    ("topka2a", "shard_map", 25, 2), ("dense", "shard_map", 25, 2),
    ("topka2a", "train_step", 15, 2),
    ("topka2a", "two_level", 15, 4), ("topka2a_sparse", "two_level", 15, 4)])
def test_two_processes_match_one_with_all_their_devices(tmp_path, algorithm, route,
                                                        files, per_process):
  """Two processes (for two_level, each a node of the mesh) train as one."""
  one = run([sys.executable, str(SCRIPT), algorithm, str(tmp_path / "one.npz"), route],
            XLA_FLAGS=f"--xla_force_host_platform_device_count={2 * per_process}")
  assert one.returncode == 0, one.stderr[-3000:]
  two = run([sys.executable, "-m", "topka2a_jax.launch", "-n", "2",
             "--devices-per-process", str(per_process), str(SCRIPT), algorithm,
             str(tmp_path / "two.npz"), route])
  assert two.returncode == 0, two.stdout[-3000:]
  assert f"[1] 2 processes, {2 * per_process} devices" in two.stdout
  single, multi = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
  assert sorted(single.files) == sorted(multi.files) and len(single.files) == files
  for name in single.files:  # mean gradients, parameters and loss, every step
    np.testing.assert_allclose(multi[name], single[name], rtol=1e-5, atol=1e-6)


def test_launcher_stops_everyone_when_one_process_fails(tmp_path):
  script = tmp_path / "fail.py"
  script.write_text(
      "import os, sys, time\n"
      "if os.environ['TOPKA2A_PROCESS_ID'] == '1':\n"
      "    print('giving up', flush=True); sys.exit(3)\n"
      "time.sleep(60)\n")
  done = run([sys.executable, "-m", "topka2a_jax.launch", "-n", "3", str(script)])
  assert done.returncode == 3
  assert "[1] giving up" in done.stdout


def test_launcher_refuses_a_missing_script():
  done = run([sys.executable, "-m", "topka2a_jax.launch", "-n", "2", "nowhere.py"])
  assert done.returncode == 2 and "no such script: nowhere.py" in done.stderr


def test_environment_names_the_processes(monkeypatch):
  from topka2a_jax.distributed import from_environment

  for name in ("TOPKA2A_COORDINATOR", "TOPKA2A_NUM_PROCESSES", "TOPKA2A_PROCESS_ID",
               "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  assert from_environment() is None
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "host0:1234")
  assert from_environment() is None  # incomplete: left to cluster detection
  monkeypatch.setenv("JAX_NUM_PROCESSES", "16")
  monkeypatch.setenv("JAX_PROCESS_ID", "3")
  assert from_environment() == ("host0:1234", 16, 3)
  monkeypatch.setenv("TOPKA2A_COORDINATOR", "127.0.0.1:5000")
  monkeypatch.setenv("TOPKA2A_NUM_PROCESSES", "2")
  monkeypatch.setenv("TOPKA2A_PROCESS_ID", "one")
  with pytest.raises(ValueError, match="TOPKA2A_PROCESS_ID='one'.*integers"):
    from_environment()
