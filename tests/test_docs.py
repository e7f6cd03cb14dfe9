"""Every docstring example in the package, its command-line tools included, runs as shown.

The examples are complete programs but for the imports every JAX user has
(``jax``, ``jnp``, ``np``, ``optax``, ``P``, ``NamedSharding`` and
``topka2a_jax``), which the namespace provides; the 8 emulated devices come
from ``conftest.py``.
"""

import doctest
import importlib
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import topka2a_jax

MODULES = sorted(info.name for info in pkgutil.walk_packages(topka2a_jax.__path__,
                                                             "topka2a_jax."))
IMPORTS = {"jax": jax, "jnp": jnp, "np": np, "optax": optax, "P": P,
           "NamedSharding": NamedSharding, "topka2a_jax": topka2a_jax}


@pytest.mark.parametrize("name", ["topka2a_jax", *MODULES])
def test_docstring_examples_run(name):
  module = importlib.import_module(name)
  finder = doctest.DocTestFinder(exclude_empty=True)
  runner = doctest.DocTestRunner(
      optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  tests = [t for t in finder.find(module, globs={**vars(module), **IMPORTS})
           if t.examples]
  for test in tests:
    runner.run(test)
  results = runner.summarize(verbose=False)
  assert results.failed == 0, f"{results.failed} docstring examples failed in {name}"
  is_package = hasattr(module, "__path__")  # the face, and each part's overview
  if not is_package:
    assert results.attempted > 0, f"{name} has no docstring example"
