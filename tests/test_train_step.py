"""The jit-level step: the same as a hand-written shard_map step, and on a 2-D mesh.

References: the usage guide's hand-written shard_map step (written out here), the
dense mean gradient computed on one device, and NumPy sums of what was sent
and what stays behind.
"""

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax


def mlp_loss(params, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def mlp_problem(seed=0):
  rng = np.random.default_rng(seed)
  params = {"w1": rng.normal(size=(16, 256)).astype(np.float32) / 4,
            "w2": rng.normal(size=(256, 4)).astype(np.float32) / 16}
  x = rng.normal(size=(512, 16)).astype(np.float32)
  return params, (x, np.sin(x[:, :4]))


def hand_written(tx, mesh, params, batches, loss_fn=mlp_loss):
  """The usage guide's shard_map step: every step's (params, state, loss)."""
  state = topka2a_jax.init(tx, params, mesh)
  specs = topka2a_jax.state_specs(state)

  def step(params, opt_state, batch):
    local = lax.pcast(params, "data", to="varying")
    loss, grads = jax.value_and_grad(loss_fn)(local, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, "data")

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
                              out_specs=(P(), specs, P())))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  history = []
  for batch in batches:
    params, state, loss = run(params, state,
                              jax.device_put(batch, NamedSharding(mesh, P("data"))))
    history.append(jax.tree.map(np.asarray, (params, state, loss)))
  return history


def minibatches(batch, count, size=64):
  x, y = batch
  return [(x[i * size:(i + 1) * size], y[i * size:(i + 1) * size])
          for i in range(count)]


def test_twenty_steps_bitwise_as_the_hand_written_step(mesh, train_steps):
  params, data = mlp_problem()
  batches = (minibatches(data, 8) * 3)[:20]  # 20 steps, 64 samples each
  tx = optax.chain(topka2a_jax.topka2a(0.01, algorithm="topka2a", mesh=mesh),
                   optax.adam(1e-2))
  theirs = hand_written(tx, mesh, params, batches)
  ours = train_steps(tx, mesh, mlp_loss, params, batches, donate=True)
  assert len(ours) == 20
  for mine, reference in zip(ours, theirs):
    chex.assert_trees_all_equal(mine, reference)
  assert ours[-1][2] < ours[0][2]  # and it trains


def test_state_from_tx_init_is_topka2a_jax_init(mesh):
  params, _ = mlp_problem()
  tx = optax.chain(topka2a_jax.topka2a(0.05, mesh=mesh, min_size=0), optax.adam(1e-3))
  plain = optax.chain(topka2a_jax.topka2a(0.05, min_size=0), optax.adam(1e-3))
  made, placed = tx.init(params), topka2a_jax.init(plain, params, mesh)
  assert jax.tree.structure(made) == jax.tree.structure(placed)
  chex.assert_trees_all_equal(made, placed)
  for a, b in zip(jax.tree.leaves(made[0]), jax.tree.leaves(placed[0])):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


def test_micro_batches_exchange_the_mean_of_their_gradients(mesh):
  # Reference: each device's 4 micro-batch gradients, added in order and
  # divided by 4, through the hand-written step's exchange.
  params, data = mlp_problem(1)
  batches = minibatches(data, 3, size=128)

  def mean_of_micro_gradients(p, batch):
    x, y = batch
    grads = [jax.grad(mlp_loss)(p, (x[i * 4:(i + 1) * 4], y[i * 4:(i + 1) * 4]))
             for i in range(4)]
    total = functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), grads)
    return jax.tree.map(lambda g: g / 4, total)

  for density, algorithm in ((1.0, "dense"), (0.05, "topka2a")):
    tx = optax.chain(topka2a_jax.topka2a(density, algorithm=algorithm, mesh=mesh),
                     optax.sgd(0.1))
    state = tx.init(params)
    specs = topka2a_jax.state_specs(state)

    def step(p, s, batch, tx=tx):
      grads = mean_of_micro_gradients(lax.pcast(p, "data", to="varying"), batch)
      updates, s = tx.update(grads, s, p)
      return optax.apply_updates(p, updates), s

    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
                                out_specs=(P(), specs)))
    theirs = (jax.device_put(params, NamedSharding(mesh, P())), state)
    ours = (params, tx.init(params))
    accumulate = topka2a_jax.train_step(mlp_loss, tx, mesh, micro_batches=4)
    for batch in batches:
      theirs = run(*theirs, jax.device_put(batch, NamedSharding(mesh, P("data"))))
      ours = accumulate(*ours, batch)[:2]
      chex.assert_trees_all_equal(ours, theirs)


