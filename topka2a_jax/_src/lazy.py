"""A public module whose names are imported on first use (PEP 562).

Each public module (``topka2a_jax`` and its namespaces) writes what it
exports as ordinary imports and assignments under ``if TYPE_CHECKING:``,
which type checkers, IDEs and the documentation read as they are, and hands
its own file to :func:`attach`. At run time nothing in that block runs:
:func:`attach` reads it once and imports each name when it is first used,
so that ``import topka2a_jax`` imports no JAX, and ``topka2a-plan --help``
and ``topka2a-launch --help`` answer without it. The idea is Scientific
Python's SPEC 1 (``lazy_loader.attach_stub``), with the stub kept in the
module itself.

The block may hold two kinds of statement:

* ``from M import a`` or ``from M import a as b``: ``b`` is ``a`` of
  module ``M``, or its submodule ``M.a``, as Python's own import finds it;
* ``NAME = alias.attribute``, where ``alias`` is a module imported above
  it: a re-export of a constant, with the docstring below it.

Example:
  >>> import os, sys, tempfile, textwrap, types
  >>> source = textwrap.dedent('''
  ...     from typing import TYPE_CHECKING
  ...     if TYPE_CHECKING:
  ...       from json import decoder as _decoder
  ...       from json import dumps as to_text
  ...       ERROR = _decoder.JSONDecodeError
  ...     ''')
  >>> with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as file:
  ...   _ = file.write(source)
  >>> module = types.ModuleType("lazy_example")
  >>> sys.modules["lazy_example"] = module
  >>> module.__getattr__, module.__dir__ = attach("lazy_example", file.name)
  >>> module.to_text([1]), module.ERROR.__name__, "to_text" in dir(module)
  ('[1]', 'JSONDecodeError', True)
  >>> del sys.modules["lazy_example"]; os.remove(file.name)
"""

from __future__ import annotations

import ast
import dis
import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

Source = tuple[str, str]
"""Where a lazy name comes from: a module and an attribute of it (or its
submodule of that name)."""


def attach(module_name: str, path: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
  """The ``__getattr__`` and ``__dir__`` of the module ``module_name`` at ``path``.

  Args:
    module_name: the module's ``__name__``.
    path: its ``__file__``, whose ``if TYPE_CHECKING:`` block lists what it
      exports.

  Returns:
    ``(__getattr__, __dir__)``: the first imports a name on first use and
    keeps it in the module, so later uses cost nothing; the second lists
    the module's public names, imported or not.

  Raises:
    ValueError: the block holds a statement of another kind.
  """
  sources = _installed_sources(module_name, path)

  def __getattr__(name: str) -> Any:
    if name not in sources:
      raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    value = _resolve(*sources[name])
    setattr(sys.modules[module_name], name, value)
    return value

  def __dir__() -> list[str]:
    public = {name for name in sources if not name.startswith("_")}
    return sorted(public | set(vars(sys.modules[module_name])))

  return __getattr__, __dir__


def _installed_sources(module_name: str, path: str) -> dict[str, Source]:
  """:func:`lazy_sources` of the module as it is installed, read through its loader.

  A source file or a zip on ``sys.path`` gives its text; an install of
  byte-compiled files only gives none, and the names come from the
  compiled block (:func:`_compiled_sources`), which Python keeps although
  it never runs it.
  """
  loader = getattr(sys.modules.get(module_name), "__loader__", None)
  if loader is None or not hasattr(loader, "get_source"):
    return lazy_sources(path)
  text = loader.get_source(module_name)
  if text is not None:
    return _parsed_sources(text, path)
  return _compiled_sources(loader.get_code(module_name))


def lazy_sources(path: str) -> dict[str, Source]:
  """Every name the ``if TYPE_CHECKING:`` blocks of the file at ``path`` define.

  Raises:
    ValueError: a block holds a statement that is neither an import from a
      module nor ``NAME = alias.attribute``.
  """
  with open(path, encoding="utf-8") as file:
    return _parsed_sources(file.read(), path)


def _parsed_sources(text: str, path: str) -> dict[str, Source]:
  """:func:`lazy_sources` of a module's source ``text`` (``path`` names it in errors)."""
  tree = ast.parse(text, path)
  sources: dict[str, Source] = {}
  for block in tree.body:
    if not (isinstance(block, ast.If) and isinstance(block.test, ast.Name)
            and block.test.id == "TYPE_CHECKING"):
      continue
    for statement in block.body:
      if isinstance(statement, ast.ImportFrom) and statement.level == 0:
        for alias in statement.names:
          sources[alias.asname or alias.name] = (statement.module, alias.name)
      elif _is_reexport(statement, sources):
        module, attribute = sources[statement.value.value.id]
        sources[statement.targets[0].id] = (f"{module}.{attribute}", statement.value.attr)
      elif not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)):
        raise ValueError(
            f"{path}:{statement.lineno}: a lazy module's TYPE_CHECKING block holds "
            "'from module import name' and 'NAME = alias.attribute' (each may have a "
            f"docstring); got {ast.unparse(statement)!r}")
  return sources


def _compiled_sources(code: types.CodeType) -> dict[str, Source]:
  """:func:`lazy_sources` read from a module's compiled code.

  The ``if TYPE_CHECKING:`` block is the jump over it after the name is
  loaded; inside it, ``from M import a as b`` compiles to ``IMPORT_NAME M``,
  ``IMPORT_FROM a``, ``STORE_NAME b``, and ``NAME = alias.attribute`` to
  ``LOAD_NAME alias``, ``LOAD_ATTR attribute``, ``STORE_NAME NAME``.
  """
  instructions = list(dis.get_instructions(code))
  sources: dict[str, Source] = {}
  for at, instruction in enumerate(instructions):
    if not (instruction.opname == "LOAD_NAME" and instruction.argval == "TYPE_CHECKING"):
      continue
    jump = next(i for i in instructions[at + 1:] if "JUMP" in i.opname)
    block = [i for i in instructions if jump.offset < i.offset < jump.argval]
    module = attribute = None
    for step in block:
      if step.opname == "IMPORT_NAME":
        module = step.argval
      elif step.opname in ("IMPORT_FROM", "LOAD_ATTR"):
        attribute = step.argval
      elif step.opname == "LOAD_NAME" and step.argval in sources:
        module = "{}.{}".format(*sources[step.argval])
      elif step.opname == "STORE_NAME" and module is not None and attribute is not None:
        sources[step.argval] = (module, attribute)
        attribute = None
  return sources


def _is_reexport(statement: ast.stmt, sources: dict[str, Source]) -> bool:
  """Whether ``statement`` is ``NAME = alias.attribute`` with ``alias`` a lazy module."""
  return (isinstance(statement, ast.Assign) and len(statement.targets) == 1
          and isinstance(statement.targets[0], ast.Name)
          and isinstance(statement.value, ast.Attribute)
          and isinstance(statement.value.value, ast.Name)
          and statement.value.value.id in sources)


def _resolve(module_name: str, attribute: str) -> Any:
  """``from module_name import attribute``, as Python's import runs it."""
  module = importlib.import_module(module_name)
  if attribute in vars(module):
    return vars(module)[attribute]
  if hasattr(module, "__path__"):  # a package: the name may be its submodule
    return importlib.import_module(f"{module_name}.{attribute}")
  raise ImportError(f"cannot import name {attribute!r} from {module_name!r}")
