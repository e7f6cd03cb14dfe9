"""The α-β cost model: what each exchange sends, and how long it takes.

The planner (:func:`topka2a_jax.plan_fusion`) chooses buckets and exchanges
with these functions; they are here to answer "does compression pay on my
link?" before anything runs.

* :class:`Network` (α latency, β bandwidth) and its presets :data:`NETWORKS`;
  :class:`Cluster`, two links (inside a node, between nodes).
* :func:`exchange_cost`, :func:`cluster_cost` (a flat or :data:`TWO_LEVEL`
  route), :func:`low_rank_step` (PowerSGD), :func:`breakeven_density`.
* :func:`elements_read`, :func:`selected_entries`: the selection's work.
* :class:`StepModel`: a whole step's predicted time, the planner's objective,
  priced with one :class:`PlannerSettings` record (the link, overlap, rates).
* :func:`time_call`: a measured time to set beside a prediction.

Example:
  >>> eth10 = topka2a_jax.cost.NETWORKS["eth10"]
  >>> dense = topka2a_jax.cost.exchange_cost("dense", 25_000_000, 8, 1.0)
  >>> sparse = topka2a_jax.cost.exchange_cost("topka2a_sparse", 25_000_000, 8, 0.01)
  >>> round(dense.seconds(eth10) / sparse.seconds(eth10))  # 1% of 25M floats on 8
  40
"""

from typing import TYPE_CHECKING

from topka2a_jax._src import lazy as _lazy

if TYPE_CHECKING:  # the namespace; at run time each name is imported on first use
  from topka2a_jax._src.planner import compute as _compute
  from topka2a_jax._src.planner import cost as _cost
  from topka2a_jax._src.planner import forms as _forms
  from topka2a_jax._src.planner.compute import Device
  from topka2a_jax._src.planner.cost import (
    Cluster,
    ClusterCost,
    LowRankStep,
    Network,
    breakeven_density,
    cluster_cost,
    detected_network,
    elements_read,
    exchange_cost,
    from_link_fit,
    get_network,
    low_rank_step,
    selected_entries,
  )
  from topka2a_jax._src.planner.fusion import PlannerSettings, StepModel
  from topka2a_jax._src.planner.tuning import time_call

  NETWORKS = _cost.NETWORKS
  """The links the planner knows, by the name ``network=`` takes
  (``"nvlink"``, ``"ib100"``, ``"eth25"``, ``"eth10"``, ``"eth1"``, ...; each a
  :class:`Network` with its source); ``network="auto"`` picks one for the
  backend (:func:`detected_network`)."""

  DEVICES = _compute.DEVICES
  """Devices' sustained rates by name (``"h100"``, ``"a100"``, ``"tpu-v5e"``,
  ``"cpu"``; each a :class:`Device`), which price the backward pass that
  buckets overlap."""

  INNER_NETWORK = _cost.INNER_NETWORK
  """The link inside a node when ``network=`` names only the one between nodes:
  ``"nvlink"``."""

  AUTO_FORMS = _forms.FORMS
  """The exchanges ``algorithm="auto"`` plans each bucket among, by the kind of
  optimizer after it in the chain: ``"adaptive"`` (Adam's family) and
  ``"unknown"`` the 8-bit gradient or dense, ``"momentum"`` (momentum SGD)
  4 bits up and 8 back or dense, ``"plain"`` (SGD or nothing) the top-k forms
  or dense."""

  AUTO_FORMS_WHY = _forms.WHY
  """Why each kind of optimizer in :data:`AUTO_FORMS` gets its forms, in words."""

  LOCAL_STEPS_FORM = _forms.LOCAL_STEPS_FORM
  """The pseudo-gradient's exchange of :func:`topka2a_jax.local_steps` by
  default: ``"rotated_4_4"``."""

  FLAT = _cost.FLAT
  """The route of an exchange over a cluster's devices as one axis."""

  TWO_LEVEL = _cost.TWO_LEVEL
  """The route of :func:`topka2a_jax.collectives.two_level`, dense inside each
  node and the exchange between nodes."""

_LAZY = {  # each name, its module (":attribute" where the name differs); the
    # block above says the same to type checkers, and tests/test_package.py
    # holds the two equal
    "Device": "topka2a_jax._src.planner.compute",
    "Cluster": "topka2a_jax._src.planner.cost",
    "ClusterCost": "topka2a_jax._src.planner.cost",
    "LowRankStep": "topka2a_jax._src.planner.cost",
    "Network": "topka2a_jax._src.planner.cost",
    "breakeven_density": "topka2a_jax._src.planner.cost",
    "cluster_cost": "topka2a_jax._src.planner.cost",
    "detected_network": "topka2a_jax._src.planner.cost",
    "elements_read": "topka2a_jax._src.planner.cost",
    "exchange_cost": "topka2a_jax._src.planner.cost",
    "from_link_fit": "topka2a_jax._src.planner.cost",
    "get_network": "topka2a_jax._src.planner.cost",
    "low_rank_step": "topka2a_jax._src.planner.cost",
    "selected_entries": "topka2a_jax._src.planner.cost",
    "PlannerSettings": "topka2a_jax._src.planner.fusion",
    "StepModel": "topka2a_jax._src.planner.fusion",
    "time_call": "topka2a_jax._src.planner.tuning",
    "NETWORKS": "topka2a_jax._src.planner.cost",
    "DEVICES": "topka2a_jax._src.planner.compute",
    "INNER_NETWORK": "topka2a_jax._src.planner.cost",
    "AUTO_FORMS": "topka2a_jax._src.planner.forms:FORMS",
    "AUTO_FORMS_WHY": "topka2a_jax._src.planner.forms:WHY",
    "LOCAL_STEPS_FORM": "topka2a_jax._src.planner.forms",
    "FLAT": "topka2a_jax._src.planner.cost",
    "TWO_LEVEL": "topka2a_jax._src.planner.cost",
}

__all__ = [
  "AUTO_FORMS",
  "AUTO_FORMS_WHY",
  "DEVICES",
  "FLAT",
  "INNER_NETWORK",
  "LOCAL_STEPS_FORM",
  "NETWORKS",
  "TWO_LEVEL",
  "Cluster",
  "ClusterCost",
  "Device",
  "LowRankStep",
  "Network",
  "PlannerSettings",
  "StepModel",
  "breakeven_density",
  "cluster_cost",
  "detected_network",
  "elements_read",
  "exchange_cost",
  "from_link_fit",
  "get_network",
  "low_rank_step",
  "selected_entries",
  "time_call",
]

__getattr__, __dir__ = _lazy.attach(__name__, _LAZY)
del _lazy  # help() lists the face's names, not the loader
