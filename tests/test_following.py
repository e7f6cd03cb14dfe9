"""The exchange's form follows the optimizer after it in its chain.

References, independent of the planner: dense training's final loss on the
README's program (an ``algorithm="dense"`` chain, the mean gradient by
``lax.pmean``), the bytes of the dense chain's compiled step
(:func:`topka2a_jax.comm_report`), and the kinds of optax's own optimizers
written out by hand.
"""

import functools
import logging
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import topka2a_jax
from topka2a_jax._src.planner.cost import exchange_cost
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
  probe.update({"w": jnp.ones(2)}, ())  # alone: what follows is not seen
  assert inner_probe == ["adaptive", "unknown"]


def test_the_chain_frames_are_optax_chains():
  # follower() reads the members a chain's and a named chain's init and update close over.
  chain = optax.chain(optax.identity(), optax.sgd(0.1))
  named = optax.named_chain(("a", optax.identity()), ("b", optax.sgd(0.1)))
  for fn, field in ((chain.init, "init_fns"), (chain.update, "update_fns"),
                    (named.init, "transforms"), (named.update, "transforms")):
    assert following._CHAIN_FRAMES[fn.__code__][0] == field
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
  assert "the accuracy evidence page" in said[0] and "Leave algorithm= out" in said[0]
  sent = topka2a_jax.comm_report(step.lower(params, state, batch)).total_bytes
  _, dense = train(optax.chain(topka2a_jax.topka2a(algorithm="dense", mesh=mesh),
                               optax.adam(1e-3)), mesh, steps=0)
  assert sent < 0.05 * dense  # still the top-k it asked for


BURSTS_BEFORE_ADAM = {"allgather": "top-k", "topka2a": "top-k", "topka2a_sparse": "top-k",
                      "gtopk": "top-k", "oktopk": "top-k",
                      "onebit": "signs", "onebit_4": "signs", "onebit_1": "signs",
                      "rotated_1_1": "signs"}
"""The exchanges whose error feedback hands Adam bursts, and what each sends: a
top-k, or the signs. The codes of 2 bits and more send every entry's size."""


@pytest.mark.parametrize("algorithm", sorted(topka2a_jax.collectives.ALGORITHMS))
def test_every_exchange_that_hands_adam_bursts_is_warned_of_and_no_other(mesh, algorithm):
  tx = optax.chain(topka2a_jax.topka2a(0.01, algorithm=algorithm, mesh=mesh),
                   optax.adam(1e-3))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tx.init(readme_problem()[0])
  said = [str(w.message) for w in caught if "adaptive optimizer" in str(w.message)]
  if algorithm in BURSTS_BEFORE_ADAM:
    assert len(said) == 1 and f"sends the gradient's {BURSTS_BEFORE_ADAM[algorithm]}" in said[0]
  else:
    assert not said


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


class _UpdateObject:
  """A user's update held in an object."""

  def __init__(self, inner):
    self.inner = inner

  def __call__(self, updates, state, params=None):
    return self.inner.update(updates, state, params)


class _SlottedUpdate:
  """An update whose object shows nothing: no attributes, no name."""

  __slots__ = ("inner",)

  def __init__(self, inner):
    self.inner = inner

  def __call__(self, updates, state, params=None):
    return self.inner.update(updates, state, params)


def _partial_update(updates, state, params=None, *, inner):
  return inner.update(updates, state, params)


ADAM = optax.adam(1e-3)


@pytest.mark.parametrize("optimizer, kind", [
    (optax.GradientTransformation(ADAM.init, _UpdateObject(ADAM)), "adaptive"),
    (optax.GradientTransformation(ADAM.init, functools.partial(_partial_update, inner=ADAM)),
     "adaptive"),
    (optax.GradientTransformation(ADAM.init, jax.jit(ADAM.update)), "adaptive"),
    (optax.GradientTransformation(ADAM.init, _SlottedUpdate(ADAM)), "unknown"),
    (optax.contrib.muon(1e-3), "adaptive"),
    (optax.MultiSteps(ADAM, 4).gradient_transformation(), "adaptive"),
    (optax.multi_transform({"a": ADAM, "s": optax.sgd(0.1)}, {"w": "a"}), "adaptive"),
    (optax.clip_by_global_norm(1.0), "unknown"),  # no step after it: the mean leaves the chain
    (optax.contrib.adopt(1e-3), "adaptive"), (optax.rprop(1e-3), "adaptive"),
], ids=["callable object", "partial", "jit", "slotted object", "muon", "MultiSteps",
        "multi_transform", "clip alone", "adopt", "rprop"])
def test_wrapped_optimizers_are_read_through_their_wrappers(optimizer, kind):
  assert kind_after(optimizer) == kind


