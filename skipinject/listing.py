"""``skipinject --list``: every plugin, its roles and targets, and whether each resolves here;
``skipinject --version``: the versions of skipinject, its plugin API, every installed plugin and the verl stack."""

from __future__ import annotations

import importlib
import inspect

from skipinject._version import API_VERSION, __version__
from skipinject.plugin_manager import ENTRY_POINT_GROUP, PluginSet, installed_entry_points
from skipinject.roles import TargetPath
from skipinject.verl import stack
from skipinject.verl.compat import verl_version, version_matches


def resolve(path: str) -> str:
    """``ok``, or why ``path`` does not resolve in this install (imports the target's module)."""
    target = TargetPath.parse(path)
    try:
        obj: object = importlib.import_module(target.module)
    except Exception as exc:
        return f"missing: cannot import {target.module} ({type(exc).__name__}: {exc})"
    for name in target.qualname.split("."):
        try:
            obj = inspect.getattr_static(obj, name)
        except AttributeError:
            return f"missing: {target.module} has no {target.qualname}"
    return "ok"


def render(plugins: PluginSet) -> str:
    installed = verl_version()
    lines = [f"verl: {installed or 'not installed'}"]
    for plugin in plugins.plugins:
        origin = f"{plugin.distribution} {plugin.version}" if plugin.distribution else plugin.source
        lines.append(f"plugin {plugin.name} ({origin})")
        for role in plugin.roles:
            lines.append(f"  role {role.name}: step from {role.step.describe()}")
            if role.description:
                lines.append(f"    {role.description}")
            for target in role.targets:
                wanted = target.verl or "any"
                state = "not for this verl" if not version_matches(target.verl, installed) else resolve(target.path)
                lines.append(f"    target {target.label}  verl {wanted}  [{state}]")
            for clock in role.clocks:
                lines.append(f"    clock  {clock}  [{resolve(clock)}]")
    for name, error in plugins.failures.items():
        lines.append(f"plugin {name}: FAILED TO LOAD: {error}")
    if not plugins.plugins and not plugins.failures:
        lines.append("no plugins installed (entry-point group skipinject.plugins)")
    return "\n".join(lines) + "\n"


def render_versions() -> str:
    """skipinject and its plugin API, each installed plugin (from entry-point metadata: nothing is
    imported) with its distribution and version, then the verl stack against the tested versions."""
    lines = [f"skipinject {__version__} (plugin API {API_VERSION[0]}.{API_VERSION[1]})"]
    entry_points = installed_entry_points()
    width = max((len(name) for name in entry_points), default=0)
    for name in sorted(entry_points):
        dist = getattr(entry_points[name], "dist", None)
        dist_name, dist_version = getattr(dist, "name", None), getattr(dist, "version", None)
        origin = f"{dist_name} {dist_version}" if dist_name else "(no distribution)"
        built_in = " (built in)" if dist_name == "skipinject" else ""
        lines.append(f"plugin {name:<{width}}  {origin}{built_in}")
    if not entry_points:
        lines.append(f"no plugins installed (entry-point group {ENTRY_POINT_GROUP})")
    lines.append(", ".join(component.describe() for component in stack.components()))
    return "\n".join(lines) + "\n"
