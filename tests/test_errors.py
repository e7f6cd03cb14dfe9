"""Bad input gets an error that names the problem; nothing is half-applied."""

import dataclasses
import inspect
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax
from topka2a_jax._src.options import Options

PARAMS = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}


@pytest.mark.parametrize("density", [0, 0.0, -0.1, 1.5, math.nan, math.inf,
                                     "0.1", True, [0.1]])
def test_bad_density(density):
  with pytest.raises(ValueError, match=r"density must be a number in \(0, 1\]"):
    topka2a_jax.topka2a(density)


def test_good_densities_are_accepted():
  for density in (1e-6, 0.5, 1, 1.0, np.float32(0.1)):
    topka2a_jax.topka2a(density)


def test_unknown_algorithm_lists_the_choices():
  with pytest.raises(ValueError, match="unknown algorithm 'topk'.*'topka2a'"):
    topka2a_jax.topka2a(0.1, algorithm="topk")


@pytest.mark.parametrize("kwargs, error, match", [
    ({"min_size": -1}, ValueError, "min_size must be at least 0"),
    ({"min_size": 1.5}, TypeError, "min_size must be an int"),
    ({"fusion": 0}, ValueError, "fusion must be at least 1"),
    ({"fusion": "big"}, TypeError, "fusion must be an int"),
    ({"network": "wifi"}, ValueError, "unknown network 'wifi'"),
    ({"backward_seconds": -1.0}, ValueError, "backward_seconds must be None or"),
    ({"selection": "fast"}, ValueError, "unknown selection 'fast'.*'threshold'"),
    ({"value_dtype": jnp.int8}, TypeError, "value_dtype must be a floating dtype"),
    ({"error_feedback": "yes"}, TypeError, "error_feedback must be True or False"),
    ({"skip_nonfinite": 1}, TypeError, "skip_nonfinite must be True or False"),
    ({"axis_name": ["data"]}, TypeError, "axis_name must be a mesh axis name"),
])
def test_bad_options(kwargs, error, match):
  with pytest.raises(error, match=match):
    topka2a_jax.topka2a(0.1, **kwargs)


@pytest.mark.parametrize("builder", [topka2a_jax.topka2a, topka2a_jax.compress_updates,
                                     topka2a_jax.sharded_optimizer])
def test_a_misspelt_option_is_named_with_the_one_meant(builder):
  args = (0.01,) if builder is topka2a_jax.topka2a else (optax.adam(1e-3), 0.01)
  with pytest.raises(TypeError, match=r"unknown option min_sise= \(did you mean "
                                      r"min_size=\?\); the options are algorithm, "):
    builder(*args, min_sise=0)
  with pytest.raises(TypeError, match=r"unknown option whole_selection="):
    builder(*args, whole_selection=True)  # the library's own setting


def test_local_steps_names_its_own_arguments_and_itself():
  """A misspelt every= was matched against the exchange's options alone, and init
  without a mesh named topka2a(..., mesh=mesh), which the user never called."""
  with pytest.raises(TypeError, match=r"unknown option evrey= \(did you mean every=\?\); the "
                     r"arguments of local_steps are average_inner_state, density, every, inner, "
                     r"outer, overlap, and the options are algorithm, "):
    topka2a_jax.local_steps(optax.adam(1e-3), evrey=4)
  with pytest.raises(ValueError, match=r"local_steps does not know the mesh .* Build it with "
                                       r"local_steps\(\.\.\., mesh=mesh\)"):
    topka2a_jax.local_steps(optax.adam(1e-3)).init(PARAMS)


def test_sharded_optimizer_refuses_the_options_it_has_no_use_for_saying_why():
  for name, value in (("fusion", 1), ("backward_seconds", 0.1), ("rank", 2)):
    with pytest.raises(TypeError, match=f"sharded_optimizer takes no {name}=: "):
      topka2a_jax.sharded_optimizer(optax.sgd(0.1), density=0.01, **{name: value})
  assert not {"fusion", "backward_seconds", "rank"} & set(
      inspect.signature(topka2a_jax.sharded_optimizer).parameters)


def test_the_signature_defaults_are_the_options_defaults():
  # One default per option: the signature shows what Options.create fills in.
  fields = {f.name: f.default for f in dataclasses.fields(Options)}
  fields["axis_name"] = fields.pop("axis").name  # the argument, parsed into a record
  for builder in (topka2a_jax.topka2a, topka2a_jax.compress_updates,
                  topka2a_jax.sharded_optimizer):
    for name, parameter in inspect.signature(builder).parameters.items():
      # compress_updates' algorithm follows its density (test_onebit.py)
      chosen = builder is topka2a_jax.compress_updates and name == "algorithm"
      if name in fields and name != "density" and not chosen:
        assert parameter.default == fields[name], (builder.__name__, name)
  assert inspect.signature(topka2a_jax.compress_updates).parameters[
      "algorithm"].default is None
  own = {f.name for f in dataclasses.fields(Options) if not f.metadata.get("user", True)}
  assert own == {"whole_selection", "density_given", "auto_forms", "caller"}  # the library's own
  assert set(fields) - own <= set(
      inspect.signature(topka2a_jax.topka2a).parameters)