def test_micro_batches_exchange_once_per_step(mesh):
  params, data = mlp_problem()
  tx = optax.chain(topka2a_jax.topka2a(0.05, algorithm="topka2a", mesh=mesh, fusion=1),
                   optax.sgd(0.1))
  counts = []
  for micro in (1, 4):
    lowered = topka2a_jax.train_step(mlp_loss, tx, mesh, micro_batches=micro).lower(
        params, tx.init(params), minibatches(data, 1, size=128)[0])
    counts.append(topka2a_jax.comm_report(lowered).count_of("all-to-all"))
  assert counts[0] == counts[1] == 2  # one per weight's bucket


def test_on_cpus_no_bucket_is_split_off_to_overlap_the_backward_pass(mesh):
  """XLA's CPU backend runs collectives in line (benchmarks/overlap.py).

  Given the backward pass's estimate, the planner splits this MLP's
  gradient into two sparse buckets, so that the first can travel while the
  backward pass computes; on CPUs the step plans one, as with no estimate.
  """
  sizes = (1024, 2048, 2048, 512)
  params = {f"w{i}": jnp.zeros(shape)
            for i, shape in enumerate(itertools.pairwise(sizes))}

  def loss(params, x):
    for i in range(len(sizes) - 1):
      x = jnp.tanh(x @ params[f"w{i}"])
    return jnp.mean(x ** 2)

  batch = jnp.zeros((8 * 32, sizes[0]))

  def exchanges(**options):
    tx = optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh, selection="exact", **options),
                     optax.sgd(0.1))  # the plan does not depend on the selection
    step = topka2a_jax.train_step(loss, tx, mesh)
    lowered = step.lower(params, tx.init(params), batch)
    return step, topka2a_jax.comm_report(lowered).count_of("all-to-all")

  step, planned = exchanges()
  estimate = step.backward_seconds(params, batch)
  assert estimate > 0
  assert planned == 1 < exchanges(backward_seconds=estimate)[1] == 2


def test_per_device_keys_are_folded_in_and_reproducible(mesh):
  params, data = mlp_problem()
  tx = optax.chain(topka2a_jax.topka2a(0.1, mesh=mesh), optax.sgd(0.1))

  def loss_fn(p, batch, key):
    return mlp_loss(p, batch), jax.random.uniform(key, (3,))

  step = topka2a_jax.train_step(loss_fn, tx, mesh, has_aux=True, micro_batches=2,
                                donate=False)
  key = jax.random.key(7)
  state = tx.init(params)
  batch = minibatches(data, 1)[0]
  *_, draws = step(params, state, batch, key)
  *_, again = step(params, state, batch, key)
  # Device i, micro-batch m draws with fold_in(fold_in(key, i), m); the
  # metrics are their mean.
  want = np.mean([jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, i), m),
                                     (3,)) for i in range(8) for m in range(2)], 0)
  np.testing.assert_allclose(draws, want, rtol=1e-6)
  np.testing.assert_array_equal(again, draws)


