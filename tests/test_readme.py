"""The README's program and the usage guide's run as written and train; the README stays short."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
USAGE = ROOT / "docs" / "guides" / "usage.md"


def programs(page: pathlib.Path) -> list[str]:
  """The python blocks that are whole programs (they start with their imports)."""
  blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL)
  return [block for block in blocks if block.startswith("import os\n")]


def test_the_readme_and_the_usage_guide_have_their_programs():
  assert len(programs(README)) == 1  # the jit route
  assert len(programs(USAGE)) == 1  # the Flax NNX route


@pytest.mark.parametrize("page", [README, USAGE], ids=["readme", "usage"])
def test_program_runs_and_the_loss_falls(page, capsys):
  namespace = {"__name__": "readme"}
  exec(compile(programs(page)[0], str(page), "exec"), namespace)  # noqa: S102
  losses = namespace["losses"]
  assert len(losses) == 100
  assert losses[-1] < 0.5 * losses[0]
  printed = capsys.readouterr().out.strip()
  assert printed == f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
  if page == README:  # its quote of the output holds to two decimals on any machine
    quoted = re.search(r"It prints `loss ([0-9.]+) -> ([0-9.]+)`", README.read_text())
    assert quoted, "the README quotes the program's output"
    assert float(quoted[1]) == pytest.approx(losses[0], abs=0.01)
    assert float(quoted[2]) == pytest.approx(losses[-1], abs=0.01)


def test_the_readme_is_short():
  assert len(README.read_text().splitlines()) <= 250
