"""local_steps: each device trains alone for a round, then one exchange of the pseudo-gradients.

References: a NumPy model (float64) of the algorithm: per-device Adam on
given gradients, each device's distance from the shared parameters summed
over the round, the exchange model of ``tests/reference.py`` applied to the
pseudo-gradients (shared minus local) with error feedback, and an outer SGD
with momentum, written out by hand; and, through ``train_step``, local SGD
on per-device least squares with the gradient taken at each device's own
parameters, the rounds ended by the exact mean.
"""

import contextlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference
from cases import SHAPES, random_grads
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax
from topka2a_jax._src.planner.cost import exchange_cost
from topka2a_jax._src.transforms.local_steps import SKIPPED_IN_A_ROW

DEVICES = 8
B1, B2, EPS, LR = 0.9, 0.999, 0.5, 0.1
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def _close(got, want, what):
  scale = max(1.0, float(np.abs(want).max()))
  np.testing.assert_allclose(got, want, rtol=1e-5,
                             atol=64 * np.finfo(np.float32).eps * scale, err_msg=what)


class NumpyLocalSteps:
  """The algorithm in float64: Adam per device, rounds of ``every``, EF exchange, outer momentum."""

  def __init__(self, shapes, every, algorithm, density):
    # every: an int, or {starting step: length}; a round takes the length of
    # the stretch its first step falls in
    self.every = every if isinstance(every, dict) else {0: every}
    self.algorithm, self.density = algorithm, density
    self.round_start, self.rounds = 0, 0
    self.params = {k: np.zeros(s) for k, s in shapes.items()}
    self.mu = {k: np.zeros((DEVICES, *s)) for k, s in shapes.items()}
    self.nu = {k: np.zeros((DEVICES, *s)) for k, s in shapes.items()}
    self.offset = {k: np.zeros((DEVICES, *s)) for k, s in shapes.items()}
    self.trace = {k: np.zeros(s) for k, s in shapes.items()}
    self.travelled = {k: np.zeros(s) for k, s in shapes.items()}  # rounds' mean offsets
    self.residuals, self.count, self.step = {}, 0, 0

  def update(self, grads):
    self.count += 1
    for k, g in grads.items():
      self.mu[k] = B1 * self.mu[k] + (1 - B1) * g
      self.nu[k] = B2 * self.nu[k] + (1 - B2) * g.astype(np.float64) ** 2
      m = self.mu[k] / (1 - B1 ** self.count)
      v = self.nu[k] / (1 - B2 ** self.count)
      self.offset[k] = self.offset[k] - LR * m / (np.sqrt(v) + EPS)
    self.step += 1
    length = self.every[max(s for s in self.every if s <= self.round_start)]
    if self.step < length:
      return {k: np.zeros_like(p) for k, p in self.params.items()}
    self.round_start += self.step
    self.step = 0
    self.rounds += 1
    for k, o in self.offset.items():
      self.travelled[k] = self.travelled[k] + o.mean(0)
    pseudo = {k: -o for k, o in self.offset.items()}
    means, self.residuals = reference.leafwise(self.algorithm, pseudo, self.residuals,
                                               self.density)
    moved = {}
    for k, mean in means.items():
      self.trace[k] = OUTER_MOMENTUM * self.trace[k] + mean
      moved[k] = -OUTER_LR * self.trace[k]
      self.params[k] = self.params[k] + moved[k]
      self.offset[k] = np.zeros_like(self.offset[k])
    return moved


def _steps(tx, mesh, grads_per_step, params, axis="data"):
  """``tx.update(grads, state, params)`` on every device, the updates applied, per step."""
  state = topka2a_jax.init(tx, params, mesh, axis_name=axis)
  specs = topka2a_jax.state_specs(state, axis_name=axis)

  def step(grads, state, params):
    updates, state = tx.update(jax.tree.map(lambda g: g[0], grads), state, params,
                               topka2a_gradient_at="local_params")
    return updates, state, optax.apply_updates(params, updates)

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(axis), specs, P()),
                              out_specs=(P(), specs, P())))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  history = []
  for grads in grads_per_step:
    updates, state, params = run(jax.device_put(grads, NamedSharding(mesh, P(axis))),
                                 state, params)
    history.append((jax.tree.map(np.asarray, updates), state))
  return history