def test_metrics_average_floats_and_sum_integers(mesh):
  params, data = mlp_problem()
  tx = optax.chain(topka2a_jax.topka2a(0.1, mesh=mesh), optax.sgd(0.1))

  def loss_fn(p, batch):
    x, y = batch
    return mlp_loss(p, batch), {"mean_x": jnp.mean(x), "positive": jnp.sum(y > 0)}

  batch = minibatches(data, 1)[0]
  _, _, loss, metrics = topka2a_jax.train_step(loss_fn, tx, mesh, has_aux=True)(
      params, tx.init(params), batch)
  np.testing.assert_allclose(metrics["mean_x"], batch[0].mean(), rtol=1e-5)
  assert int(metrics["positive"]) == int((batch[1] > 0).sum())
  np.testing.assert_allclose(loss, mlp_loss(params, batch), rtol=1e-5)


def test_inside_a_larger_jit_and_donation(mesh):
  params, data = mlp_problem()
  batch = minibatches(data, 1)[0]
  tx = optax.chain(topka2a_jax.topka2a(0.05, mesh=mesh), optax.adam(1e-2))
  top = topka2a_jax.train_step(mlp_loss, tx, mesh)
  kept = topka2a_jax.train_step(mlp_loss, tx, mesh, donate=False)

  @jax.jit
  def two_steps(params, state, batch):
    params, state, _ = kept(params, state, batch)
    return kept(params, state, batch)

  state = tx.init(params)
  placed = jax.device_put(params, NamedSharding(mesh, P()))
  nested = two_steps(placed, state, batch)
  assert not jax.tree.leaves(state)[0].is_deleted()  # not donated
  once = top(placed, state, batch)
  assert jax.tree.leaves(placed)[0].is_deleted()  # donated
  # The same steps, fused into one program: equal up to float32 rounding at
  # the parameters' scale (XLA may fuse the update into its neighbours).
  chex.assert_trees_all_close(nested, top(*once[:2], batch), rtol=0,
                              atol=8 * np.finfo(np.float32).eps)


def test_a_state_that_holds_the_parameters_themselves_is_donated_safely(mesh):
  """optax.contrib.prodigy keeps params0, the very buffers of the parameters: donating
  them twice crashed the process. The steps equal those that donate nothing."""
  params, data = mlp_problem()
  batch = minibatches(data, 1)[0]
  tx = optax.chain(topka2a_jax.topka2a(0.05, mesh=mesh), optax.contrib.prodigy())
  runs = []
  for donate in (True, False):
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    state = tx.init(placed)
    assert state[1].params0["w1"] is placed["w1"]  # one buffer, twice in the inputs
    step = topka2a_jax.train_step(mlp_loss, tx, mesh, donate=donate)
    for _ in range(2):
      placed, state, _ = step(placed, state, batch)
    runs.append(jax.tree.map(np.asarray, (placed, state)))
  chex.assert_trees_all_equal(*runs)


# A 4 x 2 mesh with automatic axes; parameters sharded over "model" by
# device_put alone, as pjit-style code does, and one replicated over it.
SPECS = {"w": P(None, "model"), "b": P("model"), "v": P("model", None), "c": P()}


def mesh_loss(params, batch):
  x, t = batch
  h = jnp.tanh(x @ params["w"] + params["b"])
  return jnp.mean((h @ params["v"] + params["c"] - t) ** 2)


@pytest.fixture(scope="module")
def auto_mesh():
  return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def sharded_problem():
  rng = np.random.default_rng(5)
  params = {"w": rng.normal(size=(16, 64)).astype(np.float32) / 4,
            "b": rng.normal(size=64).astype(np.float32) / 4,
            "v": rng.normal(size=(64, 8)).astype(np.float32) / 8,
            "c": rng.normal(size=8).astype(np.float32) / 8}
  batches = [(rng.normal(size=(32, 16)).astype(np.float32),
              rng.normal(size=(32, 8)).astype(np.float32)) for _ in range(3)]
  return params, batches


def placed_on(mesh, params):
  return {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}


