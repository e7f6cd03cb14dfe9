"""topka2a-jax: compressed gradient exchange for JAX data-parallel training, as an optax transform.

Data-parallel training averages every gradient across devices at every step.
This package sends less of each device's gradient: its largest ``density``
fraction (a top-k) before plain SGD, every entry in a few bits before Adam's
family, as the optimizer after the exchange needs; what is not sent waits in
a per-device residual (error feedback). The pieces are averaged by the
TopKA2A algorithm's AlltoAll to each shard's owner and AllGather back (Peng,
Li, Shi, Li, ICPP 2024, doi:10.1145/3673038.3673140), whose volume does not
grow with the number of devices.

The public face is this module (:data:`__all__`, and ``nnx_train_step`` and
``NnxTrainStep``, which need Flax) and four namespaces:
:mod:`topka2a_jax.collectives` (the exchanges, for your own shard_map),
:mod:`topka2a_jax.cost` (the α-β cost model), :mod:`topka2a_jax.checkpoint`
and :mod:`topka2a_jax.distributed` (several processes). The code lives in
``topka2a_jax/_src``; read it top-down from ``_src/__init__.py``. Each name
is imported on first use, so ``import topka2a_jax`` imports no JAX until you
use it.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> def loss_fn(params, x):
  ...   return jnp.mean((x @ params["w"] - 1.0) ** 2)
  >>> params = {"w": jnp.zeros((16, 4))}
  >>> tx = optax.chain(topka2a_jax.topka2a(0.01, mesh=mesh), optax.adam(1e-2))
  >>> opt_state = tx.init(params)  # residuals per device, one Adam
  >>> step = topka2a_jax.train_step(loss_fn, tx, mesh)
  >>> losses = []
  >>> for _ in range(50):
  ...   params, opt_state, loss = step(params, opt_state, jnp.ones((64, 16)))
  ...   losses.append(float(loss))
  >>> losses[0], bool(losses[-1] < 0.5 * losses[0])
  (1.0, True)
"""

from typing import TYPE_CHECKING

from topka2a_jax._src import lazy as _lazy

if TYPE_CHECKING:  # the face; at run time each name is imported on first use (_src/lazy.py)
  from topka2a_jax import checkpoint as checkpoint
  from topka2a_jax import collectives as collectives
  from topka2a_jax import cost as cost
  from topka2a_jax import distributed as distributed
  from topka2a_jax._src.checkpointing.checkpoint import restore, save
  from topka2a_jax._src.checkpointing.checkpoint_manager import CheckpointManager
  from topka2a_jax._src.planner.fusion import FusionPlan, plan_fusion
  from topka2a_jax._src.planner.report import CommReport, comm_report
  from topka2a_jax._src.planner.tuning import tune_fusion
  from topka2a_jax._src.states import (
    AccumulatedGradientsState,
    CompressedUpdatesState,
    LocalStepsState,
    RoundInFlight,
    ShardedOptimizerState,
    TopKA2AState,
    local_params,
  )
  from topka2a_jax._src.training.nnx_step import NnxTrainStep as NnxTrainStep
  from topka2a_jax._src.training.nnx_step import nnx_train_step as nnx_train_step
  from topka2a_jax._src.training.placement import init, state_specs
  from topka2a_jax._src.training.step import TrainStep, train_step
  from topka2a_jax._src.transforms.accumulation import accumulate_gradients
  from topka2a_jax._src.transforms.frozen_variance import (
    frozen_variance_adam,
    scale_by_frozen_rms,
  )
  from topka2a_jax._src.transforms.local_steps import local_steps
  from topka2a_jax._src.transforms.nonfinite import SkipNonFiniteState, skip_nonfinite
  from topka2a_jax._src.transforms.sharded_optimizer import sharded_optimizer
  from topka2a_jax._src.transforms.topka2a import topka2a
  from topka2a_jax._src.transforms.update_compression import compress_updates

