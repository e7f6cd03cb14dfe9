"""Checkpoints every N steps with Orbax's ``CheckpointManager``: keep the last few, find the latest.

:func:`topka2a_jax.save` and :func:`topka2a_jax.restore` write and read one
directory. A training loop wants more: a step number per checkpoint, only
the last few kept, the latest complete one found after a crash (a partial
save is never listed), saving in the background. :class:`CheckpointManager`
puts that on ``orbax.checkpoint.CheckpointManager`` and keeps, beside every
step's state, the layout description that :func:`topka2a_jax.restore` needs
to read it onto another number of devices (each array's fingerprint
included, checked at restore). Once a step's save has completed, the
manager seals it with the same SHA-256 manifest as :func:`topka2a_jax.save`
(at the next save, :meth:`~CheckpointManager.wait_until_finished` or
closing), so that :func:`topka2a_jax.checkpoint.verify` checks it and a
restore refuses a damaged step naming its file.

When is plain Orbax enough? When every restart has the same mesh: then
Orbax's own manager restores the residuals as the per-device arrays they
are. It cannot resize them onto another device count, and restoring with
``strict=False`` into a state whose residual shapes differ (or that has
none) drops what error feedback still owed without a word.

Example:
  >>> import tempfile
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> tx = topka2a_jax.compress_updates(optax.adam(1e-3), density=0.1, min_size=0, mesh=mesh)
  >>> params = {"w": jnp.ones((4, 3))}
  >>> state = {"params": params, "opt_state": tx.init(params)}
  >>> with CheckpointManager(tempfile.mkdtemp(), mesh, max_to_keep=2) as manager:
  ...   for step in (10, 20, 30):
  ...     _ = manager.save(step, state)
  ...   manager.wait_until_finished()
  ...   manager.all_steps(), manager.latest_step()
  ([20, 30], 30)
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from topka2a_jax._src.axis import DataAxis
from topka2a_jax._src.checkpointing import checkpoint, integrity, step_claims
from topka2a_jax._src.runtime import in_flight

if TYPE_CHECKING:  # typing.Self from Python 3.11
  from typing_extensions import Self

STATE, LAYOUT = "state", "layout"
"""The two items of every step: the state (Orbax's standard format) and its
layout description (JSON)."""


def _merged(options: Any, *, max_to_keep: int | None, async_save: bool,
            read_only: bool) -> Any:
  """Orbax's manager options: the user's, with this manager's settings.

  Orbax's own clean-up of temporary directories is never turned on: it
  removes every step being written, another live job's too, whenever a
  manager is built on the root. A writing manager removes only those that
  no live job writes (``step_claims.py``).

  Raises:
    TypeError: ``options`` is not an ``ocp.CheckpointManagerOptions``.
    ValueError: a setting given both here and in ``options``, or Orbax's
      ``cleanup_tmp_directories=True``.
  """
  import orbax.checkpoint as ocp

  if options is None:
    options = ocp.CheckpointManagerOptions()
  elif not isinstance(options, ocp.CheckpointManagerOptions):
    raise TypeError(f"options must be an orbax.checkpoint.CheckpointManagerOptions, "
                    f"got {type(options).__name__}")
  if options.cleanup_tmp_directories:
    raise ValueError(
        "options.cleanup_tmp_directories=True removes every step being written in the "
        "root whenever a manager is built there, another live job's save included. "
        "Leave it False: a writing manager removes the temporary directories that no "
        "live job writes by itself")
  default = ocp.CheckpointManagerOptions()
  for name, value, field in (("max_to_keep", max_to_keep, "max_to_keep"),
                             ("async_save", async_save, "enable_async_checkpointing"),
                             ("read_only", read_only, "read_only")):
    ours = {"max_to_keep": None, "async_save": True, "read_only": False}[name]
    if value != ours and getattr(options, field) != getattr(default, field):
      raise ValueError(f"{name}={value!r} and options.{field}="
                       f"{getattr(options, field)!r} both set it; give it once")
  read_only = read_only or options.read_only
  if read_only:
    return dataclasses.replace(
        options, read_only=True, create=False, max_to_keep=None,
        save_interval_steps=0, enable_async_checkpointing=False)
  return dataclasses.replace(
      options, max_to_keep=max_to_keep if max_to_keep is not None else options.max_to_keep,
      enable_async_checkpointing=async_save and options.enable_async_checkpointing)


class CheckpointManager:
  """Saves the training state every step asked, keeps the last few, restores anywhere.

  Args:
    directory: the root; every step is a subdirectory Orbax names.
    mesh: the mesh the saved states live on.
    axis_name: the data-parallel mesh axis, or a pair of them.
    max_to_keep: how many of the latest steps to keep (None: all).
    async_save: write in the background (Orbax's asynchronous checkpointing);
      :meth:`wait_until_finished` or closing waits for it.
    read_only: open the root to read it alone, as an evaluation job does
      while the training job saves there: :meth:`save` is refused, nothing
      is created or removed, and :meth:`latest_step` and :meth:`all_steps`
      read the root anew at each call, so that a long-lived reader sees the
      steps completed since.
    options: Orbax's ``ocp.CheckpointManagerOptions``, for its policies
      (``save_interval_steps``, ``keep_period``, ``preservation_policy``, ...);
      give ``max_to_keep``, asynchronous saving and ``read_only`` either there
      or as the arguments above, not both. A step its policy skips is not
      saved: :meth:`save` returns False.

  Building a manager never removes anything: a job polling another job's
  root, read-only or not, leaves its saves in flight alone. A writing
  manager removes Orbax's temporary directory of a step (a save cut short)
  only once it has won that step's claim from a job that ended, or whose
  claim and files have not changed for two minutes (``step_claims.py``).

  Example:
    >>> manager = CheckpointManager("/ckpt", mesh, max_to_keep=3)  # doctest: +SKIP
    >>> manager.save(step, {"params": params, "opt_state": opt_state})  # doctest: +SKIP
    >>> state = manager.restore(like)  # the latest step  # doctest: +SKIP
    >>> reader = CheckpointManager("/ckpt", mesh, read_only=True)  # doctest: +SKIP
    >>> reader.latest_step()  # an evaluation job's poll  # doctest: +SKIP
  """

  def __init__(self, directory: str | Path, mesh: Mesh, *,
               axis_name: Hashable = "data", max_to_keep: int | None = None,
               async_save: bool = True, read_only: bool = False, options: Any = None):
    import orbax.checkpoint as ocp

    if not isinstance(read_only, bool):
      raise TypeError(f"read_only={read_only!r}: pass True (read the root alone) or "
                      "False")
    self._mesh, self._axis = mesh, DataAxis.parse(axis_name)
    self._axis.check_on(mesh)
    if max_to_keep is not None and (isinstance(max_to_keep, bool) or not isinstance(
        max_to_keep, int) or max_to_keep < 1):
      raise ValueError(f"max_to_keep={max_to_keep!r} keeps no step a restore could "
                       "read; pass a positive int, or None to keep every step")
    directory = Path(directory).absolute()
    if directory.exists() and not directory.is_dir():
      raise NotADirectoryError(f"{directory} is a file, not a directory of "
                               "checkpoints; pass a directory (new or the manager's "
                               "own)")
    self._unsealed: list[int] = []  # steps saved here whose manifest is unwritten
    self._token = step_claims.new_token()  # names this manager's claims on steps
    merged = _merged(options, max_to_keep=max_to_keep, async_save=async_save,
                     read_only=read_only)
    self._read_only = merged.read_only
    self._manager = ocp.CheckpointManager(
        directory, item_names=(STATE, LAYOUT), options=merged)

  def save(self, step: int, state: Any) -> bool:
    """Saves ``state`` as ``step`` (in the background with ``async_save``).

    Returns:
      True: the step is saved (or being saved, with ``async_save``); False:
      the policy of ``options=`` skips this step, and nothing was written.

    Raises:
      ValueError: ``step`` is not a non-negative int (a fresh manager lists
        only such steps).
      FileExistsError: the root already holds ``step`` or a later one, or
        another job has claimed ``step`` (``step_claims.py``): another job
        saves to the same root, or an earlier run left its steps there.
        Nothing is overwritten; save to another root, or restore the
        latest step and go on from there.
      OSError: the step's claim cannot be written (a full disk, named):
        nothing is left behind, and the same call works once space is freed.
      PermissionError: a manager opened with ``read_only=True``.
    """
    import orbax.checkpoint as ocp

    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
      raise ValueError(f"step={step!r}: a checkpoint's step must be a non-negative "
                       "int (the training step's number), which a later manager "
                       "can find")
    step = int(step)
    if self._read_only:
      raise PermissionError(
          f"this manager opened {self._manager.directory} with read_only=True: it "
          "never writes. Nothing was written; save through a manager built without "
          "read_only")
    layout = checkpoint.describe(state, self._mesh, self._axis)
    self.wait_until_finished()  # as Orbax would; the previous step is sealed
    self._check_after_latest(step)
    root = Path(self._manager.directory)
    if not os.access(root, os.W_OK):  # before Orbax, whose failed background
      # save of an unwritable root leaves threads that never let the process exit
      raise PermissionError(f"cannot write to {root} (a read-only file system, or "
                            "no permission); nothing was written. Save to a "
                            "writable root.")
    if not self._manager.should_save(step):  # Orbax's policy (options=) skips it
      return False
    self._claim(step)
    saved = self._manager.save(step, args=ocp.args.Composite(**{
        STATE: ocp.args.StandardSave(checkpoint.stored_tree(state)),
        LAYOUT: ocp.args.JsonSave(layout)}))
    if not saved:  # Orbax skips a step not after the latest it knows
      self._check_after_latest(step)
      raise RuntimeError(f"Orbax did not save step {step} in "
                         f"{self._manager.directory}; nothing was written")
    self._unsealed.append(step)
    if not self._manager.is_saving_in_progress():  # a synchronous save
      self._seal()
    return saved

  def _claim(self, step: int) -> None:
    """Claims ``step`` for this manager before Orbax touches it (``step_claims.py``).

    Raises:
      FileExistsError: another job holds the step, named.
      OSError: the claim cannot be written (a full disk, no permission), named.
    """
    root = Path(self._manager.directory)
    refused = None
    in_flight.settle()  # no exchange on its own stream while the broadcast below runs
    if jax.process_index() == 0:
      refused = step_claims.claim(root, step, self._token)
    if jax.process_count() > 1:
      lost = multihost_utils.broadcast_one_to_all(np.int32(refused is not None))
      if lost and refused is None:
        refused = (f"step {step} of {root} cannot be claimed (process 0 says why): "
                   "nothing was written")
    if isinstance(refused, step_claims.Unwritable):
      raise OSError(refused)
    if refused is not None:
      raise FileExistsError(refused)

  def _check_after_latest(self, step: int) -> None:
    """Raises FileExistsError unless ``step`` is after every step on disk."""
    self._manager.reload()  # what is on disk now, other jobs' steps included
    steps = self._manager.all_steps()
    if steps and step <= max(steps):
      held = (f"step {step}" if step in steps else
              f"step {max(steps)}, later than {step}")
      raise FileExistsError(
          f"{self._manager.directory} already holds {held}: another job saves "
          "to this root, or an earlier run left its steps there, and a manager "
          "only adds steps after its latest. Nothing was written; restore the "
          "latest step and go on from there, or save to another root")

  def step_directory(self, step: int) -> Path:
    """The directory of ``step``, e.g. for :func:`topka2a_jax.checkpoint.verify`."""
    return Path(self._manager.directory) / str(step)

  def _seal(self) -> None:
    """Writes the manifest of every step saved here that has completed since."""
    complete = set(self._manager.all_steps())
    for step in self._unsealed:
      if step in complete and jax.process_index() == 0:
        integrity.write_manifest(self.step_directory(step))
    if self._unsealed and complete and jax.process_index() == 0:
      root = Path(self._manager.directory)
      step_claims.remove_abandoned_partials(root, self._token, max(complete))
      step_claims.remove_claims(root, complete, max(complete))
    self._unsealed = []

  def restore(self, like: Any, step: int | None = None) -> Any:
    """Reads ``step`` (the latest complete one by default) laid out like ``like``.

    ``like`` is a fresh state for the mesh of this manager, whose data axis
    may have another size than at saving: per-device leaves are resized as
    :func:`topka2a_jax.restore` does.

    Raises:
      FileNotFoundError: no complete step, or not ``step``.
      ValueError: a file of the step is missing, added or corrupted (naming
        it, :func:`topka2a_jax.checkpoint.verify`), or Orbax cannot read
        it; another model or configuration; an array that reads back other
        bytes than were saved (naming it). Nothing is returned.
    """
    import orbax.checkpoint as ocp

    steps = self.all_steps()
    if step is None:
      step = self.latest_step()
    if step is None or step not in steps:
      raise FileNotFoundError(
          f"{self._manager.directory} holds no complete checkpoint of step {step} "
          f"(complete steps: {steps}); nothing was loaded")
    directory = self.step_directory(step)
    if directory.is_symlink():
      raise ValueError(
          f"{directory} is a symbolic link (to {os.readlink(directory)}), not a step this "
          "root's manager wrote: nothing outside the root is read. Nothing was loaded; "
          "remove the link, or restore from the root it points into with a manager "
          "of that root")
    if (directory / integrity.MANIFEST_FILE).is_file():
      try:
        integrity.verify(directory)
      except ValueError as damaged:
        earlier = [s for s in steps if s < step]
        if not earlier:
          raise
        raise ValueError(f"step {step}: {damaged} The root holds earlier steps "
                         f"{earlier}: restore(like, step={earlier[-1]}) reads the "
                         "latest of them.") from None
    else:
      integrity.listed_files(directory)  # no link, no special file
      warnings.warn(
          f"{directory} has no {integrity.MANIFEST_FILE}: its files cannot be "
          "checked (an older topka2a_jax wrote it, the process ended before "
          "sealing it, or the job saving it seals it at its next save); its "
          "arrays' fingerprints still are", stacklevel=2)
    read_step = checkpoint.naming_read_errors(directory, self._manager.restore)
    saved = read_step(step, args=ocp.args.Composite(**{
        LAYOUT: ocp.args.JsonRestore()}))[LAYOUT]

    def read(targets: Any) -> Any:
      return read_step(step, args=ocp.args.Composite(**{
          STATE: ocp.args.StandardRestore(targets)}))[STATE]

    return checkpoint.restore_laid_out(saved, read, like, self._mesh, self._axis,
                                       f"step {step} of {self._manager.directory}")

  def latest_step(self) -> int | None:
    """The latest step whose save completed, or None."""
    if self._read_only:
      self._manager.reload()  # another job's steps, completed since
    return self._manager.latest_step()

  def all_steps(self) -> Sequence[int]:
    """Every step kept whose save completed, in order."""
    if self._read_only:
      self._manager.reload()
    return sorted(self._manager.all_steps())

  def wait_until_finished(self) -> None:
    """Waits for a background save to finish, and seals it."""
    self._manager.wait_until_finished()
    self._seal()

  def close(self) -> None:
    """Waits for saves in flight, seals them and releases Orbax's resources.

    Orbax's resources are released even when a save failed (its error is
    raised after), so that the process can exit.
    """
    try:
      self.wait_until_finished()
    finally:
      self._manager.close()

  def __enter__(self) -> Self:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()