@pytest.mark.parametrize("every", [3, 1, {0: 2, 4: 1, 6: 3}])
def test_rounds_match_the_numpy_model(mesh, every):
  """The exact mean (dense): every update, offset, moment and count as the model's.

  A dict of round lengths: two rounds of 2 steps, two of 1, then rounds of 3.
  """
  tx = topka2a_jax.local_steps(
      optax.adam(LR, b1=B1, b2=B2, eps=EPS), every=every,
      outer=optax.sgd(OUTER_LR, momentum=OUTER_MOMENTUM), algorithm="dense")
  steps = [random_grads(seed) for seed in range(7 if isinstance(every, int) else 10)]
  model = NumpyLocalSteps(SHAPES, every, "dense", None)
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  for i, (grads, (updates, state)) in enumerate(zip(steps, _steps(tx, mesh, steps, params))):
    want = model.update(grads)
    assert int(state.step) == model.step, f"step {i}"
    assert int(state.exchange.count) == model.rounds, f"step {i}"
    for k in SHAPES:
      _close(updates[k], want[k], f"step {i} {k}")
      _close(np.asarray(state.offset[k]), model.offset[k], f"step {i} offset {k}")
      _close(np.asarray(state.inner[0].mu[k]), model.mu[k], f"step {i} mu {k}")


STATE_CODE = (17 / 16) ** 2 - 1
"""One rounding of :func:`topka2a_jax.collectives.relative_mean`'s code, relative:
half a step of float8's 3-bit mantissa on a square root, squared."""


def _within_the_code(got, values, what):
  """``got`` is the mean over axis 0 of ``values`` to relative_mean's two roundings.

  The owner adds decoded entries (each within one rounding of its own
  size), then codes the mean again: at most
  ``STATE_CODE * (2 + STATE_CODE)`` of the devices' mean magnitude apart.
  """
  bound = STATE_CODE * (2 + STATE_CODE) * np.abs(values).mean(0)
  error = np.abs(np.asarray(got, np.float64) - values.mean(0))
  assert (error <= bound + 1e-6 * np.abs(values).max()).all(), what


WITH_MOMENTS_IN_CODE = {**SHAPES, "d": (4, 160)}
"""SHAPES, whose leaves (under 512 entries) are averaged exactly, and one of 640
entries, whose moments go through the 8-bit code."""


def _averaged_like_the_model(got, values, shape, what):
  """``got`` is the mean over axis 0 of ``values``: exactly (float32) for a leaf under
  512 entries, to relative_mean's two roundings for a larger one."""
  if np.prod(shape) < 512:
    _close(got, values.mean(0), what)
  else:
    _within_the_code(got, values, what)


def test_averaging_the_inner_state_starts_every_round_from_the_devices_mean_moments(mesh):
  """Rounds of 3: at a round's end every device holds the model's mean Adam moments,
  exactly for small leaves and to the code's rounding for a large one, and its
  count; the next round is Adam from what was delivered: the model, given it,
  predicts every update and offset."""
  every = 3
  tx = topka2a_jax.local_steps(
      optax.adam(LR, b1=B1, b2=B2, eps=EPS), every=every,
      outer=optax.sgd(OUTER_LR, momentum=OUTER_MOMENTUM), algorithm="dense",
      average_inner_state=True)
  shapes = WITH_MOMENTS_IN_CODE
  steps = [random_grads(seed, shapes) for seed in range(7)]
  model = NumpyLocalSteps(shapes, every, "dense", None)
  params = {k: jnp.zeros(s) for k, s in shapes.items()}
  rounds = 0
  for i, (grads, (updates, state)) in enumerate(zip(steps, _steps(tx, mesh, steps, params))):
    want = model.update(grads)
    adam = state.inner[0]
    np.testing.assert_array_equal(np.asarray(adam.count), model.count)
    for k, shape in shapes.items():
      _close(updates[k], want[k], f"step {i} {k}")
      _close(np.asarray(state.offset[k]), model.offset[k], f"step {i} offset {k}")
      if model.step:
        _close(np.asarray(adam.mu[k]), model.mu[k], f"step {i} mu {k}")
        continue
      for name in ("mu", "nu"):
        got = np.asarray(getattr(adam, name)[k])
        assert (got == got[0]).all(), f"step {i} {name} {k}: one state on every device"
        _averaged_like_the_model(got[0], getattr(model, name)[k], shape, f"step {i} {name} {k}")
        getattr(model, name)[k] = np.repeat(got[:1].astype(np.float64), DEVICES, axis=0)
    rounds += model.step == 0
  assert rounds == 2


