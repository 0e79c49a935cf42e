__version__ = "0.1.0"

#: The plugin API this skipinject provides (major, minor). A plugin may declare the version it was
#: written for as ``SKIPINJECT_API = 1`` or ``"1.1"``: same major and a minor no newer is compatible.
#: 1.1: the plugin kit (codec headers, row digests, verl ranges), ``PhaseContext.load`` and ``Loaded``.
#: 1.2: ``action=match``: :class:`~skipinject.roles.RowCodec`, ``Role.row_key``/``match_settings``/``on_match``.
#: 1.3: ``Role.record_meta``, ``HitInfo.meta``/``settings``, ``MatchInfo.served``/``source_meta``/``settings``;
#: a phase records and commits its steps (``PhaseContext.record``, ``commit``, ``served``, ``notes``).
#: 1.4: ``count_rescored`` (rows a role re-scored, in the run's summary).
API_VERSION = (1, 4)