OUTSIDE = (r"axis name 'data' is not bound here: this call is outside "
           r"jax.shard_map.*already all-reduced.*topka2a_jax.train_step")


@pytest.mark.parametrize("made_by", ["tx.init with mesh", "topka2a_jax.init",
                                     "tx.init of placed params"])
def test_update_under_plain_jit_says_first_that_it_is_outside_shard_map(
    mesh, made_by):
  # A plain jax.jit step, as written for optax: the first thing said is that
  # the call is outside shard_map, however the state was made.
  if made_by == "tx.init with mesh":
    tx = optax.chain(topka2a_jax.topka2a(0.1, mesh=mesh), optax.adam(1e-3))
    state = tx.init(PARAMS)
  elif made_by == "topka2a_jax.init":
    tx = optax.chain(topka2a_jax.topka2a(0.1), optax.adam(1e-3))
    state = topka2a_jax.init(tx, PARAMS, mesh)
  else:
    tx = optax.chain(topka2a_jax.topka2a(0.1), optax.adam(1e-3))
    state = tx.init(jax.device_put(PARAMS, NamedSharding(mesh, P())))

  @jax.jit
  def step(params, state, x):
    grads = jax.grad(lambda p: jnp.sum((x @ p["w"] + p["b"]) ** 2))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  x = jax.device_put(jnp.ones((16, 64)), NamedSharding(mesh, P("data")))
  with pytest.raises(ValueError, match=OUTSIDE):
    step(jax.device_put(PARAMS, NamedSharding(mesh, P())), state, x)


def test_init_outside_shard_map_without_a_mesh_says_how_to_give_one():
  tx = optax.chain(topka2a_jax.topka2a(0.1), optax.adam(1e-3))
  with pytest.raises(ValueError, match=r"does not know the mesh.*mesh=mesh"):
    tx.init(PARAMS)  # nnx.Optimizer calls this on an unplaced model


def loss_of(params, batch):
  return jnp.mean((batch @ params["w"] + params["b"]) ** 2)


def per_device_grads(params):
  local = lax.pcast(params, "data", to="varying")
  return jax.tree.map(lambda p: p * (1 + lax.axis_index("data")), local)


def hand_written(mesh, tx, state_in, state_out=None, grads_fn=per_device_grads):
  """``tx.update(grads_fn(params), state)`` in a jitted shard_map step, as a
  user writes one with these state specs; and PARAMS placed for it."""
  run = jax.jit(jax.shard_map(
      lambda p, s: tx.update(grads_fn(p), s, p), mesh=mesh, in_specs=(P(), state_in),
      out_specs=(P(), state_in if state_out is None else state_out)))
  return run, jax.device_put(PARAMS, NamedSharding(mesh, P()))


def made(tx, mesh):
  """The state and its specs, as topka2a_jax.init and state_specs give them."""
  state = topka2a_jax.init(tx, PARAMS, mesh)
  return state, topka2a_jax.state_specs(state)


def test_wrong_axis_name_is_named_where_the_state_is_made(mesh):
  with pytest.raises(ValueError, match=r"mesh has no axis 'batch'.*\('data',\)"):
    topka2a_jax.topka2a(0.1, axis_name="batch", mesh=mesh)
  tx = topka2a_jax.topka2a(0.1, axis_name="batch", min_size=0)
  with pytest.raises(ValueError, match=r"mesh has no axis 'batch'.*\('data',\)"):
    topka2a_jax.init(tx, PARAMS, mesh)


def test_wrong_axis_name_inside_shard_map(mesh):
  # A state made for a mesh with a "batch" axis, used in a step over "data".
  tx = topka2a_jax.topka2a(0.1, axis_name="batch", min_size=0)
  batch_mesh = jax.make_mesh((8,), ("batch",))
  state = jax.device_put(topka2a_jax.init(tx, PARAMS, batch_mesh, axis_name="batch"),
                         NamedSharding(mesh, P()))
  run, params = hand_written(mesh, tx, P(), P("data"))
  with pytest.raises(ValueError, match="axis name 'batch' is not bound"):
    run(params, state)


@pytest.mark.parametrize("make", [
    lambda: optax.chain(topka2a_jax.topka2a(0.1, axis_name="model", min_size=0),
                        optax.sgd(0.1)),
    lambda: topka2a_jax.compress_updates(optax.sgd(0.1), density=0.1, axis_name="model",
                                         min_size=0)])
