"""Finding, choosing and registering plugins: pluggy, fed the way pytest feeds it (docs/plugins.md). A plugin
that fails to load is left out with a warning, unless ``VERL_SKIP_PLUGINS`` (or ``--plugins``) names it."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from skipinject._version import API_VERSION
from skipinject.config.environment import ENV_PLUGINS
from skipinject.errors import PluginError, UnknownPluginError, did_you_mean
from skipinject.roles import Role

logger = logging.getLogger("skipinject")

ENTRY_POINT_GROUP = "skipinject.plugins"
API_ATTRIBUTE = "SKIPINJECT_API"
PROJECT = "skipinject"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = rf"{_IDENT}(?:\.{_IDENT})*"
_NAME_ITEM = re.compile(r"^-?[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_PATH_ITEM = re.compile(rf"^{_DOTTED}(?::{_DOTTED})?$")


@dataclass(frozen=True)
class PluginSelection:
    """A parsed ``VERL_SKIP_PLUGINS`` value (nothing included: every installed plugin)."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()


def parse_selection(text: str | None, given_as: str = ENV_PLUGINS) -> PluginSelection:
    """Parse a comma list of entry-point names, ``module[:attr]`` paths (not installed) and ``-name`` exclusions
    (all but those); errors name ``given_as``."""
    include: dict[str, None] = {}  # in order, once each
    exclude: dict[str, None] = {}
    for item in filter(None, (raw.strip() for raw in (text or "").split(","))):
        if item.startswith("-"):
            if not _NAME_ITEM.match(item[1:].strip()):
                raise UnknownPluginError(f"{given_as}: {item!r} is not a plugin name to exclude")
            exclude[item[1:].strip()] = None
        elif _PATH_ITEM.match(item) or _NAME_ITEM.match(item):
            include[item] = None
        else:
            raise UnknownPluginError(f"{given_as}: {item!r} is neither a plugin name nor a module[:attribute] path")
    return PluginSelection(tuple(include), tuple(exclude))


class HookSpecs:
    """The plugin contract in pluggy's terms: the hooks a plugin may implement (docs/plugins.md)."""

    @hookspec
    def skipinject_roles(self) -> Sequence[Role]:  # type: ignore[empty-body]
        """Return the roles this plugin provides (each with a unique name)."""


class SkipPluginManager(pluggy.PluginManager):
    """pluggy's manager: ``skipinject_*`` callables are hooks even without ``@hookimpl`` (as pytest's
    ``pytest_*``), so a forgotten marker works and a misspelt hook is caught."""

    def __init__(self) -> None:
        super().__init__(PROJECT)
        self.add_hookspecs(HookSpecs)

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith("skipinject_"):
            method = getattr(plugin, name, None)
            if callable(method) and not isinstance(method, type):
                return {}
        return opts


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

    manager: SkipPluginManager
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


#: Plugins skipinject ships as distributions of their own (not in its wheel), by the role each provides:
#: the package, and its directory in a clone of skipinject.
SHIPPED_PLUGINS = {
    "reward": ("skipinject-reward", "plugins/reward"),
    "advantage": ("skipinject-advantage", "plugins/advantage"),
}


def role_origin(role: str, loaded: PluginSet, installed: Iterable[str], given_as: str) -> str:
    """Where an unknown ``role`` would come from, as the end of its error line: a plugin that is installed but
    failed to import or was not chosen, or the shipped package that provides it; ``""`` when none is known."""
    if role in loaded.failures:
        return f"; {loaded.failures[role]}"
    if role in installed:
        return f"; the installed plugin {role!r} is not among those {given_as} chooses"
    if role in SHIPPED_PLUGINS:
        package, directory = SHIPPED_PLUGINS[role]
        return f"; the package {package} provides it: pip install {package} (from a clone: pip install ./{directory})"
    return ""


def installed_entry_points() -> dict[str, Any]:
    """Entry points of the ``skipinject.plugins`` group, by name (the first of two same-named wins)."""
    import importlib_metadata

    found: dict[str, Any] = {}
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        first = found.setdefault(ep.name, ep).value
        if first != ep.value:
            logger.warning("two installed plugins are named %r (%s and %s); using the first", ep.name, first, ep.value)
    return found


def load_plugins(selection_text: str | None = None, given_as: str = ENV_PLUGINS) -> PluginSet:
    """Discover, choose, import and register plugins (default: ``$VERL_SKIP_PLUGINS``), with their roles."""
    text = os.environ.get(ENV_PLUGINS) if selection_text is None else selection_text
    selection = parse_selection(text, given_as)
    entry_points = installed_entry_points()
    manager = SkipPluginManager()
    for name in selection.exclude:
        if name not in entry_points:
            raise UnknownPluginError(_unknown(name, entry_points, given_as, f"-{name}"))
        manager.set_blocked(name)
    plugins: list[LoadedPlugin] = []
    failures: dict[str, str] = {}
    for item in selection.include or sorted(entry_points):
        if manager.is_blocked(item):
            continue
        try:
            if item in entry_points:
                ep = entry_points[item]
                try:
                    obj = ep.load()
                except (Exception, SystemExit) as exc:  # a module that exits on import (argparse) is a failure too
                    raise PluginError(f"plugin {item!r} ({ep.value}) failed to import: {_one_line(exc)}") from exc
                dist = getattr(ep, "dist", None)
                loaded = LoadedPlugin(item, ep.value, obj, getattr(dist, "name", None), getattr(dist, "version", None))
            else:
                loaded = _from_path(item, entry_points, given_as=given_as)
            plugins.append(_register(manager, loaded))
        except PluginError as exc:
            if selection.include:  # asked for by name: an error
                raise
            failures[item] = str(exc)
            logger.warning("plugin %r was not loaded: %s", item, exc)
    return _with_roles(manager, plugins, None if selection.include else failures)


