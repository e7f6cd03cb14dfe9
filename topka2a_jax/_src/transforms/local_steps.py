"""Local steps: every device trains alone for a round, then one compressed exchange.

``optax.chain(topka2a(...), optax.adam(lr))`` exchanges every step, so Adam's
step stays bound by the wire however few bits an entry takes. With
:func:`local_steps` (the DiLoCo family's algorithm) the exchange runs once a
round of ``every`` steps:

1. every device runs ``inner`` (AdamW, say) on its own gradient, taken at
   its own local parameters, for ``every`` steps; its state is kept across
   rounds;
2. at the end of the round each device's pseudo-gradient, the shared
   parameters minus its local ones, goes through one of the library's
   exchanges with error feedback (by default every entry in 4 bits after a
   rotation, the means back in 4);
3. the mean pseudo-gradient goes to ``outer`` (by default ``optax.sgd(1.0)``:
   the shared parameters move to the mean of the local ones, to the code's
   rounding), which updates the shared parameters, from which every device
   starts the next round;
4. with ``average_inner_state=True``, every device's ``inner`` state (Adam's
   moments) also becomes the devices' mean, in 8 bits an entry with
   relative precision (:func:`topka2a_jax.collectives.relative_mean`); its
   leaves under 512 entries (an injected hyperparameter) exactly.

Over a pair of data axes, ``axis_name=("node", "local")`` (hosts of several
devices on a slower link between them), the devices of a node train as one:
every step their gradients are averaged inside the node (a dense mean over
``"local"``), and the rounds run between nodes; the pseudo-gradient takes
the two-level exchange, each device sending its slice across nodes.

The parameters the caller holds (and evaluates) are the shared ones: they
move only at the end of a round. Each device's local parameters are those
plus its ``offset`` in the state (:func:`topka2a_jax.local_params`), where
:func:`topka2a_jax.train_step` and :func:`topka2a_jax.nnx_train_step` take
the gradient; a hand-written ``shard_map`` step does the same and says so,
``tx.update(grads, state, params, topka2a_gradient_at="local_params")`` (an
update that does not say is refused). Adam only ever sees dense
local gradients, so the bursts a top-k hands it never arise, and the
exchange's bytes per step are divided by ``every``.

Example:
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> tx = local_steps(optax.adam(1e-2), every=4, mesh=mesh)
  >>> params = {"w": jnp.zeros((64, 4))}
  >>> step = topka2a_jax.train_step(lambda p, x: jnp.mean((x @ p["w"] - 1) ** 2), tx, mesh)
  >>> state = tx.init(params)
  >>> for _ in range(4):
  ...   params, state, loss = step(params, state, jnp.ones((8, 64)))
  >>> int(state.exchange.count), float(params["w"][0, 0]) > 0  # one round, one exchange
  (1, True)

References:
  Douillard et al. "DiLoCo: Distributed Low-Communication Training of
  Language Models." arXiv 2311.08105.

  Charles et al. "Communication-Efficient Language Model Training Scales
  Reliably and Robustly: Scaling Laws for DiLoCo." arXiv 2503.09799 (short
  rounds: H = 1 is the worst; the outer learning rate grows with replicas).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from topka2a_jax._src.arguments import checked_optimizer, keywords_after_inner
from topka2a_jax._src.axis import (
  DataAxis,
  as_varying,
  bound_axis_size,
  is_bound,
  per_device_blocks,
)
from topka2a_jax._src.collectives.algorithms import AUTO, ignores_density
from topka2a_jax._src.collectives.relative import CHUNK, relative_mean
from topka2a_jax._src.options import Options
from topka2a_jax._src.planner.forms import LOCAL_STEPS_FORM
from topka2a_jax._src.rounds import RoundLengths, round_lengths
from topka2a_jax._src.states import LocalStepsState, RoundInFlight
from topka2a_jax._src.transforms.exchange_state import (
  checked_residuals,
  init_state,
  layout_mesh,
  update_state,
)
from topka2a_jax._src.transforms.exchange_step import held_where
from topka2a_jax._src.transforms.extra_args import (
  ARRIVED,
  AT_LOCAL_PARAMS,
  GRADIENT_AT,
  NONFINITE,
  PARAM_SPECS,
  RoundArrived,
)
from topka2a_jax._src.transforms.following import (
  Followers,
  follower,
  for_follower,
  refuse_followers,
)
from topka2a_jax._src.transforms.leaves import check_per_device, given_specs, leaves_of
from topka2a_jax._src.transforms.marks import marked
from topka2a_jax._src.transforms.nonfinite import counted, nonfinite_on_any_device
from topka2a_jax._src.transforms.per_device import (
  counters,
  per_device_state,
  warn_if_a_zero_step_is_not_finite,
  zeros_in_float32,
)
from topka2a_jax._src.transforms.signatures import (
  CompressUpdatesOptions,
  Unpack,
  refuse_options,
  takes_options,
)

DEFAULT_EVERY = 4
"""Inner steps per round by default: chosen on the link benchmark's training
task (the local steps evidence page)."""


_WHOLE = ("Give local_steps the optimizers it runs, local_steps(optax.adam(...), "
          "outer=...), and use it alone as the step's optimizer.")

_ARGUMENTS = ("inner", "every", "outer", "density", "average_inner_state", "overlap")
"""local_steps' own arguments, besides the exchange's options."""

SKIPPED_IN_A_ROW = 8
"""Inner steps skipped in a row (not finite on some device) after which a round
is dropped: its local parameters are where every gradient overflows, and no
later step of the round could be taken."""


EAGER, OWN, DELAYED = "eager", "own", "delayed"
"""How a round's mean that arrives a round late is applied (``overlap=``)."""
RULES = (EAGER, OWN, DELAYED)