def test_a_transform_over_one_axis_in_a_step_over_another_names_both(make):
  """A user's 4 x 2 mesh: the exchange built over "model", the step over "data"."""
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  tx = make()
  step = topka2a_jax.train_step(lambda p, x: jnp.mean((x @ p["w"]) ** 2), tx, mesh)
  params = {"w": jnp.ones((64, 4))}
  state = topka2a_jax.init(tx, params, mesh, axis_name="model")
  with pytest.raises(ValueError, match=r"inside jax.shard_map over 'data', not over "
                     r"'model'.*transform with axis_name='data'.*the step with "
                     r"axis_name='model'"):
    step(params, state, jnp.ones((8, 64)))


def test_vmap_and_pmap_are_named(mesh):
  """Emulating the devices with vmap or pmap over a stacked gradient."""
  tx = optax.chain(topka2a_jax.topka2a(0.1, min_size=0), optax.sgd(0.1))
  params = {"w": jnp.ones((64, 4))}
  state = topka2a_jax.init(tx, params, mesh)
  stacked = {"w": jnp.ones((8, 64, 4))}

  def update(grads):
    return tx.update(grads, state, params)[0]

  with pytest.raises(ValueError, match="'data' is bound by jax.vmap, not by "
                                       "jax.shard_map"):
    jax.vmap(update, axis_name="data")(stacked)
  with pytest.raises(ValueError, match=r"came in whole.*or jax.pmap, which maps a "
                                       r"leading axis: use jax.shard_map"):
    jax.pmap(update, axis_name="data")(stacked)


def test_non_floating_leaf_is_named_at_init_and_update(mesh):
  tx = topka2a_jax.topka2a(0.1, mesh=mesh)
  with pytest.raises(TypeError, match=r"parameter leaf \['step'\] has dtype int32"):
    tx.init({"w": jnp.ones(4), "step": jnp.zeros((), jnp.int32)})
  state = tx.init({"n": jnp.ones(3)})
  run = jax.jit(jax.shard_map(
      lambda g, s: tx.update(g, s), mesh=mesh,
      in_specs=(P("data"), topka2a_jax.state_specs(state)),
      out_specs=(P(), topka2a_jax.state_specs(state))))
  with pytest.raises(TypeError, match=r"gradient leaf \['n'\] has dtype int32"):
    run({"n": jax.device_put(jnp.ones(24, jnp.int32), NamedSharding(mesh, P("data")))},
        state)


def test_already_summed_gradients_are_refused(mesh):
  # Differentiating with respect to replicated params makes JAX psum them.
  tx = topka2a_jax.topka2a(0.1, min_size=0)

  def grads_of_replicated(params):
    return jax.grad(lambda p: jnp.sum(p["w"] ** 2) + jnp.sum(p["b"]))(params)

  state, specs = made(tx, mesh)
  run, params = hand_written(mesh, tx, specs, grads_fn=grads_of_replicated)
  with pytest.raises(ValueError, match=r"already\s+summed.*pcast\(params, 'data'"):
    run(params, state)


def test_state_of_another_model(mesh):
  tx = topka2a_jax.topka2a(0.1, min_size=0)
  other = topka2a_jax.init(tx, {"w": jnp.ones((64, 32))}, mesh)
  specs = topka2a_jax.state_specs(other)
  run = jax.jit(jax.shard_map(lambda p, s: tx.update(per_device_grads(p), s),
                              mesh=mesh, in_specs=(P(), specs), out_specs=(P(), specs)))
  with pytest.raises(ValueError, match="does not match the gradients' pytree"):
    run(jax.device_put(PARAMS, NamedSharding(mesh, P())), other)


TRANSFORMS_WITH_A_STATE = {
    "chain": lambda: optax.chain(topka2a_jax.topka2a(0.1, min_size=0), optax.adam(1e-3)),
    "compress_updates": lambda: topka2a_jax.compress_updates(optax.adam(1e-3), density=0.1,
                                                             min_size=0),
    "sharded_optimizer": lambda: topka2a_jax.sharded_optimizer(optax.adam(1e-3), density=0.1,
                                                               min_size=0),
}


