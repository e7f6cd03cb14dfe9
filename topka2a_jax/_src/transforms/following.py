"""What follows the exchange in its chain, and the forms that keep that optimizer's quality.

``optax.chain(topka2a(0.01), optax.adam(1e-3))`` hands Adam the exchange's
mean. A top-k with error feedback delivers each entry as a rare burst, the
sum of many steps' gradients: plain SGD does not mind when mass arrives, but
Adam's moments go wrong on bursts (the accuracy evidence page measures how
far), and momentum SGD multiplies each burst by about ``1 / (1 - b)``
and can diverge where dense momentum SGD converges. A few-bit code with
error feedback sends every entry every step, its error bounded by half a
quantization step, and trains on dense's curve before both.

:func:`follower` reads the optimizer after the exchange from the chain that
is running it: ``optax.chain`` calls each member from its own ``init`` and
``update``, so the calling frames hold the chain's members in order (nested
chains, one frame each). :func:`kind_of` sorts what it finds by the optax
factories behind it (their functions' qualified names, found by walking
closures as ``clipping.py`` does): Adam's family (:data:`ADAPTIVE`), momentum
(:data:`MOMENTUM`), plain SGD or nothing (:data:`PLAIN`), or
:data:`UNKNOWN`. With ``algorithm="auto"`` the planner then takes, per bucket,
the cheapest of that kind's forms (``planner/forms.py``).

Example:
  >>> def kind_after(optimizer):
  ...   seen = []
  ...   def update(updates, state, params=None):
  ...     seen.append(kind_of(follower(update)))
  ...     return updates, state
  ...   tx = optax.chain(optax.GradientTransformation(lambda p: (), update), optimizer)
  ...   tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))
  ...   return seen[0]
  >>> kind_after(optax.adam(1e-3)), kind_after(optax.sgd(0.1, momentum=0.9))
  ('adaptive', 'momentum')
  >>> kind_after(optax.sgd(0.1))
  'plain'
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import optax

from topka2a_jax._src.caller import user_stacklevel
from topka2a_jax._src.collectives import algorithms
from topka2a_jax._src.options import FOLLOWS_KINDS, Options
from topka2a_jax._src.planner.forms import (
  ADAPTIVE,
  CODED_FORM,
  FORMS,
  MOMENTUM,
  PLAIN,
  ROUNDS,
  UNKNOWN,
  WHY,
)
from topka2a_jax._src.transforms.clipping import held

_ADAPTIVE_NAMES = frozenset({
    "scale_by_adam", "scale_by_adamax", "scale_by_amsgrad", "scale_by_belief",
    "scale_by_rms", "scale_by_stddev", "scale_by_factored_rms", "scale_by_lion",
    "scale_by_radam", "scale_by_yogi", "scale_by_novograd", "scale_by_adadelta",
    "scale_by_sm3", "scale_by_adan", "scale_by_rss", "scale_by_sign",
    "scale_by_param_block_rms", "scale_by_muon", "scale_by_frozen_rms",
    "adam", "adamw", "nadam", "nadamw", "radam", "amsgrad", "adabelief", "adamax",
    "adamaxw", "rmsprop", "adafactor", "lion", "lamb", "adagrad", "yogi", "novograd",
    "adadelta", "sm3", "adan", "sign_sgd", "muon", "frozen_variance_adam",
    "scale_by_adopt", "adopt", "scale_by_ademamix", "ademamix", "scale_by_prodigy",
    "prodigy", "scale_by_rprop", "rprop", "scale_by_schedule_free", "schedule_free"})
"""Factories of per-entry adaptive steps (Adam and its family, signs, Muon)."""

_MOMENTUM_NAMES = frozenset({"trace", "ema", "sgd", "lars"})
"""Factories of momentum (``optax.sgd(lr, momentum=...)`` is a ``trace``)."""

_NEUTRAL_NAMES = frozenset({
    "chain", "named_chain", "identity", "init_empty_state", "scale",
    "scale_by_learning_rate", "scale_by_schedule", "with_extra_args_support",
    "add_decayed_weights", "clip", "clip_by_global_norm", "clip_by_block_rms",
    "adaptive_grad_clip", "zero_nans", "masked", "add_noise", "noisy_sgd",
    "keep_params_nonnegative", "scale_by_trust_ratio", "inject_hyperparams",
    "inject_stateful_hyperparams", "apply_if_finite", "skip_nonfinite",
    "skip_not_finite", "centralize", "scale_by_polyak", "polyak_sgd", "partition",
    "multi_transform", "MultiSteps"})
"""Factories that change no entry's timing: scales, decays, clips, masks."""