DEFAULT_OVERLAP = OWN
"""The rule ``overlap=True`` takes: the one that ended lowest in the local
steps evidence page's comparison of the three."""

OVERLAPPED = "topka2a_overlapped"
"""The attribute of an overlapped ``local_steps``' update function that holds
its :class:`Overlapped` record, for the training steps that drive it."""


class Overlapped(NamedTuple):
  """What a training step needs to run an overlapped ``local_steps``' exchanges.

  Attributes:
    rule: ``"eager"``, ``"own"`` or ``"delayed"``.
    lengths: the rounds' lengths.
    exchange: ``exchange(sent, exchange_state, **extra_args) ->``
      :class:`RoundArrived`, inside ``shard_map`` over the data axis: the
      exchange of a round's pseudo-gradients (``RoundInFlight.sent``'s
      blocks), as its own program.
  """

  rule: str
  lengths: RoundLengths
  exchange: Any


def overlap_rule(overlap: Any) -> str | None:
  """``overlap`` as a rule: None (in line), ``"eager"``, ``"own"`` or ``"delayed"``.

  Raises:
    ValueError: any other value, naming the ones taken.
  """
  if overlap is False or overlap is None:
    return None
  if overlap is True:
    return DEFAULT_OVERLAP
  if overlap in RULES:
    return overlap
  raise ValueError(f"overlap must be False, True, {EAGER!r}, {OWN!r} or {DELAYED!r}; "
                   f"got {overlap!r}")


def default_outer() -> optax.GradientTransformation:
  """The outer optimizer by default: ``optax.sgd(1.0)``, the mean of the local
  parameters (the training evidence page compares it with DiLoCo's Nesterov)."""
  return optax.sgd(1.0)


