"""The plugin contract, run by pluggy: hooks, blocking, check_pending, the API version, sources."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import skipinject
from skipinject.errors import PluginError
from skipinject.plugin_manager import load_plugins, load_sources, parse_selection

ROLE = """
from skipinject import Role, StepSource, Target{marker_import}

{api}

{decorator}
def {hook}():
    return [Role(name="{role}", targets=[Target("json:dumps")], step=StepSource.argument("step"))]
"""


@pytest.fixture
def make_plugin(tmp_path: Path) -> Iterator[object]:
    """Write a plugin module on ``sys.path``: ``make_plugin(name, role=..., marked=..., hook=..., api=...)``."""
    sys.path.insert(0, str(tmp_path))
    written: list[str] = []

    def make(name: str, *, role: str = "", marked: bool = True, hook: str = "skipinject_roles", api: str = "") -> str:
        source = ROLE.format(
            marker_import=", hookimpl" if marked else "",
            decorator="@hookimpl" if marked else "",
            hook=hook,
            role=role or name,
            api=api,
        )
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        importlib.invalidate_caches()
        return name

    yield make
    sys.path.remove(str(tmp_path))
    for name in written:
        sys.modules.pop(name, None)


def test_roles_come_from_pluggys_hook(make_plugin) -> None:
    plugins = load_plugins(f"{make_plugin('si_marked_a')},{make_plugin('si_marked_b')}")
    from_hook = [role.name for roles in plugins.manager.hook.skipinject_roles() for role in roles]
    assert sorted(from_hook) == sorted(plugins.roles) == ["si_marked_a", "si_marked_b"]
    assert [p.name for p in plugins.plugins] == ["si_marked_a", "si_marked_b"]
    assert plugins.plugin_of("si_marked_b").name == "si_marked_b"
    assert dict(plugins.manager.list_name_plugin()).keys() == {"si_marked_a", "si_marked_b"}


def test_unmarked_hook_is_still_a_hook(make_plugin) -> None:
    plugins = load_plugins(make_plugin("si_unmarked", marked=False))
    assert set(plugins.roles) == {"si_unmarked"}
    assert [roles[0].name for roles in plugins.manager.hook.skipinject_roles()] == ["si_unmarked"]


def test_misspelt_hook_is_one_clear_error(make_plugin) -> None:
    with pytest.raises(PluginError) as info:
        load_plugins(make_plugin("si_misspelt", hook="skipinject_role"))
    message = str(info.value)
    assert "si_misspelt" in message and "skipinject_role" in message and "\n" not in message


def test_plugin_without_the_hook_is_an_error(tmp_path: Path, make_plugin) -> None:
    (tmp_path / "si_nohook.py").write_text("VALUE = 1\n")
    with pytest.raises(PluginError, match="has no skipinject_roles hook"):
        load_plugins("si_nohook")
    sys.modules.pop("si_nohook", None)


@pytest.mark.parametrize(
    "declared", ["SKIPINJECT_API = 1", "SKIPINJECT_API = '1.0'", "SKIPINJECT_API = '1.1'", "SKIPINJECT_API = '1.2'", ""]
)
def test_compatible_api_declarations(make_plugin, declared: str) -> None:
    name = make_plugin(f"si_api_ok_{abs(hash(declared))}", role="ok", api=declared)
    assert set(load_plugins(name).roles) == {"ok"}


@pytest.mark.parametrize(
    ("declared", "expected"),
    [
        ("SKIPINJECT_API = 2", "needs skipinject plugin API 2.0"),
        ("SKIPINJECT_API = '1.9'", "API 1.9"),
        ("SKIPINJECT_API = '1.7'", "provides API 1.6"),
        ("SKIPINJECT_API = 'one'", "is not a version"),
    ],
)
def test_incompatible_api_is_one_clear_error(make_plugin, declared: str, expected: str) -> None:
    name = make_plugin(f"si_api_bad_{abs(hash(declared))}", role="bad", api=declared)
    with pytest.raises(PluginError) as info:
        load_plugins(name)
    assert expected in str(info.value) and name in str(info.value) and "\n" not in str(info.value)


def test_sources_load_without_scanning_entry_points(make_plugin, monkeypatch: pytest.MonkeyPatch) -> None:
    import skipinject.plugin_manager as manager

    def no_scan() -> None:
        raise AssertionError("children must not scan entry points")

    monkeypatch.setattr(manager, "installed_entry_points", no_scan)
    plugins = load_sources({"mine": make_plugin("si_by_source", role="by_source")})
    assert [p.name for p in plugins.plugins] == ["mine"] and set(plugins.roles) == {"by_source"}


def test_duplicated_names_in_the_selection_count_once() -> None:
    assert parse_selection("a,a,-b,-b").include == ("a",)
    assert parse_selection("a,a,-b,-b").exclude == ("b",)


def test_public_api_names_resolve() -> None:
    for name in skipinject.__all__:
        assert getattr(skipinject, name) is not None, name
    assert skipinject.API_VERSION[0] == 1
    with pytest.raises(AttributeError):
        skipinject.no_such_name  # noqa: B018


def test_plugins_import_only_the_public_api() -> None:
    """The lint rule (plugins/ruff.toml, TID251) and what it protects, checked on the sources too."""
    import ast

    root = Path(__file__).resolve().parents[2] / "plugins"
    offenders = []
    for path in root.glob("*/skipinject_*/*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [module or ""]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("skipinject.")]
    assert not offenders
