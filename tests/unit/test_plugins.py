"""Plugin discovery through entry points of a really installed distribution, and selection."""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path

import pytest

from skipinject.errors import PluginError
from skipinject.plugin_manager import load_plugins, parse_selection


def test_entry_point_discovery_of_installed_distribution(toy_path: Path):
    plugins = load_plugins("toy")
    (plugin,) = plugins.plugins
    assert plugin.name == "toy"
    assert plugin.distribution == "skipinject-toy-plugin"
    assert plugin.version == "1.2.3"
    assert set(plugins.roles) == {"toy", "toy_score"}
    assert plugins.manager.get_plugin("toy") is plugin.obj


def test_everything_installed_when_unset(toy_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("VERL_SKIP_PLUGINS", raising=False)
    names = {p.name for p in load_plugins().plugins}
    assert {"toy", "rollout", "async_rollout"} <= names


def test_exclusion_by_name(toy_path: Path):
    names = {p.name for p in load_plugins("-toy").plugins}
    assert "toy" not in names and "rollout" in names
    assert {p.name for p in load_plugins("toy,rollout,-rollout").plugins} == {"toy"}


def test_env_var_is_read(toy_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("VERL_SKIP_PLUGINS", "toy")
    assert [p.name for p in load_plugins().plugins] == ["toy"]


def test_module_attr_path_loads_uninstalled_plugin(toy_path: Path):
    plugins = load_plugins("skipinject_toy_plugin:plugin")
    assert set(plugins.roles) == {"toy", "toy_score"}


@pytest.mark.parametrize(
    ("selection", "named"),
    [
        ("rollot", "rollot"),
        ("-rollot", "rollot"),
        ("skipinject_toy_plugin:nope", "nope"),
        ("no_such_module_abc:plugin", "no_such_module_abc"),
        ("json", "json"),  # importable, but not a plugin
        ("toy,toy_again_unknown", "toy_again_unknown"),
        ("a b", "a b"),
    ],
)
def test_unknown_or_bad_selection_is_a_clear_error(toy_path: Path, selection: str, named: str):
    with pytest.raises(PluginError) as info:
        load_plugins(selection)
    assert named in str(info.value)


def test_duplicate_role_names_are_an_error(toy_path: Path):
    with pytest.raises(PluginError, match="toy"):
        load_plugins("toy,skipinject_toy_plugin:plugin")


@pytest.fixture
def broken_dist(tmp_path: Path):
    """A really installed distribution (dist-info on sys.path) whose plugin fails to import."""
    info = tmp_path / "skipinject_broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: skipinject-broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[skipinject.plugins]\nbroken = skipinject_broken_missing_module:plugin\n")
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    yield
    sys.path.remove(str(tmp_path))


def test_failing_plugin_is_reported_by_name_and_skipped_when_autoloaded(broken_dist, caplog):
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        plugins = load_plugins("")
    assert "broken" in plugins.failures
    assert "rollout" in {p.name for p in plugins.plugins}
    assert any(
        "'broken'" in r.getMessage() and "skipinject_broken_missing_module" in r.getMessage() for r in caplog.records
    )


def test_failing_plugin_asked_for_by_name_is_an_error(broken_dist):
    with pytest.raises(PluginError, match=r"broken.*failed to import"):
        load_plugins("broken")


def test_parse_selection_forms():
    selection = parse_selection(" rollout , -reward,,pkg.mod:attr , pkg.mod ")
    assert selection.include == ("rollout", "pkg.mod:attr", "pkg.mod")
    assert selection.exclude == ("reward",)
    assert not parse_selection(None).include and not parse_selection("").include


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ("targets=None", "targets must be a list of Target"),
        ("targets=['json:dumps']", "targets must be a list of Target"),
        ("targets='json:dumps'", "targets must be a list of Target"),
        ("step='meta'", "step must be a StepSource"),
        ("codec=object()", "has no encode(result), decode(payload, call)"),
        ("clocks='json:dumps'", "clocks must be a list of str"),
    ],
)
def test_a_role_of_the_wrong_shape_is_a_plugin_error_not_a_traceback_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fields: str, named: str
) -> None:
    """``--list`` and the runner iterated ``targets`` and called ``step.describe()``: a TypeError traceback."""
    defaults = {"targets": "[Target('json:dumps')]", "step": "StepSource.meta()"}
    key, _, value = fields.partition("=")
    args = ", ".join(f"{k}={v}" for k, v in {**defaults, key: value}.items())
    module = f"si_misshapen_role_{abs(hash(fields))}"
    (tmp_path / f"{module}.py").write_text(
        "from skipinject import Role, StepSource, Target\n"
        f"def skipinject_roles():\n    return [Role('misshapen', {args})]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(PluginError) as info:
        load_plugins(module)
    message = str(info.value)
    assert f"plugin {module!r}" in message and "role 'misshapen'" in message and named in message
    assert "\n" not in message


@pytest.fixture
def exiting_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed plugin whose module exits while imported (a script's argparse run at import)."""
    info = tmp_path / "skipinject_exiting-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: skipinject-exiting\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[skipinject.plugins]\nexiting = si_exiting_plugin_module\n")
    (tmp_path / "si_exiting_plugin_module.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "si_exiting_plugin_module", raising=False)


def test_a_plugin_that_exits_on_import_is_left_out_not_the_end_of_the_run(exiting_dist: None, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        plugins = load_plugins("")
    assert "SystemExit: 3" in plugins.failures["exiting"] and "rollout" in {p.name for p in plugins.plugins}
    with pytest.raises(PluginError, match=r"^plugin 'exiting' .* failed to import: SystemExit: 3$"):
        load_plugins("exiting")
    with pytest.raises(PluginError, match=r"^plugin 'si_exiting_plugin_module' failed to import: SystemExit: 3$"):
        load_plugins("si_exiting_plugin_module")


@pytest.fixture
def failing_hook_dists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two installed plugins that import, but whose ``skipinject_roles`` fails: at once (a missing optional
    dependency), and partway through a generator."""
    for name, body in (
        ("raising", "def skipinject_roles():\n    import si_no_such_dependency\n"),
        ("halfway", "def skipinject_roles():\n    yield from ()\n    raise ValueError('bad')\n"),
    ):
        info = tmp_path / f"skipinject_{name}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: skipinject-{name}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[skipinject.plugins]\n{name} = si_{name}_hook_module\n")
        (tmp_path / f"si_{name}_hook_module.py").write_text(body)
        monkeypatch.delitem(sys.modules, f"si_{name}_hook_module", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_plugin_whose_hook_fails_is_left_out_unless_named(failing_hook_dists: None, caplog) -> None:
    """As a plugin that fails to import: the others (the built-ins) load, and a warning names it."""
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        plugins = load_plugins("")
    assert "ModuleNotFoundError" in plugins.failures["raising"] and "ValueError: bad" in plugins.failures["halfway"]
    assert "rollout" in plugins.roles and not {"raising", "halfway"} & {p.name for p in plugins.plugins}
    assert {"'raising'", "'halfway'"} <= {m.split()[1] for m in caplog.messages if m.startswith("plugin ")}
    for name, why in (("raising", "ModuleNotFoundError"), ("halfway", "ValueError: bad")):
        with pytest.raises(PluginError, match=rf"^plugin '{name}': skipinject_roles\(\) raised {why}"):
            load_plugins(name)
