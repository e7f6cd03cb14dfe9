"""The README's usage example runs as written and trains."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks():
  return re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


def test_usage_example_runs_and_the_loss_falls():
  usage = max(python_blocks(), key=len)  # the one-liner first, then the step
  namespace = {"__name__": "readme"}
  exec(compile(usage, str(README), "exec"), namespace)  # noqa: S102
  losses = namespace["losses"]
  assert len(losses) == 100
  assert losses[-1] < 0.5 * losses[0]
