"""The library's code, private: users import the face, ``topka2a_jax``.

Read it top-down: each part or shared record imports only those after it in
this list (``tests/test_package.py`` holds it so).

* ``training/``: what users call to train. ``step.py`` (``train_step``, and
  ``DataParallelStep``, the one core behind both training steps),
  ``nnx_step.py`` (Flax NNX), ``placement.py`` (the optimizer state laid out
  on a mesh).
* ``checkpointing/``: ``checkpoint.py`` and ``checkpoint_manager.py`` (Orbax,
  any device count), ``resize.py`` (what each kind of per-device state
  becomes on another device count, one rule per kind), ``integrity.py``
  (fingerprints, manifest), ``step_claims.py`` (one job per manager step).
* ``runtime/``: several processes. ``distributed.py`` (joining the
  runtime), ``launch.py`` (N local processes), ``watchdog.py`` (a stalled
  one ended), ``contract.py`` (the variables and exit status the launcher
  and its processes share).
* ``transforms/``: the optax transforms. ``topka2a.py`` (the transform),
  ``exchange_state.py`` (its state made and updated, shared by every
  transform), ``exchange_plan.py`` (what every leaf does, decided once per
  trace), ``leaves.py`` (pytrees taken apart), ``exchange_step.py`` (one
  device's step, the one every transform runs: a ``Carried`` record in, a
  ``Stepped`` one out; the warm-up, non-finite and overflow switches),
  ``bucket_exchange.py`` (each bucket's exchange under it: residuals added
  back, the wire's clip, one collective per bucket; ended at the means, or
  at the owners' shards for the sharded optimizer),
  ``extra_args.py`` (the keys passed through
  optax's extra arguments), ``update_compression.py``, ``local_steps.py``
  (rounds of local steps, one exchange a round), ``per_device.py`` (state
  each device keeps a copy of), ``frozen_variance.py``,
  ``sharded_optimizer.py``, ``nonfinite.py``,
  ``clipping.py``, ``following.py`` (what follows the exchange in its chain,
  which sets ``"auto"``'s forms).
* ``options.py``: every option of the transforms, declared once (default,
  check, docstring line); ``transforms/signatures.py`` makes the factories'
  signatures and types from them.
* ``planner/``: which exchange each bucket takes. ``cost.py`` (α-β costs,
  the links), ``fusion.py`` (the bucket plan), ``forms.py`` (``"auto"``'s
  forms for each kind of optimizer), ``buckets.py`` (which leaves
  share a flat buffer), ``compute.py`` (the backward pass's duration),
  ``tuning.py`` (the plan tuned on timed steps), ``report.py`` (what a
  compiled program sends).
* ``rounds.py``: how many steps each of ``local_steps``' rounds takes, read
  by the transform at run time and by the report's bytes a step.
* ``collectives/``: the exchanges of one flat buffer. ``exchanges.py``
  (dense, TopkA, TopKA2A, TopKA2A-sparse, few-bit, two-level),
  ``low_rank.py`` (PowerSGD), ``selection.py``, ``threshold.py`` and ``top_k.py`` (which
  entries to send, by name), ``wire.py`` (values and indices in one
  message), ``quantized.py`` (the few-bit exchanges' codes),
  ``algorithms.py`` (every exchange's name, phases and cost terms: the
  registry the collectives are read from).
* Shared records: ``layout.py`` (where each piece lives on the mesh),
  ``states.py`` (the transforms' states, and the walk over their per-device
  fields), ``buffers.py`` (flat buffers in rows), ``arguments.py``
  (argument checks), ``caller.py`` (where a warning points), ``axis.py``
  (the data axis, parsed once), ``sizes.py`` (counts: ``k``, shards, chunks,
  PowerSGD's matrices), ``lazy.py`` (the public modules' names imported on
  first use).
"""
