"""sharded_optimizer: the inner optimizer on each device's shard, as the plain chain.

The reference is ``optax.chain(topka2a(..., fusion=1), inner)``, whose
exchange the other test modules check against NumPy; ``fusion=1`` gives it
the same buckets (one per leaf). The parameters agree to 1e-6, not bitwise:
in the plain chain XLA may fuse the update's last multiply with the
parameter add into one rounding (an FMA), while the sharded step multiplies
on the shard before the all-gather and adds after it.
"""

import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax
from topka2a_jax.sharded_optimizer import shard_length

DEVICES = 8


def _params():
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.normal(size=(300, 17)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(17,)), jnp.float32),
          "scale": jnp.float32(0.5)}


def _loss(params, x):
  return jnp.mean(jnp.tanh(x @ params["w"] + params["b"]) ** 2) * params["scale"]


def _batches(steps):
  rng = np.random.default_rng(1)
  return [jnp.asarray(rng.normal(size=(64, 300)), jnp.float32) for _ in range(steps)]


def _both(inner, train_steps, mesh, steps=20, **options):
  """Parameters after every step: plain chain, then sharded."""
  options = {"algorithm": "topka2a", "min_size": 100, **options}
  plain = optax.chain(topka2a_jax.topka2a(0.05, fusion=1, **options), inner)
  sharded = topka2a_jax.sharded_optimizer(inner, 0.05, **options)
  batches = _batches(steps)
  return (train_steps(plain, mesh, _loss, _params(), batches),
          train_steps(sharded, mesh, _loss, _params(), batches))


@pytest.mark.parametrize("inner", [
    optax.adam(1e-2),
    optax.sgd(0.1, momentum=0.9),
    optax.adamw(1e-2, weight_decay=0.1, mask=lambda p: jax.tree.map(
        lambda x: x.ndim > 1, p)),
], ids=["adam", "momentum", "adamw-masked"])
def test_twenty_steps_match_the_plain_chain(inner, train_steps, mesh):
  plain, sharded = _both(inner, train_steps, mesh)
  for (p1, _, l1), (p2, _, l2) in zip(plain, sharded):
    for name in p1:
      np.testing.assert_allclose(p2[name], p1[name], rtol=0, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
  assert np.abs(plain[-1][0]["w"] - _params()["w"]).max() > 1e-2  # it trained


def test_the_mask_sees_the_leaves_dimensions(train_steps, mesh):
  """Weight decay masked off 1-D leaves: a bias with zero gradient stays put."""
  inner = optax.adamw(1e-2, weight_decay=0.5, mask=lambda p: jax.tree.map(
      lambda x: x.ndim > 1, p))
  tx = topka2a_jax.sharded_optimizer(inner, 0.05, algorithm="topka2a")
  params = {"w": jnp.ones((64, 8)), "b": jnp.ones(8)}
  loss = lambda p, x: jnp.sum(x @ p["w"]) * 0.0
  (params, _, _), = train_steps(tx, mesh, loss, params, [jnp.ones((8, 64))])
  np.testing.assert_array_equal(params["b"], np.ones(8))
  assert (params["w"] < 1).all()


def test_warmup_and_dense_match_the_plain_chain(train_steps, mesh):
  plain, sharded = _both(optax.adam(1e-2), train_steps, mesh, steps=6,
                         warmup_steps=3)
  for (p1, s1, _), (p2, s2, _) in zip(plain, sharded):
    np.testing.assert_allclose(p2["w"], p1["w"], rtol=0, atol=1e-6)
    assert int(s1[0].count) == int(s2.exchange.count)


def test_state_bytes_per_device_are_a_shard(mesh):
  params = {"w": jnp.zeros((1001, 33)), "b": jnp.zeros(33), "scale": jnp.zeros(())}
  inner = optax.adam(1e-3)
  plain = optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh), inner).init(params)[1]
  sharded = topka2a_jax.sharded_optimizer(inner, 0.01, mesh=mesh).init(params).inner
  device = mesh.devices.flat[0]

  def on_device(tree):
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree)
               for shard in leaf.addressable_shards if shard.device == device)

  padding = sum(4 * 2 * shard_length(p.size, DEVICES) for p in jax.tree.leaves(params))
  count_bytes = 4  # Adam's step count, kept on every device
  assert on_device(sharded) <= on_device(plain) / DEVICES + padding + count_bytes
  assert on_device(sharded) < on_device(plain) / 4