@keywords_after_inner("every", "outer", "density")
@takes_options(CompressUpdatesOptions, defaults={"algorithm": LOCAL_STEPS_FORM}, docs={
    "algorithm": (
        f"the pseudo-gradient's exchange: by default ``{LOCAL_STEPS_FORM!r}`` (every "
        "entry in 4 bits after a rotation, the means back in 4); any name of "
        ":data:`topka2a_jax.collectives.ALGORITHMS` "
        "(a top-k needs ``density``), ``\"powersgd\"``, or ``\"auto\"``, whose forms "
        "then follow ``outer`` as :func:`topka2a_jax.topka2a`'s follow the optimizer "
        "after it, but for plain SGD: each round restarts the local parameters from "
        "the shared ones, so a top-k would hold most of every round's progress back "
        "in the residuals, and the coded forms go out there too."),
    "skip_nonfinite": (
        "a non-finite gradient or inner step on any device skips that step "
        "everywhere (local parameters and ``inner``'s state as they were, the round "
        "one step longer), counted in ``state.exchange.nonfinite_steps``; after "
        f"{SKIPPED_IN_A_ROW} skipped in a row (local parameters where every "
        "gradient overflows) the round is dropped and the next starts from the "
        "shared parameters; a round whose pseudo-gradient is not finite is dropped "
        "too, the shared parameters kept. Each drop is counted as well."),
    "warmup_steps": "exchange the first this many rounds' pseudo-gradients densely.",
})
def local_steps(inner: optax.GradientTransformation, *,
                every: int | Mapping[int, int] = DEFAULT_EVERY,
                outer: optax.GradientTransformation | None = None,
                density: float | None = None, average_inner_state: bool = False,
                overlap: bool | Literal["eager", "own", "delayed"] = False,
                **options: Unpack[CompressUpdatesOptions]
                ) -> optax.GradientTransformationExtraArgs:
  """Trains ``every`` steps on each device alone, then exchanges the pseudo-gradients.

  Use it as the whole optimizer of a data-parallel step, in place of
  ``optax.chain(topka2a(...), inner)``.

  Args:
    inner: the optimizer each device runs on its own gradient (any optax
      transform, e.g. ``optax.adamw(1e-3)``); its state is kept across rounds.
      Tune its learning rate on the run you will train: the best need not
      be a per-step run's (with many windows a device it was higher than
      dense's; the local steps evidence page).
    every: inner steps per round, at least 1; or a dict from the step where
      a stretch of rounds starts to their length, ``{0: 4, 100: 2}``, each
      stretch starting at a round's end of the one before. Its steps are
      counted in rounds taken: a round dropped as not finite moves the
      later stretches on by its length. Shorter rounds late in a run gain
      about the seeds' spread for more bytes, and long rounds first lost
      more than they saved (the local steps evidence page). A
      checkpoint restores into a state whose first length is the one it
      was saved with (the later lengths are not checked).
    outer: the optimizer of the shared parameters, given the mean
      pseudo-gradient (shared minus local parameters) once a round; by
      default ``optax.sgd(1.0)``, which moves them to the local ones' mean.
      DiLoCo's, for rounds of hundreds of steps, is
      ``optax.sgd(0.7, momentum=0.9, nesterov=True)``; it does poorly on
      rounds of a few steps.
    density: fraction of every bucket sent where a top-k is chosen.
    average_inner_state: at every round's end, also replace each device's
      ``inner`` state (Adam's moments) by the devices' mean: floating
      leaves of 512 entries or more in 8 bits with relative precision
      (:func:`topka2a_jax.collectives.relative_mean`), smaller ones exactly,
      each entry on which every device agrees kept as it is (so the
      hyperparameters of ``optax.inject_hyperparams`` and Muon's
      coefficients stay as set); its counts are kept. An ``inner`` whose
      state keeps a copy of the parameters (schedule-free's ``z``,
      Prodigy's initial parameters), which the code would round, is refused
      at ``init``: ``init`` runs once more, on random parameters, and a
      state leaf holding their values (however it was computed) is one. A
      state that takes the parameters only in its ``update`` is not seen.
      Local Adam's state averaging: every device starts each round from the
      same moments, those of all the devices' gradients. It closes most of
      the rounds' cost where many windows a device make it show, and sends
      8 bits each way for every float of the state (Adam: twice the
      parameters) each round, several times the default pseudo-gradient's
      bytes; so it is off by default (the training evidence page, "Local
      steps"). The round's end then also needs temporary memory of about
      twice the state's floating size (the state as one buffer, and its
      mean).
    overlap: run each round's exchange beside the next round's steps, as a
      program of its own, and apply its mean at the end of that next round
      (a round late). ``True`` takes the measured rule (the local steps
      evidence page); ``"eager"``: each device moves by its own share of
      its pseudo-gradient (the outer step of it over the device count) at
      once, and the mean replaces that share when it arrives (Kale et al.);
      ``"own"``: each device moves by the outer step of its whole
      pseudo-gradient at once (it goes on from where its round ended), and
      the mean replaces it when it arrives; ``"delayed"``: the next round
      starts from the shared parameters without the round in flight. The
      step is then its compute alone where the exchange takes no longer than
      a round. Driven by
      :func:`topka2a_jax.train_step` and :func:`topka2a_jax.nnx_train_step`
      (which dispatch the exchange on its own execution stream); the state
      holds the round in flight (:class:`topka2a_jax.RoundInFlight`), so a
      checkpoint saved between rounds restores with it and its mean is
      applied once. The parameters the step returns lack the round in
      flight, and the loss it returns is over each process's own devices
      (a collective between round ends would wait on the wire behind the
      exchange). Not with ``average_inner_state``.
    **options: every option of the exchange, below.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`topka2a_jax.LocalStepsState`; its update needs ``params`` (the
    shared parameters) and gradients taken at :func:`local_params`, said with
    ``topka2a_gradient_at="local_params"`` (the training steps say it).

  Raises:
    ValueError, TypeError: ``every`` below 1, ``inner`` or ``outer`` not an
      optax transform, or a bad option (as :func:`topka2a_jax.topka2a`).

  Example:
    >>> tx = local_steps(optax.adamw(1e-3), every=500,  # DiLoCo's round
    ...                  outer=optax.sgd(0.7, momentum=0.9, nesterov=True),
    ...                  mesh=jax.make_mesh((8,), ("data",)))
  """
  refuse_options("local_steps", options, {
      "follows": "its exchange's form follows outer, which it runs itself"})
  lengths = round_lengths(every)
  if not isinstance(average_inner_state, bool):
    raise TypeError(f"average_inner_state must be True or False, got "
                    f"{average_inner_state!r}")
  inner = optax.with_extra_args_support(checked_optimizer("inner", inner))
  outer = optax.with_extra_args_support(
      checked_optimizer("outer", default_outer() if outer is None else outer))
  options.setdefault("algorithm", LOCAL_STEPS_FORM)
  algorithm = options["algorithm"]
  if density is not None and (ignores_density(algorithm) or (
      algorithm == AUTO and options.get("value_dtype") is None)):
    raise ValueError(
        f"local_steps(density={density!r}) would be unused: its exchange, "
        f"algorithm={algorithm!r}, sends every entry"
        + (" (before local_steps' outer step \"auto\" plans only such codes)"
           if algorithm == AUTO else "")
        + ". Leave density out, or name a top-k exchange with it, "
        "local_steps(..., density=0.01, algorithm='topka2a').")
  rule = overlap_rule(overlap)
  if rule is not None and average_inner_state:
    raise ValueError(
        "local_steps(overlap=..., average_inner_state=True): the inner state's mean runs "
        "in the step's own program, in line, so the overlap would not hide the round's "
        "exchanges. Leave one of them out.")
  checked = for_follower(Options.create(density, forms_follow=True, caller="local_steps",
                                        arguments=_ARGUMENTS, **options),
                         Followers((outer.update,), True), set(), rounds=True)

  def init_fn(params: optax.Params) -> LocalStepsState:
    refuse_followers(follower(init_fn), "local_steps(...)", _WHOLE)
    exchange = init_state(checked, params)
    mesh = layout_mesh(checked, jax.tree.leaves(params))
    step, length = counters(lengths.first, mesh, jax.tree.leaves(params))
    state = LocalStepsState(
        exchange,
        per_device_state(checked, inner.init, params, mesh, "local_steps"),
        per_device_state(checked, zeros_in_float32, params, mesh, "local_steps"),
        outer.init(params),
        step,
        length,
        jnp.zeros_like(step),
        None if rule is None else RoundInFlight(
            per_device_state(checked, zeros_in_float32, params, mesh, "local_steps"),
            per_device_state(checked, zeros_in_float32, params, mesh, "local_steps"),
            jnp.zeros_like(step, dtype=bool), jnp.zeros_like(step)))
    if not is_bound(checked.axis_name):
      warn_if_a_zero_step_is_not_finite(inner, params, "local_steps")
    if average_inner_state:
      _refuse_kept_parameters(inner.init, params, state.inner)
    return state

  def update_fn(updates: optax.Updates, state: LocalStepsState,
                params: optax.Params | None = None,
                **extra_args: Any) -> tuple[optax.Updates, LocalStepsState]:
    refuse_followers(follower(update_fn), "local_steps(...)", _WHOLE)
    return _update(checked, inner, outer, lengths, average_inner_state, rule, updates, state,
                   params, extra_args)

  def exchange_fn(sent: Any, exchange: Any, **extra_args: Any) -> RoundArrived:
    pseudo = jax.tree.map(lambda x: x[0], sent)
    means, exchange, dropped = update_state(checked, pseudo, exchange, extra_args)
    return RoundArrived(means, exchange, jnp.asarray(dropped))

  update_fn = marked(update_fn, checked.axis_name)
  if rule is not None:
    setattr(update_fn, OVERLAPPED, Overlapped(rule, lengths, exchange_fn))
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _update(options: Options, inner: optax.GradientTransformationExtraArgs,
            outer: optax.GradientTransformationExtraArgs, lengths: RoundLengths,
            average_inner_state: bool, rule: str | None, grads: optax.Updates,
            state: LocalStepsState,
            params: optax.Params | None, extra_args: dict[str, Any]
            ) -> tuple[optax.Updates, LocalStepsState]:
  """One device's step: ``inner`` at its local parameters; at a round's end, the exchange."""
  axis = options.axis_name
  bound_axis_size(axis)  # refuses outside shard_map, naming the fix
  if not isinstance(state, LocalStepsState):
    raise TypeError(f"expected the LocalStepsState made by local_steps' init, got "
                    f"{type(state).__name__}")
  if params is None:
    raise ValueError("local_steps needs the shared parameters: call "
                     "tx.update(grads, state, params), as train_step does")
  if extra_args.get(GRADIENT_AT) != AT_LOCAL_PARAMS:
    raise ValueError(
        "local_steps needs each device's gradient taken at its own local parameters, "
        "topka2a_jax.local_params(params, state): a gradient taken at the shared "
        "params runs another algorithm. Take it there and say so, "
        f"tx.update(grads, state, params, {GRADIENT_AT}={AT_LOCAL_PARAMS!r}); "
        "topka2a_jax.train_step and nnx_train_step do both")
  tree = leaves_of(grads)
  check_per_device(tree.values, tree.paths, axis)
  checked_residuals(options, tree.structure, state.exchange, tree.values, tree.paths,
                    given_specs(tree.structure, extra_args.get(PARAM_SPECS)))
  own_inner = jax.tree.map(lambda x: x[0], state.inner)
  offset = jax.tree.map(lambda x: x[0], state.offset)
  local = jax.tree.map(lambda p, o: (p + o).astype(p.dtype), params, offset)
  data_axis = DataAxis.parse(axis)
  if data_axis.is_pair:  # one node trains as one: its devices' mean gradient every step
    grads = jax.tree.map(lambda g: as_varying(lax.pmean(g, data_axis.inner), axis), grads)
  steps, new_inner = inner.update(grads, own_inner, local, **extra_args)
  new_offset = jax.tree.map(lambda o, s: as_varying(o + s.astype(o.dtype), axis), offset, steps)
  new_inner = jax.tree.map(lambda x: as_varying(x, axis), new_inner)
  decided = extra_args.get(NONFINITE)  # by skip_nonfinite around this transform
  bad = None
  if decided is not None or options.skip_nonfinite:
    checked = leaves_of(steps).values + ([] if decided is not None else tree.values)
    bad = nonfinite_on_any_device(checked, axis)
    bad = bad if decided is None else bad | decided
    new_inner = held_where(bad, own_inner, new_inner)
    new_offset = held_where(bad, offset, new_offset)
  step = state.step + (1 if bad is None else (~bad).astype(jnp.int32))
  stuck = None  # the round cannot finish: dropped, the next starts afresh
  skipped = jnp.zeros_like(state.skipped)
  if bad is not None:
    skipped = jnp.where(bad, state.skipped + 1, 0)
    stuck = skipped >= SKIPPED_IN_A_ROW
    skipped = jnp.where(stuck, 0, skipped)
  zeros = jax.tree.map(jnp.zeros_like, params)
  exchange_args = {key: value for key, value in extra_args.items() if key != NONFINITE}

  def round_ends(new_offset: Any, new_inner: Any) -> tuple[Any, ...]:
    pseudo = jax.tree.map(jnp.negative, new_offset)  # shared minus local
    means, exchange, dropped = update_state(options, pseudo, state.exchange, exchange_args)
    moved, new_outer = outer.update(means, state.outer, params)
    new_outer = held_where(dropped, state.outer, new_outer)
    moved = jax.tree.map(lambda m, p: jnp.where(dropped, 0, m).astype(p.dtype), moved, params)
    restart = jax.tree.map(lambda o: as_varying(jnp.zeros_like(o), axis), new_offset)
    if average_inner_state:
      new_inner = held_where(dropped, new_inner, _averaged(new_inner, axis))
    return moved, exchange, new_outer, restart, new_inner, jnp.zeros_like(step)

  def round_goes_on(new_offset: Any, new_inner: Any) -> tuple[Any, ...]:
    if stuck is None:
      return zeros, state.exchange, state.outer, new_offset, new_inner, step
    exchange = state.exchange._replace(nonfinite_steps=counted(
        counted(state.exchange.nonfinite_steps, bad), stuck))
    new_offset = jax.tree.map(lambda o: jnp.where(stuck, jnp.zeros_like(o), o), new_offset)
    return zeros, exchange, state.outer, new_offset, new_inner, jnp.where(stuck, 0, step)

  flight = state.in_flight
  if (rule is None) != (flight is None):
    made, built = ("without", "with") if flight is None else ("with", "without")
    raise TypeError(f"this local_steps state was made {made} overlap=, the optimizer is "
                    f"{built} it: pass the state this optimizer's init made (or restored)")
  if rule is None:
    ends, rounds = round_ends, state.exchange.count
  else:
    ends, rounds = functools.partial(_round_ends_late, rule, outer, state, params,
                                     extra_args.get(ARRIVED), axis), flight.rounds

  def goes_on(new_offset: Any, new_inner: Any) -> tuple[Any, ...]:
    result = round_goes_on(new_offset, new_inner)
    if flight is None:
      return result
    start = flight.start if stuck is None else jax.tree.map(
        lambda x: jnp.where(stuck, jnp.zeros_like(x), x), flight.start)
    return (*result, flight._replace(start=start))

  if lengths.constant == 1 and bad is None:
    result = ends(new_offset, new_inner)
  else:
    result = lax.cond(step >= lengths.at(rounds), ends, goes_on, new_offset, new_inner)
  moved, exchange, new_outer, new_offset, new_inner, step, *late = result
  return moved, LocalStepsState(exchange, per_device_blocks(new_inner, axis),
                                per_device_blocks(new_offset, axis), new_outer, step,
                                state.every, skipped, *late)


