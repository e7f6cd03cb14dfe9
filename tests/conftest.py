"""Gives the test process 8 emulated CPU devices before JAX's backend starts."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

NUM_DEVICES = 8


@pytest.fixture(scope="session")
def mesh():
  """All 8 devices on one data-parallel axis, "data"."""
  assert jax.device_count() == NUM_DEVICES, "XLA_FLAGS were set too late"
  return jax.make_mesh((NUM_DEVICES,), ("data",))
