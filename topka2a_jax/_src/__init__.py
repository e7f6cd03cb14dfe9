"""The library's code, private: users import the face, ``topka2a_jax``.

Read it top-down, in four parts and a few shared records:

* ``training/``: what users call to train. ``step.py`` (``train_step``, and
  ``DataParallelStep``, the one core behind both training steps),
  ``nnx_step.py`` (Flax NNX), ``placement.py`` (the optimizer state laid out
  on a mesh), ``checkpoint.py`` and ``checkpoint_manager.py`` (Orbax, any
  device count), ``resize.py`` (what per-device state becomes on another
  device count), ``integrity.py`` (fingerprints, manifest),
  ``distributed.py``, ``launch.py`` and ``watchdog.py`` (several processes,
  a stalled one ended).
* ``transforms/``: the optax transforms. ``topka2a.py`` (the transform),
  ``exchange_state.py`` (its state made and updated, shared by every
  transform), ``leaves.py`` (pytrees taken apart), ``error_feedback.py`` (one device's step:
  residuals, buckets, one collective per bucket, the warm-up and non-finite switches),
  ``update_compression.py``, ``frozen_variance.py``,
  ``sharded_optimizer.py``, ``nonfinite.py``, ``clipping.py``.
* ``planner/``: which exchange each bucket takes. ``cost.py`` (α-β costs),
  ``fusion.py`` (the bucket plan), ``buckets.py`` (which leaves share a flat
  buffer), ``compute.py`` (the backward pass's duration), ``tuning.py``
  (the plan tuned on timed steps), ``report.py`` (what a compiled program
  sends).
* ``collectives/``: the exchanges of one flat buffer. ``exchanges.py``
  (dense, TopkA, TopKA2A, TopKA2A-sparse, one-bit, two-level), ``low_rank.py``
  (PowerSGD), ``selection.py`` and ``threshold.py`` (which entries to send),
  ``wire.py`` (values and indices in one message), ``quantized.py`` (the
  one-bit exchanges' codes), ``algorithms.py`` (every
  exchange's name, phases and cost terms).
* Shared records: ``options.py`` (the transforms' options, validated once),
  ``states.py`` (their states), ``axis.py`` (the data axis, parsed once),
  ``layout.py`` (where each piece lives on the mesh).

Each part imports only the parts below it in this list (``training`` the
transforms, the transforms the planner, the planner the collectives) and the
shared records.
"""
