"""The package's shape: a curated face over private code, imports in layers, one step core."""

import ast
import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

import topka2a_jax
from topka2a_jax._src.training.step import DataParallelStep

PACKAGE = pathlib.Path(topka2a_jax.__file__).parent
ROOT = PACKAGE.parent
PUBLIC_NAMESPACES = ("collectives", "cost", "checkpoint", "distributed")
TOOLS = PACKAGE / "tools"  # the command-line tools: public, built on the face alone


def module_name(path: pathlib.Path) -> str:
  """``topka2a_jax/_src/planner/cost.py`` -> ``topka2a_jax._src.planner.cost``."""
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(node: ast.ImportFrom | ast.Import, modules: set[str]) -> set[str]:
  """The package's modules one import statement names."""
  if isinstance(node, ast.Import):
    return {alias.name for alias in node.names} & modules
  found = {f"{node.module}.{alias.name}" for alias in node.names} & modules
  return found or ({node.module} & modules)


def module_imports() -> dict[str, set[str]]:
  """Each module's module-level imports of other modules of the package.

  Packages' ``__init__`` files are left out: the face's only re-exports, and
  the others are empty.
  """
  paths = {module_name(path): path for path in PACKAGE.rglob("*.py")
           if path.stem != "__init__"}
  modules = set(paths)
  imports = {}
  for name, path in paths.items():
    found = set()
    for node in module_level(ast.parse(path.read_text())):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        found |= imported_modules(node, modules)
    imports[name] = found - {name}
  return imports


def module_level(tree: ast.Module) -> list[ast.stmt]:
  """A module's statements, with those of its ``if TYPE_CHECKING:`` blocks: a
  public module's names, which it imports on first use."""
  return [statement for node in tree.body
          for statement in (node.body if isinstance(node, ast.If) and isinstance(
              node.test, ast.Name) and node.test.id == "TYPE_CHECKING" else [node])]


LAYERS = ("training", "checkpointing", "runtime", "transforms", "options", "planner",
          "rounds", "collectives", "layout", "states", "buffers", "arguments", "caller", "axis",
          "sizes", "lazy")
"""The parts and shared records of ``topka2a_jax/_src``, top down: each imports
only what comes after it (``_src/__init__.py`` and ``docs/layout.md`` say so)."""


def part_of(module: str) -> str:
  """``topka2a_jax._src.planner.cost`` -> ``planner``; ``..._src.axis`` -> ``axis``."""
  return module.split(".")[2]


def test_every_part_imports_only_the_parts_below_it():
  private = {m: deps for m, deps in module_imports().items() if "._src." in m}
  assert {part_of(m) for m in private} == set(LAYERS)
  upward = [f"{m} -> {d}" for m, deps in private.items() for d in deps
            if LAYERS.index(part_of(d)) < LAYERS.index(part_of(m))]
  assert not upward


def positional_returns(part: str) -> dict[str, str]:
  """The public functions of a part of ``_src`` (those other modules may import) that
  return a tuple of unlike things (``tuple[A, B]``, not ``tuple[A, ...]``), by
  ``module.function``, with their annotations."""
  found = {}
  for path in (PACKAGE / "_src" / part).glob("*.py"):
    for node in ast.parse(path.read_text()).body:
      if (isinstance(node, ast.FunctionDef) and node.returns is not None
          and not node.name.startswith("_")):
        returned = ast.unparse(node.returns)
        if returned.startswith("tuple[") and not returned.endswith(", ...]"):
          found[f"{path.stem}.{node.name}"] = returned
  return found


def test_the_transforms_pass_records_not_positional_tuples_between_modules():
  # What one module of the step hands another has named fields (Stepped,
  # Carried, Sent, Planned, Exchanged...): reordering a field cannot misassign it.
  transforms = PACKAGE / "_src" / "transforms"
  texts = {path.stem: path.read_text() for path in transforms.glob("*.py")}
  crossing = [f"{name}: {returned}" for name, returned in positional_returns("transforms").items()
              if any(re.search(rf"\b{name.split('.')[1]}\(", text)
                     for stem, text in texts.items() if stem != name.split(".")[0])]
  assert not crossing


def test_the_tuple_reader_sees_a_positional_return(tmp_path, monkeypatch):
  part = tmp_path / "topka2a_jax" / "_src" / "probe"
  part.mkdir(parents=True)
  (part / "m.py").write_text("def f() -> tuple[int, str]: ...\n"
                             "def g() -> tuple[int, ...]: ...\n"
                             "def _h() -> tuple[int, str]: ...\n")
  monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "topka2a_jax")
  assert positional_returns("probe") == {"m.f": "tuple[int, str]"}