def _is_update(fn: Any) -> bool:
  """Whether ``fn`` takes updates and a state (an update function), not a schedule."""
  code = getattr(fn, "__code__", None)
  return code is not None and code.co_argcount + code.co_kwonlyargcount >= 2


def _qualnames(fns: Sequence[Any], updates_only: bool) -> set[str]:
  """The qualified name of every function behind ``fns`` (update functions only, if asked)."""
  return {found.__qualname__ for found in held(tuple(fns))
          if callable(found) and isinstance(getattr(found, "__qualname__", None), str)
          and (not updates_only or _is_update(found))}


def _factories(fns: Sequence[Any], updates_only: bool) -> set[str]:
  """The factory behind every function behind ``fns``: its qualified name's first part."""
  return {name.split(".")[0] for name in _qualnames(fns, updates_only)}


_CHAIN = optax.chain(optax.identity())
_NAMED_CHAIN = optax.named_chain(("only", optax.identity()))
_CHAIN_FRAMES = {
    _CHAIN.init.__code__: ("init_fns", False),
    _CHAIN.update.__code__: ("update_fns", True),
    _NAMED_CHAIN.init.__code__: ("transforms", True),
    _NAMED_CHAIN.update.__code__: ("transforms", True),
}
"""The codes of every ``optax.chain``'s and ``optax.named_chain``'s init and
update, the local each reads its members from, and whether the members'
update functions are there (a chain's init holds init functions only; a
named chain holds ``(name, transform)`` pairs). ``tests/test_following.py``
holds them to optax."""

_STEP_NAMES = frozenset({"scale", "scale_by_learning_rate", "scale_by_schedule",
                         "scale_by_polyak", "polyak_sgd", "noisy_sgd"})
"""Neutral factories that make a step of the mean: plain SGD is one of them."""


def _members(field: str, members: Sequence[Any]) -> list[Any]:
  """A chain's members as functions or transforms, in order."""
  return [member for _, member in members] if field == "transforms" else list(members)


class Followers(NamedTuple):
  """What follows the exchange in its chains, as :func:`follower` reads it.

  Attributes:
    functions: the functions after it, innermost chain first (or whole
      transforms under ``optax.named_chain``).
    updates: whether their update functions are among them (read from a
      chain's update, or any named chain), which tells the kinds apart.
  """

  functions: tuple[Any, ...]
  updates: bool


def follower(own: Callable[..., Any]) -> Followers | None:
  """The functions after ``own`` in every chain now running it, innermost first.

  Call it from inside ``own`` (a transform's ``init`` or ``update``).

  Args:
    own: the running transform's init or update function.

  Returns:
    :class:`Followers`, or None where no chain runs ``own`` (the transform
    was called alone, or by a combinator this module does not read).
  """
  after, updates, found = [], True, False
  for members, position, has_updates in _chains_running(own, sys._getframe(1)):
    after += members[position + 1:]
    updates, found = updates and has_updates, True
  return Followers(tuple(after), updates) if found else None


def preceding(own: Callable[..., Any]) -> tuple[Any, ...]:
  """The functions before ``own`` in every chain now running it, innermost first.

  Call it from inside ``own`` (a transform's ``init`` or ``update``), as
  :func:`follower`.
  """
  return tuple(member for members, position, _ in _chains_running(own, sys._getframe(1))
               for member in members[:position])


def _chains_running(own: Callable[..., Any], frame: Any
                    ) -> Iterator[tuple[list[Any], int, bool]]:
  """For every chain on the stack from ``frame`` out that runs ``own``, innermost
  first: its members, where ``own`` (or the member holding it) sits among them, and
  whether they are update functions."""
  inner = (own,)
  while frame is not None:
    field, has_updates = _CHAIN_FRAMES.get(frame.f_code, (None, False))
    members = frame.f_locals.get(field) if field else None
    if members is not None:
      members = _members(field, members)
      position = next((i for i, member in enumerate(members)
                       if any(one is mine for one in held(member) for mine in inner)), None)
      if position is not None:
        yield members, position, has_updates
        inner = tuple(members[position]) if isinstance(members[position], tuple) \
            else (members[position],)
    frame = frame.f_back


EXCHANGE_FIRST = ("Put the exchange first: optax.chain(topka2a_jax.topka2a(...), "
                  "<the other transforms>); or, to exchange the optimizer's updates "
                  "rather than the gradients, topka2a_jax.compress_updates(<the "
                  "optimizer>, density), which keeps its state per device.")
"""The fix for per-parameter state before the exchange, wherever it is refused."""


