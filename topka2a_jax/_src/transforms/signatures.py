"""The transform factories' options as signatures: for ``help``, the API pages and type checkers.

Every option is declared once, as a field of :class:`Options`. Each
factory says which options it takes by the ``TypedDict`` that types its
``**options`` (PEP 692's ``Unpack``), so pyright, mypy and IDEs see every
option and flag a misspelt one; :func:`takes_options` reads the same
``TypedDict`` to give the factory its run-time signature and one Args line
per option. ``tests/test_signatures.py`` checks that these records name
every option, each with the type its field declares.

Example:
  >>> sorted(ShardedOptimizerOptions.__optional_keys__)[:3]
  ['algorithm', 'axis_name', 'error_feedback']
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import textwrap
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal, Protocol, TypedDict, TypeVar

from jax.sharding import Mesh

from topka2a_jax._src.axis import DataAxis
from topka2a_jax._src.options import argument_of, user_options

if sys.version_info >= (3, 11):
  from typing import Unpack
else:  # PEP 692's Unpack came to typing in 3.11
  from typing_extensions import Unpack

# Unpack is here for the factories, which import it with their records.
__all__ = ["CompressUpdatesOptions", "FrozenVarianceAdamOptions", "ShardedOptimizerOptions",
           "TopKA2AOptions", "Unpack", "refuse_options", "takes_options"]

F = TypeVar("F", bound=Callable[..., Any])


class Transform(Protocol):
  """What ``follows=`` takes besides a kind's name: an optax transform (its
  ``init`` and ``update``), for type checkers."""

  @property
  def init(self) -> Callable[..., Any]: ...

  @property
  def update(self) -> Callable[..., Any]: ...


class _EveryFactorysOptions(TypedDict, total=False):
  """The options every factory takes (each one's doc: :class:`Options`)."""

  axis_name: Hashable
  mesh: Mesh | None
  algorithm: str
  error_feedback: bool
  min_size: int
  network: Any
  value_dtype: Any
  residual_dtype: Any
  selection: str
  skip_nonfinite: bool


class ShardedOptimizerOptions(_EveryFactorysOptions, total=False):
  """The options :func:`topka2a_jax.sharded_optimizer` takes: no ``fusion``,
  ``backward_seconds``, ``rank`` or ``follows``."""

  warmup_steps: int


class FrozenVarianceAdamOptions(_EveryFactorysOptions, total=False):
  """The options :func:`topka2a_jax.frozen_variance_adam` takes: its warm-up is
  ``freeze_after``, and the exchange's form follows its momentum."""

  fusion: int | Literal["auto"]
  backward_seconds: float | None
  rank: int | None


class CompressUpdatesOptions(ShardedOptimizerOptions, FrozenVarianceAdamOptions, total=False):
  """The options of :func:`topka2a_jax.compress_updates` and :func:`topka2a_jax.local_steps`:
  all but ``follows`` (the exchange's form follows the optimizer they are given)."""


class TopKA2AOptions(CompressUpdatesOptions, total=False):
  """The options of :func:`topka2a_jax.topka2a`: every option."""

  follows: Literal["adam", "momentum", "sgd"] | Transform | None


def takes_options(taken: type, *, defaults: dict[str, Any] | None = None,
                  docs: dict[str, str] | None = None) -> Callable[[F], F]:
  """Gives a transform factory ``f(..., **options)`` the parameter and Args line of each
  option it takes.

  The factory keeps its own parameters and takes the options as
  ``**options: Unpack[taken]``, which it passes to :meth:`Options.create`.
  Its run-time signature (``inspect.signature``, ``help``, the API pages)
  lists the options ``taken`` names, with their defaults, and the line
  ``**options: ...`` of its docstring becomes one Args line per option,
  the field's ``doc``.

  Args:
    taken: the ``TypedDict`` of the options the factory takes (it refuses
      the others with :func:`refuse_options`).
    defaults: the factory's own defaults, where they differ.
    docs: the factory's own Args lines, where they differ.

  Raises:
    TypeError: ``taken`` names a key that is no option of :class:`Options`.

  Example:
    >>> @takes_options(ShardedOptimizerOptions)
    ... def exchange(density, **options: Unpack[ShardedOptimizerOptions]):
    ...   '''An exchange.
    ...
    ...   Args:
    ...     density: the fraction sent.
    ...     **options: the options.
    ...   '''
    ...   return density, options
    >>> list(inspect.signature(exchange).parameters)[:3]
    ['density', 'axis_name', 'mesh']
    >>> "    min_size: leaves with fewer elements" in exchange.__doc__
    True
  """
  defaults, docs = defaults or {}, docs or {}
  options = user_options()
  unknown = set(taken.__optional_keys__) - {argument_of(field) for field in options}
  if unknown:
    raise TypeError(f"{taken.__name__} names {sorted(unknown)}, no option of Options")

  def decorate(factory: F) -> F:
    shown = [field for field in options if argument_of(field) in taken.__optional_keys__]
    signature = inspect.signature(factory)
    own = [parameter for parameter in signature.parameters.values()
           if parameter.kind != inspect.Parameter.VAR_KEYWORD]
    for field in shown:
      name = argument_of(field)
      default = field.default.name if isinstance(field.default, DataAxis) else field.default
      own.append(inspect.Parameter(
          name, inspect.Parameter.KEYWORD_ONLY, default=defaults.get(name, default),
          annotation=field.metadata["annotation"] or field.type))
    factory.__signature__ = signature.replace(parameters=own)  # type: ignore[attr-defined]
    if factory.__doc__ is not None:  # None under python -OO: nothing to document
      factory.__doc__ = _with_option_lines(factory.__doc__, shown, docs)
    return factory

  return decorate


def refuse_options(transform: str, options: dict[str, Any], refused: dict[str, str]) -> None:
  """Raises TypeError for an option ``transform`` does not take, saying why.

  Example:
    >>> refuse_options("sharded_optimizer", {"fusion": 1}, {"fusion": "every leaf is a bucket"})
    Traceback (most recent call last):
    TypeError: sharded_optimizer takes no fusion=: every leaf is a bucket
  """
  for name, why in refused.items():
    if name in options:
      raise TypeError(f"{transform} takes no {name}=: {why}")


def _with_option_lines(doc: str, shown: Sequence[dataclasses.Field],
                       docs: dict[str, str]) -> str:
  """``doc`` with its line ``**options: ...`` replaced by one Args line per option."""
  lines = doc.split("\n")
  at = next((i for i, line in enumerate(lines) if line.lstrip().startswith("**options:")),
            None)
  if at is None:
    raise ValueError("a factory that takes_options documents them with a line "
                     "'**options: ...' in its Args")
  indent = lines[at][:len(lines[at]) - len(lines[at].lstrip())]
  end = at + 1  # its continuation lines go with it
  while end < len(lines) and lines[end].startswith(indent + " "):
    end += 1
  made = []
  for field in shown:
    name = argument_of(field)
    made += textwrap.wrap(f"{name}: {docs.get(name, field.metadata['doc'])}", width=80,
                          initial_indent=indent, subsequent_indent=indent + "  ",
                          break_long_words=False, break_on_hyphens=False)
  return "\n".join(lines[:at] + made + lines[end:])