@pytest.mark.parametrize("make", TRANSFORMS_WITH_A_STATE.values(), ids=TRANSFORMS_WITH_A_STATE)
@pytest.mark.parametrize("params, said", [
    ({"w": PARAMS["w"]}, r"these parameters lack \['b'\]"),
    ({**PARAMS, "c": jnp.ones(3)}, r"they have \['c'\], which it has not"),
], ids=["a-leaf-less", "a-leaf-more"])
def test_a_train_step_given_other_parameters_than_its_state_names_the_leaves(
    mesh, make, params, said):
  tx = make()
  state = topka2a_jax.init(tx, PARAMS, mesh)
  step = topka2a_jax.train_step(
      lambda p, x: sum(jnp.sum(leaf) for leaf in jax.tree.leaves(p)) * jnp.mean(x), tx, mesh)
  with pytest.raises(ValueError, match=f"state was made for other parameters: {said}"):
    step(params, state, jnp.ones((8, 4)))


@pytest.mark.parametrize("make", TRANSFORMS_WITH_A_STATE.values(), ids=TRANSFORMS_WITH_A_STATE)
def test_a_parameter_of_another_shape_than_its_state_is_named(mesh, make):
  tx = make()
  state = topka2a_jax.init(tx, PARAMS, mesh)
  step = topka2a_jax.train_step(lambda p, x: (jnp.sum(p["w"]) + jnp.sum(p["b"])) * jnp.mean(x),
                                tx, mesh)
  with pytest.raises(ValueError, match=r"residual for leaf \['w'\] has shape \(64, 32\), "
                                       r"expected \(64, 16\)"):
    step({"w": jnp.ones((64, 16)), "b": PARAMS["b"]}, state, jnp.ones((8, 4)))


@pytest.mark.parametrize("other, given", [
    (lambda mesh: optax.chain(topka2a_jax.topka2a(0.1, min_size=0, mesh=mesh), optax.sgd(0.1)),
     r"\(TopKA2AState, \(EmptyState, EmptyState\)\)"),
    (lambda mesh: topka2a_jax.local_steps(optax.adam(1e-3), mesh=mesh), "LocalStepsState")],
    ids=["another optimizer's", "local_steps'"])
def test_a_train_step_given_another_optimizers_state_names_both(mesh, other, given):
  """It failed inside optax: "'EmptyState' object has no attribute 'mu'", or "The number
  of updates and states has to be the same in chain!"."""
  tx = TRANSFORMS_WITH_A_STATE["chain"]()
  state = other(mesh).init(PARAMS)
  step = topka2a_jax.train_step(lambda p, x: (jnp.sum(p["w"]) + jnp.sum(p["b"])) * jnp.mean(x),
                                tx, mesh)
  with pytest.raises(TypeError, match=r"opt_state is not the state of the optimizer this step "
                     r"was built with: tx.init\(params\) makes \(TopKA2AState, "
                     rf"\(ScaleByAdamState, EmptyState\)\), the step was given {given}"):
    step(PARAMS, state, jnp.ones((8, 4)))


def test_state_made_with_other_options(mesh):
  first = topka2a_jax.topka2a(0.1, min_size=0)
  used = topka2a_jax.topka2a(0.1, min_size=100)
  state, specs = made(first, mesh)
  run, params = hand_written(mesh, used, specs)
  with pytest.raises(ValueError, match=r"residual for leaf \['b'\].*other options"):
    run(params, state)


def test_failed_update_leaves_the_state_usable(mesh):
  tx = topka2a_jax.topka2a(0.1, min_size=0)
  state, specs = made(tx, mesh)
  run, params = hand_written(mesh, tx, specs)
  params_bad = {"w": params["w"].astype(jnp.int32), "b": params["b"]}
  before = jax.tree.map(np.asarray, state)
  with pytest.raises(TypeError, match="dtype int32"):
    run(params_bad, state)
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, state), before)
  _, new_state = run(params, state)
  assert float(jnp.abs(new_state.residuals["w"]).sum()) > 0


def test_init_on_a_mesh_without_the_axis(mesh):
  tx = topka2a_jax.topka2a(0.1)
  with pytest.raises(ValueError, match=r"mesh has no axis 'batch'.*\('data',\)"):
    topka2a_jax.init(tx, PARAMS, mesh, axis_name="batch")


def test_state_from_a_mesh_of_another_size(mesh):
  # A state made on 8 devices, given to a step on 4 after a restart: the step
  # places it on the 4, where each device would see two devices' residuals.
  tx = optax.chain(topka2a_jax.topka2a(0.1, min_size=0), optax.sgd(0.1))
  state = topka2a_jax.init(tx, PARAMS, mesh)
  small = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  step = topka2a_jax.train_step(loss_of, tx, small)
  with pytest.raises(ValueError, match=r"residual for leaf \['b'\] has shape "
                     r"\(64,\), expected \(32,\).*resized by topka2a_jax.restore"):
    step(PARAMS, state, jnp.ones((16, 64)))


