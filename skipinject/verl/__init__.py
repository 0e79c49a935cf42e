"""Everything skipinject knows about verl, in one package: the rest knows roles, steps, payloads and bytes.

* :mod:`~skipinject.verl.compat` — the installed verl's version, the run's config, validation batches,
  the step's name (``global_steps``);
* :mod:`~skipinject.verl.codecs` — ``DataProto`` and TensorDict results as payloads, and which of
  their tensors follow from others (``input_ids`` is ``prompts`` and ``responses`` side by side);
* :mod:`~skipinject.verl.rows` — a ``DataProto``'s rows taken, padded and merged (``action=match``);
* :mod:`~skipinject.verl.tensordicts` — TensorDicts (jagged tensors, ``NonTensorStack``) as payload entries;
* :mod:`~skipinject.verl.layout` — upstream's cache directory names, from the run's config;
* :mod:`~skipinject.verl.builtin_guard` — verl's own SkipManager turned off for the roles skipinject handles;
* :mod:`~skipinject.verl.stack` — the verl stack installed against the versions tested.

A new verl version goes here (and into the plugins' targets). Nothing here imports verl, torch or
tensordict at module level.
"""
