"""The plugin contract, in pluggy's terms (docs/plugins.md).

A plugin is any object or module with a ``skipinject_roles`` hook returning the
:class:`~skipinject.roles.Role` objects it contributes, found through the ``skipinject.plugins``
entry-point group or named in ``VERL_SKIP_PLUGINS``. Any ``skipinject_*`` function of a plugin is a
hook, marked or not; one this spec does not declare is an error (a misspelt hook never goes unnoticed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from collections.abc import Sequence

    from skipinject.roles import Role

PROJECT = "skipinject"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def skipinject_roles() -> Sequence[Role]:  # type: ignore[empty-body]
    """Return the roles this plugin provides (each with a unique name)."""
