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


def prose(page_text: str) -> str:
  """A page's prose: no code blocks, tables, headings or inline code."""
  text = re.sub(r"```.*?```", "", page_text, flags=re.DOTALL)
  lines = [line for line in text.splitlines()
           if not line.lstrip().startswith(("|", "#"))]
  return re.sub(r"`[^`]*`", "CODE", "\n".join(lines))


def sentences(text: str) -> list[str]:
  return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z(*\[])", " ".join(text.split())) if s]


NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*")


def test_the_readme_is_read_in_five_minutes():
  """At most about 1,000 words of prose, no sentence with more than three numbers (the
  figures live on the evidence pages), and no test counts or timings (CI prints them)."""
  text = prose(README.read_text())
  assert len(text.split()) <= 1000
  crowded = [s for s in sentences(text) if len(NUMBER.findall(s)) > 3]
  assert not crowded, crowded
  assert not re.search(r"\d+ tests|\d+(\.\d+)? min\b|minutes? of pytest", text)


def test_the_readme_check_sees_prose_and_skips_code_and_tables():
  page = ("Intro with 1, 2, 3 and 4 numbers. Short one.\n\n| 1 | 2 | 3 | 4 | 5 |\n"
          "```python\nx = [1, 2, 3, 4, 5]\n```\nCode `f(1, 2, 3, 4)` is skipped.\n")
  text = prose(page)
  assert [len(NUMBER.findall(s)) for s in sentences(text)] == [4, 0, 0]
  assert len(text.split()) == 14
