"""Flax NNX: nnx.Optimizer and an nnx.jit step through nnx_train_step.

References: the functional train_step on the same parameters (the digits
example's model), and NumPy statistics of each device's slice of the batch.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import train_digits
from cases import nnx_against_functional
from flax import nnx

import topka2a_jax


def digits_loss(model, batch):
  x, y = batch
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def sgd(mesh):
  return optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh),
                     optax.sgd(train_digits.LEARNING_RATE,
                               momentum=train_digits.MOMENTUM))


@pytest.mark.slow
def test_digits_through_nnx_jit_is_the_functional_run(mesh):
  task = train_digits.make_task()
  model = train_digits.CNN(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, sgd(mesh), wrt=nnx.Param)
  train = topka2a_jax.nnx_train_step(digits_loss, mesh)

  @nnx.jit
  def step(model, optimizer, batch):
    return train(model, optimizer, batch)

  graphdef, params = nnx.split(task.model(0))  # the same parameters, as a pytree
  tx = sgd(mesh)
  state = tx.init(params)
  functional = topka2a_jax.train_step(
      lambda params, batch: task.loss(nnx.merge(graphdef, params), batch), tx, mesh)
  ours, theirs = task.batches(0, 128), task.batches(0, 128)
  for _ in range(60):
    loss = step(model, optimizer, next(ours))
    params, state, want = functional(params, state, next(theirs))
    np.testing.assert_array_equal(loss, want)
  chex.assert_trees_all_equal(
               nnx.as_pure(nnx.state(model, nnx.Param)), nnx.as_pure(params))
  accuracy = task.evaluate(model)
  assert accuracy == task.evaluate(nnx.merge(graphdef, params)) > 0.8
  assert int(optimizer.step[...]) == 60


class Noisy(nnx.Module):
  """A linear layer, batch norm and dropout: state besides the parameters."""

  def __init__(self, rngs):
    self.linear = nnx.Linear(6, 4, rngs=rngs)
    self.norm = nnx.BatchNorm(4, momentum=0.9, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.drop(self.norm(self.linear(x)))


def noisy_loss(model, x):
  out = model(x)
  return jnp.mean(out ** 2), {"kept": model.drop(jnp.ones(64))}


def noisy_run(mesh, x, steps=1):
  model = Noisy(nnx.Rngs(0, dropout=1))
  tx = optax.chain(topka2a_jax.topka2a(0.5, mesh=mesh, min_size=0), optax.sgd(0.1))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  train = nnx.jit(topka2a_jax.nnx_train_step(noisy_loss, mesh, has_aux=True))
  for _ in range(steps):
    loss, metrics = train(model, optimizer, x)
  return model, loss, metrics


def test_batch_statistics_are_averaged_and_dropout_differs_per_device(mesh):
  x = np.random.default_rng(3).normal(size=(32, 6)).astype(np.float32)
  before = Noisy(nnx.Rngs(0, dropout=1))
  hidden = np.asarray(before.linear(x)).reshape(8, 4, 4)  # per device
  model, _, metrics = noisy_run(mesh, x)
  np.testing.assert_allclose(model.norm.mean[...], 0.1 * hidden.mean(1).mean(0),
                             rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(model.norm.var[...],
                             0.9 + 0.1 * hidden.var(1).mean(0), rtol=1e-5)
  # Each device drops its own entries: their mean is neither 0 nor 2 everywhere.
  kept = np.asarray(metrics["kept"])
  assert ((kept > 0) & (kept < 2)).any()
  again, _, repeat = noisy_run(mesh, x)  # and the same on every run
  np.testing.assert_array_equal(repeat["kept"], kept)
  same = nnx.Not(nnx.RngKey)  # keys are typed; the rest compares as arrays
  chex.assert_trees_all_equal(nnx.state(again, same),
               nnx.state(model, same))


def test_exchange_after_adam_and_optimizer_without_a_mesh(mesh):
  model = train_digits.CNN(nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"does not know the mesh.*mesh=mesh"):
    nnx.Optimizer(model, optax.chain(topka2a_jax.topka2a(0.01), optax.adam(1e-3)),
                  wrt=nnx.Param)
  late = optax.chain(optax.adam(1e-3), topka2a_jax.topka2a(0.01, mesh=mesh))
  with pytest.raises(ValueError, match=r"scale_by_adam\) before the topka2a exchange.*Put "
                                       "the exchange first"):
    nnx.Optimizer(model, late, wrt=nnx.Param)


class Sharded(nnx.Module):
  """Two layers annotated for a "model" axis, as Flax's sharding guide writes them."""

  def __init__(self, rngs):
    init, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
    self.up = nnx.Linear(16, 64, rngs=rngs,
                         kernel_init=nnx.with_partitioning(init, (None, "model")),
                         bias_init=nnx.with_partitioning(zeros, ("model",)))
    self.down = nnx.Linear(64, 8, rngs=rngs,
                           kernel_init=nnx.with_partitioning(init, ("model", None)),
                           bias_init=nnx.with_partitioning(zeros, (None,)))

  def __call__(self, x):
    return self.down(jnp.tanh(self.up(x)))


