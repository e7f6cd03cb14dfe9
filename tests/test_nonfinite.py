"""A NaN or an infinity on one device skips the step on every device alike."""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference
from cases import random_grads, residuals_of
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax
from topka2a_jax._src.transforms.nonfinite import nonfinite_on_any_device


def poisoned(grads, value, device=3, leaf="b"):
  """A copy of ``grads`` with ``value`` in one entry of one device's leaf."""
  grads = {k: g.copy() for k, g in grads.items()}
  grads[leaf][device].flat[7] = value
  return grads


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("algorithm", ["topka2a", "topka2a_sparse", "allgather"])
def test_bad_step_changes_nothing_but_the_counter(mesh, algorithm, value,
                                                  exchange_steps):
  tx = optax.chain(topka2a_jax.topka2a(0.1, algorithm=algorithm, min_size=0,
                                       fusion=1))
  first, third = random_grads(71), random_grads(73)
  history = exchange_steps(tx, mesh, [first, poisoned(random_grads(72), value), third])
  (_, before), (skipped, during), (last, after) = history
  assert all(not u.any() for u in skipped.values())  # zero updates everywhere
  for k, r in residuals_of(before).items():
    np.testing.assert_array_equal(residuals_of(during)[k], r)
  assert (int(during[0].count), int(during[0].nonfinite_steps)) == (1, 1)
  assert (int(after[0].count), int(after[0].nonfinite_steps)) == (2, 1)
  # The next step goes on as if the bad one had never come.
  _, residuals = reference.leafwise(algorithm, first, {}, 0.1)
  want, residuals = reference.leafwise(algorithm, third, residuals, 0.1)
  for k in third:
    np.testing.assert_allclose(last[k][0], want[k], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(residuals_of(after)[k], residuals[k],
                               rtol=1e-5, atol=1e-5)


def test_a_bad_step_under_onebit_is_as_if_it_never_came(mesh, exchange_steps):
  tx = optax.chain(topka2a_jax.topka2a(algorithm="onebit", min_size=0, fusion=1))
  first, third = random_grads(71), random_grads(73)
  history = exchange_steps(tx, mesh, [first, poisoned(random_grads(72), np.nan), third])
  clean = exchange_steps(tx, mesh, [first, third])
  (_, before), (skipped, during), (last, after) = history
  assert all(not u.any() for u in skipped.values())
  for k, r in residuals_of(before).items():
    np.testing.assert_array_equal(residuals_of(during)[k], r)
  assert int(after[0].nonfinite_steps) == 1
  for k in third:  # bitwise the run without the bad step
    np.testing.assert_array_equal(last[k], clean[1][0][k])
    np.testing.assert_array_equal(residuals_of(after)[k], residuals_of(clean[1][1])[k])


@pytest.mark.parametrize("algorithm", ["onebit", "quantized_4_8", "rotated_4_8"])
def test_huge_finite_gradients_are_delivered_or_skipped_never_made_nan(
    mesh, exchange_steps, algorithm):
  """Every device's entries near 1e37 (delivered) or 3e38 (their sum overflows)."""
  tx = optax.chain(topka2a_jax.topka2a(algorithm=algorithm, min_size=0, fusion=1))
  rng = np.random.default_rng(0)
  for size, applied in ((1e37, True), (3e38, False)):
    grads = [{"w": (size * (1 + 0.1 * rng.random((8, 64, 64)))).astype(np.float32)}
             for _ in range(2)]
    history = exchange_steps(tx, mesh, grads)
    for (updates, state), grad in zip(history, grads):
      assert np.isfinite(updates["w"]).all()
      assert np.isfinite(residuals_of(state)["w"]).all()
    (first, state), _ = history
    if applied:  # the first step's mean plus what is owed is the exact mean
      owed = residuals_of(state)["w"].astype(np.float64).sum(0) / 8
      want = grads[0]["w"].astype(np.float64).mean(0)
      np.testing.assert_allclose(first["w"][0].ravel() + owed, want.ravel(), rtol=1e-6)
      assert int(history[-1][1][0].nonfinite_steps) == 0
    else:
      assert not first["w"].any()
      assert int(history[-1][1][0].nonfinite_steps) == 2


def test_opting_out_lets_the_nan_through(mesh, exchange_steps):
  tx = optax.chain(topka2a_jax.topka2a(1.0, min_size=0, fusion=1,
                                       skip_nonfinite=False))
  [(updates, state)] = exchange_steps(tx, mesh, [poisoned(random_grads(74), np.nan)])
  assert np.isnan(updates["b"]).any()
  assert int(state[0].nonfinite_steps) == 0


def scaled_least_squares(params, batch):
  """Each device's loss is scaled by its own entry of ``scale`` (inf poisons it)."""
  x, scale = batch
  return jnp.mean((x @ params["w"] - 1.0) ** 2) * scale[0]


def test_wrapper_skips_the_whole_chain_bitwise(mesh, train_steps):
  tx = topka2a_jax.skip_nonfinite(
      optax.chain(topka2a_jax.topka2a(0.05, min_size=0), optax.adam(1e-2)))
  rng = np.random.default_rng(75)
  xs = [rng.normal(size=(64, 40)).astype(np.float32) for _ in range(3)]
  good = np.ones(8, np.float32)
  bad = good.copy()
  bad[5] = np.inf  # one device's loss, hence its gradient, is non-finite
  params = {"w": jnp.zeros((40, 30))}
  with_bad = train_steps(tx, mesh, scaled_least_squares, params,
                         [(xs[0], good), (xs[1], bad), (xs[2], good)])
  without = train_steps(tx, mesh, scaled_least_squares, params,
                        [(xs[0], good), (xs[2], good)])
  chex.assert_trees_all_equal(with_bad[1][0], with_bad[0][0])
  chex.assert_trees_all_equal(with_bad[2][0], without[1][0])
  inner_then, inner_now = with_bad[2][1].inner_state, without[1][1].inner_state
  chex.assert_trees_all_equal(inner_then, inner_now)
  assert [int(s.nonfinite_steps) for _, s, _ in with_bad] == [0, 1, 1]


def test_nested_wrappers_pass_one_decision_down(mesh, train_steps):
  # The inner wrapper receives the outer one's decision as an extra argument
  # and hands its own down under the same name, replacing it.
  chain = optax.chain(topka2a_jax.topka2a(0.05, min_size=0), optax.sgd(0.1))
  tx = topka2a_jax.skip_nonfinite(topka2a_jax.skip_nonfinite(chain))
  x = np.random.default_rng(76).normal(size=(64, 40)).astype(np.float32)
  good = np.ones(8, np.float32)
  bad = good.copy()
  bad[2] = np.nan
  steps = train_steps(tx, mesh, scaled_least_squares, {"w": jnp.zeros((40, 30))},
                      [(x, good), (x, bad)])
  assert [int(s.nonfinite_steps) for _, s, _ in steps] == [0, 1]
  # The outer wrapper keeps the inner state, counter included, as it was.
  assert [int(s.inner_state.nonfinite_steps) for _, s, _ in steps] == [0, 0]
  chex.assert_trees_all_equal(steps[1][0], steps[0][0])


def test_wrapper_state_specs_and_init(mesh):
  tx = topka2a_jax.skip_nonfinite(
      optax.chain(topka2a_jax.topka2a(0.05, min_size=0), optax.sgd(0.1)))
  state = topka2a_jax.init(tx, {"w": jnp.zeros((10, 10))}, mesh)
  specs = topka2a_jax.state_specs(state)
  assert specs.nonfinite_steps == P()
  assert specs.inner_state[0].residuals["w"] == P("data")
  assert specs.inner_state[0].count == P()


@pytest.mark.parametrize("value_dtype, scale", [
    (jnp.float16, 1e5),  # beyond float16's 65,504
    (jnp.float8_e4m3fn, 1e3),  # beyond float8_e4m3fn's 448
])
def test_values_beyond_the_wire_dtype_wait_in_the_residual(mesh, exchange_steps,
                                                           value_dtype, scale):
  rng = np.random.default_rng(0)
  grads = [{"w": (scale * rng.normal(size=(8, 4096))).astype(np.float32)}
           for _ in range(3)]
  zeros = {"w": np.zeros((8, 4096), np.float32)}
  tx = optax.chain(topka2a_jax.topka2a(0.05, algorithm="topka2a", min_size=0,
                                       value_dtype=value_dtype))
  history = exchange_steps(tx, mesh, grads + [zeros] * 400)
  for updates, state in history:
    assert np.isfinite(updates["w"]).all()
    assert np.isfinite(np.asarray(state[0].residuals["w"])).all()
    assert int(state[0].nonfinite_steps) == 0
  delivered = sum(np.asarray(u["w"][0], np.float64) for u, _ in history)
  owed = np.asarray(history[-1][1][0].residuals["w"], np.float64).reshape(8, -1).sum(0)
  total = sum(g["w"].astype(np.float64).sum(0) for g in grads)
  # Nothing lost: what arrived and what is still owed add up to every gradient
  # (float32 sums of values of `scale`, rounded to the wire dtype, fed back).
  np.testing.assert_allclose(8 * delivered + owed, total, rtol=0,
                             atol=1e-4 * scale)


@pytest.mark.parametrize("algorithm", ["topka2a_sparse", "topka2a", "auto"])
def test_a_float16_wire_trains_without_a_skipped_step_up_to_its_range(
    mesh, exchange_steps, algorithm):
  """Gradients up to float16's range: the owners' sums must not overflow the wire."""
  rng = np.random.default_rng(12)
  grads = [{"w": rng.uniform(-6e4, 6e4, size=(8, 4096)).astype(np.float32)}
           for _ in range(5)]
  runs = {}
  for value_dtype in (jnp.float16, None):
    tx = topka2a_jax.topka2a(0.05, algorithm=algorithm, min_size=0, network="eth1",
                             value_dtype=value_dtype)
    runs[value_dtype] = exchange_steps(tx, mesh, grads)
  total = sum(g["w"].astype(np.float64).sum(0) for g in grads)
  for value_dtype, history in runs.items():
    for updates, state in history:
      assert int(state.nonfinite_steps) == 0, value_dtype
      assert np.isfinite(updates["w"]).all()
    delivered = sum(np.asarray(u["w"][0], np.float64) for u, _ in history)
    owed = np.asarray(history[-1][1].residuals["w"], np.float64).reshape(8, -1).sum(0)
    np.testing.assert_allclose(8 * delivered + owed, total, rtol=0, atol=1e-5 * 5 * 8 * 6e4)
  if algorithm == "topka2a":  # every owner sends its whole shard back
    # The first step sends the same entries in both runs (nothing was
    # clipped), to float16's rounding of the means. (The sparse second phase
    # may pick another entry at a near-tie; the planner may price the two
    # wires apart.)
    first16, first32 = runs[jnp.float16][0][0]["w"][0], runs[None][0][0]["w"][0]
    np.testing.assert_allclose(first16, first32, rtol=0,
                               atol=1e-3 * np.abs(first32).max())


def test_float16_parameters_survive_error_feedbacks_bursts(mesh, exchange_steps):
  grads = {"w": np.full((8, 4096), 2000.0, np.float16)}
  tx = optax.chain(topka2a_jax.topka2a(0.01, algorithm="topka2a", min_size=0))
  for step, (updates, state) in enumerate(exchange_steps(tx, mesh, [grads] * 40)):
    assert updates["w"].dtype == np.float16
    assert np.isfinite(updates["w"].astype(np.float32)).all(), f"step {step}"
    assert state[0].residuals["w"].dtype == jnp.float32  # accumulates in float32


@pytest.mark.parametrize("wrapped", [False, True], ids=["alone", "in-skip_nonfinite"])
@pytest.mark.parametrize("algorithm", [None, "dense", "topka2a"])
def test_a_non_finite_step_from_finite_gradients_is_skipped_by_every_exchange(
    mesh, train_steps, algorithm, wrapped):
  """float16 parameters: Adam's eps is 0 there, so a step can be infinite or
  huge (m / sqrt(v) with v rounded to 0) from finite gradients. Inside
  skip_nonfinite, whose decision reads the gradients alone, the inner steps
  are still checked."""
  options = {} if algorithm is None else {"algorithm": algorithm}
  tx = topka2a_jax.compress_updates(
      optax.adam(1e-2), density=0.01 if algorithm == "topka2a" else None, min_size=0, **options)
  if wrapped:
    tx = topka2a_jax.skip_nonfinite(tx)
  rng = np.random.default_rng(0)
  params = {"w1": (rng.normal(size=(16, 64)) / 4).astype(np.float16),
            "w2": (rng.normal(size=(64, 4)) / 16).astype(np.float16)}

  def loss(p, batch):
    x, y = batch
    w1, w2 = p["w1"].astype(jnp.float32), p["w2"].astype(jnp.float32)
    return jnp.mean((jnp.tanh(x @ w1) @ w2 - y) ** 2)

  x = rng.normal(size=(64, 16)).astype(np.float32)
  history = train_steps(tx, mesh, loss, params, [(x, np.sin(x[:, :4]))] * 3)
  last_params, state, _ = history[-1]
  for key, before in params.items():  # nothing applied
    np.testing.assert_array_equal(last_params[key], before)
  compressed = state.inner_state if wrapped else state
  assert int(compressed.exchange.nonfinite_steps) == 3 and int(compressed.exchange.count) == 0
  assert all(np.isfinite(np.asarray(leaf, np.float32)).all()
             for leaf in jax.tree.leaves(state))
  # Adam's own count: no step reached it.
  assert int(jax.tree.leaves(compressed.inner)[0].max()) == 0


def test_where_the_exchange_skips_an_overflow_the_inner_state_is_held(mesh, exchange_steps):
  """compress_updates: finite steps of 1e38 on every device, whose sum overflows.

  The few-bit exchange skips the step; the momentum that made those steps
  must not keep them either, or the next step would send them again.
  """
  tx = topka2a_jax.compress_updates(optax.sgd(1.0, momentum=0.9), algorithm="quantized_8_8",
                                    min_size=0)
  huge = np.zeros((8, 16), np.float32)
  huge[:, 3] = 1e38
  (updates, skipped), (after_updates, _) = exchange_steps(
      tx, mesh, [{"w": huge}, {"w": np.ones((8, 16), np.float32)}])
  np.testing.assert_array_equal(updates["w"], 0)
  assert int(skipped.exchange.nonfinite_steps) == 1 and int(skipped.exchange.count) == 0
  np.testing.assert_array_equal(np.asarray(skipped.inner[0].trace["w"]), 0)
  # The next step starts from an empty momentum: -1 for every entry, to the code's rounding.
  np.testing.assert_allclose(after_updates["w"], -1.0, rtol=0, atol=1 / 127)


@pytest.mark.parametrize("eps, warns", [(1e-8, True), (1e-4, False)])
def test_float16_adam_whose_eps_rounds_to_zero_is_said_at_init(mesh, eps, warns):
  """Its steps would all be skipped; an eps float16 holds trains and says nothing."""
  params = {"w": jnp.zeros((16, 16), jnp.float16)}
  tx = topka2a_jax.compress_updates(optax.adam(1e-3, eps=eps), mesh=mesh)
  with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    topka2a_jax.init(tx, params, mesh)
  assert any("eps=1e-8 is 0 in float16" in str(w.message) and w.filename == __file__
             for w in said) == warns  # and it points at the user's call


@pytest.mark.parametrize("algorithm", ["topka2a", "dense"])
def test_finite_gradients_whose_sum_overflows_float32_are_skipped(mesh, exchange_steps,
                                                                  algorithm):
  """1e38 on each of 8 devices: the sum, 8e38, is past float32's 3.4e38."""
  tx = topka2a_jax.topka2a(0.5, algorithm=algorithm, min_size=0)
  huge = np.zeros((8, 16), np.float32)
  huge[:, 2] = 1e38
  fine = huge / 10  # 8e37 summed: within range, applied
  (skipped_updates, skipped), (applied_updates, applied) = exchange_steps(
      tx, mesh, [{"w": huge}, {"w": fine}])
  np.testing.assert_array_equal(skipped_updates["w"], 0)
  assert int(skipped.nonfinite_steps) == 1 and int(skipped.count) == 0
  np.testing.assert_allclose(applied_updates["w"][:, 2], 1e37, rtol=1e-6)
  assert int(applied.count) == 1


@pytest.mark.parametrize("make, warns", [
    (lambda mesh: topka2a_jax.topka2a(algorithm="quantized_8_8_fine", mesh=mesh), True),
    (lambda mesh: topka2a_jax.compress_updates(optax.sgd(1.0), mesh=mesh), True),
    (lambda mesh: topka2a_jax.topka2a(0.1, mesh=mesh, follows="sgd"), False),
], ids=["8-bit", "signs", "top-k"])
def test_float64_parameters_through_a_few_bit_code_are_told_its_range(mesh, make, warns):
  with jax.enable_x64():
    params = {"w": jnp.zeros((16, 16), jnp.float64)}
    with warnings.catch_warnings(record=True) as said:
      warnings.simplefilter("always")
      topka2a_jax.init(make(mesh), params, mesh)
  assert any("float64 gradients go through a few-bit code" in str(w.message)
             and w.filename == __file__ for w in said) == warns


def _nan_at(pattern, grads, device=3):
  """``grads`` (one leaf, ``(8, rows, 256)``) with NaN where ``pattern`` says, on one device."""
  grads = grads.copy()
  flat = grads[device].reshape(-1)
  if pattern == "whole rows":
    grads[device, ::7] = np.nan
  else:
    flat[{"first entry": 0, "a middle entry": flat.size // 2 + 3,
          "last entry": -1}[pattern]] = np.nan
  return grads


@pytest.mark.parametrize("pattern", ["a middle entry", "first entry", "last entry",
                                     "whole rows"])
@pytest.mark.parametrize("entries", [4096, 65536, 262144])
def test_nan_is_seen_in_a_large_float32_leaf_on_one_device(mesh, entries, pattern):
  """XLA's CPU max reduction drops NaN in float32 arrays of 4096 entries or more;
  the check must not."""
  grads = _nan_at(pattern, np.ones((8, entries // 256, 256), np.float32))

  def check(g):
    return nonfinite_on_any_device(g[0], "data")

  run = jax.jit(jax.shard_map(check, mesh=mesh, in_specs=P("data"), out_specs=P()))
  seen = run(jax.device_put(grads, NamedSharding(mesh, P("data"))))
  assert bool(seen)


@pytest.mark.parametrize("make", [
    lambda: optax.chain(topka2a_jax.topka2a(0.01, min_size=0), optax.adam(1e-3)),
    lambda: optax.chain(topka2a_jax.topka2a(0.01, min_size=0), optax.sgd(0.1)),
    lambda: topka2a_jax.skip_nonfinite(
        optax.chain(topka2a_jax.topka2a(0.01, min_size=0), optax.adam(1e-3))),
    lambda: topka2a_jax.sharded_optimizer(optax.adam(1e-3), density=0.01, min_size=0),
    lambda: topka2a_jax.compress_updates(optax.adam(1e-3), min_size=0),
], ids=["8-bit before adam", "top-k before sgd", "skip_nonfinite", "sharded_optimizer",
        "compress_updates"])
def test_one_nan_entry_in_a_large_leaf_skips_the_step_everywhere(mesh, exchange_steps, make):
  """One NaN entry of a 16 x 256 gradient on device 3: no NaN is applied or kept.

  The exchange keeps its residuals as they were; an optimizer after it in a
  plain chain still takes its step on the zero mean (momentum), so only the
  wrappers that own the optimizer's step return zeros.
  """
  rng = np.random.default_rng(5)
  good = {"w": rng.normal(size=(8, 16, 256)).astype(np.float32)}
  bad = {"w": _nan_at("a middle entry", rng.normal(size=(8, 16, 256)).astype(np.float32))}
  (_, before), (skipped, during) = exchange_steps(make(), mesh, [good, bad])
  assert np.isfinite(skipped["w"]).all()
  counted_before, counted_during = [], []
  for (path, old), new in zip(jax.tree_util.tree_leaves_with_path(before),
                              jax.tree.leaves(during)):
    name = jax.tree_util.keystr(path)
    assert np.isfinite(np.asarray(new, np.float32)).all(), name
    if "nonfinite_steps" in name:
      counted_before.append(int(np.max(old)))
      counted_during.append(int(np.max(new)))
    elif "residuals" in name:
      np.testing.assert_array_equal(np.asarray(new), np.asarray(old), err_msg=name)
  assert max(counted_during) == max(counted_before) + 1


@pytest.mark.parametrize("algorithm", ["rotated_4_4", "rotated_4_8"])
def test_a_step_of_huge_entries_leaves_a_rotated_code_finite_and_stepping(
    mesh, exchange_steps, algorithm):
  """Entries near 1e37 with random signs (under the check's 3.4e38 / 8), then ordinary steps:
  the owners' 4-bit rounding, unrotated, must not overflow into the residual."""
  rng = np.random.default_rng(0)
  grads = [{"w": (size * (1 + 0.1 * rng.random((8, 4096)))
                  * rng.choice([-1.0, 1.0], size=(1, 4096))).astype(np.float32).reshape(8, 64, 64)}
           for size in (1e37, 1.0, 1.0, 1.0)]
  tx = optax.chain(topka2a_jax.topka2a(algorithm=algorithm, min_size=0))
  history = exchange_steps(tx, mesh, grads)
  for updates, state in history:
    assert np.isfinite(residuals_of(state)["w"]).all()
    assert np.isfinite(updates["w"]).all()
  assert [int(state[0].count) for _, state in history] == [1, 2, 3, 4]
  assert int(history[-1][1][0].nonfinite_steps) == 0


@pytest.mark.parametrize("make", [
    lambda: topka2a_jax.compress_updates(optax.sgd(1.0, momentum=0.9), algorithm="dense",
                                         min_size=0),
    lambda: topka2a_jax.sharded_optimizer(optax.sgd(1.0, momentum=0.9), density=1.0,
                                          algorithm="dense", min_size=0),
], ids=["compress_updates", "sharded_optimizer"])
def test_a_skip_after_the_count_of_skips_saturates_still_holds_the_inner_state(
    mesh, exchange_steps, make):
  """A run that has skipped 2**31 - 1 steps (the count holds there, never wraps) skips
  one more, a NaN on one device, between two steps of ones: the momentum must stay as
  the first step left it, so the third step is -(0.9 + 1) everywhere."""
  tx = make()
  params = {"w": jax.ShapeDtypeStruct((16,), jnp.float32)}
  state = topka2a_jax.init(tx, params, mesh)
  saturated = jax.device_put(jnp.int32(2**31 - 1), NamedSharding(mesh, P()))
  state = state._replace(exchange=state.exchange._replace(nonfinite_steps=saturated))
  ones = np.ones((8, 16), np.float32)
  bad = ones.copy()
  bad[5, 2] = np.nan
  history = exchange_steps(tx, mesh, [{"w": ones}, {"w": bad}, {"w": ones}], state=state)
  (skipped_updates, _), (updates, after) = history[1:]
  assert int(after.exchange.nonfinite_steps) == 2**31 - 1
  np.testing.assert_array_equal(skipped_updates["w"], 0)
  np.testing.assert_allclose(updates["w"], -1.9, rtol=1e-6)
