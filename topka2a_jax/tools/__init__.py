"""The command-line tools, built on the public API alone.

Installed as console scripts with the package:

* ``topka2a-plan`` (:mod:`topka2a_jax.tools.plan`): the fusion plan and the
  predicted step of a model on a device count and link, before anything runs.
* ``topka2a-launch`` (:mod:`topka2a_jax.tools.launch`): N local processes of
  one script, as a multi-host job would run it.

:mod:`topka2a_jax.tools.model_shapes` holds the layer shapes of the models
``topka2a-plan --model`` knows. Each tool also runs as ``python -m
topka2a_jax.tools.plan`` (or ``.launch``).

Example:
  >>> from topka2a_jax.tools import model_shapes
  >>> sorted(model_shapes.MODELS)[:2]
  ['bert-base', 'gpt2']
"""