def test_two_levels_average_the_inner_state_over_the_nodes():
  """On a 2 x 4 mesh each node trains as one: at a round's end every device holds the
  two nodes' mean moments (the model fed each node's mean gradient), exactly for
  small leaves and to the code for a large one."""
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  tx = topka2a_jax.local_steps(optax.adam(LR, b1=B1, b2=B2, eps=EPS), every=2, outer=optax.sgd(1.0),
                               algorithm="dense", axis_name=("node", "local"),
                               average_inner_state=True)
  shapes = WITH_MOMENTS_IN_CODE
  steps = [random_grads(seed, shapes) for seed in range(2)]
  node_means = [{k: np.repeat(g.reshape(2, 4, *g.shape[1:]).mean(1), 4, axis=0)
                 for k, g in grads.items()} for grads in steps]
  model = NumpyLocalSteps(shapes, 2, "dense", None)
  for grads in node_means:
    model.update(grads)
  params = {k: jnp.zeros(s) for k, s in shapes.items()}
  _, state = _steps(tx, mesh, steps, params, ("node", "local"))[-1]
  for k, shape in shapes.items():
    for name in ("mu", "nu"):
      got = np.asarray(getattr(state.inner[0], name)[k])
      assert (got == got[0]).all(), f"{name} {k}: one state on every device"
      _averaged_like_the_model(got[0], getattr(model, name)[k][::4], shape, f"{name} {k}")


CONSTANTS = {
    "inject_hyperparams(adamw)": (
        lambda: optax.inject_hyperparams(optax.adamw)(
            learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4),
        lambda inner: inner.hyperparams, lambda inner: inner.inner_state[0].mu["w"]),
    "muon": (
        lambda: optax.contrib.muon(1e-3),
        lambda inner: {"ns_coeffs": inner.inner_states["muon"].inner_state[0].ns_coeffs},
        lambda inner: inner.inner_states["muon"].inner_state[0].mu["w"]),
}
"""Optimizers that keep constants in their state: how to make one, its constants, a moment."""


@pytest.mark.parametrize("devices", [8, 3])
@pytest.mark.parametrize("name", sorted(CONSTANTS))
def test_averaging_the_inner_state_keeps_the_optimizers_constants_as_set(name, devices):
  """``optax.inject_hyperparams`` keeps its hyperparameters in its state as float
  scalars, Muon its Newton-Schulz coefficients as a small array: after four
  rounds through ``train_step`` they are what ``init`` set, to the bit, on 8
  devices and on 3 (where a mean of equal floats can be an ulp off), while the
  moments are averaged."""
  make, constants, moment = CONSTANTS[name]
  mesh = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
  tx = topka2a_jax.local_steps(make(), every=2, algorithm="dense", mesh=mesh,
                               average_inner_state=True)
  step = topka2a_jax.train_step(_least_squares, tx, mesh)
  rng = np.random.default_rng(0)
  batch = tuple(rng.normal(size=(devices * 16, n)).astype(np.float32) for n in (12, 3))
  params, state = {"w": jnp.zeros((12, 3))}, tx.init({"w": jnp.zeros((12, 3))})
  want = jax.tree.map(np.array, constants(state.inner))
  for _ in range(8):
    params, state, _ = step(params, state, batch)
  changed = {key: np.asarray(value) for key, value in constants(state.inner).items()
             if not np.array_equal(np.asarray(value), want[key])}
  assert not changed, f"set at init: {want}; changed since: {changed}"
  mu = np.asarray(moment(state.inner))
  assert (mu == mu[0]).all() and np.abs(mu).max() > 0, "the moments are averaged"


def test_averaging_the_inner_state_gives_a_scalar_its_exact_mean(mesh):
  """A float scalar that differs by device (here a thousandth of the running sum of
  its gradients' means, beside Adam's larger moments in the state) becomes the
  devices' mean to float32's rounding (NumPy), not to the 8-bit code's."""

  def running_sum() -> optax.GradientTransformation:
    def update(updates, total, params=None):
      return updates, total + 1e-3 * sum(jnp.mean(u) for u in jax.tree.leaves(updates))
    return optax.GradientTransformation(lambda params: jnp.zeros((), jnp.float32), update)

  tx = topka2a_jax.local_steps(optax.chain(running_sum(), optax.adam(LR)), every=2,
                               algorithm="dense", average_inner_state=True)
  steps = [random_grads(seed) for seed in range(2)]
  _, state = _steps(tx, mesh, steps, {k: jnp.zeros(s) for k, s in SHAPES.items()})[-1]
  sums = 1e-3 * sum(g.reshape(DEVICES, -1).mean(1, dtype=np.float64)
                    for grads in steps for g in grads.values())
  got = np.asarray(state.inner[0])
  assert (got == got[0]).all()
  np.testing.assert_allclose(got[0], sums.mean(), rtol=64 * np.finfo(np.float32).eps)
  assert not np.isclose(sums.mean(), sums[0], rtol=0.2), "the devices' sums differ"