def refuse_state_before(own: Callable[..., Any]) -> None:
  """Refuses Adam's family or momentum before the exchange in its chain (read at ``init``).

  Such an optimizer would keep its moments of each device's own gradient,
  different on every device, and hand the exchange its steps.

  Raises:
    ValueError: naming what comes first, and the order to write.
  """
  names = _factories(preceding(own), updates_only=False)
  found = sorted(names & (_ADAPTIVE_NAMES | _MOMENTUM_NAMES))
  if found:
    raise ValueError(
        f"the optimizer keeps per-parameter state ({', '.join(found)}) before the topka2a "
        "exchange: each device's, of its own gradient, where the step needs it the same "
        f"on every device. {EXCHANGE_FIRST}")


def kind_of(followed: Followers | None) -> str:
  """The kind of optimizer :func:`follower` found: one of the four kinds.

  :data:`PLAIN` only where it is positively known: a step of plain SGD (a
  learning rate's scale) follows, and nothing that is not neutral. From a
  chain's init (which holds no update functions) only Adam's family and
  momentum are told apart; everything else reads as :data:`PLAIN` there,
  and the update decides. No chain, nothing after the exchange in it, or
  functions whose names say nothing: :data:`UNKNOWN`.
  """
  if followed is None or not followed.functions:
    return UNKNOWN
  fns, updates = followed
  names = _factories(fns, updates_only=updates)
  if names & _ADAPTIVE_NAMES:
    return ADAPTIVE
  if names & _MOMENTUM_NAMES:
    return MOMENTUM
  if not updates or (names & _STEP_NAMES and names <= _NEUTRAL_NAMES):
    return PLAIN
  return UNKNOWN


def unrecognised(followed: Followers | None) -> str:
  """What the exchange could not read of the optimizer after it, in a phrase."""
  if followed is None:
    return ("no optax.chain or optax.named_chain is running it, so it cannot see what "
            "is done with its mean")
  if not followed.functions:
    return ("nothing follows it in its chain, so it cannot see what is done with its "
            "mean")
  known = _NEUTRAL_NAMES | _ADAPTIVE_NAMES | _MOMENTUM_NAMES
  names = sorted(name for name in _qualnames(*followed) if name.split(".")[0] not in known)
  if names:
    return f"it does not know the optimizer after it ({', '.join(names)})"
  if not _qualnames(*followed):
    return ("the functions after it carry no name it can read ("
            f"{', '.join(type(fn).__name__ for fn in followed.functions)})")
  return "nothing after it in its chain makes a step of the mean"



def refuse_followers(followed: Followers | None, transform: str, fix: str) -> None:
  """Refuses a transform that must be the whole optimizer but has something after it.

  Args:
    followed: :func:`follower` of the transform's init or update.
    transform: the call the user made, e.g. ``"local_steps(...)"``.
    fix: what to write instead, in a sentence.

  Raises:
    ValueError: naming what follows it, and ``fix``.
  """
  if followed is None or not followed.functions:
    return
  found = _factories(followed.functions, updates_only=False)
  names = sorted(found - _NEUTRAL_NAMES - {"init_empty_state"}) or sorted(found) or sorted(
      type(fn).__name__ for fn in followed.functions)
  raise ValueError(
      f"{transform} must be the whole optimizer, yet its chain runs {', '.join(names)} "
      f"after it, which would step again on what it returns. {fix}")


_LOG = logging.getLogger("topka2a_jax")


WHY_SHORT = {ADAPTIVE: "an adaptive optimizer (Adam's family)", MOMENTUM: "momentum SGD"}
"""The kinds a top-k harms, as a warning names them."""


def _spelled(follows: Any) -> str:
  """``follows=`` as the user wrote it, near enough: a kind's name, or the transform."""
  if isinstance(follows, str):
    return repr({value: name for name, value in FOLLOWS_KINDS.items()}.get(follows, follows))
  return "<a transform of plain SGD>"


def _named_kind(follows: Any) -> tuple[str, str]:
  """The kind ``follows=`` says, and what could not be read where it says nothing."""
  if isinstance(follows, str):
    return follows, ""
  named = Followers((follows.update,), True)
  kind = kind_of(named)
  return kind, (unrecognised(named) if kind == UNKNOWN else "")