def test_one_class_is_behind_both_training_steps():
  assert issubclass(topka2a_jax.TrainStep, DataParallelStep)
  assert issubclass(topka2a_jax.NnxTrainStep, DataParallelStep)


def test_the_public_face_is_small_and_every_name_resolves():
  assert 20 <= len(topka2a_jax.__all__) <= 30
  for namespace in (topka2a_jax, *(getattr(topka2a_jax, name)
                                   for name in PUBLIC_NAMESPACES)):
    for name in namespace.__all__:
      assert getattr(namespace, name) is not None, (namespace.__name__, name)


def test_a_star_import_and_help_work_without_flax_and_the_flax_names_say_what_they_need():
  script = ("import sys; sys.modules['flax'] = None\n"
            "from topka2a_jax import *\n"
            "assert callable(train_step) and callable(topka2a)\n"
            "import pydoc, topka2a_jax\n"
            "assert 'compress_updates' in pydoc.render_doc(topka2a_jax)\n"
            "try:\n"
            "  topka2a_jax.nnx_train_step\n"
            "except ImportError as error:\n"
            "  print(error)\n")
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        check=False, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert done.returncode == 0, done.stderr
  assert "needs Flax: pip install 'topka2a-jax[nnx]'" in done.stdout


def imports_of(*arguments: str) -> tuple[set[str], subprocess.CompletedProcess]:
  """The modules a fresh interpreter imports to run ``python ARGUMENTS``, and its result."""
  done = subprocess.run([sys.executable, "-X", "importtime", *arguments],
                        capture_output=True, text=True, check=False,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  modules = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines()
             if line.startswith("import time:") and "|" in line}
  return modules, done


@pytest.mark.parametrize("command", ["plan", "launch"])
def test_help_of_both_commands_answers_without_importing_jax(command):
  modules, done = imports_of("-m", f"topka2a_jax.tools.{command}", "--help")
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.startswith(f"usage: topka2a-{command}")
  assert "topka2a_jax" in modules  # the count sees the package's own imports
  assert not {"jax", "optax", "flax"} & modules


def test_the_face_imports_each_name_on_first_use():
  script = ("import sys, topka2a_jax, topka2a_jax.collectives, topka2a_jax.cost, "
            "topka2a_jax.checkpoint, topka2a_jax.distributed\n"
            "assert 'jax' not in sys.modules and 'optax' not in sys.modules\n"
            "print(sorted(set(topka2a_jax.__all__) - set(dir(topka2a_jax))))\n"
            "print(sorted(set(topka2a_jax.cost.__all__) - set(dir(topka2a_jax.cost))))\n"
            "print(topka2a_jax.cost.NETWORKS['eth10'].name, 'jax' in sys.modules)\n"
            "print(topka2a_jax.topka2a.__module__, 'jax' in sys.modules)\n")
  _, done = imports_of("-c", script)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.splitlines() == [
      "[]", "[]", "eth10 False", "topka2a_jax._src.transforms.topka2a True"]


def type_checking_block(path: str) -> dict[str, str]:
  """Each public name a module's ``if TYPE_CHECKING:`` block defines, and where from,
  written as the module's ``_LAZY`` writes it (``"module"``, or ``"module:attribute"``
  where the name differs)."""
  tree = ast.parse(pathlib.Path(path).read_text(), path)
  aliases: dict[str, str] = {}  # every name the block binds, the private modules included
  found: dict[str, str] = {}
  for block in tree.body:
    if not (isinstance(block, ast.If) and isinstance(block.test, ast.Name)
            and block.test.id == "TYPE_CHECKING"):
      continue
    for statement in block.body:
      if isinstance(statement, ast.ImportFrom):
        for alias in statement.names:
          name = alias.asname or alias.name
          aliases[name] = f"{statement.module}.{alias.name}"
          found[name] = (statement.module if name == alias.name
                         else f"{statement.module}:{alias.name}")
      elif isinstance(statement, ast.Assign):
        name, value = statement.targets[0].id, statement.value
        module = aliases[value.value.id]
        found[name] = module if value.attr == name else f"{module}:{value.attr}"
  return {name: where for name, where in found.items() if not name.startswith("_")}


@pytest.mark.parametrize("namespace", ["", *PUBLIC_NAMESPACES])
def test_what_each_public_module_exports_is_what_it_imports_on_first_use(namespace):
  # What type checkers read (the TYPE_CHECKING block) and what runs (_LAZY) agree,
  # and every name of __all__ is in both.
  module = importlib.import_module(f"topka2a_jax.{namespace}".rstrip("."))
  assert type_checking_block(module.__file__) == module._LAZY
  extra = {*topka2a_jax.NEEDS_FLAX, *PUBLIC_NAMESPACES} if module is topka2a_jax else set()
  assert set(module._LAZY) == set(module.__all__) | extra
  for name in module._LAZY:
    assert getattr(module, name) is not None
  with pytest.raises(AttributeError, match=f"module '{module.__name__}' has no attribute 'nope'"):
    module.nope  # noqa: B018