@pytest.mark.parametrize("shape", [(8,), (2, 4)], ids=["flat", "node-local"])
def test_relative_mean_keeps_every_entry_near_its_own_size(shape):
  """Entries over 8 decades in one chunk, signs differing by device: each mean within
  the code's two roundings of the devices' magnitudes (NumPy), where one evenly
  spaced code a chunk would send the small ones as zero."""
  names = ("data",) if len(shape) == 1 else ("node", "local")
  axis = names[0] if len(shape) == 1 else names
  mesh = jax.make_mesh(shape, names)
  rng = np.random.default_rng(0)
  size = 10.0 ** rng.uniform(-8, 0, 3000)  # each entry's size, alike on every device
  rows = (size * rng.uniform(0.5, 2.0, (DEVICES, 3000))
          * rng.choice([-1.0, 1.0], (DEVICES, 3000))).astype(np.float32)
  spec = P(axis)
  mean = jax.jit(jax.shard_map(
      lambda row: topka2a_jax.collectives.relative_mean(row[0], axis)[None], mesh=mesh,
      in_specs=spec, out_specs=spec))(jax.device_put(rows, NamedSharding(mesh, spec)))
  got = np.asarray(mean)
  assert (got == got[0]).all()
  _within_the_code(got[0], rows.astype(np.float64), "relative_mean")


@pytest.mark.parametrize("algorithm", ["dense", "quantized_8_8_fine"])
def test_two_levels_train_each_node_as_one_and_run_rounds_between_nodes(algorithm):
  """On a 2 x 4 mesh of (node, local): the model fed every device its node's mean gradient.

  Dense, outer momentum: every update and offset as the model's. 8 bits, outer
  SGD at 1: the shared parameters move by the rounds' mean distance, to the
  code's rounding (error feedback holds the rest).
  """
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  outer = (optax.sgd(OUTER_LR, momentum=OUTER_MOMENTUM) if algorithm == "dense"
           else optax.sgd(1.0))
  tx = topka2a_jax.local_steps(optax.adam(LR, b1=B1, b2=B2, eps=EPS), every=2, outer=outer,
                               algorithm=algorithm, axis_name=("node", "local"))
  steps = [random_grads(seed) for seed in range(5)]
  node_means = [{k: np.repeat(g.reshape(2, 4, *g.shape[1:]).mean(1), 4, axis=0)
                 for k, g in grads.items()} for grads in steps]
  model = NumpyLocalSteps(SHAPES, 2, "dense", None)
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  moved = {k: np.zeros(s) for k, s in SHAPES.items()}
  history = _steps(tx, mesh, steps, params, ("node", "local"))
  for i, (grads, (updates, state)) in enumerate(zip(node_means, history)):
    want = model.update(grads)
    for k in SHAPES:
      offset = np.asarray(state.offset[k])
      np.testing.assert_array_equal(offset, np.repeat(offset[::4], 4, axis=0))  # one per node
      _close(offset, model.offset[k], f"step {i} offset {k}")
      moved[k] += updates[k]
      if algorithm == "dense":
        _close(updates[k], want[k], f"step {i} {k}")
  assert int(state.exchange.count) == 2
  if algorithm != "dense":
    for k in SHAPES:
      scale = np.abs(model.travelled[k]).max()
      assert np.abs(moved[k] - model.travelled[k]).max() <= 0.02 * scale, k


@pytest.mark.parametrize("algorithm, density, every", [
    ("quantized_8_8_fine", None, 3), ("rotated_4_8", None, 2), ("topka2a", 0.1, 2),
    ("quantized_4_8", None, 1)])
def test_a_compressed_round_delivers_the_mean_pseudo_gradient_or_owes_it(
    mesh, algorithm, density, every):
  """In parameter space: what the shared parameters moved, plus what error feedback
  still owes them (the residuals' sum over the devices), is every round's mean
  distance travelled, from the NumPy model's Adam, with outer SGD at 1."""
  tx = topka2a_jax.local_steps(optax.adam(LR, b1=B1, b2=B2, eps=EPS), every=every,
                               outer=optax.sgd(1.0), density=density, algorithm=algorithm,
                               min_size=0, fusion=1)
  steps = [random_grads(seed) for seed in range(7)]
  model = NumpyLocalSteps(SHAPES, every, "dense", None)  # its offsets: Adam's alone
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  moved = {k: np.zeros(s) for k, s in SHAPES.items()}
  for i, (grads, (updates, state)) in enumerate(zip(steps, _steps(tx, mesh, steps, params))):
    model.update(grads)
    for k in SHAPES:
      _close(np.asarray(state.inner[0].mu[k]), model.mu[k], f"step {i} mu {k}")
      moved[k] += updates[k]
  travelled = model.travelled
  for k in SHAPES:
    owed = -np.asarray(state.exchange.residuals[k], np.float64).reshape(DEVICES, -1).sum(0)
    _close(moved[k].ravel() + owed / DEVICES, travelled[k].ravel(), f"{algorithm} {k}")
    if algorithm != "topka2a":  # a code sends every entry: little is owed
      assert np.abs(owed / DEVICES).max() < 0.1 * np.abs(travelled[k]).max()