def dense_mean_gradient(params, batch):
  """The mean over the 4 data slices of each slice's gradient, on one device."""
  x, t = batch
  grads = [jax.grad(mesh_loss)(params, (x[i * 8:(i + 1) * 8], t[i * 8:(i + 1) * 8]))
           for i in range(4)]
  return jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *grads)


def test_2d_density_one_is_adam_on_the_dense_mean_gradient(auto_mesh, sharded_problem):
  params, batches = sharded_problem
  tx = optax.chain(topka2a_jax.topka2a(1.0, min_size=0), optax.adam(1e-2))
  placed = placed_on(auto_mesh, params)
  state = tx.init(placed)  # the mesh comes from the parameters' shardings
  step = topka2a_jax.train_step(mesh_loss, tx, auto_mesh)
  reference, ref_state = params, optax.adam(1e-2).init(params)
  for batch in batches:
    placed, state, _ = step(placed, state, batch)
    updates, ref_state = optax.adam(1e-2).update(
        dense_mean_gradient(reference, batch), ref_state, reference)
    reference = optax.apply_updates(reference, updates)
    for k in params:
      np.testing.assert_allclose(placed[k], reference[k], rtol=0, atol=1e-6)
  for k, p in placed.items():
    assert p.sharding.is_equivalent_to(NamedSharding(auto_mesh, SPECS[k]), p.ndim)


def test_2d_sparse_loses_nothing_and_keeps_shard_sized_residuals(
    auto_mesh, sharded_problem):
  params, batches = sharded_problem
  tx = optax.chain(topka2a_jax.topka2a(0.1, min_size=0), optax.sgd(1.0))
  placed = placed_on(auto_mesh, params)
  state = tx.init(placed)
  step = topka2a_jax.train_step(mesh_loss, tx, auto_mesh)
  owed = {k: np.zeros(v.shape) for k, v in params.items()}
  for batch in batches:
    before = jax.tree.map(np.asarray, placed)
    grads = dense_mean_gradient(before, batch)
    placed, state, _ = step(placed, state, batch)
    for k, g in grads.items():
      sent = 4 * (before[k].astype(np.float64) - np.asarray(placed[k]))  # sgd(1.0)
      residual = np.asarray(state[0].residuals[k], np.float64)
      left = residual.reshape(4, *g.shape).sum(0)  # one block per data index
      np.testing.assert_allclose(sent + left, 4 * g + owed[k], rtol=1e-5, atol=1e-5)
      owed[k] = left
  for k, residual in state[0].residuals.items():
    # Each device holds the residual of its parameter shard only.
    shard_bytes = placed[k].addressable_shards[0].data.nbytes
    assert {s.data.nbytes for s in residual.addressable_shards} == {shard_bytes}
    assert shard_bytes == params[k].nbytes // (1 if k == "c" else 2)


@pytest.mark.slow
def test_2d_exchange_adds_no_collective_over_model(auto_mesh, sharded_problem):
  params, batches = sharded_problem

  def model_axis_collectives(algorithm, density):
    tx = optax.chain(topka2a_jax.topka2a(density, algorithm=algorithm, min_size=0),
                     optax.adam(1e-3))
    placed = placed_on(auto_mesh, params)
    lowered = topka2a_jax.train_step(mesh_loss, tx, auto_mesh).lower(
        placed, tx.init(placed), batches[0])
    report = topka2a_jax.comm_report(lowered, mesh=auto_mesh)
    return [(r.kind, r.axes, r.count, r.bytes) for r in report.collectives
            if "model" in r.axes], report

  dense, _ = model_axis_collectives("dense", 1.0)
  for algorithm in ("topka2a", "topka2a_sparse", "allgather"):
    sparse, report = model_axis_collectives(algorithm, 0.05)
    assert sparse == dense
    assert report.count_of(axis="data") > 0
  assert ("all-reduce", ("model",), 1, 2 * 1 / 2 * 8 * 8 * 4) in dense  # h @ v's sum


