"""Sphinx configuration of the topka2a-jax site: ``sphinx-build -W docs docs/_build``."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import figures  # docs/figures.py
import tables  # docs/tables.py

# Every evidence figure, from the committed JSON: one that cannot be drawn
# fails the build.
figures.draw_all()
# Every evidence table, from the committed JSON: one that cannot be rendered
# fails the build. The pages include them; they are not pages of their own.
tables.write_all()

project = "topka2a-jax"
author = "The topka2a-jax maintainers"
copyright = "2026, The topka2a-jax maintainers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "evidence/tables"]
templates_path = ["_templates"]

autosummary_generate = True
autodoc_typehints = "description"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
myst_heading_anchors = 3

html_theme = "sphinx_book_theme"
html_title = "topka2a-jax"
html_static_path = ["_static"]
html_css_files = ["wide_tables.css"]  # wide evidence tables scroll, not cut