def _round_ends_late(rule: str, outer: optax.GradientTransformationExtraArgs,
                     state: LocalStepsState, params: optax.Params,
                     arrived: RoundArrived | None, axis: Any, new_offset: Any,
                     new_inner: Any) -> tuple[Any, ...]:
  """A round's end with ``overlap``: the round in flight's mean applied, this one sent.

  The mean of the round sent at the last round's end (``arrived``, its
  exchange run beside this round) moves the shared parameters through
  ``outer``; this round's pseudo-gradient, measured from where the round
  started, becomes the round in flight. Under the eager rule each device
  starts the next round moved by ``outer``'s step of its own pseudo-gradient
  over the device count, the share of the mean it knows already (Kale et
  al., arXiv 2502.12996); under the own rule, by ``outer``'s step of its
  whole pseudo-gradient, its own round standing in for the mean.
  """
  if arrived is None:
    raise ValueError(
        f"local_steps(overlap=...) needs, at a round's end, the mean of the round in "
        f"flight, which its exchange delivers as a program of its own: drive it with "
        f"topka2a_jax.train_step or nnx_train_step, which pass it as {ARRIVED}=. "
        "A hand-written step runs local_steps without overlap.")
  flight = state.in_flight
  own = lambda tree: jax.tree.map(lambda x: x[0], tree)
  start = own(flight.start)
  pseudo = jax.tree.map(lambda s, o: as_varying(s - o, axis), start, new_offset)
  applied = flight.pending & ~arrived.dropped
  moved, new_outer = outer.update(arrived.means, state.outer, params)
  new_outer = held_where(~applied, state.outer, new_outer)
  moved = jax.tree.map(lambda m, p: jnp.where(applied, m, 0).astype(p.dtype), moved, params)
  exchange = held_where(~flight.pending, state.exchange, arrived.exchange)
  if rule in (EAGER, OWN):
    replicas = bound_axis_size(DataAxis.parse(axis).names[0])  # a node trains as one
    share = pseudo if rule == OWN else jax.tree.map(lambda d: d / replicas, pseudo)
    step, _ = outer.update(share, new_outer, optax.apply_updates(params, moved))
    start = jax.tree.map(lambda d, u: as_varying(u.astype(d.dtype), axis), pseudo, step)
  else:
    start = jax.tree.map(jnp.zeros_like, pseudo)
  sent = RoundInFlight(per_device_blocks(pseudo, axis), per_device_blocks(start, axis),
                       jnp.ones_like(flight.pending), flight.rounds + 1)
  return moved, exchange, new_outer, start, new_inner, jnp.zeros_like(state.step), sent


