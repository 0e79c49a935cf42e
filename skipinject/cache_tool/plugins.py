"""The installed plugins' roles, as the cache tool sees them: a role's own codec decodes its steps.

A step is decoded by the codec of the plugin providing its role (the engine's, the default
``DataProtoCodec`` when the role declares none). A step of a role no installed plugin provides is
still listed and verified (the store's checks need no codec); ``show`` and ``diff`` then show its raw
payload and name the plugin that would decode it. Plugins are chosen as for a run
(``VERL_SKIP_PLUGINS``, else every installed one), loaded once; one that fails to load is left out.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from skipinject.errors import SkipInjectError
from skipinject.roles import Codec, Role, UpstreamFormat
from skipinject.store.format import STEP_NAME


@dataclass(frozen=True)
class Upstream:
    """verl's own cache of one installed role (its :class:`UpstreamFormat`), as the tool finds it."""

    role: str
    format: UpstreamFormat

    @property
    def directory(self) -> re.Pattern[str]:
        """The step directory's name; group 1 is the step number."""
        return directory_pattern(self.format.directory)

    @property
    def per_part(self) -> bool:
        """One file per part directory (``0/name``, ``1/name`` ...) instead of one in the step."""
        return self.format.file_name.startswith("0/")

    @property
    def base_name(self) -> str:
        return self.format.file_name.rsplit("/", 1)[-1]


def directory_pattern(template: str) -> re.Pattern[str]:
    """``"genstep_{step:06d}"`` -> ``^genstep_([0-9]{1,18})$`` (``{step}``: the store's step rule)."""
    pieces = []
    for literal, name, spec, _ in string.Formatter().parse(template):
        pieces.append(re.escape(literal))
        if name is not None:
            pieces.append(f"({STEP_NAME.pattern})" if not spec else "([0-9]{1,18})")
    return re.compile("^" + "".join(pieces) + "$")


class InstalledRoles:
    """The roles of this environment's plugins, by name (loaded on first use); ``selection``: a
    ``VERL_SKIP_PLUGINS`` value (``None``: the variable, else every plugin)."""

    def __init__(self, selection: str | None = None) -> None:
        self._selection = selection
        self._roles: dict[str, tuple[Role, str]] | None = None
        self.problem: str | None = None
        self._default_codec: Codec | None = None

    def _load(self) -> dict[str, tuple[Role, str]]:
        if self._roles is None:
            from skipinject.plugin_manager import load_plugins

            self._roles = {}
            try:
                plugins = load_plugins(self._selection)
            except SkipInjectError as exc:  # a bad VERL_SKIP_PLUGINS: decode nothing, say why
                self.problem = str(exc)
                return self._roles
            self._roles = {role.name: (role, plugin.name) for plugin in plugins.plugins for role in plugin.roles}
        return self._roles

    def role(self, name: str) -> Role | None:
        return self._load().get(name, (None, None))[0]

    def plugin_of(self, role: str) -> str | None:
        return self._load().get(role, (None, None))[1]

    def upstreams(self) -> list[Upstream]:
        """Every installed role's upstream formats; for one file, roles that ``claims`` values come
        first and the one that takes the rest (and names the file in listings) last."""
        found = [Upstream(role.name, f) for role, _ in self._load().values() for f in role.upstream_formats]
        return sorted(found, key=lambda u: u.format.claims is None)

    def codec(self, role: str) -> Codec | None:
        """The codec the engine uses for ``role`` (its own, or the default), None without its plugin."""
        found = self.role(role)
        if found is None or found.codec is not None:
            return None if found is None else found.codec
        if self._default_codec is None:
            from skipinject.verl.codecs import DataProtoCodec

            self._default_codec = DataProtoCodec()
        return self._default_codec

    def missing(self, role: str, meta: Mapping[str, Any]) -> str | None:
        """One line when no installed plugin provides ``role`` (which plugin would decode it), else None."""
        if self.plugin_of(role) is not None:
            return None
        writer = meta.get("plugin")
        named = f"plugin {writer!r}" if isinstance(writer, str) and writer else f"the plugin providing role {role!r}"
        why = f" ({self.problem})" if self.problem else ""
        return (
            f"no installed plugin provides role {role!r}{why}: install {named} (or name it in "
            "VERL_SKIP_PLUGINS) to decode its steps; shown as the raw payload"
        )
