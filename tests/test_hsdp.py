"""Hybrid sharding (HSDP): parameters split over ``fsdp`` inside a node, the exchange over ``data``.

PyTorch's HYBRID_SHARD and MaxText's DCN-data x ICI-fsdp layout: the batch is
split over both axes, XLA reduces the gradient over ``fsdp`` (inside the
node) as for any sharded parameter, and the compressed exchange runs over
``data`` (between nodes), each device on its own piece. The reference is a
plain ``jax.jit`` Adam step on the same mesh: XLA's own reductions.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax

SPECS = {"w1": P(None, "fsdp"), "w2": P("fsdp", None)}
STEPS = 20


@pytest.fixture(scope="module")
def mesh():
  return jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)


def _loss(params, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def _params(mesh):
  params = {"w1": jax.random.normal(jax.random.key(0), (16, 256)) / 4,
            "w2": jax.random.normal(jax.random.key(1), (256, 4)) / 16}
  return jax.tree.map(lambda p, s: jax.device_put(p, NamedSharding(mesh, s)), params, SPECS)


def _batch(mesh):
  x = jax.random.normal(jax.random.key(2), (512, 16))
  return jax.device_put((x, jnp.sin(x[:, :4])), NamedSharding(mesh, P(("data", "fsdp"))))


PLAIN_TX = optax.adam(1e-2)


@jax.jit
def _plain_step(params, state, batch):
  """Adam under jax.jit: XLA all-reduces over data and reduces over fsdp itself."""
  loss, grads = jax.value_and_grad(_loss)(params, batch)
  updates, state = PLAIN_TX.update(grads, state, params)
  return optax.apply_updates(params, updates), state, loss


def _plain_jit(mesh):
  step = _plain_step
  params, batch = _params(mesh), _batch(mesh)
  state, losses = PLAIN_TX.init(params), []
  for _ in range(STEPS):
    params, state, loss = step(params, state, batch)
    losses.append(float(loss))
  return params, losses


def _ours(mesh, **options):
  tx = optax.chain(topka2a_jax.topka2a(0.01, min_size=0, **options), optax.adam(1e-2))
  params, batch = _params(mesh), _batch(mesh)
  state = topka2a_jax.init(tx, params, mesh, param_specs=SPECS)
  step = topka2a_jax.train_step(_loss, tx, mesh, param_specs=SPECS)
  losses = []
  for _ in range(STEPS):
    params, state, loss = step(params, state, batch)
    losses.append(float(loss))
  return params, losses, state


def test_dense_over_data_follows_a_plain_jit_step(mesh):
  expected, expected_losses = _plain_jit(mesh)
  params, losses, _ = _ours(mesh, algorithm="dense")
  for name, value in params.items():
    assert value.sharding.is_equivalent_to(NamedSharding(mesh, SPECS[name]), value.ndim)
    # Twenty Adam steps of float32 roundings in another order: m / sqrt(v)
    # turns a gradient's last-bit difference into a step's, on O(1) values;
    # where a gradient is near zero the step's direction itself moves by a
    # part in 1e3 or so (6e-5 on one entry of 4096 on some CPUs).
    np.testing.assert_allclose(value, expected[name], rtol=0,
                               atol=1024 * np.finfo(np.float32).eps, err_msg=name)
  np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)


def _bytes_over_data(mesh, lowered) -> int:
  """Bytes a device sends per step over ``data`` alone (collectives over both axes aside)."""
  report = topka2a_jax.comm_report(lowered, mesh=mesh)
  return int(sum(row.bytes for row in report.collectives if tuple(row.axes) == ("data",)))


def test_the_8_bit_default_before_adam_ends_on_the_plain_steps_loss(mesh):
  _, expected_losses = _plain_jit(mesh)
  _, losses, state = _ours(mesh)
  assert losses[-1] == pytest.approx(expected_losses[-1], rel=1e-3)
  # What it sends between nodes: the 8-bit codes (an all-to-all and an
  # all-gather) and a flag, against XLA's all-reduce of the whole gradient.
  tx = optax.chain(topka2a_jax.topka2a(0.01, min_size=0), optax.adam(1e-2))
  params, batch = _params(mesh), _batch(mesh)
  step = topka2a_jax.train_step(_loss, tx, mesh, param_specs=SPECS)
  ours = step.lower(params, topka2a_jax.init(tx, params, mesh, param_specs=SPECS), batch)
  plain = _plain_step.lower(params, PLAIN_TX.init(params), batch)
  assert _bytes_over_data(mesh, plain) == 15_360
  assert _bytes_over_data(mesh, ours) == 4_110
  # Each device keeps the residual of its own piece: 1/fsdp of every parameter.
  residuals = state[0].residuals
  assert residuals["w1"].sharding.spec == P("data", "fsdp")
  assert {shard.data.shape for shard in residuals["w1"].addressable_shards} == {(16, 128)}
  assert {shard.data.shape for shard in residuals["w2"].addressable_shards} == {(128, 4)}
