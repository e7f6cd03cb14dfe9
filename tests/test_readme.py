"""The README's complete programs run as written and train."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def programs():
  """The python blocks that are whole programs (they start with their imports)."""
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
  return [block for block in blocks if block.startswith("import os\n")]


def test_the_readme_has_its_two_usage_programs():
  assert len(programs()) == 2  # the jit route and the Flax NNX route


@pytest.mark.parametrize("index", range(2))
def test_usage_program_runs_and_the_loss_falls(index):
  namespace = {"__name__": "readme"}
  exec(compile(programs()[index], str(README), "exec"), namespace)  # noqa: S102
  losses = namespace["losses"]
  assert len(losses) == 100
  assert losses[-1] < 0.5 * losses[0]