def test_nonfinite_gradients_are_skipped_not_raised(mesh):
  # Not an error: the step is skipped on every device (tests/test_nonfinite.py).
  tx = topka2a_jax.topka2a(0.1, min_size=0)
  state, specs = made(tx, mesh)
  run, params = hand_written(
      mesh, tx, specs,
      grads_fn=lambda p: jax.tree.map(lambda x: x * jnp.nan, per_device_grads(p)))
  updates, new_state = run(params, state)
  assert int(new_state.nonfinite_steps) == 1
  assert not any(np.asarray(u).any() for u in jax.tree.leaves(updates))


def test_param_specs_of_another_pytree(mesh):
  tx = topka2a_jax.topka2a(0.1)
  with pytest.raises(ValueError, match="param_specs has 1 PartitionSpecs for 2 "
                     "parameter leaves"):
    topka2a_jax.init(tx, PARAMS, mesh, param_specs={"w": P()})


def test_state_passed_with_p_instead_of_state_specs_on_automatic_axes():
  # With automatic axes shard_map gathers the state to fit P(): the library
  # then sees every device's residuals on each device.
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  tx = topka2a_jax.topka2a(0.1, min_size=0, mesh=mesh)
  run, params = hand_written(mesh, tx, P(), P("data"))
  with pytest.raises(ValueError, match=r"residual for leaf \['b'\] has shape "
                     r"\(256,\), expected \(32,\) on each device.*state_specs"):
    run(params, tx.init(PARAMS))


def test_state_passed_with_p_instead_of_state_specs_on_explicit_axes(mesh):
  # jax.make_mesh's explicit axes: JAX refuses the call before the update runs.
  tx = topka2a_jax.topka2a(0.1, min_size=0, mesh=mesh)
  run, params = hand_written(mesh, tx, P(), P("data"))
  with pytest.raises(ValueError, match=r"in_specs passed to shard_map: P\(None,\) "
                     r"does not match the specs of the input: P\('data',\)"):
    run(params, tx.init(PARAMS))


CHAIN_ORDER = (r"per-parameter state \((ScaleByAdamState|scale_by_adam)[^)]*\) before the "
               r"topka2a exchange")


def users_chain(*transforms):
  """A chain of the user's own making, which the exchange cannot read from its init."""
  def init(params):
    return tuple(tx.init(params) for tx in transforms)

  def update(updates, state, params=None):
    states = []
    for tx, inner in zip(transforms, state):
      updates, inner = optax.with_extra_args_support(tx).update(updates, inner, params)
      states.append(inner)
    return updates, tuple(states)

  return optax.GradientTransformation(init, update)


def test_exchange_after_adam_is_refused_by_tx_init_and_by_the_step(mesh):
  tx = optax.chain(optax.adam(1e-3), topka2a_jax.topka2a(0.1, mesh=mesh))
  with pytest.raises(ValueError, match=CHAIN_ORDER + r".*Put the exchange first: "
                                     r"optax.chain\(topka2a_jax.topka2a\(\.\.\.\), <the"):
    tx.init(PARAMS)  # it was accepted, with a warning advising follows=, which fixed nothing
  # In a chain of the user's own, tx.init cannot see the order; the step sees the state.
  tx = users_chain(optax.adam(1e-3), topka2a_jax.topka2a(0.1, mesh=mesh))
  state = tx.init(PARAMS)
  step = topka2a_jax.train_step(loss_of, tx, mesh)
  with pytest.raises(ValueError, match=CHAIN_ORDER + r".*topka2a\(\.\.\.\), <the"):
    step(PARAMS, state, jnp.ones((16, 64)))


def test_exchange_after_adam_is_refused_by_init_and_state_specs(mesh):
  # The hand-written route, even with check_vma=False, passes through these.
  tx = optax.chain(optax.sgd(0.1, momentum=0.9), topka2a_jax.topka2a(0.1))
  with pytest.raises(ValueError, match=r"per-parameter state \((TraceState|trace)"):
    topka2a_jax.init(tx, PARAMS, mesh)
  late = users_chain(optax.adam(1e-3), topka2a_jax.topka2a(0.1, mesh=mesh))
  with pytest.raises(ValueError, match=CHAIN_ORDER):
    topka2a_jax.state_specs(late.init(PARAMS))


def test_decay_before_the_exchange_is_allowed(mesh):
  # Stateless transforms may come first (weight decay before the exchange).
  tx = optax.chain(optax.add_decayed_weights(1e-4), topka2a_jax.topka2a(0.1),
                   optax.adam(1e-3))
  topka2a_jax.state_specs(topka2a_jax.init(tx, PARAMS, mesh))


