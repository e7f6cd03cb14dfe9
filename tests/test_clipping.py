"""Global-norm clipping beside the exchange: after it clips the mean; before it, a warning.

Reference: NumPy's mean of the devices' gradients, clipped by its global
norm, against which both orders run at density 1.0 (every entry sent).
"""

import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import topka2a_jax

LEARNING_RATE = 0.5
MAX_NORM = 1.0


def loss_fn(params, batch):
  """Device i's gradient is its row of the batch, one row per device."""
  return jnp.sum(params["w"] * batch[0]) + jnp.sum(params["b"] * batch[0, :3])


def sgd(clip_first: bool, mesh) -> optax.GradientTransformation:
  clip, exchange = optax.clip_by_global_norm(MAX_NORM), topka2a_jax.topka2a(1.0, mesh=mesh)
  first, second = (clip, exchange) if clip_first else (exchange, clip)
  return optax.chain(first, second, optax.sgd(LEARNING_RATE))


def one_step(tx, mesh, rows):
  params = {"w": jnp.zeros(16), "b": jnp.zeros(3)}
  step = topka2a_jax.train_step(loss_fn, tx, mesh)
  new, _, _ = step(params, tx.init(params), jnp.asarray(rows))
  return np.concatenate([np.asarray(new["b"]), np.asarray(new["w"])])


def clipped(grad: np.ndarray) -> np.ndarray:
  return grad * min(1.0, MAX_NORM / np.linalg.norm(grad))


def device_rows(seed=0):
  """Per-device gradients of norms about 1 to 8: clipping changes most of them."""
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(8, 16)) * np.arange(1, 9)[:, None] / 4).astype(np.float32)


def gradient(row: np.ndarray) -> np.ndarray:
  return np.concatenate([row[:3], row])  # (b, w), as one_step concatenates them


def test_clipping_after_the_exchange_clips_the_mean(mesh):
  rows = device_rows()
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the recommended order warns of nothing
    got = one_step(sgd(clip_first=False, mesh=mesh), mesh, rows)
  want = -LEARNING_RATE * clipped(np.mean([gradient(r) for r in rows], 0))
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_clipping_before_the_exchange_warns_and_clips_each_device(mesh):
  rows = device_rows()
  with pytest.warns(UserWarning, match=r"before topka2a_jax.topka2a.*Clip after the "
                    r"exchange") as caught:
    got = one_step(sgd(clip_first=True, mesh=mesh), mesh, rows)
  assert caught[0].filename == __file__  # names the user's line
  want = -LEARNING_RATE * np.mean([clipped(gradient(r)) for r in rows], 0)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  mean_clipped = -LEARNING_RATE * clipped(np.mean([gradient(r) for r in rows], 0))
  assert np.abs(got - mean_clipped).max() > 0.01  # what the warning says: not the same


@pytest.mark.parametrize("wrap", ["skip_nonfinite", "nested chain"])
def test_the_warning_finds_the_order_inside_wrappers(mesh, wrap):
  tx = (topka2a_jax.skip_nonfinite(sgd(clip_first=True, mesh=mesh)) if wrap == "skip_nonfinite"
        else optax.chain(optax.clip_by_global_norm(MAX_NORM),
                         optax.chain(topka2a_jax.topka2a(0.01), optax.adam(1e-3))))
  with pytest.warns(UserWarning, match="clip_by_global_norm runs before"):
    topka2a_jax.init(tx, {"w": jnp.zeros(16)}, mesh)


def test_clipping_inside_compress_updates_does_not_warn(mesh):
  tx = topka2a_jax.compress_updates(
      optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adam(1e-3)), density=0.01, mesh=mesh)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    topka2a_jax.train_step(loss_fn, tx, mesh)


def test_nnx_train_step_warns_on_its_first_call(mesh):
  model = nnx.Linear(16, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, sgd(clip_first=True, mesh=mesh), wrt=nnx.Param)
  train = topka2a_jax.nnx_train_step(lambda m, x: jnp.mean(m(x)), mesh)
  batch = jnp.ones((8, 16))
  with pytest.warns(UserWarning, match="clip_by_global_norm runs before"):
    train(model, optimizer, batch)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # once per optimizer, not every step
    train(model, optimizer, batch)


def test_the_optax_internals_the_warning_reads_are_still_there():
  """A chain is its update's code, closing over its members' updates in order.

  The warning (and sharded_optimizer's refusal) read optax.chain this way; an
  optax release that changes it fails here, not silently.
  """
  from topka2a_jax._src.transforms.clipping import chained, transform_names

  clip, exchange = optax.clip_by_global_norm(1.0), topka2a_jax.topka2a(0.01)
  [members] = list(chained(optax.chain(clip, exchange).update))
  assert len(members) == 2  # each wrapped for extra args, in the chain's order
  assert "clip_by_global_norm" in set(transform_names(members[0]))
  assert "topka2a" in set(transform_names(members[1]))
  assert "topka2a" not in set(transform_names(members[0]))