def for_follower(options: Options, followed: Followers | None,
                 said: set[str], at_init: bool = False, rounds: bool = False) -> Options:
  """``options`` with ``"auto"``'s forms set for the optimizer after the exchange.

  The optimizer is ``follows=`` where given, else what :func:`follower`
  read from the chain. A top-k goes out only where plain SGD is positively
  known to follow; where the chain says nothing readable, or its init and
  its update read differently, the 8-bit form goes out, safe before both.

  Says each thing once per transform (``said`` remembers): the forms
  ``"auto"`` plans with and why, as an INFO line on the ``topka2a_jax``
  logger; a warning naming what it could not read and how to say it; a
  warning for an explicit top-k or sign of the gradient before an adaptive
  optimizer (kept: the user asked for it), or for ``follows=`` that the chain
  contradicts.

  Args:
    options: the transform's checked options.
    followed: :func:`follower` of the transform's init or update.
    said: what this transform has said already; updated.
    at_init: whether this is the transform's init (which decides nothing:
      it remembers the kind it read, and the update decides).
    rounds: whether ``followed`` is :func:`topka2a_jax.local_steps`' outer
      step, where plain SGD gets the coded forms (:data:`ROUNDS`).

  Returns:
    The options the exchange runs with.

  Warns:
    UserWarning: as above.
  """
  if options.follows is not None:
    kind, missing = _named_kind(options.follows)
    read = kind_of(followed)
    if kind == PLAIN and read in (ADAPTIVE, MOMENTUM) and "contradicted" not in said:
      said.add("contradicted")
      warnings.warn(
          f"topka2a(follows={_spelled(options.follows)}) says plain SGD follows, but its "
          f"chain runs {WHY_SHORT[read]} after it: a top-k with error feedback hands it "
          "each entry as a burst of many steps' gradients, which it does not train "
          "well on. Leave follows= out (the chain is read), or make it name the "
          "optimizer the chain runs.", UserWarning, stacklevel=user_stacklevel())
  else:
    kind, missing = kind_of(followed), ""
    if kind == UNKNOWN:
      missing = unrecognised(followed)
    if at_init and kind in (ADAPTIVE, MOMENTUM):
      said.add(f"init saw {kind}")
    seen_at_init = [one for one in (ADAPTIVE, MOMENTUM) if f"init saw {one}" in said]
    if not at_init and kind != UNKNOWN and seen_at_init and kind not in seen_at_init:
      missing = (f"its chain's init reads {seen_at_init[0]} after it and its update "
                 f"{kind}: one of them runs through something it does not read")
      kind = UNKNOWN
  if options.algorithm != algorithms.AUTO:
    entry = algorithms.ALGORITHMS.get(options.algorithm)  # None for "powersgd"
    if (kind == ADAPTIVE and entry is not None and entry.delivers_bursts
        and "bursts" not in said):
      said.add("bursts")
      warnings.warn(
          f"topka2a(algorithm={options.algorithm!r}) sends the gradient's "
          f"{'signs' if entry.quantizes else 'top-k'} to an "
          "adaptive optimizer (Adam's family): error feedback hands it each entry "
          "as a burst of many steps' gradients and its moments go wrong, ending far "
          "above dense's loss (the accuracy evidence page). Leave algorithm= out: "
          "topka2a(...) before Adam sends every entry in 8 bits "
          "(algorithm='quantized_8_8_fine'), which trains as dense does, or dense "
          "where that is cheaper.", UserWarning, stacklevel=user_stacklevel())
    return options
  if rounds and kind == PLAIN:
    kind = ROUNDS
  if options.value_dtype is not None or (options.density_given and options.density >= 1.0):
    kind, missing = PLAIN, ""  # a narrow top-k was asked for, or one that sends every entry
  if kind == PLAIN and not options.density_given:
    raise ValueError(
        "topka2a(algorithm='auto') before plain SGD sends the top-k of each bucket, "
        "and needs its fraction: give density, e.g. topka2a(0.01, ...). (Before "
        "Adam's family or momentum SGD every entry is sent, and density may be "
        "left out.)")
  if kind == UNKNOWN and "unknown" not in said:
    said.add("unknown")
    warnings.warn(
        f"topka2a(algorithm='auto'): {missing}. So it plans the form safe before both "
        f"SGD and Adam: every entry in 8 bits ({CODED_FORM!r}), or dense where that is "
        "cheaper. Say what follows with topka2a(..., follows=optax.adam(...)) (or "
        "follows='adam', 'momentum', 'sgd'; 'sgd' lets it send a top-k), or choose "
        "the form with algorithm=.", UserWarning, stacklevel=user_stacklevel())
  elif not at_init and kind not in said:
    said.add(kind)
    _LOG.info("topka2a(algorithm='auto') plans each bucket among %s: %s. (Set "
                 "follows= or algorithm= to choose; this line is logged once per "
                 "transform on the 'topka2a_jax' logger.)", ", ".join(FORMS[kind]),
                 WHY[kind])
  return dataclasses.replace(options, auto_forms=FORMS[kind])