def test_step_without_an_exchange_or_with_multisteps(mesh):
  step = topka2a_jax.train_step(loss_of, optax.adam(1e-3), mesh)
  with pytest.raises(ValueError, match="holds no topka2a exchange.*Chain one first"):
    step(PARAMS, optax.adam(1e-3).init(PARAMS), jnp.ones((16, 64)))
  tx = optax.MultiSteps(optax.chain(topka2a_jax.topka2a(0.1, mesh=mesh),
                                    optax.sgd(0.1)), every_k_schedule=4)
  step = topka2a_jax.train_step(loss_of, tx, mesh)
  with pytest.raises(ValueError, match=r"optax.MultiSteps around \(or before\) the topka2a "
                     r"exchange.*accumulate_gradients\(<the optimizer>, every=N\).*"
                     r"micro_batches=N"):
    step(PARAMS, tx.init(PARAMS), jnp.ones((16, 64)))


@pytest.mark.parametrize("micro, error, match", [
    (2.0, TypeError, "micro_batches must be an int, got 2.0"),
    (True, TypeError, "micro_batches must be an int, got True"),
    (0, ValueError, "micro_batches must be at least 1, got 0"),
])
def test_micro_batches_not_a_positive_int(mesh, micro, error, match):
  # The same mistake raises what the transforms' counts raise (fusion=, rank=).
  tx = optax.chain(topka2a_jax.topka2a(0.1, mesh=mesh), optax.sgd(0.1))
  with pytest.raises(error, match=match):
    topka2a_jax.train_step(loss_of, tx, mesh, micro_batches=micro)


@pytest.mark.parametrize("rows, micro, needs", [(60, 1, 8), (64, 3, 24)])
def test_batch_that_does_not_split_over_the_devices(mesh, rows, micro, needs):
  tx = optax.chain(topka2a_jax.topka2a(0.1, mesh=mesh), optax.sgd(0.1))
  step = topka2a_jax.train_step(loss_of, tx, mesh, micro_batches=micro)
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match=rf"batch leaf <root> has leading axis {rows}, "
                     rf"which does not split evenly.*multiple of {needs}"):
    step(PARAMS, state, jnp.ones((rows, 64)))
  assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


def test_parameters_sharded_over_the_data_axis_are_refused(mesh):
  placed = {"w": jax.device_put(PARAMS["w"], NamedSharding(mesh, P("data"))),
            "b": jax.device_put(PARAMS["b"], NamedSharding(mesh, P()))}
  tx = optax.chain(topka2a_jax.topka2a(0.1, mesh=mesh), optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"parameter \['w'\] is sharded over the data "
                     r"axis 'data'.*replicate them"):
    tx.init(placed)
  state = tx.init(PARAMS)
  step = topka2a_jax.train_step(loss_of, tx, mesh)
  with pytest.raises(ValueError, match=r"parameter \['w'\] is sharded over the data"):
    step(placed, state, jnp.ones((16, 64)))


@pytest.mark.parametrize("name, now", [("NETWORKS", "topka2a_jax.cost.NETWORKS"),
                                       ("Exchange", "collectives.ExchangeResult")])
def test_a_name_that_moved_off_the_top_level_says_where_it_is_now(name, now):
  # Code written for 0.1.0 reads these from the top level.
  with pytest.raises(AttributeError, match=f"topka2a_jax.{name} has moved: use .*{now}"):
    getattr(topka2a_jax, name)
  with pytest.raises(AttributeError, match="has no attribute 'not_a_name'"):
    topka2a_jax.not_a_name  # noqa: B018


@pytest.mark.parametrize("wrap", [
    lambda inner, mesh: topka2a_jax.compress_updates(inner, mesh=mesh),
    lambda inner, mesh: topka2a_jax.skip_nonfinite(inner),
    lambda inner, mesh: topka2a_jax.sharded_optimizer(inner, density=0.01, mesh=mesh)])
def test_an_optimizer_argument_that_is_not_one_says_what_to_pass(mesh, wrap):
  with pytest.raises(TypeError, match=r"got the function adam itself: call it, e\.g\. "
                                      r"optax\.adam\(1e-3\)"):
    wrap(optax.adam, mesh)
  with pytest.raises(TypeError, match="must be an optax.GradientTransformation such "
                                      "as optax.adam.*got None"):
    wrap(None, mesh)


def test_no_mesh_where_one_is_needed_says_what_a_mesh_is(tmp_path):
  for call in (lambda: topka2a_jax.train_step(lambda p, b: 0.0, optax.sgd(0.1), None),
               lambda: topka2a_jax.save(tmp_path / "ckpt", {"w": jnp.ones(3)}, None)):
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh, e\.g\. "
                                        r"jax.make_mesh.*got None"):
      call()
  assert not (tmp_path / "ckpt").exists()


def test_rank_with_a_quantizing_exchange_says_what_it_sends():
  with pytest.raises(ValueError, match="algorithm='onebit' sends every entry as a "
                                       "few-bit code. Drop rank="):
    topka2a_jax.topka2a(algorithm="onebit", rank=2)