def test_the_block_reader_reads_a_renamed_re_export(tmp_path):
  source = tmp_path / "face.py"
  source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "  from json import decoder as _decoder\n  from json import dumps\n"
                    "  from json import loads as read\n  ERROR = _decoder.JSONDecodeError\n")
  assert type_checking_block(str(source)) == {
      "dumps": "json", "read": "json:loads", "ERROR": "json.decoder:JSONDecodeError"}


def test_the_only_public_modules_are_the_four_namespaces_and_the_tools():
  public = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"}
  assert public == set(PUBLIC_NAMESPACES)
  packages = {path.name for path in PACKAGE.iterdir()
              if path.is_dir() and (path / "__init__.py").exists()}
  assert packages == {"_src", "tools"}


def private_imports(path: pathlib.Path) -> list[str]:
  """The package's private names a file imports: ``_src`` modules, ``_``-names."""
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("topka2a_jax"):
      names = [alias.name for alias in node.names]
      if "_src" in node.module.split(".") or any(n.startswith("_") for n in names):
        found.append(f"from {node.module} import {', '.join(names)}")
    elif isinstance(node, ast.Import):
      found += [f"import {alias.name}" for alias in node.names
                if alias.name.startswith("topka2a_jax") and "_src" in alias.name]
  return found


OUTSIDE_SRC = ["topka2a_jax/tools/*.py", "benchmarks/*.py", "examples/*.py", "docs/*.py"]


@pytest.mark.parametrize("pattern", OUTSIDE_SRC)
def test_nothing_outside_the_private_code_imports_a_private_name(pattern):
  paths = sorted(ROOT.glob(pattern))
  assert paths, pattern
  for path in paths:
    assert not private_imports(path), (path.relative_to(ROOT), private_imports(path))


def test_the_private_import_check_sees_one(tmp_path):
  leaky = tmp_path / "leaky.py"
  leaky.write_text("from topka2a_jax._src.planner.cost import INNER_NETWORK\n"
                   "from topka2a_jax.cost import _cost\nimport topka2a_jax._src.axis\n")
  assert len(private_imports(leaky)) == 3


USER_FACING = ["README.md", "examples/*.py", "benchmarks/*.py", "topka2a_jax/tools/*.py",
               "docs/index.md",
               "docs/api.md", "docs/guides/*.md", "docs/evidence/*.md"]


@pytest.mark.parametrize("pattern", USER_FACING)
def test_what_users_read_uses_only_the_public_face(pattern):
  for path in sorted(ROOT.glob(pattern)):
    text = path.read_text()
    assert "topka2a_jax._src" not in text, f"{path.relative_to(ROOT)} reaches into private code"
    for module in re.findall(r"topka2a_jax\.([a-z_0-9]+)", text):
      assert module in (*topka2a_jax.__all__, *topka2a_jax.NEEDS_FLAX,
                        *PUBLIC_NAMESPACES, "tools"), (
          f"{path.relative_to(ROOT)} names topka2a_jax.{module}, not public")


def named_public_object(dotted: str) -> bool:
  """Whether ``topka2a_jax.a.b`` names something: attributes, or modules below."""
  parts, found = dotted.split(".")[1:], topka2a_jax
  for i, part in enumerate(parts):
    try:
      found = getattr(found, part)
    except AttributeError:
      try:
        found = importlib.import_module(".".join(["topka2a_jax", *parts[:i + 1]]))
      except ImportError:
        return False
  return True


def test_every_public_name_the_code_mentions_exists():
  """Docstrings and error messages send users only to names they can import."""
  missing = set()
  for path in PACKAGE.rglob("*.py"):
    for found in re.finditer(r"(?<![\w.])topka2a_jax(?:\.[A-Za-z_]\w*)+", path.read_text()):
      if ".".join(found.group(0).split(".")[:2]) != "topka2a_jax._src" and not (
          named_public_object(found.group(0))):
        missing.add((str(path.relative_to(ROOT)), found.group(0)))
  assert not missing
  assert not named_public_object("topka2a_jax.integrity.verify")


