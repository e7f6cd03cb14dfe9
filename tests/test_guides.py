"""The guides as a new user reads them: their references resolve and their first snippets train.

The README's whole program and the usage guide's Flax NNX program run in
``test_readme.py``; here the usage guide's first snippet (which the index
says to read first) runs in the README program's namespace, and every page's
links, file paths and test names point at something that exists.
"""

import pathlib
import re

import pytest
from test_readme import README, ROOT, USAGE, programs

PAGES = sorted([README, *(ROOT / "docs").rglob("*.md")])
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))

LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"`((?:topka2a_jax|tests|benchmarks|examples|docs|\.ci)/[\w/.\-]+)`")
TEST = re.compile(r"`?(?:tests/)?(test_\w+\.py)::(test_\w+)")
SECTION = re.compile(r"[\"“]([^\"”\n]{3,80})[\"”] (?:below|above)")
BURSTS = re.compile(r"algorithm=\"(?:topka2a|topka2a_sparse|allgather|onebit\w*)\"")


def _blocks(page: pathlib.Path) -> list[str]:
  return re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL)


def _rel(page: pathlib.Path) -> str:
  return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_link_and_file_a_page_names_exists(page):
  text = page.read_text()
  missing = []
  for target in LINK.findall(text):
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
      continue  # a web address, or an anchor on the page
    if not (page.parent / target.split("#")[0]).exists():
      missing.append(target)
  for path in PATH.findall(text):
    if path.startswith("docs/_build/"):
      continue  # what building the site writes
    if not any((ROOT / candidate).exists() for candidate in (path, path.rstrip("."))):
      missing.append(path)
  for title in SECTION.findall(text):  # "Several processes" below
    if not re.search(rf"^(?:#+ |\*\*){re.escape(title)}", text, re.MULTILINE):
      missing.append(f"the section {title!r}")
  for module, name in TEST.findall(text):
    source = ROOT / "tests" / module
    if not source.exists() or not re.search(rf"^def {name}\(", source.read_text(), re.MULTILINE):
      missing.append(f"{module}::{name}")
  assert not missing, f"{_rel(page)} names what does not exist: {missing}"


@pytest.mark.parametrize("page", GUIDES, ids=_rel)
def test_no_guide_opens_with_a_top_k_or_sign_before_adam(page):
  """The first snippet is what a reader copies: before Adam it uses the README's form."""
  blocks = _blocks(page)
  first = blocks[0] if blocks else ""
  if "optax.adam" in first:
    assert not BURSTS.search(first), first


def test_the_usage_guides_first_snippet_and_program_train_as_the_readme_program():
  readme = programs(README)[0]
  setup = readme[:readme.index("tx = ")]  # the model, the data and the mesh
  snippet = _blocks(USAGE)[0]
  namespace = {"__name__": "usage"}
  exec(compile(setup + snippet, str(USAGE), "exec"), namespace)  # noqa: S102
  losses = [float(namespace["loss"])]
  for _ in range(99):  # the README program's 100 steps
    params, opt_state, loss = namespace["train_step"](
        namespace["params"], namespace["opt_state"], (namespace["x"], namespace["y"]))
    namespace.update(params=params, opt_state=opt_state)
    losses.append(float(loss))
  reference = {"__name__": "readme"}
  exec(compile(readme, str(README), "exec"), reference)  # noqa: S102
  assert losses[-1] == pytest.approx(reference["losses"][-1], rel=0.01)
  # The guide's first whole program (Flax NNX) trains the README's model too.
  nnx_program = {"__name__": "usage"}
  exec(compile(programs(USAGE)[0], str(USAGE), "exec"), nnx_program)  # noqa: S102
  assert nnx_program["losses"][-1] == pytest.approx(reference["losses"][-1], rel=0.01)