@pytest.mark.parametrize("inner, named", [
    (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), "clip_by_global_norm"),
    (optax.lamb(1e-3), "scale_by_trust_ratio"),
    (optax.adafactor(1e-3), "scale_by_factored_rms"),
], ids=["clip", "lamb", "adafactor"])
def test_transforms_that_reduce_are_refused_by_name(inner, named):
  with pytest.raises(ValueError, match=named) as error:
    topka2a_jax.sharded_optimizer(inner, 0.01)
  assert "optax.chain(topka2a_jax.topka2a" in str(error.value)


@pytest.mark.parametrize("inner", [optax.lion(1e-3), optax.adamw(1e-3),
                                   optax.sgd(optax.cosine_decay_schedule(0.1, 100))])
def test_element_wise_transforms_are_accepted(inner, mesh):
  tx = topka2a_jax.sharded_optimizer(inner, 0.01, mesh=mesh)
  assert tx.init({"w": jnp.zeros((16, 16))}) is not None


def test_exchanges_without_an_owner_phase_are_refused():
  with pytest.raises(ValueError, match="'allgather' has no such phase"):
    topka2a_jax.sharded_optimizer(optax.adam(1e-3), 0.01, algorithm="allgather")


def test_a_model_axis_is_refused_with_the_alternative():
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  tx = topka2a_jax.sharded_optimizer(optax.adam(1e-3), 0.01, mesh=mesh)
  with pytest.raises(ValueError, match="also has axes \\['model'\\]"):
    tx.init({"w": jnp.zeros((8, 8))})


def test_a_hand_written_shard_map_step(mesh):
  """tx.update inside the user's own shard_map, specs from state_specs."""
  tx = topka2a_jax.sharded_optimizer(optax.sgd(1.0), 1.0, mesh=mesh, min_size=0)
  params = {"w": jnp.zeros((10, 3))}
  state = tx.init(params)
  specs = topka2a_jax.state_specs(state)
  rows = jnp.arange(DEVICES * 30.0).reshape(DEVICES, 10, 3)

  @jax.jit
  @jax.shard_map(mesh=mesh, in_specs=(P("data"), specs), out_specs=(P(), specs))
  def step(grads, state):
    return tx.update({"w": grads[0]}, state)

  updates, state = step(jax.device_put(rows, NamedSharding(mesh, P("data"))), state)
  np.testing.assert_allclose(updates["w"], -np.asarray(rows).mean(0))  # lax.pmean's


SCRIPT = Path(__file__).with_name("resumable.py")


