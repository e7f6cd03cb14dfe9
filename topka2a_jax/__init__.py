"""topka2a-jax: top-k sparse gradient averaging over AlltoAll, as an optax transform.

Data-parallel training averages every gradient across devices at every step.
This package sends only the largest ``density`` fraction of each device's
gradient, keeps the rest in a per-device residual (error feedback) and
averages the sparse pieces with the TopKA2A algorithm (Peng, Li, Shi, Li,
ICPP 2024, doi:10.1145/3673038.3673140), whose volume does not grow with the
number of devices.

Read it top-down:

* :mod:`topka2a_jax.step`: ``train_step``, the jitted data-parallel step;
  :mod:`topka2a_jax.nnx_step`: the same for Flax NNX.
* :mod:`topka2a_jax.transform`: the optax transform users chain first, with
  its options (:mod:`topka2a_jax.options`) and the per-device exchange
  (:mod:`topka2a_jax.exchange`).
* :mod:`topka2a_jax.update_compression`: ``compress_updates``, the
  optimizer run on every device's own gradient and its updates exchanged
  sparsely: what converges with Adam; :mod:`topka2a_jax.frozen_variance`:
  Adam's momentum compressed and its variance frozen (1-bit Adam's form).
* :mod:`topka2a_jax.sharded_optimizer`: the optimizer run on the shards
  TopKA2A's first phase leaves each device, its state divided among them.
* :mod:`topka2a_jax.layout`: parameter specs and the residuals' layout.
* :mod:`topka2a_jax.buckets`: fusing gradient leaves into flat buffers.
* :mod:`topka2a_jax.collectives`: the dense, TopkA and TopKA2A exchanges;
  :mod:`topka2a_jax.low_rank`: PowerSGD, matrices as rank-r products.
* :mod:`topka2a_jax.selection`: how many entries to send, and which.
* :mod:`topka2a_jax.wire`: values and indices packed into one message.
* :mod:`topka2a_jax.axis`: trace-time checks of the mesh axis.
* :mod:`topka2a_jax.nonfinite`: skipping steps with NaN or infinite gradients.
* :mod:`topka2a_jax.placement`: laying the optimizer state out on a mesh.
* :mod:`topka2a_jax.checkpoint`: saving and restoring it, on any device count;
  :mod:`topka2a_jax.checkpoint_manager`: every N steps, the last few kept.
* :mod:`topka2a_jax.distributed`, :mod:`topka2a_jax.launch`: several processes
  (hosts), and the local launcher that starts them.
* :mod:`topka2a_jax.fusion`: planning buckets with the cost model; the
  online variant that times real steps is :mod:`topka2a_jax.tuning`.
* :mod:`topka2a_jax.cost`: the α-β cost of each exchange;
  :mod:`topka2a_jax.compute`: how long the backward pass takes.
* :mod:`topka2a_jax.report`: the collectives a compiled program really runs.
* :mod:`topka2a_jax.algorithms`: every exchange, its collective and its cost
  terms, in one registry.
* :mod:`topka2a_jax.plan`: the command-line planner, with the layer shapes of
  known models.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> def loss_fn(params, batch):
  ...   x, y = batch
  ...   return jnp.mean((x @ params["w"] - y) ** 2)
  >>> params = {"w": jnp.zeros((16, 4))}
  >>> batch = (jnp.ones((64, 16)), jnp.ones((64, 4)))
  >>> tx = optax.chain(topka2a_jax.topka2a(density=0.01, mesh=mesh),
  ...                  optax.adam(1e-3))
  >>> opt_state = tx.init(params)
  >>> step = topka2a_jax.train_step(loss_fn, tx, mesh)
  >>> params, opt_state, loss = step(params, opt_state, batch)
  >>> float(loss)
  1.0
"""

from topka2a_jax import checkpoint, collectives, low_rank
from topka2a_jax.checkpoint import restore, save
from topka2a_jax.checkpoint_manager import CheckpointManager
from topka2a_jax.collectives import Exchange
from topka2a_jax.cost import NETWORKS, Network, breakeven_density, exchange_cost
from topka2a_jax.frozen_variance import frozen_variance_adam, scale_by_frozen_rms
from topka2a_jax.fusion import FusionPlan, plan_fusion
from topka2a_jax.nonfinite import SkipNonFiniteState, skip_nonfinite
from topka2a_jax.placement import init, state_specs
from topka2a_jax.report import CommReport, comm_report
from topka2a_jax.sharded_optimizer import sharded_optimizer
from topka2a_jax.states import (
  CompressedUpdatesState,
  ShardedOptimizerState,
  TopKA2AState,
)
from topka2a_jax.step import TrainStep, train_step
from topka2a_jax.transform import topka2a
from topka2a_jax.tuning import time_call, tune_fusion
from topka2a_jax.update_compression import compress_updates

__all__ = [
  "NETWORKS",
  "CheckpointManager",
  "CommReport",
  "CompressedUpdatesState",
  "Exchange",
  "FusionPlan",
  "Network",
  "NnxTrainStep",
  "ShardedOptimizerState",
  "SkipNonFiniteState",
  "TopKA2AState",
  "TrainStep",
  "breakeven_density",
  "checkpoint",
  "collectives",
  "comm_report",
  "compress_updates",
  "exchange_cost",
  "frozen_variance_adam",
  "init",
  "low_rank",
  "nnx_train_step",
  "plan_fusion",
  "restore",
  "save",
  "scale_by_frozen_rms",
  "sharded_optimizer",
  "skip_nonfinite",
  "state_specs",
  "time_call",
  "topka2a",
  "train_step",
  "tune_fusion",
]


def __getattr__(name: str):
  """``nnx_train_step`` and ``NnxTrainStep`` import Flax, so only on first use."""
  if name in ("nnx_train_step", "NnxTrainStep"):
    try:
      from topka2a_jax import nnx_step
    except ImportError as error:
      raise ImportError(f"topka2a_jax.{name} needs Flax: pip install "
                        f"'topka2a-jax[nnx]' ({error})") from None
    return getattr(nnx_step, name)
  raise AttributeError(f"module 'topka2a_jax' has no attribute {name!r}")
