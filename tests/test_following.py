"""The exchange's form follows the optimizer after it in its chain.

References, independent of the planner: dense training's final loss on the
README's program (an ``algorithm="dense"`` chain, the mean gradient by
``lax.pmean``), the bytes of the dense chain's compiled step
(:func:`topka2a_jax.comm_report`), and the kinds of optax's own optimizers
written out by hand.
"""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import topka2a_jax
from topka2a_jax._src.transforms import following


def loss_fn(params, batch):
  """The README's model: an MLP fitted to sin(x) on its first four inputs."""
  x, y = batch
  return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def readme_problem():
  params = {"w1": jax.random.normal(jax.random.key(0), (16, 256)) / 4,
            "w2": jax.random.normal(jax.random.key(1), (256, 4)) / 16}
  x = jax.random.normal(jax.random.key(2), (512, 16))
  return params, (x, jnp.sin(x[:, :4]))


def train(tx, mesh, steps=100):
  """The README's loop: the last loss, and the bytes each device sends a step."""
  params, batch = readme_problem()
  state, step = tx.init(params), topka2a_jax.train_step(loss_fn, tx, mesh)
  sent = topka2a_jax.comm_report(step.lower(params, state, batch)).total_bytes
  loss = None
  for _ in range(steps):
    params, state, loss = step(params, state, batch)
  return loss if loss is None else float(loss), sent


def kind_after(*optimizers):
  """The kind the exchange reads, as a chain's update hands it over."""
  seen = []

  def update(updates, state, params=None):
    seen.append(following.kind_of(following.follower(update)))
    return updates, state

  tx = optax.chain(optax.GradientTransformation(lambda p: (), update), *optimizers)
  tx.update({"w": jnp.ones(3)}, tx.init({"w": jnp.ones(3)}), {"w": jnp.ones(3)})
  return seen[0]


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)


@pytest.mark.parametrize("optimizer, kind", [
    (optax.adam(1e-3), "adaptive"), (optax.adam(SCHEDULE), "adaptive"),
    (optax.adamw(1e-3), "adaptive"), (optax.nadam(1e-3), "adaptive"),
    (optax.lion(1e-3), "adaptive"), (optax.adafactor(1e-3), "adaptive"),
    (optax.rmsprop(1e-3), "adaptive"), (optax.adagrad(1e-2), "adaptive"),
    (optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), "adaptive"),
    (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), "adaptive"),
    (optax.sgd(0.1, momentum=0.9), "momentum"),
    (optax.sgd(0.1, momentum=0.9, nesterov=True), "momentum"),
    (optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1, momentum=0.9)),
     "momentum"),
    (optax.sgd(0.1), "plain"), (optax.sgd(SCHEDULE), "plain"),
    (optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)), "plain"),
    (optax.GradientTransformation(lambda p: (), lambda u, s, p=None: (u, s)), "unknown"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_the_kinds_of_optax_optimizers(optimizer, kind):
  assert kind_after(optimizer) == kind


def test_nested_chains_and_a_transform_called_alone():
  # What follows in the inner chain and in the outer one both count.
  inner_probe = []

  def update(updates, state, params=None):
    inner_probe.append(following.kind_of(following.follower(update)))
    return updates, state

  probe = optax.GradientTransformation(lambda p: (), update)
  tx = optax.chain(optax.chain(probe, optax.clip_by_global_norm(1.0)), optax.adam(1e-3))
  tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))
  probe.update({"w": jnp.ones(2)}, ())  # alone: nothing follows
  assert inner_probe == ["adaptive", "plain"]


def test_the_chain_frames_are_optax_chains():
  # follower() reads the members a chain's init and update close over.
  chain = optax.chain(optax.identity(), optax.sgd(0.1))
  for fn, field in ((chain.init, "init_fns"), (chain.update, "update_fns")):
    assert following._CHAIN_FRAMES[fn.__code__] == field
    assert field in fn.__code__.co_freevars


@pytest.mark.parametrize("lr", [0.01, 0.05, 0.1])
def test_the_headline_line_before_momentum_sgd_trains_as_dense(mesh, lr):
  # A top-k here ended at 14.28 (lr 0.05) and 1545 (lr 0.1) where dense
  # momentum SGD reaches 0.0315 and 0.0194.
  dense, _ = train(optax.chain(topka2a_jax.topka2a(algorithm="dense", mesh=mesh),
                               optax.sgd(lr, momentum=0.9)), mesh)
  headline, _ = train(optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh),
                                  optax.sgd(lr, momentum=0.9)), mesh)
  assert headline < 2 * dense


def test_the_headline_line_before_adam_trains_as_dense(mesh):
  dense, _ = train(optax.chain(topka2a_jax.topka2a(algorithm="dense", mesh=mesh),
                               optax.adam(1e-2)), mesh)
  headline, _ = train(optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh),
                                  optax.adam(1e-2)), mesh)
  assert headline < 1.25 * dense


@pytest.mark.parametrize("optimizer, low, high", [
    (optax.adam(1e-3), 0.10, 0.35), (optax.sgd(0.1), 0.0, 0.10)], ids=["adam", "sgd"])
def test_the_headline_line_sends_a_share_of_the_dense_chains_bytes(mesh, optimizer, low,
                                                                   high):
  def sent(algorithm, density):
    tx = optax.chain(topka2a_jax.topka2a(density, algorithm=algorithm, network="eth1",
                                         mesh=mesh), optimizer)
    return train(tx, mesh, steps=0)[1]

  assert low <= sent("auto", 0.01) / sent("dense", None) <= high


def test_an_explicit_top_k_before_adam_is_kept_and_warned_once(mesh):
  tx = optax.chain(topka2a_jax.topka2a(0.01, algorithm="topka2a_sparse", mesh=mesh),
                   optax.adam(1e-3))
  params, batch = readme_problem()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state = topka2a_jax.init(tx, params, mesh)
    step = topka2a_jax.train_step(loss_fn, tx, mesh)
    for _ in range(2):
      params, state, _ = step(params, state, batch)
  said = [str(w.message) for w in caught if "adaptive optimizer" in str(w.message)]
  assert len(said) == 1
  assert "+44%" in said[0] and "Leave algorithm= out" in said[0]
  sent = topka2a_jax.comm_report(step.lower(params, state, batch)).total_bytes
  _, dense = train(optax.chain(topka2a_jax.topka2a(algorithm="dense", mesh=mesh),
                               optax.adam(1e-3)), mesh, steps=0)
  assert sent < 0.05 * dense  # still the top-k it asked for


def test_the_defaults_before_adam_or_sgd_warn_nothing(mesh):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for optimizer in (optax.adam(1e-3), optax.sgd(0.1, momentum=0.9), optax.sgd(0.1)):
      train(optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh), optimizer), mesh, steps=1)


def test_an_optimizer_it_cannot_classify_gets_the_safe_form_and_one_line(mesh):
  def my_update(updates, state, params=None):
    return jax.tree.map(lambda g: -0.05 * g, updates), state

  tx = optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh),
                   optax.GradientTransformation(lambda p: (), my_update))
  with pytest.warns(UserWarning, match=r"does not know the optimizer.*my_update"):
    _, unknown = train(tx, mesh, steps=1)
  _, coded = train(optax.chain(topka2a_jax.topka2a(algorithm="quantized_8_8_fine",
                                                   mesh=mesh), optax.sgd(0.05)), mesh,
                   steps=0)
  assert unknown == coded
