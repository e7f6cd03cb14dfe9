"""Bad input gets an error that names the problem; nothing is half-applied."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax

PARAMS = {"w": jnp.ones((64, 32)), "b": jnp.zeros(32)}


@pytest.mark.parametrize("density", [0, 0.0, -0.1, 1.5, math.nan, math.inf,
                                     "0.1", None, True, [0.1]])
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


def test_update_outside_shard_map_names_the_axis():
  tx = topka2a_jax.topka2a(0.1, min_size=0)
  with pytest.raises(ValueError, match="axis name 'data' is not bound.*shard_map"):
    tx.update(PARAMS, tx.init(PARAMS))


def sharded_update(mesh, tx, grads_fn, specs=None):
  """Runs tx.update in a shard_map step on grads_fn(params)."""
  state = topka2a_jax.init(tx, PARAMS, mesh)
  specs = topka2a_jax.state_specs(state) if specs is None else specs

  def step(params, state):
    updates, state = tx.update(grads_fn(params), state, params)
    return updates, state

  params = jax.device_put(PARAMS, NamedSharding(mesh, P()))
  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs),
                              out_specs=(P(), topka2a_jax.state_specs(state))))
  return run, params, state


def per_device_grads(params):
  local = lax.pcast(params, "data", to="varying")
  return jax.tree.map(lambda p: p * (1 + lax.axis_index("data")), local)


def update_step(mesh, tx, state_in, state_out=None):
  """tx.update on per_device_grads in a jitted shard_map step with these state
  specs, and PARAMS placed for it."""
  run = jax.jit(jax.shard_map(
      lambda p, s: tx.update(per_device_grads(p), s), mesh=mesh,
      in_specs=(P(), state_in),
      out_specs=(P(), state_in if state_out is None else state_out)))
  return run, jax.device_put(PARAMS, NamedSharding(mesh, P()))


def test_wrong_axis_name_inside_shard_map(mesh):
  tx = topka2a_jax.topka2a(0.1, axis_name="batch", min_size=0)
  run, params, state = sharded_update(mesh, tx, per_device_grads)
  with pytest.raises(ValueError, match="axis name 'batch' is not bound"):
    run(params, state)


def test_non_floating_leaf_is_named_at_init_and_update(mesh):
  tx = topka2a_jax.topka2a(0.1)
  with pytest.raises(TypeError, match=r"parameter leaf \['step'\] has dtype int32"):
    tx.init({"w": jnp.ones(4), "step": jnp.zeros((), jnp.int32)})
  with pytest.raises(TypeError, match=r"gradient leaf \['n'\] has dtype int32"):
    tx.update({"n": jnp.ones(3, jnp.int32)}, topka2a_jax.TopKA2AState({"n": 0}, 0, 0))


def test_already_summed_gradients_are_refused(mesh):
  # Differentiating with respect to replicated params makes JAX psum them.
  tx = topka2a_jax.topka2a(0.1, min_size=0)

  def grads_of_replicated(params):
    return jax.grad(lambda p: jnp.sum(p["w"] ** 2) + jnp.sum(p["b"]))(params)

  run, params, state = sharded_update(mesh, tx, grads_of_replicated)
  with pytest.raises(ValueError, match=r"already\s+summed.*pcast\(params, 'data'"):
    run(params, state)


def test_state_of_another_model(mesh):
  tx = topka2a_jax.topka2a(0.1, min_size=0)
  other = tx.init({"w": jnp.ones((64, 32))})
  with pytest.raises(ValueError, match="does not match the gradients' pytree"):
    jax.jit(jax.shard_map(lambda s: tx.update(PARAMS, s), mesh=mesh,
                          in_specs=P(), out_specs=P()))(
        jax.device_put(other, NamedSharding(mesh, P())))


def test_state_passed_replicated_instead_of_per_device(mesh):
  # The global state, replicated and passed with P() specs: each device then
  # sees all devices' residuals.
  tx = topka2a_jax.topka2a(0.1, min_size=0)
  state = jax.device_put(topka2a_jax.init(tx, PARAMS, mesh),
                         NamedSharding(mesh, P()))
  run, params = update_step(mesh, tx, P(), P("data"))
  with pytest.raises(ValueError, match=r"residual for leaf \['b'\] has shape "
                     r"\(256,\), expected \(32,\).*state_specs"):
    run(params, state)


def test_state_made_with_other_options(mesh):
  made = topka2a_jax.topka2a(0.1, min_size=0)
  used = topka2a_jax.topka2a(0.1, min_size=100)
  state = topka2a_jax.init(made, PARAMS, mesh)
  specs = topka2a_jax.state_specs(state)
  run, params = update_step(mesh, used, specs)
  with pytest.raises(ValueError, match=r"residual for leaf \['b'\].*other options"):
    run(params, state)


def test_failed_update_leaves_the_state_usable(mesh):
  tx = topka2a_jax.topka2a(0.1, min_size=0)
  run, params, state = sharded_update(mesh, tx, per_device_grads)
  params_bad = {"w": params["w"].astype(jnp.int32), "b": params["b"]}
  before = jax.tree.map(np.asarray, state)
  with pytest.raises(TypeError, match="dtype int32"):
    run(params_bad, state)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state), before)
  _, new_state = run(params, state)
  assert float(jnp.abs(new_state.residuals["w"]).sum()) > 0


def test_init_on_a_mesh_without_the_axis(mesh):
  tx = topka2a_jax.topka2a(0.1)
  with pytest.raises(ValueError, match=r"mesh has no axis 'batch'.*\('data',\)"):
    topka2a_jax.init(tx, PARAMS, mesh, axis_name="batch")


def test_state_from_a_mesh_of_another_size(mesh):
  # A state initialised on 8 devices, moved as it is onto a 4-device step:
  # each device would see two devices' residuals.
  tx = topka2a_jax.topka2a(0.1, min_size=0)
  state = topka2a_jax.init(tx, PARAMS, mesh)
  small = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  specs = topka2a_jax.state_specs(state)
  moved = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(small, s), specs))
  run, params = update_step(small, tx, specs)
  with pytest.raises(ValueError, match=r"residual for leaf \['b'\] has shape "
                     r"\(64,\), expected \(32,\)"):
    run(params, moved)


def test_nonfinite_gradients_are_skipped_not_raised(mesh):
  # Not an error: the step is skipped on every device (tests/test_nonfinite.py).
  tx = topka2a_jax.topka2a(0.1, min_size=0)
  run, params, state = sharded_update(
      mesh, tx, lambda p: jax.tree.map(lambda x: x * jnp.nan, per_device_grads(p)))
  updates, new_state = run(params, state)
  assert int(new_state.nonfinite_steps) == 1
  assert not any(np.asarray(u).any() for u in jax.tree.leaves(updates))


def test_param_specs_of_another_pytree(mesh):
  tx = topka2a_jax.topka2a(0.1)
  with pytest.raises(ValueError, match="param_specs has 1 PartitionSpecs for 2 "
                     "parameter leaves"):
    topka2a_jax.init(tx, PARAMS, mesh, param_specs={"w": P()})
