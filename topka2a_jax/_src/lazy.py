"""A public module whose names are imported on first use (PEP 562).

Each public module (``topka2a_jax`` and its namespaces) writes what it
exports twice, side by side: as ordinary imports and assignments under
``if TYPE_CHECKING:``, which type checkers, IDEs and the documentation read
as they are, and as data, a mapping from each name to the module that holds
it, which it hands to :func:`attach`. At run time only the mapping is read:
each name is imported when it is first used, so that ``import topka2a_jax``
imports no JAX, and ``topka2a-plan --help`` and ``topka2a-launch --help``
answer without it. ``tests/test_package.py`` holds the two lists equal. The
idea is Scientific Python's SPEC 1 (``lazy_loader.attach``'s
``submod_attrs``).

Example:
  >>> import sys, types
  >>> module = types.ModuleType("lazy_example")
  >>> sys.modules["lazy_example"] = module
  >>> module.__getattr__, module.__dir__ = attach(
  ...     "lazy_example", {"dumps": "json", "ERROR": "json.decoder:JSONDecodeError"})
  >>> module.dumps([1]), module.ERROR.__name__, "dumps" in dir(module)
  ('[1]', 'JSONDecodeError', True)
  >>> del sys.modules["lazy_example"]
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def attach(module_name: str, sources: Mapping[str, str]
           ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
  """The ``__getattr__`` and ``__dir__`` of the module ``module_name``.

  Args:
    module_name: the module's ``__name__``.
    sources: each name it exports, and where that name is: a module that
      holds it under the same name (``"topka2a_jax._src.transforms.topka2a"``),
      or a module and the attribute it is there (``"json.decoder:JSONDecodeError"``).
      Where the module is a package, the name may be its submodule.

  Returns:
    ``(__getattr__, __dir__)``: the first imports a name on first use and
    keeps it in the module, so later uses cost nothing; the second lists
    the module's public names, imported or not.
  """
  sources = dict(sources)

  def __getattr__(name: str) -> Any:
    if name not in sources:
      raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    module, _, attribute = sources[name].partition(":")
    value = _resolve(module, attribute or name)
    setattr(sys.modules[module_name], name, value)
    return value

  def __dir__() -> list[str]:
    public = {name for name in sources if not name.startswith("_")}
    return sorted(public | set(vars(sys.modules[module_name])))

  return __getattr__, __dir__


def _resolve(module_name: str, attribute: str) -> Any:
  """``from module_name import attribute``, as Python's import runs it."""
  module = importlib.import_module(module_name)
  if attribute in vars(module):
    return vars(module)[attribute]
  if hasattr(module, "__path__"):  # a package: the name may be its submodule
    return importlib.import_module(f"{module_name}.{attribute}")
  raise ImportError(f"cannot import name {attribute!r} from {module_name!r}")
