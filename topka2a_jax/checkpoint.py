"""Saving and restoring training state, on the same or another device count.

:func:`save` and :func:`restore` (also ``topka2a_jax.save`` and
``topka2a_jax.restore``) write any pytree holding the transforms' states
with Orbax, with a description of its layout and a manifest of every file's
SHA-256; :class:`CheckpointManager` saves every N steps and keeps the last
few. On another number of devices the residuals are resized
(:func:`resize_residual`, :func:`resize_slices` for a pair of data axes) and
a sharded optimizer's state re-sharded (:func:`reshard`), so that nothing
error feedback holds is lost. :func:`verify` checks a directory without
restoring it.

Example:
  >>> import tempfile
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> tx = optax.chain(topka2a_jax.topka2a(0.01), optax.sgd(0.1))
  >>> params = {"w": jnp.ones((64, 64))}
  >>> state = {"params": params, "opt_state": topka2a_jax.init(tx, params, mesh)}
  >>> directory = tempfile.mkdtemp() + "/step_0"
  >>> topka2a_jax.checkpoint.save(directory, state, mesh)
  >>> topka2a_jax.checkpoint.verify(directory)
  >>> restored = topka2a_jax.checkpoint.restore(directory, state, mesh)
  >>> bool(jnp.all(restored["params"]["w"] == 1.0))
  True
"""

from typing import TYPE_CHECKING

from topka2a_jax._src import lazy as _lazy

if TYPE_CHECKING:  # the namespace; at run time each name is imported on first use
  from topka2a_jax._src.checkpointing.checkpoint import restore, save
  from topka2a_jax._src.checkpointing.checkpoint_manager import CheckpointManager
  from topka2a_jax._src.checkpointing.integrity import verify
  from topka2a_jax._src.checkpointing.resize import reshard, resize_residual, resize_slices

_LAZY = {  # each name, its module (":attribute" where the name differs); the
    # block above says the same to type checkers, and tests/test_package.py
    # holds the two equal
    "restore": "topka2a_jax._src.checkpointing.checkpoint",
    "save": "topka2a_jax._src.checkpointing.checkpoint",
    "CheckpointManager": "topka2a_jax._src.checkpointing.checkpoint_manager",
    "verify": "topka2a_jax._src.checkpointing.integrity",
    "reshard": "topka2a_jax._src.checkpointing.resize",
    "resize_residual": "topka2a_jax._src.checkpointing.resize",
    "resize_slices": "topka2a_jax._src.checkpointing.resize",
}

__all__ = [
  "CheckpointManager",
  "reshard",
  "resize_residual",
  "resize_slices",
  "restore",
  "save",
  "verify",
]

__getattr__, __dir__ = _lazy.attach(__name__, _LAZY)
del _lazy  # help() lists the face's names, not the loader