USES_THE_FACE = (
    "import topka2a_jax, optax\n"
    "print(topka2a_jax.__file__)\n"
    "topka2a_jax.topka2a(0.01); topka2a_jax.compress_updates(optax.sgd(1.0))\n"
    "topka2a_jax.sharded_optimizer(optax.sgd(1.0), 0.1)\n"
    "print(topka2a_jax.cost.NETWORKS['eth10'].name, topka2a_jax.checkpoint.save.__name__)\n")
"""A user's first lines: the face, the three transforms, two namespaces."""


def _run_python(*arguments: str, path: str | None = None) -> subprocess.CompletedProcess:
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  if path is not None:
    env["PYTHONPATH"] = path
  return subprocess.run([sys.executable, *arguments], capture_output=True, text=True,
                        check=False, env=env,
                        cwd=None if path is None else pathlib.Path(path).parent)


def test_the_face_works_under_python_oo_where_docstrings_are_stripped():
  done = _run_python("-OO", "-c", USES_THE_FACE)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.splitlines()[1] == "eth10 save"
  plan = _run_python("-OO", "-m", "topka2a_jax.tools.plan", "--params", "1000000",
                     "--devices", "8", "--density", "0.01")
  assert plan.returncode == 0, plan.stderr[-2000:]
  assert "speedup" in plan.stdout
  assert _run_python("-OO", "-m", "topka2a_jax.tools.plan", "--help").returncode == 0


@pytest.mark.parametrize("install", ["byte-compiled", "zip"])
def test_the_face_works_from_an_install_without_source_files(tmp_path, install):
  """Installs that hold no .py files: only .pyc files beside each other, or a zip."""
  import compileall
  import shutil
  import zipfile

  copy = tmp_path / "site" / "topka2a_jax"
  shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
  if install == "byte-compiled":
    assert compileall.compile_dir(copy, quiet=1, legacy=True)
    for source in copy.rglob("*.py"):
      source.unlink()
    where = str(copy.parent)
  else:
    where = str(tmp_path / "topka2a_jax.zip")
    with zipfile.ZipFile(where, "w") as archive:
      for source in copy.rglob("*.py"):
        archive.write(source, source.relative_to(copy.parent))
  done = _run_python("-c", USES_THE_FACE, path=where)
  assert done.returncode == 0, done.stderr[-2000:]
  printed = done.stdout.splitlines()
  assert printed[0].startswith(where) and printed[1] == "eth10 save"
  for command in ("plan", "launch"):
    helped = _run_python("-m", f"topka2a_jax.tools.{command}", "--help", path=where)
    assert helped.stdout.startswith(f"usage: topka2a-{command}"), helped.stderr[-2000:]


def test_every_kind_of_per_device_state_has_its_specs_and_its_restore_rule():
  """A new kind in states.PER_DEVICE needs a row in placement's SPECS and resize's RULES."""
  from topka2a_jax._src.checkpointing.resize import RULES
  from topka2a_jax._src.states import PER_DEVICE
  from topka2a_jax._src.training.placement import SPECS

  kinds = {kind for fields in PER_DEVICE.values() for kind in fields.values()}
  assert set(SPECS) == set(RULES) == kinds


def test_the_version_is_the_installed_distributions_and_dir_shows_the_face():
  from importlib.metadata import version

  assert topka2a_jax.__version__ == version("topka2a-jax")
  shown = dir(topka2a_jax)
  assert "__version__" in shown and set(topka2a_jax.__all__) <= set(shown)
  assert not {"NEEDS_FLAX", "TYPE_CHECKING", "_MOVED", "_src"} & set(shown)


LAB = {
    "a signed percentage (a measured result)": re.compile(r"(?<![\w.])[+-]\d+(\.\d+)?%"),
    "a path into benchmarks/ (not shipped with the package)": re.compile(r"benchmarks/"),
}
"""What the package must not say: figures live on the evidence pages, named by
the package where one matters."""


def lab_findings(text):
  """``(line, what)`` for every line of ``text`` that holds a measured result or a
  path the installed package does not ship."""
  return [(number, what) for number, line in enumerate(text.splitlines(), 1)
          for what, pattern in LAB.items() if pattern.search(line)]


def test_the_package_states_behaviour_and_leaves_figures_to_the_evidence():
  found = [f"{path.relative_to(ROOT)}:{line}: {what}"
           for path in sorted(PACKAGE.rglob("*.py"))
           for line, what in lab_findings(path.read_text())]
  assert not found, "\n".join(found)


def test_the_lab_guard_sees_a_figure_and_a_path():
  assert lab_findings('"""ended +4.5% / -0.6% against dense"""\n# see benchmarks/x.py\n'
                      'ratio = 0.5  # 50% of the bytes, -x\n') == [
      (1, "a signed percentage (a measured result)"),
      (2, "a path into benchmarks/ (not shipped with the package)")]