@pytest.mark.parametrize("freeze_after", [-1, 0, 2.5])
def test_frozen_variance_names_its_own_option(mesh, freeze_after):
  with pytest.raises(ValueError, match=f"freeze_after={freeze_after!r}: the variance"):
    topka2a_jax.frozen_variance_adam(1e-3, 0.01, freeze_after=freeze_after, mesh=mesh)


def test_the_planner_and_the_collectives_refuse_what_they_cannot_plan(mesh):
  with pytest.raises(ValueError, match="num_devices must be at least 1, got 0"):
    topka2a_jax.plan_fusion([1000], num_devices=0, density=0.01)
  with pytest.raises(ValueError, match=r"density must be a number in \(0, 1\]"):
    topka2a_jax.plan_fusion([1000], num_devices=8, density=-0.1)
  rows = jax.device_put(jnp.ones((8, 100)), NamedSharding(mesh, P("data")))
  with pytest.raises(ValueError, match=r"density must be a number in \(0, 1\]"):
    jax.shard_map(lambda r: topka2a_jax.collectives.topka2a(r[0], "data", -0.1).mean,
                  mesh=mesh, in_specs=P("data"), out_specs=P())(rows)


@pytest.mark.parametrize("timeout", ["10", True, 0, -5])
def test_a_stall_timeout_that_is_not_a_number_of_seconds(timeout):
  with pytest.raises(ValueError, match="must be a positive number of seconds"):
    topka2a_jax.distributed.initialize(stall_timeout_seconds=timeout)


def test_calling_a_step_again_on_inputs_it_donated_names_donation(mesh):
  tx = optax.chain(topka2a_jax.topka2a(0.1, min_size=0, mesh=mesh), optax.sgd(0.1))
  step = topka2a_jax.train_step(lambda p, x: jnp.mean((x @ p["w"]) ** 2), tx, mesh)
  params = {"w": jnp.ones((16, 4))}
  state = tx.init(params)
  x = jnp.ones((8, 16))
  new_params, new_state, _ = step(params, state, x)
  with pytest.raises(ValueError, match=r"parameter \['w'\] was donated to an earlier "
                                       r"call of this step.*donate=False"):
    step(params, state, x)
  step(new_params, new_state, x)  # the arrays it returned go on


@pytest.mark.parametrize("call, error, match", [
    (lambda mesh: topka2a_jax.train_step(lambda p, x: 0.0, None, mesh), TypeError,
     "tx must be an optax.GradientTransformation such as optax.adam"),
    (lambda mesh: topka2a_jax.init(None, PARAMS, mesh), TypeError,
     "tx must be an optax.GradientTransformation such as optax.adam"),
    (lambda mesh: topka2a_jax.frozen_variance_adam(1e-3, freeze_after=5, b1=1.5), ValueError,
     r"b1=1.5: a moment's decay is a number in \[0, 1\)"),
    (lambda mesh: topka2a_jax.frozen_variance_adam(1e-3, freeze_after=5, variance_floor=-1),
     ValueError, "variance_floor=-1: the floor is a share of the mean variance"),
    (lambda mesh: topka2a_jax.frozen_variance_adam(float("nan"), freeze_after=5), ValueError,
     "learning_rate=nan: give a finite number"),
    (lambda mesh: topka2a_jax.frozen_variance_adam(1e-3, freeze_after=5, eps=-1), ValueError,
     "eps=-1: Adam's eps is added to a square root"),
    (lambda mesh: topka2a_jax.train_step(lambda p, x: 0.0, optax.sgd(0.1), mesh,
                                         donate="yes"), TypeError,
     "donate must be True or False, got 'yes'"),
    (lambda mesh: topka2a_jax.comm_report(None), TypeError,
     "comm_report reads a lowered or compiled program"),
    (lambda mesh: topka2a_jax.comm_report("not HLO"), ValueError, "text that is not HLO"),
    (lambda mesh: topka2a_jax.tune_fusion(None, 1, 10), TypeError,
     "make_step must build a step for a threshold"),
    (lambda mesh: topka2a_jax.tune_fusion(lambda t: (lambda: None), 1, 10, repeats=0),
     ValueError, "repeats must be at least 1"),
    (lambda mesh: topka2a_jax.tune_fusion(lambda t: (lambda: None), 1, 10,
                                          measure=lambda run: float("nan")),
     ValueError, "timed at nan s"),
], ids=["train_step-None", "init-None", "b1-1.5", "variance_floor-negative",
        "learning_rate-nan", "eps-negative", "donate-yes", "comm_report-None",
        "comm_report-text", "tune_fusion-None", "repeats-0", "timing-nan"])