def _refuse_kept_parameters(init: Any, params: optax.Params, per_device: Any) -> None:
  """Refuses an ``inner`` whose state keeps a copy of the parameters (at init).

  Schedule-free's ``z``, Prodigy's, DoG's and Mechanic's initial parameters:
  the 8-bit code is for moments, and would round parameters by up to 13% a
  round. The check runs ``init`` on random parameters of the same shapes
  and dtypes (so it holds also where the user's ``init`` is traced, under
  ``jax.jit``, and never mistakes a parameter of zeros for Adam's zero
  moments): a state leaf whose values are a parameter's, to the leaf's
  dtype's rounding, is a kept copy however ``init`` made it (``p``,
  ``jnp.copy(p)``, ``p * 1.0``, ``p + 0``, ``jnp.where``, a reshape, a cast,
  ``stop_gradient``). It cannot see a state that takes the parameters only
  in its ``update`` (zeros at ``init``), nor one that keeps something
  computed from them other than their values (``0.5 * p``). Only leaves of at
  least :data:`CHUNK` entries on each device (in ``per_device``, the state
  made from ``init`` with a leading axis of devices) are refused, the ones
  the code sends; smaller ones go exactly. It needs the memory of one more
  copy of the parameters and of ``inner``'s state while ``init`` runs.

  Raises:
    ValueError: naming the state's leaf and the fix.
  """
  with jax.ensure_compile_time_eval():
    given = jax.tree.leaves(params)
    keys = jax.random.split(jax.random.key(0), max(len(given), 1))
    probes = [jax.random.normal(key, jnp.shape(leaf)).astype(jnp.result_type(leaf))
              if jnp.issubdtype(jnp.result_type(leaf), jnp.floating)
              else jnp.zeros(jnp.shape(leaf), jnp.result_type(leaf))
              for key, leaf in zip(keys, given)]
    state = init(jax.tree.unflatten(jax.tree.structure(params), probes))
    kept = [np.asarray(probe, np.float32).ravel() for probe in probes
            if jnp.issubdtype(probe.dtype, jnp.floating)]
    leaves = jax.tree_util.tree_leaves_with_path(per_device)
    for (path, leaf), made in zip(leaves, jax.tree.leaves(state), strict=True):
      if (leaf.size // leaf.shape[0] < CHUNK
          or not jnp.issubdtype(jnp.result_type(made), jnp.floating)):
        continue
      values = np.asarray(made, np.float32).ravel()
      rounding = float(jnp.finfo(jnp.result_type(made)).eps)
      if any(probe.size == values.size and np.all(
          np.abs(values - probe) <= rounding * np.abs(probe)) for probe in kept):
        raise ValueError(
            f"average_inner_state=True would send the parameters that inner's state "
            f"keeps at {jax.tree_util.keystr(path)} in 8 bits, rounding each by up to "
            "13% every round: the code is for states of moments (Adam's, Lion's, "
            "momentum). Leave average_inner_state off with this inner optimizer.")


