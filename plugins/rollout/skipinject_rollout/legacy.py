"""verl's older built-in rollout skip (``verl.utils.rollout_skip.RolloutSkip``, verl < 0.9).

Before SkipManager (verl 0.9), ``RayPPOTrainer.fit`` builds a ``RolloutSkip`` when the trainer
config enables it (``actor_rollout_ref.rollout.skip.enable`` in 0.8, ``...rollout.skip_rollout``
in 0.6/0.7) and calls its ``wrap_generate_sequences()``, which replaces the rollout manager's (or
worker group's) ``generate_sequences`` on that instance with one that loads and dumps pickles.
With skipinject's ``rollout`` role on as well, both would act: two caches written, and verl's
pickles loaded without the user asking skipinject to trust them.

:class:`BuiltinSkipOff` is the phase of a target on ``RolloutSkip.wrap_generate_sequences``: while
the rollout role is enabled, the wrapping does not happen (one warning), so exactly one mechanism
acts. If the role cannot act in this run (its ``check`` says why, e.g. verl 0.6's sync rollout
path), the built-in is left alone, so the user's own setting still does what it did.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from skipinject import Call, PhaseContext, run_config_of

BUILTIN_WRAP = "verl.utils.rollout_skip:RolloutSkip.wrap_generate_sequences"


class BuiltinSkipOff:
    """``RolloutSkip.wrap_generate_sequences``: not called while skipinject's role acts (warns once).

    ``check``: the role's own check (a reason it cannot act in a run, or None).
    """

    def __init__(self, check: Callable[[Any], str | None] | None = None) -> None:
        self.check = check

    def run(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        if self._keep_builtin(role, call):
            return proceed()
        return None

    async def run_async(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        if self._keep_builtin(role, call):
            return await proceed()
        return None

    def _keep_builtin(self, role: PhaseContext, call: Call) -> bool:
        reason = None
        check = self.check
        config = run_config_of(call)
        if check is not None and config is not None:
            try:
                reason = check(config)
            except Exception:  # a failing check must not decide for the user
                reason = None
        if reason:
            role.once(
                "builtin-kept",
                logging.WARNING,
                "verl's built-in rollout skip (RolloutSkip) is enabled and skipinject's %s role cannot act in this "
                "run (%s): the built-in one is left on",
                role.name,
                reason,
            )
            return True
        role.once(
            "builtin",
            logging.WARNING,
            "verl's built-in rollout skip is enabled and skipinject's %s role is on: skipinject handles it, verl's "
            "RolloutSkip is turned off for this run (it writes and loads nothing)",
            role.name,
        )
        return False
