"""The package's shape: how deep its imports go, and one core behind both steps."""

import ast
import functools
import pathlib

import topka2a_jax
from topka2a_jax.step import DataParallelStep

PACKAGE = pathlib.Path(topka2a_jax.__file__).parent
MAX_CHAIN = 8  # modules, the first and the last included


def module_imports() -> dict[str, set[str]]:
  """Each module's module-level imports of other modules of the package."""
  modules = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"}
  imports = {}
  for name in modules:
    found = set()
    for node in ast.parse((PACKAGE / f"{name}.py").read_text()).body:
      if isinstance(node, ast.ImportFrom) and node.module == "topka2a_jax":
        found |= {alias.name for alias in node.names}
      elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("topka2a_jax."):
        found.add(node.module.split(".")[1])
    imports[name] = (found & modules) - {name}
  return imports


def longest_chain(imports: dict[str, set[str]]) -> list[str]:
  @functools.cache
  def chain(name: str) -> tuple[str, ...]:
    return (name,) + max((chain(dep) for dep in imports[name]), key=len, default=())

  return list(max((chain(name) for name in imports), key=len))


def test_no_import_chain_is_longer_than_eight_modules():
  chain = longest_chain(module_imports())
  assert len(chain) <= MAX_CHAIN, " -> ".join(chain)


def test_the_chain_counter_counts_a_chain_it_is_shown():
  imports = {"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}}
  assert longest_chain(imports) == ["a", "b", "c"]


def test_one_class_is_behind_both_training_steps():
  assert issubclass(topka2a_jax.TrainStep, DataParallelStep)
  assert issubclass(topka2a_jax.NnxTrainStep, DataParallelStep)