def _averaged(inner_state: Any, axis: Any) -> Any:
  """Every device's ``inner_state`` replaced by the devices' mean, its counts kept.

  The floating leaves of at least :data:`CHUNK` entries (moments) go as one
  buffer through :func:`relative_mean` (one exchange, not one a leaf). The
  smaller ones go exactly, as one float32 buffer: they cost little, and
  among them are the state's constants, the same on every device, which
  must stay as they are (``optax.inject_hyperparams``' ``b2`` of 0.999,
  which the code would round by up to 13%, or Muon's Newton-Schulz
  coefficients). The other leaves (step counts) are the same on every
  device and stay.
  """
  leaves, structure = jax.tree.flatten(inner_state)
  floating = [i for i, leaf in enumerate(leaves) if jnp.issubdtype(leaf.dtype, jnp.floating)]
  for group, mean_of in (([i for i in floating if leaves[i].size >= CHUNK], relative_mean),
                         ([i for i in floating if leaves[i].size < CHUNK], _exact_mean)):
    if not group:
      continue
    mean = mean_of(jnp.concatenate([leaves[i].astype(jnp.float32).reshape(-1)
                                    for i in group]), axis)
    for i, end in zip(group, itertools.accumulate(leaves[i].size for i in group)):
      leaf = leaves[i]
      leaves[i] = as_varying(mean[end - leaf.size:end].reshape(leaf.shape).astype(leaf.dtype),
                             axis)
  return jax.tree.unflatten(structure, leaves)


def _exact_mean(buffer: jax.Array, axis: Any) -> jax.Array:
  """The devices' float32 mean of ``buffer``, each entry on which they all agree kept.

  A mean of equal values need not return them (``lax.pmean`` of eight equal
  float32 values on the CPU backend came back an ulp off), and every round
  would move them again.
  """
  highest = lax.pmax(jnp.concatenate([buffer, -buffer]), axis)
  agreed = highest[:buffer.size] == -highest[buffer.size:]
  return jnp.where(agreed, buffer, lax.pmean(buffer, axis))