def test_named_chain_is_read_as_chain_is():
  seen = []

  def update(updates, state, params=None):
    seen.append(following.kind_of(following.follower(update)))
    return updates, state

  probe = optax.GradientTransformation(lambda p: (), update)
  for tx in (optax.named_chain(("x", probe), ("opt", optax.adam(1e-3))),
             optax.named_chain(("x", optax.chain(probe)), ("opt", optax.sgd(0.1))),
             optax.chain(optax.named_chain(("x", probe)), optax.sgd(0.1, momentum=0.9)),
             optax.named_chain(("x", probe))):
    tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))
  assert seen == ["adaptive", "plain", "momentum", "unknown"]


def _sent(tx, mesh):
  return train(tx, mesh, steps=0)[1]


def test_what_cannot_be_read_gets_the_8_bit_form_and_one_warning_naming_follows(mesh):
  coded = _sent(optax.chain(topka2a_jax.topka2a(algorithm="quantized_8_8_fine", mesh=mesh),
                            optax.adam(1e-3)), mesh)
  for tx in (optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh)),  # Adam applied by hand
             optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh),
                         optax.GradientTransformation(ADAM.init, _SlottedUpdate(ADAM)))):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      assert _sent(tx, mesh) == coded
    said = [str(w.message) for w in caught if "follows=" in str(w.message)]
    assert len(said) == 1 and "every entry in 8 bits" in said[0], said


def test_an_init_and_update_that_read_apart_get_the_safe_form(mesh):
  """Adam's init with an SGD step's update: not positively plain SGD."""
  sgd = optax.sgd(0.1)
  tx = optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh),
                   optax.GradientTransformation(ADAM.init, sgd.update))
  with pytest.warns(UserWarning, match="init reads adaptive after it and its update plain"):
    sent = _sent(tx, mesh)
  assert sent == _sent(optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh), optax.adam(1e-3)),
                       mesh)


@pytest.mark.parametrize("follows, like", [
    ("sgd", optax.sgd(0.1)), ("adam", optax.adam(1e-3)),
    ("momentum", optax.sgd(0.1, momentum=0.9)), (optax.adam(1e-3), optax.adam(1e-3))],
    ids=["sgd", "adam", "momentum", "a transform"])
def test_follows_says_what_the_chain_cannot(mesh, follows, like):
  alone = optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh, follows=follows))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    sent = _sent(alone, mesh)
  assert sent == _sent(optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh), like), mesh)


@pytest.mark.parametrize("follows", ["sgd", optax.sgd(0.1)], ids=["'sgd'", "optax.sgd"])
@pytest.mark.parametrize("after, read", [
    (optax.adam(1e-2), "an adaptive optimizer"), (optax.sgd(0.1, momentum=0.9), "momentum SGD")],
    ids=["adam", "momentum"])
def test_follows_sgd_that_the_chain_contradicts_warns_naming_both(mesh, follows, after, read):
  """``follows='sgd'`` before Adam sent a top-k to Adam in silence (75x dense's loss)."""
  tx = optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh, follows=follows), after)
  with pytest.warns(UserWarning, match=r"topka2a\(follows=.*\) says plain SGD follows, but its "
                                       f"chain runs {read}.*Leave follows= out"):
    _sent(tx, mesh)
  with warnings.catch_warnings():  # what follows is plain SGD: nothing to say
    warnings.simplefilter("error")
    _sent(optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh, follows=follows),
                      optax.sgd(0.1)), mesh)


@pytest.mark.parametrize("follows, error, match", [
    ("adamw", ValueError, r"follows='adamw' names no optimizer kind.*'adam', 'momentum', 'sgd'"),
    (0.1, TypeError, r"follows= takes the optimizer after the exchange.*got float"),
])
def test_a_bad_follows_is_refused_naming_what_it_takes(follows, error, match):
  with pytest.raises(error, match=match):
    topka2a_jax.topka2a(0.01, follows=follows)


def test_under_named_chain_the_headline_line_trains_as_dense(mesh):
  """Read as plain SGD, it sent a top-k to Adam and ended 6,000x above dense."""
  dense, _ = train(optax.chain(topka2a_jax.topka2a(algorithm="dense", mesh=mesh),
                               optax.adam(1e-2)), mesh)
  named, _ = train(optax.named_chain(("exchange", topka2a_jax.topka2a(0.01, mesh=mesh)),
                                     ("adam", optax.adam(1e-2))), mesh)
  assert named < 1.25 * dense


@pytest.mark.parametrize("optimizer, algorithm", [
    (optax.adam(1e-3), "quantized_8_8_fine"), (optax.sgd(0.1, momentum=0.9), "quantized_4_8")],
    ids=["adam", "momentum"])
def test_density_may_be_left_out_where_no_top_k_is_chosen(mesh, optimizer, algorithm):
  """``topka2a(mesh=mesh)`` before Adam or momentum SGD: no error, and the bytes of the
  code it plans (the explicit algorithm's, which ignores density)."""
  def sent(**options):
    tx = optax.chain(topka2a_jax.topka2a(network="eth1", mesh=mesh, **options), optimizer)
    return train(tx, mesh, steps=0)[1]

  assert sent() == sent(algorithm=algorithm)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # and no warning either
    loss, _ = train(optax.chain(topka2a_jax.topka2a(mesh=mesh), optimizer), mesh, steps=3)
  assert np.isfinite(loss)