def _least_squares(params, batch):
  x, y = batch
  return jnp.mean((x @ params["w"] - y) ** 2)


def test_train_step_takes_each_devices_gradient_at_its_own_parameters(mesh):
  """Local SGD on per-device least squares: the shared parameters after two rounds
  of three steps are the mean of the devices' own SGD runs (NumPy, float64)."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(DEVICES * 16, 12)).astype(np.float32)
  y = rng.normal(size=(DEVICES * 16, 3)).astype(np.float32)
  lr, every = 0.05, 3
  tx = topka2a_jax.local_steps(optax.sgd(lr), every=every, algorithm="dense", mesh=mesh)
  step = topka2a_jax.train_step(_least_squares, tx, mesh)
  params = {"w": jnp.zeros((12, 3))}
  state = tx.init(params)
  shared = np.zeros((12, 3))
  for round_ in range(2):
    local = [shared.copy() for _ in range(DEVICES)]
    for _ in range(every):
      params, state, _ = step(params, state, (x, y))
      for device in range(DEVICES):
        xs, ys = (a[device * 16:(device + 1) * 16].astype(np.float64) for a in (x, y))
        grad = 2 * xs.T @ (xs @ local[device] - ys) / ys.size
        local[device] = local[device] - lr * grad
    shared = np.mean(local, axis=0)
    _close(np.asarray(params["w"]), shared, f"round {round_}")
  assert int(state.exchange.count) == 2


def test_a_hand_written_step_says_where_it_took_the_gradient_or_is_refused(mesh):
  """A step that took the gradient at the shared parameters ran another algorithm in
  silence; one that takes it at ``local_params`` and says so trains as ``train_step``."""
  rng = np.random.default_rng(0)
  rows = NamedSharding(mesh, P("data"))
  x = jax.device_put(rng.normal(size=(DEVICES * 16, 12)).astype(np.float32), rows)
  y = jax.device_put(rng.normal(size=(DEVICES * 16, 3)).astype(np.float32), rows)
  tx = topka2a_jax.local_steps(optax.sgd(0.05), every=3, algorithm="dense", mesh=mesh)
  fresh = lambda: jax.device_put({"w": jnp.zeros((12, 3))}, NamedSharding(mesh, P()))
  specs = topka2a_jax.state_specs(tx.init(fresh()))

  def hand_written(say):
    def step(params, state, x, y):
      at = topka2a_jax.local_params(jax.lax.pcast(params, "data", to="varying"), state)
      grads = jax.grad(_least_squares)(at, (x, y))
      said = {"topka2a_gradient_at": "local_params"} if say else {}
      updates, state = tx.update(grads, state, params, **said)
      return optax.apply_updates(params, updates), state
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                                 out_specs=(P(), specs)))

  with pytest.raises(ValueError, match=r"gradient taken at its own local parameters, "
                     r"topka2a_jax.local_params\(params, state\).*"
                     r"topka2a_gradient_at='local_params'"):
    hand_written(say=False)(fresh(), tx.init(fresh()), x, y)
  mine, mine_state = fresh(), tx.init(fresh())
  theirs, theirs_state = fresh(), tx.init(fresh())
  library = topka2a_jax.train_step(_least_squares, tx, mesh)
  run = hand_written(say=True)
  for _ in range(6):
    mine, mine_state = run(mine, mine_state, x, y)
    theirs, theirs_state, _ = library(theirs, theirs_state, (x, y))
  assert int(mine_state.exchange.count) == 2
  np.testing.assert_array_equal(np.asarray(mine["w"]), np.asarray(theirs["w"]))


def test_every_one_with_outer_sgd_one_is_compress_updates(mesh):
  """One inner step a round, the mean applied as it is: compress_updates' step."""
  grads = [random_grads(seed) for seed in range(4)]
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  inner = optax.adam(LR, b1=B1, b2=B2, eps=EPS)
  local = _steps(topka2a_jax.local_steps(inner, every=1, algorithm="quantized_8_8_fine",
                                         min_size=0), mesh, grads, params)
  compressed = _steps(topka2a_jax.compress_updates(inner, algorithm="quantized_8_8_fine",
                                                   min_size=0), mesh, grads, params)
  for (got, _), (want, _) in zip(local, compressed):
    chex.assert_trees_all_close(got, want, rtol=0, atol=1e-6)