def test_2d_inside_a_larger_jit_with_param_specs(auto_mesh, sharded_problem):
  params, batches = sharded_problem
  tx = optax.chain(topka2a_jax.topka2a(0.1, min_size=0), optax.sgd(0.1))
  placed = placed_on(auto_mesh, params)
  state = tx.init(placed)
  top = topka2a_jax.train_step(mesh_loss, tx, auto_mesh, donate=False)
  inner = topka2a_jax.train_step(mesh_loss, tx, auto_mesh, param_specs=SPECS,
                                 donate=False)
  batch = jax.device_put(batches[0], NamedSharding(auto_mesh, P("data")))
  want = top(placed, state, batch)
  got = jax.jit(inner)(placed, state, batch)
  chex.assert_trees_all_equal(got, want)


EMPTY_LEAF_OPTIMIZERS = {
    "topka2a": lambda: optax.chain(topka2a_jax.topka2a(0.1, min_size=0), optax.sgd(0.1)),
    "compress_updates": lambda: topka2a_jax.compress_updates(optax.adam(1e-2), density=0.1,
                                                             min_size=0),
    "onebit": lambda: topka2a_jax.compress_updates(optax.adam(1e-2), algorithm="onebit",
                                                   min_size=0),
    "powersgd": lambda: optax.chain(topka2a_jax.topka2a(algorithm="powersgd", rank=2),
                                    optax.sgd(0.1)),
    "sharded_optimizer": lambda: topka2a_jax.sharded_optimizer(optax.adam(1e-2), density=0.1,
                                                               min_size=0),
}


@pytest.mark.parametrize("name", list(EMPTY_LEAF_OPTIMIZERS))
def test_a_parameter_with_no_elements_passes_through(mesh, train_steps, name):
  """A leaf of 0 elements (a layer sized 0 by a config) gets an empty update."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 16)).astype(np.float32)
  y = np.sin(x[:, :4])
  params = {"w": rng.normal(size=(16, 4)).astype(np.float32) / 4,
            "none": np.zeros((0,), np.float32), "empty": np.zeros((3, 0), np.float32)}

  def loss(p, batch):
    return (jnp.mean((batch[0] @ p["w"] - batch[1]) ** 2) + jnp.sum(p["none"])
            + jnp.sum(p["empty"]))

  history = train_steps(EMPTY_LEAF_OPTIMIZERS[name](), mesh, loss, params, [(x, y)] * 5)
  last_params, _, last_loss = history[-1]
  assert last_params["none"].shape == (0,) and last_params["empty"].shape == (3, 0)
  assert last_loss < history[0][2]


def test_extra_arguments_reach_the_optimizer_and_bad_ones_are_refused(mesh):
  def update(updates, state, params=None, *, scale=1.0, **extra):
    del params, extra
    return jax.tree.map(lambda u: u * scale, updates), state

  scaled = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
  tx = optax.chain(topka2a_jax.topka2a(algorithm="dense"), optax.sgd(0.1), scaled)
  loss = lambda p, x: jnp.mean((x @ p["w"] - 1.0) ** 2)
  params = jax.device_put({"w": jnp.zeros((8, 2))}, NamedSharding(mesh, P()))
  step = topka2a_jax.train_step(loss, tx, mesh, donate=False)
  batch = jnp.ones((16, 8))
  whole, _, _ = step(params, tx.init(params), batch)
  half, _, _ = step(params, tx.init(params), batch, scale=jnp.float32(0.5))
  np.testing.assert_allclose(np.asarray(half["w"]), 0.5 * np.asarray(whole["w"]),
                             rtol=1e-6)
  with pytest.raises(ValueError, match="names starting 'topka2a_' are the library's"):
    step(params, tx.init(params), batch, topka2a_param_specs=jnp.ones(()))
  with pytest.raises(TypeError, match="extra argument 'scale' holds a function"):
    step(params, tx.init(params), batch, scale=lambda: 0.5)