def load_sources(sources: Mapping[str, str]) -> PluginSet:
    """Register plugins the runner already chose (``name -> module[:attr]``), in its children: no scan."""
    manager = SkipPluginManager()
    plugins = [_register(manager, _from_path(source, {}, name=name)) for name, source in sources.items()]
    return _with_roles(manager, plugins)


def _unknown(name: str, entry_points: Mapping[str, Any], given_as: str, item: str | None = None) -> str:
    installed, where = ", ".join(sorted(entry_points)) or "none", f" in {item!r}" if item else ""
    return (
        f"{given_as}: unknown plugin {name!r}{where} (installed plugins: {installed}){did_you_mean(name, entry_points)}"
    )


def _from_path(
    item: str, entry_points: Mapping[str, Any], *, name: str | None = None, given_as: str = ENV_PLUGINS
) -> LoadedPlugin:
    if not _PATH_ITEM.match(item):
        raise UnknownPluginError(_unknown(item, entry_points, given_as))
    module_name, _, attr = item.partition(":")
    if name is None and "." not in module_name and not attr:
        # A bare word: an entry-point name we do not know, unless it is an importable module.
        try:
            found = importlib.util.find_spec(module_name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UnknownPluginError(_unknown(item, entry_points, given_as))
    try:
        obj: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:
        raise PluginError(f"plugin {item!r} failed to import: {_one_line(exc)}") from exc
    try:
        obj = functools.reduce(getattr, filter(None, attr.split(".")), obj)
    except AttributeError as exc:
        raise PluginError(f"plugin {item!r}: module {module_name!r} has no attribute {attr!r}") from exc
    return LoadedPlugin(name or item, item, obj)


def _register(manager: SkipPluginManager, plugin: LoadedPlugin) -> LoadedPlugin:
    where = f"plugin {plugin.name!r} ({plugin.source})"
    _check_api(plugin.obj, where)
    if manager.get_plugin(plugin.name) is not None or manager.is_registered(plugin.obj):
        raise PluginError(f"{where} is registered twice (under two names?)")
    try:
        manager.register(plugin.obj, name=plugin.name)
        manager.check_pending()
    except (pluggy.PluginValidationError, ValueError) as exc:
        if manager.has_plugin(plugin.name):  # registered before a hook failed validation
            manager.unregister(name=plugin.name)
        raise PluginError(f"{where}: {_one_line(exc)}") from exc
    if not any(impl.plugin_name == plugin.name for impl in manager.hook.skipinject_roles.get_hookimpls()):
        manager.unregister(name=plugin.name)
        raise PluginError(f"{where} has no skipinject_roles hook")
    return plugin


def _check_api(obj: Any, where: str) -> None:
    declared = getattr(obj, API_ATTRIBUTE, None)
    if declared is None:
        return
    match = re.fullmatch(r"([0-9]{1,4})(?:\.([0-9]{1,4}))?", str(declared))
    if match is None or isinstance(declared, bool):
        raise PluginError(f"{where}: {API_ATTRIBUTE} = {declared!r} is not a version like 1 or '1.0'")
    major, minor = int(match.group(1)), int(match.group(2) or 0)
    if major != API_VERSION[0] or minor > API_VERSION[1]:
        provided = f"{API_VERSION[0]}.{API_VERSION[1]}"
        raise PluginError(
            f"{where} needs skipinject plugin API {major}.{minor}; this skipinject provides API {provided}: "
            f"install a skipinject that provides it, or a release of the plugin written for API {provided}"
        )


def _with_roles(
    manager: SkipPluginManager, plugins: list[LoadedPlugin], failures: dict[str, str] | None = None
) -> PluginSet:
    """The plugin set, with the roles of every ``skipinject_roles`` implementation. With ``failures`` (no plugin
    named), a plugin whose hook fails is left out with a warning, as one that fails to import."""
    by_name = {plugin.name: plugin for plugin in plugins}
    owners: dict[str, str] = {}
    for impl in manager.hook.skipinject_roles.get_hookimpls():  # registration order
        plugin = by_name[impl.plugin_name]
        try:
            roles = _roles_of(plugin, impl.function)
        except PluginError as exc:
            if failures is None:
                raise
            manager.unregister(name=plugin.name)
            plugins.remove(plugin)
            failures[plugin.name] = str(exc)
            logger.warning("plugin %r was not loaded: %s", plugin.name, exc)
            continue
        for role in roles:
            if role.name in owners:
                raise PluginError(
                    f"role {role.name!r} is provided by two plugins: {owners[role.name]!r} and {plugin.name!r}; "
                    f"exclude one with {ENV_PLUGINS}=-<name>"
                )
            owners[role.name] = plugin.name
            plugin.roles.append(role)
    return PluginSet(manager, plugins, failures or {})


def _roles_of(plugin: LoadedPlugin, hook: Callable[[], Any]) -> list[Role]:
    """What ``skipinject_roles()`` returns, read whole (a generator that fails partway fails here)."""
    try:
        returned = hook()
        returned = [returned] if isinstance(returned, Role) else [] if returned is None else returned
        if not isinstance(returned, Iterable) or isinstance(returned, (str, bytes, Mapping)):
            raise PluginError(f"plugin {plugin.name!r}: skipinject_roles() must return a list of Role objects")
        roles = list(returned)
    except PluginError:
        raise
    except Exception as exc:
        raise PluginError(f"plugin {plugin.name!r}: skipinject_roles() raised {_one_line(exc)}") from exc
    wrong = next((role for role in roles if not isinstance(role, Role)), None)
    if wrong is not None:
        raise PluginError(f"plugin {plugin.name!r}: skipinject_roles() returned {wrong!r}, not a Role")
    return roles


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