def test_a_non_finite_gradient_skips_the_step_and_the_round_waits(mesh):
  grads = [random_grads(seed) for seed in range(3)]
  bad = {k: v.copy() for k, v in grads[1].items()}
  bad["b"][3, 0] = np.nan
  params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
  tx = topka2a_jax.local_steps(optax.adam(LR), every=2, algorithm="dense")
  history = _steps(tx, mesh, [grads[0], bad, grads[2]], params)
  clean = _steps(tx, mesh, [grads[0], grads[2]], params)
  assert [int(s.step) for _, s in history] == [1, 1, 0]
  chex.assert_trees_all_close(history[2][0], clean[1][0], rtol=0, atol=0)
  assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(history[1][1]))


def test_skipped_inner_steps_are_counted_and_a_round_that_cannot_finish_is_dropped(mesh):
  """One huge but finite first inner step puts the local parameters where every later
  gradient overflows: each skipped step is counted, the round is dropped after
  SKIPPED_IN_A_ROW of them, and training goes on from the shared parameters as a
  clean run of plain SGD from the start does (the exact mean)."""
  rng = np.random.default_rng(0)
  batches = [(rng.normal(size=(DEVICES * 4, 12)).astype(np.float32),
              rng.normal(size=(DEVICES * 4, 3)).astype(np.float32)) for _ in range(4)]
  fresh = lambda: {"w": jnp.zeros((12, 3))}  # the step donates what it is given
  loss = lambda p, batch: _least_squares(p, batch) + jnp.mean(p["w"] ** 4)  # overflows far out
  rate = lambda count: jnp.where(count < 1, 1e30, 1e-2)  # the first step only: huge
  stuck = topka2a_jax.local_steps(optax.inject_hyperparams(optax.sgd)(learning_rate=rate),
                                  every=4, algorithm="dense", mesh=mesh)
  step, state = topka2a_jax.train_step(loss, stuck, mesh), stuck.init(fresh())
  limit = SKIPPED_IN_A_ROW
  shared = fresh()
  for taken in range(1 + limit):
    shared, state, _ = step(shared, state, batches[0])
    if taken < limit:  # the round waits on its second step, each skip counted
      assert (int(state.step), int(state.exchange.nonfinite_steps)) == (1, taken)
  # The round is dropped: counted once more, the next one starts afresh.
  assert (int(state.step), int(state.exchange.nonfinite_steps)) == (0, limit + 1)
  assert int(state.exchange.count) == 0
  np.testing.assert_array_equal(np.asarray(shared["w"]), 0)
  clean = topka2a_jax.local_steps(optax.sgd(1e-2), every=4, algorithm="dense", mesh=mesh)
  clean_step, clean_state, want = topka2a_jax.train_step(loss, clean, mesh), \
      clean.init(fresh()), fresh()
  for batch in batches:
    shared, state, _ = step(shared, state, batch)
    want, clean_state, _ = clean_step(want, clean_state, batch)
  assert int(state.exchange.count) == 1
  np.testing.assert_array_equal(np.asarray(shared["w"]), np.asarray(want["w"]))


@pytest.mark.parametrize("outer", [None, optax.sgd(0.5)], ids=["default", "sgd 0.5"])
def test_auto_before_an_sgd_outer_plans_the_coded_forms_not_a_top_k(mesh, outer, caplog):
  """A top-k of the pseudo-gradient left most of each round's progress in the residuals
  (6x the exact mean's loss) while the log said it kept its quality."""
  params = {"w": jnp.zeros((256, 64))}
  x = np.ones((DEVICES * 4, 256), np.float32)
  loss = lambda p, x: jnp.mean((x @ p["w"]) ** 2)
  sent = {}
  for name in ("auto", "rotated_4_4"):
    with caplog.at_level("INFO", logger="topka2a_jax"):  # "auto" says its plan when built
      tx = topka2a_jax.local_steps(optax.adam(1e-3), every=4, outer=outer, algorithm=name,
                                   mesh=mesh)
      step = topka2a_jax.train_step(loss, tx, mesh)
      sent[name] = topka2a_jax.comm_report(step.lower(params, tx.init(params), x)).total_bytes
  assert sent["auto"] == sent["rotated_4_4"]
  assert "plans each bucket among rotated_4_4, dense: local_steps' outer step" in caplog.text
  assert "keeps its quality" not in caplog.text


