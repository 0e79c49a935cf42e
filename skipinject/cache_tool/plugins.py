"""The installed plugins' roles, chosen as for a run (``VERL_SKIP_PLUGINS``, else every installed one):
a role's own codec decodes its steps; without its plugin, ``show`` and ``diff`` show the raw payload."""

from __future__ import annotations

import functools
import re
import string
from dataclasses import dataclass

from skipinject.errors import SkipInjectError
from skipinject.roles import Codec, Role, UpstreamFormat
from skipinject.store import STEP_NAME, StepMeta


@dataclass(frozen=True)
class Upstream:
    """verl's own cache of one installed role (its :class:`UpstreamFormat`), as the tool finds it."""

    role: str
    format: UpstreamFormat

    @property
    def directory(self) -> re.Pattern[str]:
        """The step directory's name, group 1 the step number (``genstep_{step:06d}``: ``^genstep_([0-9]{1,18})$``)."""
        pieces = []
        for literal, name, spec, _ in string.Formatter().parse(self.format.directory):
            pieces.append(re.escape(literal))
            if name is not None:
                pieces.append(f"({STEP_NAME.pattern})" if not spec else "([0-9]{1,18})")
        return re.compile("^" + "".join(pieces) + "$")

    @property
    def per_part(self) -> bool:
        """One file per part directory (``0/name``, ``1/name`` ...) instead of one in the step."""
        return self.format.file_name.startswith("0/")

    @property
    def base_name(self) -> str:
        return self.format.file_name.rsplit("/", 1)[-1]


class InstalledRoles:
    """The roles of this environment's plugins, by name, loaded on first use."""

    problem: str | None = None  # why no plugin is loaded (a bad VERL_SKIP_PLUGINS): nothing is decoded

    @functools.cached_property
    def _roles(self) -> dict[str, tuple[Role, str]]:
        from skipinject.plugin_manager import load_plugins

        try:
            plugins = load_plugins()
        except SkipInjectError as exc:
            self.problem = str(exc)
            return {}
        return {role.name: (role, plugin.name) for plugin in plugins.plugins for role in plugin.roles}

    def role(self, name: str) -> Role | None:
        return self._roles.get(name, (None, None))[0]

    def plugin_of(self, role: str) -> str | None:
        return self._roles.get(role, (None, None))[1]

    def upstreams(self) -> list[Upstream]:
        """Every installed role's upstream formats; for one file, roles that ``claims`` values come
        first and the one that takes the rest (and names the file in listings) last."""
        found = [Upstream(role.name, f) for role, _ in self._roles.values() for f in role.upstream_formats]
        return sorted(found, key=lambda u: u.format.claims is None)

    def codec(self, role: str) -> Codec | None:
        """The codec the engine uses for ``role`` (its own, or the default), None without its plugin."""
        from skipinject.verl.codecs import DataProtoCodec

        found = self.role(role)
        return None if found is None else found.codec if found.codec is not None else DataProtoCodec()

    def missing(self, role: str, meta: StepMeta) -> str | None:
        """One line when no installed plugin provides ``role`` (which plugin would decode it), else None."""
        if self.plugin_of(role) is not None:
            return None
        writer = meta.plugin
        named = f"plugin {writer!r}" if isinstance(writer, str) and writer else f"the plugin providing role {role!r}"
        why = f" ({self.problem})" if self.problem else ""
        return (
            f"no installed plugin provides role {role!r}{why}: install {named} (or name it in "
            "VERL_SKIP_PLUGINS) to decode its steps; shown as the raw payload"
        )
