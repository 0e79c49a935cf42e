"""The plugin contract, in pluggy's terms (docs/plugins.md): any ``skipinject_*`` function of a plugin is a
hook, marked or not; one not declared here is an error (a misspelt hook never goes unnoticed)."""

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
