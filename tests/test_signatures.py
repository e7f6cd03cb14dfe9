"""The options each transform factory takes, as its signature and its type say.

Every option is one field of ``Options``; each factory's ``**options`` is
typed by a ``TypedDict`` (``transforms/signatures.py``) that type checkers
read. These tests hold the records to the fields, and run mypy on a user's
file to show that a misspelt option is reported before anything runs.
"""

import inspect
import subprocess
import sys

import optax
import pytest

import topka2a_jax
from topka2a_jax._src.options import argument_of, user_options
from topka2a_jax._src.transforms.sharded_optimizer import NOT_TAKEN
from topka2a_jax._src.transforms.signatures import (
  CompressUpdatesOptions,
  FrozenVarianceAdamOptions,
  ShardedOptimizerOptions,
  TopKA2AOptions,
  takes_options,
)

OPTIONS = {argument_of(field): field for field in user_options()}
TAKEN = {  # each factory, its record, and the options it refuses
    topka2a_jax.topka2a: (TopKA2AOptions, set()),
    topka2a_jax.compress_updates: (CompressUpdatesOptions, {"follows"}),
    topka2a_jax.local_steps: (CompressUpdatesOptions, {"follows"}),
    topka2a_jax.sharded_optimizer: (ShardedOptimizerOptions, set(NOT_TAKEN)),
    topka2a_jax.frozen_variance_adam: (FrozenVarianceAdamOptions, {"follows", "warmup_steps"}),
}


@pytest.mark.parametrize("factory", list(TAKEN), ids=lambda f: f.__name__)
def test_each_record_names_every_option_the_factory_does_not_refuse(factory):
  record, refused = TAKEN[factory]
  assert set(record.__optional_keys__) == set(OPTIONS) - refused
  keyword_only = [name for name, parameter in inspect.signature(factory).parameters.items()
                  if parameter.kind == inspect.Parameter.KEYWORD_ONLY and name in OPTIONS]
  assert keyword_only == [name for name in OPTIONS if name in record.__optional_keys__]


def test_each_option_has_the_type_its_field_declares():
  for name, ref in TopKA2AOptions.__annotations__.items():
    field = OPTIONS[name]
    assert ref.__forward_arg__ == (field.metadata["annotation"] or field.type), name


def test_a_record_that_names_no_option_is_refused_where_it_is_written():
  class Misspelt(ShardedOptimizerOptions, total=False):
    min_sise: int

  with pytest.raises(TypeError, match=r"Misspelt names \['min_sise'\], no option of Options"):
    takes_options(Misspelt)


REFUSING = [factory for factory, (_, refused) in TAKEN.items() if refused]


@pytest.mark.parametrize("factory", REFUSING, ids=lambda f: f.__name__)
def test_every_option_a_factory_does_not_take_is_refused_at_run_time_naming_why(factory):
  _, refused = TAKEN[factory]
  if factory is topka2a_jax.frozen_variance_adam:
    args, kwargs = (1e-3, 0.01), {"freeze_after": 2}
  else:
    args, kwargs = (optax.adam(1e-3), 0.01), {}
  for name in refused:
    with pytest.raises(TypeError, match=f"{factory.__name__} takes no {name}=: "):
      factory(*args, **kwargs, **{name: OPTIONS[name].default})


USER_FILE = '''\
import topka2a_jax

kept = topka2a_jax.topka2a(0.01, min_size=0, algorithm="dense")
misspelt = topka2a_jax.topka2a(0.01, min_sise=0)
refused = topka2a_jax.sharded_optimizer(None, density=0.01, fusion=2)
mistyped = topka2a_jax.compress_updates(None, warmup_steps="2")
fused = topka2a_jax.topka2a(0.01, fusion="2")
follows = topka2a_jax.topka2a(0.01, follows="adamw")
'''


def test_a_type_checker_reports_a_misspelt_option_before_anything_runs(tmp_path):
  user_file = tmp_path / "train.py"
  user_file.write_text(USER_FILE)
  done = subprocess.run(
      [sys.executable, "-m", "mypy", "--follow-imports=silent", "--no-incremental",
       "--cache-dir", str(tmp_path / "cache"), "--hide-error-context",
       "--no-error-summary", str(user_file)],
      cwd=tmp_path, capture_output=True, text=True, check=False)  # the user's own folder
  errors = sorted(line.split(": error: ", 1)[1].split("  [")[0]
                  for line in done.stdout.splitlines() if ": error: " in line)
  assert errors == [
      ('Argument "follows" to "topka2a" has incompatible type "Literal[\'adamw\']"; '
       'expected "Literal[\'adam\', \'momentum\', \'sgd\'] | Transform | None"'),
      ('Argument "fusion" to "topka2a" has incompatible type "Literal[\'2\']"; '
       'expected "int | Literal[\'auto\']"'),
      ('Argument "warmup_steps" to "compress_updates" has incompatible type "str"; '
       'expected "int"'),
      'Unexpected keyword argument "fusion" for "sharded_optimizer"',
      'Unexpected keyword argument "min_sise" for "topka2a"; did you mean "min_size"?',
  ], done.stdout + done.stderr
  lines = [int(line.split(":")[1]) for line in done.stdout.splitlines() if ": error: " in line]
  assert sorted(lines) == [4, 5, 6, 7, 8]  # line 3, every option spelt right, is clean