def test_bytes_per_step_are_the_exchanges_over_the_round(mesh):
  """The compiled step holds the round's exchange once, in the branch a round's end takes."""
  params = {"w": jnp.zeros((256, 64))}
  x = np.ones((DEVICES * 4, 256), np.float32)
  loss = lambda p, x: jnp.mean((x @ p["w"]) ** 2)
  reports = {}
  for name, tx in (("dense", optax.chain(topka2a_jax.topka2a(algorithm="dense", mesh=mesh),
                                         optax.adam(1e-3))),
                   ("local", topka2a_jax.local_steps(optax.adam(1e-3), every=8, mesh=mesh))):
    step = topka2a_jax.train_step(loss, tx, mesh)
    reports[name] = topka2a_jax.comm_report(step.lower(params, tx.init(params), x))
  local = reports["local"]
  in_branch = sum(row.bytes for row in local.collectives if row.in_branch)
  wanted = exchange_cost("rotated_4_4", 256 * 64, DEVICES, 1.0).bytes
  flag = 2 * (DEVICES - 1) / DEVICES * 4  # one int32 all-reduce: is the round finite?
  assert in_branch == wanted + flag  # the default code of the whole model, once a round
  every_step = local.total_bytes - in_branch  # the loss's mean, a flag or two
  assert every_step < 64
  assert local.step_bytes(8) == pytest.approx((wanted + flag) / 8 + every_step)
  assert local.step_bytes(8) <= 0.05 * reports["dense"].step_bytes()
  assert not any(row.in_branch for row in reports["dense"].collectives)


@pytest.mark.parametrize("inner", [
    optax.contrib.schedule_free_adamw(1e-3), optax.contrib.prodigy(),
    optax.contrib.dog(), optax.contrib.mechanize(optax.adam(1e-3))],
    ids=["schedule_free", "prodigy", "dog", "mechanize"])
@pytest.mark.parametrize("traced, in_mesh", [(False, False), (False, True), (True, True)],
                         ids=["init", "init under set_mesh", "jitted init under set_mesh"])
def test_averaging_a_state_that_keeps_the_parameters_is_refused_at_init(mesh, inner, traced,
                                                                        in_mesh):
  """Schedule-free keeps its iterate ``z`` in its state, Prodigy, DoG and Mechanic
  the initial parameters: the 8-bit code would round them, so ``init`` refuses,
  naming the leaf and the fix, also where a user jits it."""
  params = {"w": jax.random.normal(jax.random.key(0), (32, 32)), "b": jnp.ones(8)}
  tx = topka2a_jax.local_steps(inner, every=4, mesh=mesh, average_inner_state=True)
  plain = topka2a_jax.local_steps(inner, every=4, mesh=mesh).init
  init, plain = (jax.jit(tx.init), jax.jit(plain)) if traced else (tx.init, plain)
  with jax.set_mesh(mesh) if in_mesh else contextlib.nullcontext():
    with pytest.raises(ValueError,
                       match=r"keeps at .*\['w'\].*Leave average_inner_state off"):
      init(params)
    plain(params)  # without it, no question


def keeping(copy):
  """Adam whose state also keeps the parameters, made by ``copy`` (an anchor, slow weights)."""
  adam = optax.adam(1e-3)
  return optax.GradientTransformation(
      lambda params: (adam.init(params), jax.tree.map(copy, params)),
      lambda updates, state, params=None: (adam.update(updates, state[0], params)[0], state))


@pytest.mark.parametrize("copy", [
    lambda p: p * 1.0, lambda p: p + 0.0, lambda p: jnp.negative(-p),
    lambda p: jnp.where(True, p, 0.0),
    lambda p: p.reshape(-1).reshape(p.shape), jax.lax.stop_gradient,
    lambda p: p.astype(jnp.bfloat16)],
    ids=["p * 1.0", "p + 0", "-(-p)", "where", "reshape round trip", "stop_gradient",
         "bfloat16"])
@pytest.mark.parametrize("traced", [False, True], ids=["init", "jitted init"])
def test_a_state_that_keeps_the_parameters_through_arithmetic_is_refused(mesh, copy, traced):
  """Such copies were accepted, then moved by up to 12% a round by the 8-bit code."""
  params = {"w": jnp.zeros((32, 32)), "b": jnp.ones(8)}  # zeros: like Adam's moments
  params["w"] = params["w"].at[0, 0].set(1.0)
  tx = topka2a_jax.local_steps(keeping(copy), every=4, mesh=mesh, average_inner_state=True)
  with pytest.raises(ValueError, match=r"keeps at \[1\]\['w'\].*Leave average_inner_state off"):
    (jax.jit(tx.init) if traced else tx.init)(params)