def test_arguments_that_cannot_work_are_named(mesh, call, error, match):
  with pytest.raises(error, match=match):
    call(mesh)


def test_a_density_given_as_a_scalar_array_is_taken():
  assert topka2a_jax.topka2a(jnp.asarray(0.01)) is not None
  with pytest.raises(ValueError, match="density must be a number in"):
    topka2a_jax.topka2a(jnp.asarray([0.01, 0.02]))


def test_launch_without_a_command_says_what_it_needs():
  from topka2a_jax.distributed import launch
  with pytest.raises(ValueError, match="launch needs a command to run"):
    launch([], 2, 1)


def test_an_axis_name_the_state_was_not_made_over_is_named(mesh):
  """``state_specs`` and ``skip_nonfinite`` took any axis_name, and the step failed later."""
  params = {"w": jnp.ones((64, 32))}
  state = optax.chain(topka2a_jax.topka2a(0.1, min_size=0, mesh=mesh),
                      optax.adam(1e-3)).init(params)
  with pytest.raises(ValueError, match=r"state_specs\(..., axis_name='batch'\): the "
                     r"optimizer state's per-device residual \['w'\] is laid out over 'data'.*"
                     r"axis_name='data'"):
    topka2a_jax.state_specs(state, axis_name="batch")
  guarded = topka2a_jax.skip_nonfinite(
      topka2a_jax.compress_updates(optax.adam(1e-3), mesh=mesh), axis_name="batch")
  with pytest.raises(ValueError, match=r"skip_nonfinite\(..., axis_name='batch'\).*laid out "
                                       r"over 'data'.*axis_name='data'"):
    guarded.init(params)


@pytest.mark.parametrize("old, new", [
    (lambda: topka2a_jax.local_steps(optax.adam(1e-3), 8, None, None),
     r"local_steps\(inner, 8, None, None\): pass every=, outer=, density= by keyword"),
    (lambda: topka2a_jax.compress_updates(optax.adam(1e-3), 0.01),
     (r"compress_updates\(inner, 0.01\): pass density= by keyword, "
     r"compress_updates\(inner, density=0.01\)")),
    (lambda: topka2a_jax.sharded_optimizer(optax.adam(1e-3), 0.01),
     r"sharded_optimizer\(inner, 0.01\): pass density= by keyword"),
    (lambda: topka2a_jax.skip_nonfinite(optax.adam(1e-3), "data"),
     r"skip_nonfinite\(inner, 'data'\): pass axis_name= by keyword"),
    (lambda: topka2a_jax.accumulate_gradients(tx=optax.chain(topka2a_jax.topka2a(0.01),
                                                             optax.sgd(0.1)), every=2),
     r"accumulate_gradients\(tx=...\) is now accumulate_gradients\(inner=...\)"),
    (lambda: topka2a_jax.accumulate_gradients(optax.chain(topka2a_jax.topka2a(0.01),
                                                          optax.sgd(0.1)), 2),
     r"accumulate_gradients\(inner, 2\): pass every= by keyword"),
    (lambda: topka2a_jax.accumulate_gradients(optax.chain(topka2a_jax.topka2a(0.01),
                                                          optax.sgd(0.1)), every=2,
                                              axis_name="data"),
     (r"accumulate_gradients\(..., axis_name=...\) is no longer needed: it reads the axis "
     r"from the exchange it wraps")),
], ids=["local_steps", "compress_updates", "sharded_optimizer", "skip_nonfinite",
        "accumulate tx=", "accumulate every", "accumulate axis_name"])
def test_a_wrappers_old_spelling_works_with_a_warning_naming_the_new(old, new):
  with pytest.warns(DeprecationWarning, match=new):
    tx = old()
  assert callable(tx.init) and callable(tx.update)


def test_accumulate_gradients_reads_the_axis_from_the_exchange_it_wraps():
  """Once from the exchange, never twice: the pair of axes of a two-level exchange."""
  mesh = jax.make_mesh((2, 4), ("node", "local"))
  exchange = topka2a_jax.topka2a(0.1, mesh=mesh, axis_name=("node", "local"), min_size=0)
  tx = topka2a_jax.accumulate_gradients(optax.chain(exchange, optax.sgd(0.1)), every=2)
  state = tx.init(PARAMS)
  assert state.grads["w"].shape == (8, *PARAMS["w"].shape)  # one sum per device
  refused = pytest.raises(ValueError, match=r"axis_name='data'\) wraps an exchange over "
                                          r"\('node', 'local'\); leave axis_name out")
  with refused, pytest.warns(DeprecationWarning):
    topka2a_jax.accumulate_gradients(optax.chain(exchange, optax.sgd(0.1)), every=2,
                                     axis_name="data")
