"""The documentation's named results (``docs/results.py``) and their kinds, for the tests."""

import importlib
import json
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
DATA = DOCS / "evidence" / "data"


def tables():
  """``docs/tables.py``, imported as the documentation build imports it."""
  if str(DOCS) not in sys.path:
    sys.path.insert(0, str(DOCS))
  return importlib.import_module("tables")


def results():
  """``docs/results.py``: every named result the pages include."""
  tables()
  return importlib.import_module("results")


def json_of(name: str) -> dict:
  """The committed JSON that the named result ``name`` renders."""
  return json.loads((DATA / results().RESULTS[name].file).read_text())