@pytest.mark.slow
def test_annotated_model_on_a_2d_mesh_inside_nnx_jit(mesh):
  # Inside nnx.jit the arrays cannot say how they are split; the annotations
  # can, so the run is the functional step's on the same parameters (which
  # reads the arrays' shardings), and the exchange stays off "model".
  mesh2d = jax.make_mesh((4, 2), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def loss(model, batch):
    x, t = batch
    return jnp.mean((model(x) - t) ** 2)

  tx = optax.chain(topka2a_jax.topka2a(0.1, min_size=0), optax.adam(1e-2))
  with jax.set_mesh(mesh2d):
    model = Sharded(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  graphdef, params = nnx.split(model)
  params = jax.tree.map(jnp.copy, nnx.as_pure(params))
  state = tx.init(params)
  functional = topka2a_jax.train_step(
      lambda p, batch: loss(nnx.merge(graphdef, p), batch), tx, mesh2d)
  train = topka2a_jax.nnx_train_step(loss, mesh2d)
  step = nnx.jit(lambda model, optimizer, batch: train(model, optimizer, batch))
  rng = np.random.default_rng(4)
  for _ in range(3):
    batch = (rng.normal(size=(32, 16)).astype(np.float32),
             rng.normal(size=(32, 8)).astype(np.float32))
    step(model, optimizer, batch)
    params, state, _ = functional(params, state, batch)
  chex.assert_trees_all_equal(
               nnx.as_pure(nnx.state(model, nnx.Param)), params)
  report = topka2a_jax.comm_report(train.lower(model, optimizer, batch), mesh=mesh2d)
  assert [(r.kind, r.axes) for r in report.collectives if "model" in r.axes] == [
      ("all-reduce", ("data", "model")), ("all-reduce", ("model",))]


EXCHANGE_STATES = {
    # nnx.Optimizer's state holds PowerSGD's Q:
    "powersgd": lambda mesh: optax.chain(topka2a_jax.topka2a(
        algorithm="powersgd", rank=2, mesh=mesh, min_size=0), optax.sgd(0.1)),
    # ... or every device's Adam state, whose signs the exchange sends:
    "onebit of adam": lambda mesh: topka2a_jax.compress_updates(
        optax.adam(1e-2), algorithm="onebit", mesh=mesh, min_size=0),
    # ... or the gradient in 4 bits, both phases' roundings kept per device:
    "quantized_4_8, then adam": lambda mesh: optax.chain(topka2a_jax.topka2a(
        algorithm="quantized_4_8", mesh=mesh, min_size=0), optax.adam(1e-2)),
    # ... or every device's Adam step, rotated before its 4-bit code:
    "rotated_4_8 of adam": lambda mesh: topka2a_jax.compress_updates(
        optax.adam(1e-2), algorithm="rotated_4_8", mesh=mesh, min_size=0),
    # ... or local steps: every device's Adam state and offset, one round of two:
    "local steps of adam": lambda mesh: topka2a_jax.local_steps(
        optax.adam(1e-2), every=2, mesh=mesh, min_size=0),
}


@pytest.mark.parametrize("name", list(EXCHANGE_STATES))
def test_exchange_state_through_nnx_optimizer_is_the_functional_run(mesh, name):
  """nnx.Optimizer holds the exchange's state; three steps equal train_step's, bitwise."""
  nnx_against_functional(lambda: EXCHANGE_STATES[name](mesh), mesh, 3, wrap=nnx.jit)


def scaled_by(name="scale"):
  """A transform that multiplies the updates by its extra argument ``name``."""
  def update(updates, state, params=None, **extra):
    del params
    factor = extra.get(name, 1.0)
    return jax.tree.map(lambda u: u * factor, updates), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def test_a_step_is_nnx_optimizers_own_update_of_the_mean_gradient(mesh):
  """Against flax's own path: nnx.grad of the whole batch, then optimizer.update."""
  def make():
    return nnx.Linear(16, 4, rngs=nnx.Rngs(0))

  def loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)

  model, reference = make(), make()
  optimizer = nnx.Optimizer(model, optax.chain(
      topka2a_jax.topka2a(algorithm="dense", mesh=mesh), optax.adam(1e-2), scaled_by()),
      wrt=nnx.Param)
  flax_optimizer = nnx.Optimizer(reference, optax.chain(optax.adam(1e-2), scaled_by()),
                                 wrt=nnx.Param)
  train = topka2a_jax.nnx_train_step(loss, mesh)
  rng = np.random.default_rng(1)
  for scale in (1.0, 0.5, 0.25):
    batch = (rng.normal(size=(32, 16)).astype(np.float32),
             rng.normal(size=(32, 4)).astype(np.float32))
    train(model, optimizer, batch, scale=jnp.float32(scale))
    flax_optimizer.update(reference, nnx.grad(loss)(reference, batch),
                          scale=jnp.float32(scale))
  chex.assert_trees_all_close(nnx.as_pure(nnx.state(model, nnx.Param)),
                              nnx.as_pure(nnx.state(reference, nnx.Param)),
                              rtol=1e-5, atol=1e-6)
  assert int(optimizer.step[...]) == int(flax_optimizer.step[...]) == 3
  chex.assert_trees_all_close(nnx.as_pure(optimizer.opt_state[1][0].nu),
                              nnx.as_pure(flax_optimizer.opt_state[0][0].nu),
                              rtol=1e-5, atol=1e-9)
