"""What a run tells its user about the cache as a whole: the start lines (:mod:`~skipinject.report.start`).

Every per-step decision is already one line of the engine's; this package says what the run is about
to do before it starts and what went wrong in the settings, in the driver (the process the user
started), once.
"""
