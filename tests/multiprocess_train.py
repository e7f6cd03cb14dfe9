"""A few data-parallel steps on every device of every process.

Run in one process (``XLA_FLAGS`` giving it 4 devices) or under the launcher
(``topka2a-launch -n 2 --devices-per-process 2``); process 0
writes each step's mean gradient (hand-written shard_map step) or loss
(``topka2a_jax.train_step``; ``two_level`` on a ``("node", "local")`` mesh of
two nodes, each process one node when there are two; ``train_step_adam`` with
Adam after the exchange; ``local_steps`` and
``local_two_level`` train with ``local_steps(optax.adam(...), 2)``, ALGORITHM the
pseudo-gradient's form) and parameters, so that tests can check the two agree:

  python tests/multiprocess_train.py ALGORITHM OUT.npz \
      [shard_map|train_step|train_step_adam|two_level|local_steps|local_two_level]
"""

import sys
import threading

import topka2a_jax.distributed
from topka2a_jax._src.runtime.distributed import launched

if launched():
  topka2a_jax.distributed.initialize()

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax


def global_array(value, mesh, spec):
  """The same NumPy value on every process, placed as one global array."""
  value = np.asarray(value)
  return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                      lambda index: value[index])


def local_copy(array):
  """A replicated global array as NumPy, from this process's first shard."""
  return np.asarray(array.addressable_data(0))


def loss_of(params, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2)


def held_back(step, tx):
  """Each round's exchange held on its thread until the next round's first step has
  returned with its results (a step that waited for it would wait a minute, in vain):
  returns the gates and whether each exchange was released in time."""
  flight = step._flight(tx)
  program, gates, released = flight.program, [threading.Event() for _ in range(8)], []

  def held(*args):
    made = program(*args)

    def run(*inputs):
      released.append(gates[len(released)].wait(60))
      return made(*inputs)

    return run

  flight.program = held
  return gates, released


def with_train_step(mesh, algorithm, params, batches, axis_name="data", local=False,
                    adam=False, overlap=False):
  """The same run through topka2a_jax.train_step: every step's loss and params.

  With ``overlap``, the params only (the loss is each process's own devices'),
  and each round's exchange held until the next round's first step returned.
  """
  if local:  # rounds of two Adam steps, then the pseudo-gradient in `algorithm`
    tx = topka2a_jax.local_steps(optax.adam(0.05), every=2, algorithm=algorithm, min_size=0,
                                 mesh=mesh, axis_name=axis_name, overlap=overlap)
  else:  # adam: its count is made on one device, the step places it on every process
    tx = optax.chain(topka2a_jax.topka2a(0.1, algorithm=algorithm, min_size=0,
                                         mesh=mesh, axis_name=axis_name),
                     optax.adam(0.01) if adam else optax.sgd(0.1))
  params = jax.tree.map(lambda v: global_array(v, mesh, P()), params)
  step = topka2a_jax.train_step(loss_of, tx, mesh, axis_name=axis_name)
  state, record = tx.init(params), {}
  gates, released = held_back(step, tx) if overlap else ([], [])
  for i, (x, y) in enumerate(batches):
    batch = (global_array(x, mesh, P(axis_name)), global_array(y, mesh, P(axis_name)))
    params, state, loss = step(params, state, batch)
    jax.block_until_ready((params, state))
    if overlap and i % 2 == 0 and i:  # the first step of a round: the last exchange may go
      gates[i // 2 - 1].set()
    if not overlap:
      record[f"loss{i}"] = local_copy(loss)
    for k in ("w", "b"):
      record[f"params{i}_{k}"] = local_copy(params[k])
  for gate in gates:
    gate.set()
  step.settle()  # the last round's exchange has run
  if overlap:
    assert released[:2] == [True, True], f"a step waited for the exchange: {released}"
  return record


def main(algorithm, out, route="shard_map"):
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = Mesh(np.array(devices), ("data",))
  rng = np.random.default_rng(91)
  params = {"w": rng.normal(size=(24, 16)).astype(np.float32) / 5,
            "b": np.zeros(16, np.float32)}
  if route in ("train_step", "train_step_adam", "two_level", "local_steps",
               "local_two_level", "local_overlapped"):
    batches = []
    for _ in range(5):
      x = rng.normal(size=(32, 24)).astype(np.float32)
      batches.append((x, np.sin(x[:, :16])))
    local = route.startswith("local")
    if route.endswith("two_level"):  # two nodes: with two processes, each one a node
      mesh = Mesh(np.array(devices).reshape(2, -1), ("node", "local"))
      record = with_train_step(mesh, algorithm, params, batches, ("node", "local"), local)
    else:
      record = with_train_step(mesh, algorithm, params, batches, local=local,
                               adam=route == "train_step_adam",
                               overlap=route == "local_overlapped")
    print(f"{jax.process_count()} processes, {jax.device_count()} devices")
    if jax.process_index() == 0:
      np.savez(out, **record)
    return
  tx = optax.chain(topka2a_jax.topka2a(0.1, algorithm=algorithm, min_size=0),
                   optax.sgd(0.1))
  state = topka2a_jax.init(tx, params, mesh)
  specs = topka2a_jax.state_specs(state)

  def step(params, state, x, y):
    def loss(p):
      return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)
    value, grads = jax.value_and_grad(loss)(lax.pcast(params, "data", to="varying"))
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, updates, lax.pmean(value, "data")

  run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                              out_specs=(P(), specs, P(), P())))
  params = jax.tree.map(lambda v: global_array(v, mesh, P()), params)
  record = {}
  for i in range(5):
    x = rng.normal(size=(32, 24)).astype(np.float32)
    y = np.sin(x[:, :16])
    params, state, updates, loss = run(params, state, global_array(x, mesh, P("data")),
                                       global_array(y, mesh, P("data")))
    record[f"loss{i}"] = local_copy(loss)
    for k in ("w", "b"):
      record[f"mean_grad{i}_{k}"] = local_copy(updates[k])
      record[f"params{i}_{k}"] = local_copy(params[k])
  print(f"{jax.process_count()} processes, {jax.device_count()} devices, "
        f"loss {float(record['loss0']):.4f} -> {float(record['loss4']):.4f}")
  if jax.process_index() == 0:
    np.savez(out, **record)


if __name__ == "__main__":
  main(*sys.argv[1:])