def _run(*args, processes=1):
  """tests/resumable.py with the sharded optimizer, in fresh processes."""
  launcher = [] if processes == 1 else [
      "-m", "topka2a_jax.launch", "-n", str(processes), "--devices-per-process",
      str(DEVICES // processes)]
  done = subprocess.run([sys.executable, *launcher, str(SCRIPT), "--sharded",
                         *map(str, args)], capture_output=True, text=True,
                        timeout=300, check=False)
  assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]


def _parameters(path):
  """The parameters (b, w) a run of resumable.py wrote: its last two arrays."""
  saved = np.load(path)
  return [saved[name] for name in
          sorted(saved.files, key=lambda name: int(name.split("_")[1]))[-2:]]


@pytest.mark.parametrize("devices", [4, 3])
def test_saved_on_eight_resumed_on_fewer_in_a_fresh_process(tmp_path, devices):
  """Adam's sharded moments are re-sharded: training goes on as it would on 8."""
  _run(devices, "straight", tmp_path / "straight.npz")
  _run(devices, "first", tmp_path / "ckpt")
  _run(devices, "resume", tmp_path / "ckpt", tmp_path / "resumed.npz")
  straight, resumed = _parameters(tmp_path / "straight.npz"), _parameters(
      tmp_path / "resumed.npz")
  for want, got in zip(straight, resumed):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.abs(straight[1]).max() > 1e-2  # they trained


@pytest.mark.slow
def test_two_processes_train_as_one(tmp_path):
  """Each process holds 4 of the 8 devices and their shards; gloo between them."""
  _run(8, "straight", tmp_path / "one.npz")
  _run(8, "straight", tmp_path / "two.npz", processes=2)
  for want, got in zip(_parameters(tmp_path / "one.npz"),
                       _parameters(tmp_path / "two.npz")):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_resharding_by_hand():
  saved = np.arange(1.0, 9.0, dtype=np.float32).reshape(4, 1, 2)  # 7 entries, 1 padding
  np.testing.assert_array_equal(
      topka2a_jax.checkpoint.reshard(saved, (3, 1, 3))[:, 0],
      [[1, 2, 3], [4, 5, 6], [7, 8, 0]])
  np.testing.assert_array_equal(topka2a_jax.checkpoint.reshard(
      np.array([5, 5, 5, 5], np.int32), (2,)), [5, 5])  # a step count


def test_through_nnx_optimizer_as_the_functional_step(mesh):
  """nnx.Optimizer + nnx_train_step trains as train_step does on the same parameters."""
  nnx = pytest.importorskip("flax.nnx")
  tx = lambda: topka2a_jax.sharded_optimizer(optax.adam(1e-2), 0.05, mesh=mesh,
                                             min_size=16)
  model = nnx.Linear(32, 8, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(nnx.Linear(32, 8, rngs=nnx.Rngs(0)))
  optimizer = nnx.Optimizer(model, tx(), wrt=nnx.Param)
  train = topka2a_jax.nnx_train_step(lambda m, x: jnp.mean(jnp.sin(m(x))), mesh)
  functional_tx = tx()
  state = functional_tx.init(params)
  functional = topka2a_jax.train_step(
      lambda p, x: jnp.mean(jnp.sin(nnx.merge(graphdef, p)(x))), functional_tx, mesh)
  for x in _batches(5):
    loss = train(model, optimizer, x[:, :32])
    params, state, want = functional(params, state, x[:, :32])
    np.testing.assert_allclose(loss, want, rtol=1e-6)
  np.testing.assert_allclose(nnx.state(model, nnx.Param)["kernel"][...],
                             params["kernel"][...], atol=1e-6)


def test_sends_the_bytes_of_the_plain_chain(mesh):
  """comm_report: the same all-to-all and all-gather bytes as topka2a + adam."""
  options = {"algorithm": "topka2a", "min_size": 100}
  inner = optax.adam(1e-2)
  plain = optax.chain(topka2a_jax.topka2a(0.05, fusion=1, **options), inner)
  sharded = topka2a_jax.sharded_optimizer(inner, 0.05, **options)
  reports = []
  for tx in (plain, sharded):
    params = jax.device_put(_params(), NamedSharding(mesh, P()))
    step = topka2a_jax.train_step(_loss, tx, mesh, donate=False)
    reports.append(topka2a_jax.comm_report(step.lower(params, tx.init(params),
                                                      _batches(1)[0])))
  plain_report, sharded_report = reports
  assert sharded_report.bytes_of("all-to-all") == plain_report.bytes_of("all-to-all") > 0
  # The plain chain all-reduces the small leaves (b, scale) with the rest of
  # its all-reduces; the sharded step reduce-scatters them and all-gathers
  # their updates with w's: (P-1)/P of their padded entries each way.
  scattered = sharded_report.bytes_of("reduce-scatter")
  assert scattered == 4 * (DEVICES - 1) * (shard_length(17, DEVICES) + 1)
  assert (sharded_report.bytes_of("all-gather") - plain_report.bytes_of("all-gather")
          == scattered)


def test_a_non_finite_step_is_skipped_with_the_optimizer_state(mesh, exchange_steps):
  """A NaN on one device: zero updates, Adam's moments and count untouched."""
  tx = topka2a_jax.sharded_optimizer(optax.adam(0.1), 0.5, algorithm="topka2a",
                                     min_size=0)
  good = {"w": np.ones((DEVICES, 16), np.float32)}
  bad = {"w": good["w"].copy()}
  bad["w"][3, 5] = np.nan
  (_, first), (skipped_updates, skipped), (_, after) = exchange_steps(
      tx, mesh, [good, bad, good])
  np.testing.assert_array_equal(skipped_updates["w"], 0)
  chex.assert_trees_all_equal(skipped.inner, first.inner)
  assert int(skipped.exchange.nonfinite_steps) == 1
  assert int(skipped.exchange.count) == int(first.exchange.count) == 1
  assert int(after.exchange.count) == 2
  assert np.isfinite(np.asarray(after.inner[0].mu["w"])).all()
