"""Finding, choosing and registering plugins (pytest-style: entry points plus an opt-out list).

Plugins come from the ``skipinject.plugins`` entry-point group. ``VERL_SKIP_PLUGINS`` (or the
runner's ``--plugins``) chooses among them::

    VERL_SKIP_PLUGINS=rollout,reward        only these entry points
    VERL_SKIP_PLUGINS=-reward               every installed plugin but this one
    VERL_SKIP_PLUGINS=mypkg.skip:plugin     a plugin object that is not installed as a distribution
    VERL_SKIP_PLUGINS=mypkg.skip_roles      a module holding ``skipinject_roles``

Unset (or empty) means every installed plugin. A name that matches nothing is an error. An
installed plugin that fails to import is reported by name and skipped, unless it was asked for
by name, in which case it is an error.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

from skipinject import hookspecs
from skipinject.errors import PluginError
from skipinject.roles import Role

logger = logging.getLogger("skipinject")

ENTRY_POINT_GROUP = "skipinject.plugins"
ENV_PLUGINS = "VERL_SKIP_PLUGINS"

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = rf"{_IDENT}(?:\.{_IDENT})*"
_NAME_ITEM = re.compile(r"^-?[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_PATH_ITEM = re.compile(rf"^{_DOTTED}(?::{_DOTTED})?$")


@dataclass(frozen=True)
class PluginSelection:
    """A parsed ``VERL_SKIP_PLUGINS`` value."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    @property
    def everything(self) -> bool:
        return not self.include


def parse_selection(text: str | None) -> PluginSelection:
    """Parse a comma list of names, ``module[:attr]`` paths and ``-name`` exclusions."""
    include: list[str] = []
    exclude: list[str] = []
    for raw in (text or "").split(","):
        item = raw.strip()
        if not item:
            continue
        if item.startswith("-"):
            name = item[1:].strip()
            if not name or not _NAME_ITEM.match(name):
                raise PluginError(f"{ENV_PLUGINS}: {item!r} is not a plugin name to exclude")
            exclude.append(name)
        elif _PATH_ITEM.match(item) or _NAME_ITEM.match(item):
            include.append(item)
        else:
            raise PluginError(f"{ENV_PLUGINS}: {item!r} is neither a plugin name nor a module[:attribute] path")
    return PluginSelection(tuple(include), tuple(exclude))


@dataclass
class LoadedPlugin:
    """One registered plugin and where it came from."""

    name: str
    source: str
    obj: Any
    distribution: str | None = None
    version: str | None = None
    roles: list[Role] = field(default_factory=list)


@dataclass
class PluginSet:
    """The plugins of this process and the roles they provide."""

    manager: pluggy.PluginManager
    plugins: list[LoadedPlugin]
    failures: dict[str, str] = field(default_factory=dict)

    @property
    def roles(self) -> dict[str, Role]:
        return {role.name: role for plugin in self.plugins for role in plugin.roles}

    def plugin_of(self, role_name: str) -> LoadedPlugin:
        for plugin in self.plugins:
            if any(role.name == role_name for role in plugin.roles):
                return plugin
        raise KeyError(role_name)


def installed_entry_points() -> dict[str, Any]:
    """Entry points of the ``skipinject.plugins`` group, by name."""
    import importlib_metadata

    found: dict[str, Any] = {}
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found and found[ep.name].value != ep.value:
            logger.warning(
                "two installed plugins are named %r (%s and %s); using the first",
                ep.name,
                found[ep.name].value,
                ep.value,
            )
            continue
        found.setdefault(ep.name, ep)
    return found