_LAZY = {  # each name, its module (":attribute" where the name differs); the
    # block above says the same to type checkers, and tests/test_package.py
    # holds the two equal
    "checkpoint": "topka2a_jax",
    "collectives": "topka2a_jax",
    "cost": "topka2a_jax",
    "distributed": "topka2a_jax",
    "restore": "topka2a_jax._src.checkpointing.checkpoint",
    "save": "topka2a_jax._src.checkpointing.checkpoint",
    "CheckpointManager": "topka2a_jax._src.checkpointing.checkpoint_manager",
    "FusionPlan": "topka2a_jax._src.planner.fusion",
    "plan_fusion": "topka2a_jax._src.planner.fusion",
    "CommReport": "topka2a_jax._src.planner.report",
    "comm_report": "topka2a_jax._src.planner.report",
    "tune_fusion": "topka2a_jax._src.planner.tuning",
    "AccumulatedGradientsState": "topka2a_jax._src.states",
    "CompressedUpdatesState": "topka2a_jax._src.states",
    "LocalStepsState": "topka2a_jax._src.states",
    "RoundInFlight": "topka2a_jax._src.states",
    "ShardedOptimizerState": "topka2a_jax._src.states",
    "TopKA2AState": "topka2a_jax._src.states",
    "local_params": "topka2a_jax._src.states",
    "NnxTrainStep": "topka2a_jax._src.training.nnx_step",
    "nnx_train_step": "topka2a_jax._src.training.nnx_step",
    "init": "topka2a_jax._src.training.placement",
    "state_specs": "topka2a_jax._src.training.placement",
    "TrainStep": "topka2a_jax._src.training.step",
    "train_step": "topka2a_jax._src.training.step",
    "accumulate_gradients": "topka2a_jax._src.transforms.accumulation",
    "frozen_variance_adam": "topka2a_jax._src.transforms.frozen_variance",
    "scale_by_frozen_rms": "topka2a_jax._src.transforms.frozen_variance",
    "local_steps": "topka2a_jax._src.transforms.local_steps",
    "SkipNonFiniteState": "topka2a_jax._src.transforms.nonfinite",
    "skip_nonfinite": "topka2a_jax._src.transforms.nonfinite",
    "sharded_optimizer": "topka2a_jax._src.transforms.sharded_optimizer",
    "topka2a": "topka2a_jax._src.transforms.topka2a",
    "compress_updates": "topka2a_jax._src.transforms.update_compression",
}

__all__ = [
  "AccumulatedGradientsState",
  "CheckpointManager",
  "CommReport",
  "CompressedUpdatesState",
  "FusionPlan",
  "LocalStepsState",
  "RoundInFlight",
  "ShardedOptimizerState",
  "SkipNonFiniteState",
  "TopKA2AState",
  "TrainStep",
  "accumulate_gradients",
  "comm_report",
  "compress_updates",
  "frozen_variance_adam",
  "init",
  "local_params",
  "local_steps",
  "plan_fusion",
  "restore",
  "save",
  "scale_by_frozen_rms",
  "sharded_optimizer",
  "skip_nonfinite",
  "state_specs",
  "topka2a",
  "train_step",
  "tune_fusion",
]


NEEDS_FLAX = ("NnxTrainStep", "nnx_train_step")
"""Public names that import Flax; not in ``__all__``, so that ``from
topka2a_jax import *`` works without Flax."""

_MOVED = {
    "Exchange": "topka2a_jax.collectives.ExchangeResult",
    "NETWORKS": "topka2a_jax.cost.NETWORKS",
    "Network": "topka2a_jax.cost.Network",
    "breakeven_density": "topka2a_jax.cost.breakeven_density",
    "exchange_cost": "topka2a_jax.cost.exchange_cost",
    "low_rank": "topka2a_jax.collectives.powersgd and .initial_factor",
    "time_call": "topka2a_jax.cost.time_call",
}
"""Names the top level exported in an earlier release that moved, and where each is now."""


_import_on_first_use, _every_name = _lazy.attach(__name__, _LAZY)
del _lazy  # help() lists the face's names, not the loader


def __dir__() -> list[str]:
  """The face's names but the two that need Flax: ``help(topka2a_jax)`` works without it.

  Its public names, namespaces and the module's dunders (``__version__``
  among them); not the loader's own names.
  """
  def shown(name: str) -> bool:
    private = name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
    return not private and name not in (*NEEDS_FLAX, "NEEDS_FLAX", "TYPE_CHECKING")

  return sorted(filter(shown, {*_every_name(), "__version__"}))


def __getattr__(name: str):
  """Imports a public name on first use; ``nnx_train_step`` and ``NnxTrainStep`` need Flax."""
  if name == "__version__":  # the installed distribution's, as pip shows it
    from importlib.metadata import PackageNotFoundError, version
    try:
      return version("topka2a-jax")
    except PackageNotFoundError:
      return "unknown (not installed: pip install -e .)"
  if name in _MOVED:
    raise AttributeError(f"topka2a_jax.{name} has moved: use {_MOVED[name]}")
  try:
    return _import_on_first_use(name)
  except ImportError as error:
    if name not in NEEDS_FLAX:
      raise
    raise ImportError(f"topka2a_jax.{name} needs Flax: pip install "
                      f"'topka2a-jax[nnx]' ({error})") from None
