"""Everything skipinject knows about verl, in one package: the rest knows roles, steps, payloads and bytes.

compat (version, run config, validation, ``global_steps``), codecs and tensordicts (``DataProto`` and
TensorDict results as payloads), rows (``action=match``), layout (upstream's directory names),
builtin_guard (verl's own SkipManager turned off for our roles), stack (the versions tested), samples
(rows as people read them). A new verl version goes here and into the plugins' targets.
"""