def load_plugins(selection_text: str | None = None) -> PluginSet:
    """Discover, choose, import and register plugins; collect their roles.

    ``selection_text`` defaults to ``$VERL_SKIP_PLUGINS``.
    """
    if selection_text is None:
        selection_text = os.environ.get(ENV_PLUGINS)
    selection = parse_selection(selection_text)
    entry_points = installed_entry_points()
    for name in selection.exclude:
        if name not in entry_points:
            raise PluginError(_unknown(f"-{name}", name, entry_points))

    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    loaded: list[LoadedPlugin] = []
    failures: dict[str, str] = {}

    if selection.everything:
        for name in sorted(entry_points):
            if name in selection.exclude:
                continue
            try:
                loaded.append(_from_entry_point(entry_points[name]))
            except PluginError as exc:
                failures[name] = str(exc)
                logger.warning("plugin %r was not loaded: %s", name, exc)
    else:
        for item in selection.include:
            if item in selection.exclude:
                continue
            if item in entry_points:
                loaded.append(_from_entry_point(entry_points[item]))
            else:
                loaded.append(_from_path(item, entry_points))

    for plugin in loaded:
        _register(manager, plugin)
    _check_unique(loaded)
    return PluginSet(manager, loaded, failures)


def _unknown(item: str, name: str, entry_points: Mapping[str, Any]) -> str:
    installed = ", ".join(sorted(entry_points)) or "none"
    return f"{ENV_PLUGINS}: unknown plugin {name!r} in {item!r} (installed plugins: {installed})"


def _from_entry_point(ep: Any) -> LoadedPlugin:
    try:
        obj = ep.load()
    except Exception as exc:
        raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to import: {type(exc).__name__}: {exc}") from exc
    dist = getattr(ep, "dist", None)
    return LoadedPlugin(
        name=ep.name,
        source=ep.value,
        obj=obj,
        distribution=getattr(dist, "name", None),
        version=getattr(dist, "version", None),
    )


def _from_path(item: str, entry_points: Mapping[str, Any]) -> LoadedPlugin:
    if not _PATH_ITEM.match(item):
        raise PluginError(_unknown(item, item, entry_points))
    module_name, _, attr = item.partition(":")
    if "." not in module_name and not attr:
        # A bare word: an entry-point name we do not know, unless it is an importable module.
        try:
            found = importlib.util.find_spec(module_name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise PluginError(_unknown(item, item, entry_points))
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise PluginError(f"plugin {item!r} failed to import: {type(exc).__name__}: {exc}") from exc
    for part in filter(None, attr.split(".")):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise PluginError(f"plugin {item!r}: module {module_name!r} has no attribute {attr!r}") from exc
    return LoadedPlugin(name=item, source=item, obj=obj)


def _register(manager: pluggy.PluginManager, plugin: LoadedPlugin) -> None:
    if not hasattr(plugin.obj, "skipinject_roles"):
        raise PluginError(f"plugin {plugin.name!r} ({plugin.source}) has no skipinject_roles hook")
    try:
        manager.register(plugin.obj, name=plugin.name)
    except ValueError as exc:  # already registered under another name
        raise PluginError(f"plugin {plugin.name!r} ({plugin.source}) is registered twice: {exc}") from exc
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {plugin.name!r} ({plugin.source}): {exc}") from exc
    try:
        roles = plugin.obj.skipinject_roles()
    except Exception as exc:
        raise PluginError(f"plugin {plugin.name!r}: skipinject_roles() raised {type(exc).__name__}: {exc}") from exc
    if isinstance(roles, Role):
        roles = [roles]
    for role in _as_list(roles, plugin):
        if not isinstance(role, Role):
            raise PluginError(f"plugin {plugin.name!r}: skipinject_roles() returned {role!r}, not a Role")
        plugin.roles.append(role)


def _as_list(roles: Any, plugin: LoadedPlugin) -> list[Any]:
    if roles is None:
        return []
    if isinstance(roles, Iterable):
        return list(roles)
    raise PluginError(f"plugin {plugin.name!r}: skipinject_roles() must return a list of Role objects")


def _check_unique(loaded: Iterable[LoadedPlugin]) -> None:
    owners: dict[str, str] = {}
    for plugin in loaded:
        for role in plugin.roles:
            if role.name in owners:
                raise PluginError(
                    f"role {role.name!r} is provided by two plugins: {owners[role.name]!r} and "
                    f"{plugin.name!r}; exclude one with {ENV_PLUGINS}=-<name>"
                )
            owners[role.name] = plugin.name