def test_density_left_out_before_plain_sgd_is_asked_for_naming_the_fix(mesh):
  tx = optax.chain(topka2a_jax.topka2a(mesh=mesh), optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"before plain SGD sends the top-k of each bucket, "
                     r"and needs its fraction: give density, e\.g\. topka2a\(0\.01"):
    tx.init(readme_problem()[0])
  with pytest.raises(ValueError, match="density is required with algorithm='topka2a'"):
    topka2a_jax.topka2a(algorithm="topka2a")  # an explicit top-k, as before


def test_the_warnings_point_at_the_users_line(mesh):
  """Not into the library or optax: a ``-W error`` traceback or an IDE link lands here."""
  unknown = optax.GradientTransformation(lambda p: (), lambda u, s, p=None: (u, s))
  tx = optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh), unknown)
  params, batch = readme_problem()
  step = topka2a_jax.train_step(loss_fn, tx, mesh)
  clipped = optax.chain(optax.clip_by_global_norm(1.0), topka2a_jax.topka2a(0.01, mesh=mesh),
                        optax.sgd(0.1))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step(params, tx.init(params), batch)
    topka2a_jax.train_step(loss_fn, clipped, mesh)
  said = {str(w.message).split(":")[0][:40]: w.filename for w in caught}
  assert len(said) == 2, said
  assert all(filename == __file__ for filename in said.values()), said


@pytest.mark.parametrize("follower, said", [
    (optax.adam(1e-2), r"4,096 entries in quantized_8_8_fine \(1 bucket\), 8 dense \(1 bucket\)"),
    (optax.sgd(0.1), (r"the top 1% of 4,096 entries by (allgather|topka2a|topka2a_sparse) "
                      r"\(1 bucket\), 8 dense \(1 bucket\)")),
], ids=["adam", "sgd"])
def test_what_each_bucket_sends_is_said_once_where_a_user_sees_it(mesh, caplog, monkeypatch,
                                                                   follower, said):
  """One INFO line at the first call says the candidates, one the forms the buckets
  got (WARNING is for likely mistakes): a (64, 64) weight coded or its top 1%, the
  8-entry bias (below min_size) dense. Neither again at later calls or lowerings; the
  compiled step's all-to-all and all-gather send what the named form sends."""
  from topka2a_jax._src.transforms import exchange_plan
  monkeypatch.setattr(exchange_plan, "_SAID", set())  # other tests' plans said already
  params = {"w": jnp.zeros((64, 64)), "b": jnp.zeros(8)}
  tx = optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh), follower)
  step = topka2a_jax.train_step(lambda p, x: jnp.mean((x @ p["w"] + p["b"][0] - 1) ** 2),
                                tx, mesh, donate=False)
  state, x = tx.init(params), np.ones((16, 64), np.float32)
  with caplog.at_level(logging.INFO, logger="topka2a_jax"):
    for _ in range(2):
      params, state, _ = step(params, state, x)
    report = topka2a_jax.comm_report(step.lower(params, state, x))
  records = [record for record in caplog.records if record.name == "topka2a_jax"]
  assert [record.levelno for record in records] == [logging.INFO] * 2
  lines = [record.getMessage() for record in records]
  assert lines[0].startswith("topka2a(algorithm='auto') plans each bucket among")
  form = re.search("each exchange sends .*?" + said, lines[1])
  assert form, lines[1]
  name = form.group(1) if form.groups() else "quantized_8_8_fine"
  sent = sum(row.bytes for row in report.collectives if row.kind != "all-reduce")
  assert sent == pytest.approx(exchange_cost(name, 4096, 8, 0.01).bytes)


class _UsersAdam:
  """An optimizer of the user's own class, around optax's Adam."""

  def __init__(self, learning_rate):
    self.inner = optax.adam(learning_rate)

  def init(self, params):
    return self.inner.init(params)

  def update(self, updates, state, params=None):
    return self.inner.update(updates, state, params)


class _UsersStep:
  """An optimizer of the user's own class that the library cannot read."""

  def init(self, params):
    return ()

  def update(self, updates, state, params=None):
    return jax.tree.map(lambda u: -0.1 * u, updates), state


def test_an_optimizer_of_the_users_own_class_is_read_or_named():
  """Read through its attributes; one that says nothing is named in the warning, not
  described as "nothing after it makes a step of the mean"."""
  assert kind_after(_UsersAdam(1e-3)) == "adaptive"
  assert kind_after(_UsersStep()) == "unknown"
  followed = following.Followers((_UsersStep(),), True)
  assert "does not know the optimizer after it (_UsersStep.init, _UsersStep.update)" in (
      following.unrecognised(followed))