@pytest.mark.parametrize("inner", [optax.adagrad(0.1), optax.rprop(1e-3), optax.adam(1e-3)],
                         ids=["adagrad", "rprop", "adam"])
def test_a_state_of_moments_that_starts_above_zero_is_taken(mesh, inner):
  """Adagrad's accumulator and Rprop's step sizes start above zero, as no moment of
  Adam's does, yet are no copy of the parameters: ``init`` takes them."""
  params = {"w": jax.random.normal(jax.random.key(0), (32, 32))}
  topka2a_jax.local_steps(inner, every=4, mesh=mesh, average_inner_state=True).init(params)


@pytest.mark.parametrize("call, error, match", [
    (lambda: topka2a_jax.local_steps(optax.adam(1e-3), every=0), ValueError,
     "every must be at least 1"),
    (lambda: topka2a_jax.local_steps(optax.adam(1e-3), every=2.5), TypeError,
     "every must be an int"),
    (lambda: topka2a_jax.local_steps(optax.adam, every=4), TypeError,
     "inner must be an optax.GradientTransformation"),
    (lambda: topka2a_jax.local_steps(optax.adam(1e-3), every=4, outer="sgd"), TypeError,
     "outer must be an optax.GradientTransformation"),
    (lambda: topka2a_jax.local_steps(optax.adam(1e-3), every=4, follows="sgd"), TypeError,
     "local_steps takes no follows="),
    (lambda: topka2a_jax.local_steps(optax.adam(1e-3), every=4, average_inner_state="mu"),
     TypeError, "average_inner_state must be True or False"),
    (lambda: topka2a_jax.local_steps(optax.adam(1e-3), every={0: 4, 6: 2}), ValueError,
     r"rounds of 4 steps from step 0 end at steps 4 and 8, not at 6"),
    (lambda: topka2a_jax.local_steps(optax.adam(1e-3), every={8: 2}), ValueError,
     "nothing of the rounds before step 8: give their length at key 0"),
    (lambda: topka2a_jax.local_steps(optax.adam(1e-3), every={0: 4, 96: 0}), ValueError,
     r"every\[96\] must be at least 1"),
    (lambda: topka2a_jax.local_steps(optax.adam(1e-3), every="4"), TypeError,
     "every must be an int, or a dict from the step"),
    (lambda: topka2a_jax.local_steps(optax.adam(1e-3), every=4, density=0.01), ValueError,
     (r"local_steps\(density=0.01\) would be unused: its exchange, "
      r"algorithm='rotated_4_4', sends every entry. Leave density out")),
    (lambda: topka2a_jax.local_steps(optax.adam(1e-3), every=4, density=0.01, algorithm="auto"),
     ValueError, r"before local_steps' outer step \"auto\" plans only such codes"),
    (lambda: topka2a_jax.local_steps(optax.adam(1e-3), every=2**31), ValueError,
     (r"every must be at most 2,147,483,647 \(the state counts it in int32\), got "
     "2,147,483,648")),
    (lambda: topka2a_jax.local_steps(optax.adam(1e-3), every={0: 1, 2**33: 2}), ValueError,
     r"every's key 8589934592 must be at most 2,147,483,647"),
    (lambda: topka2a_jax.accumulate_gradients(optax.adam(1e-3), every=2**31), ValueError,
     r"every must be at most 2,147,483,647"),
], ids=["every-0", "every-float", "inner-factory", "outer-string", "follows", "average-str",
        "stretch-inside-a-round", "no-stretch-from-0", "length-0", "every-str",
        "density-with-a-code", "density-with-auto", "every-2**31", "key-2**33",
        "accumulate-2**31"])
def test_bad_arguments_are_refused_naming_the_fix(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_local_params_where_it_cannot_answer_says_why(mesh):
  """Outside shard_map, with other parameters, or with two local_steps states: named, not
  a sharding or pytree error from inside JAX."""
  params = {"w": jnp.ones((4, 4))}
  state = topka2a_jax.local_steps(optax.adam(1e-2), mesh=mesh).init(params)
  for given, match in (
      ((params, state), (r"called outside shard_map: opt_state holds every device's offset "
                        r"\(8 of them at \['w'\]\).*Call it inside your shard_map step")),
      ((None, state), r"params are not the parameters opt_state was made for"),
      (({"w": jnp.ones((3, 4))}, state), (r"parameter \['w'\] has shape \(3, 4\), its "
                                         r"offset in opt_state \(4, 4\)")),
      ((params, (state, state)), "found 2 local_steps states in opt_state")):
    with pytest.raises(ValueError, match=match):
      topka2a_jax.local_params(*given)
