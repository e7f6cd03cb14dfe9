"""The documentation site builds with warnings as errors, and documents every public name."""

import importlib.util
import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import topka2a_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_site_builds_without_warnings_and_has_a_page_per_public_name(tmp_path):
  shutil.copytree(ROOT / "docs", tmp_path / "docs",
                  ignore=shutil.ignore_patterns("_build", "_autosummary"))
  shutil.copy(ROOT / "CHANGELOG.md", tmp_path)
  built = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "-E", "-q", "-b", "html",
       str(tmp_path / "docs"), str(tmp_path / "site")],
      capture_output=True, text=True, check=False)
  assert built.returncode == 0, built.stderr
  pages = {path.stem for path in (tmp_path / "site" / "_autosummary").glob("*.html")}
  # described on the reference page itself (data, not a function or class)
  api = (tmp_path / "site" / "api.html").read_text()
  pages |= set(re.findall(r'id="(topka2a_jax\.[\w.]+)"', api))
  for name, entry in re.findall(r'<dt class="sig sig-object py" id="(topka2a_jax\.[\w.]+)">'
                                r"(.*?)</dd>", api, re.DOTALL):
    # A first line of "text: more" reads as "type: description" and loses its start.
    assert "Type:" not in re.sub(r"<[^>]+>", "", entry), f"{name}'s first line lost"
  public = {f"topka2a_jax.{name}" for name in topka2a_jax.__all__}
  for namespace in ("collectives", "cost", "checkpoint", "distributed"):
    module = getattr(topka2a_jax, namespace)
    public |= {f"topka2a_jax.{namespace}.{name}" for name in module.__all__
               if getattr(module, name) is not getattr(topka2a_jax, name, None)}
  missing = public - pages
  assert not missing, f"public names without an API page: {sorted(missing)}"


def test_every_run_a_figure_draws_has_a_legend():
  """A committed JSON whose run has no legend would fail only the slow site build."""
  spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "docs" / "figures.py")
  figures = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(figures)
  runs = {row["run"] for path in figures.DATA.glob(figures.TRAINING_JSON)
          for row in json.loads(path.read_text())["rows"]}
  runs |= {run["name"] for path in figures.DATA.glob(figures.CHARLM_JSON)
           for run in json.loads(path.read_text())["runs"]}
  assert runs, f"no committed JSON found under {figures.DATA}"
  missing = sorted(runs - set(figures.LEGENDS))
  assert not missing, f"runs without a legend in docs/figures.py's LEGENDS: {missing}"
