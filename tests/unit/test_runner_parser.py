"""The runner's command line (argparse), its help, and the one-line messages of everything a user names."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from skipinject import cli
from skipinject.config import Config
from skipinject.config.environment import VARIABLES
from skipinject.config.overrides import apply_overrides, split_overrides
from skipinject.errors import ConfigError, PluginError, UsageError, did_you_mean
from skipinject.plugin_manager import load_plugins, parse_selection
from tests.conftest import ROOT


def parsed(*argv: str) -> cli.Program | None:
    return cli._program(cli.build_parser().parse_args(list(argv)))


def test_the_program_and_its_args_are_what_follows_the_options(tmp_path: Path) -> None:
    script = str(tmp_path / "train.py")
    Path(script).write_text("")
    assert parsed("--plugins", "toy", script, "--plugins", "x", "--", "-m") == cli.Program(
        "script", script, ["--plugins", "x", "--", "-m"]
    )
    assert parsed("-m", "json.tool", "--sort-keys", "--", "f") == cli.Program(
        "module", "json.tool", ["--sort-keys", "--", "f"]
    )
    assert parsed("-c", "print(1)", "-c", "x") == cli.Program("code", "print(1)", ["-c", "x"])
    assert parsed("--list", "--", script, "a") == cli.Program("script", script, ["a"])
    assert parsed("--list") is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--plugin", "toy", "x.py"], "unrecognized arguments: --plugin; did you mean '--plugins'?"),
        (["--skip-confg", "f", "x.py"], "did you mean '--skip-config'?"),
        (["-m"], "-m needs a module name"),
        (["-c"], "-c needs code"),
        (["-m", "a", "-c", "b"], None),  # -c is the module's argument
        (["no/such/script.py"], "can't open file 'no/such/script.py': no such file"),
        (["--plugins"], "argument --plugins: expected one argument"),
        (["--plugins", "a", "--plugins=b", "-c", "0"], "argument --plugins: given twice"),
        (
            ["skip.rollout.enable=True", "-m", "verl.trainer.main_ppo", "x=1"],
            "skip.rollout.enable=True comes before the program: settings go after it, among its ARGS: "
            "python -m skipinject -m verl.trainer.main_ppo x=1 skip.rollout.enable=True",
        ),
        (
            ["++skip.rollout.steps=[1,2]", "trainer.use_v1=False", "train.py"],
            "++skip.rollout.steps=[1,2] comes before the program: settings go after it, among its ARGS: "
            "python -m skipinject train.py '++skip.rollout.steps=[1,2]' trainer.use_v1=False",
        ),
        (["skip.rollout.enable=True"], "skip.rollout.enable=True is a setting, not a program: give a SCRIPT"),
    ],
)
def test_command_line_mistakes_are_one_line(argv: list[str], message: str | None) -> None:
    if message is None:
        assert parsed(*argv) == cli.Program("module", "a", ["-c", "b"])
        return
    with pytest.raises(UsageError) as info:
        parsed(*argv)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_settings_before_the_program_name_the_command_in_order_with_its_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["--plugins", "rollout", "skip.rollout.enable=True", "-m", "verl.trainer.main_ppo"]) == 2
    assert capsys.readouterr().err == (
        "skipinject: error: skip.rollout.enable=True comes before the program: settings go after it, among its "
        "ARGS: python -m skipinject --plugins rollout -m verl.trainer.main_ppo skip.rollout.enable=True\n"
    )


def test_main_prints_one_line_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--plugin", "toy", "x.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("skipinject: error: ") and err.count("\n") == 1


def test_help_lists_every_command_setting_source_and_environment_variable() -> None:
    from skipinject.cache_tool import build_parser as cache_parser

    text = cli.build_parser().format_help()
    sub = next(a for a in cache_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for command in sub.choices:
        assert re.search(rf"^  cache {command}\s", text, re.MULTILINE), command
    assert "cache compact" in text
    for source in ("--skip-config FILE", "skip.<role>.<key>=<value>", "+skip...", "++skip..."):
        assert source in text, source
    for option in ("--plugins", "--list", "--version", "-m MODULE", "-c CODE", "SCRIPT"):
        assert option in text, option
    for name in read_environment_variables():
        assert re.search(rf"^  {name}\s", text, re.MULTILINE), f"--help does not list {name}"


def read_environment_variables() -> set[str]:
    """Every environment variable skipinject's code reads or sets (``ENV_X = "NAME"`` constants and
    ``environ.get("NAME")`` / ``environ["NAME"]`` / ``getenv("NAME")`` literals)."""
    names: set[str] = set()
    for path in [*(ROOT / "skipinject").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")]:
        text = path.read_text()
        names.update(re.findall(r'^ENV_\w+\s*=\s*"([A-Z][A-Z0-9_]+)"', text, re.MULTILINE))
        names.update(re.findall(r'(?:environ\.get|getenv|environ\[|\.get)\(?\s*"([A-Z][A-Z0-9_]{3,})"', text))
    assert {"VERL_SKIP_PLUGINS", "SKIPINJECT_CONFIG", "PYTHONPATH", "RAY_JOB_CONFIG_JSON_ENV_VAR"} <= names
    return names


def test_every_variable_the_help_lists_is_one_skipinject_reads() -> None:
    assert set(VARIABLES) == read_environment_variables()


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("skip.toy.acton=cache", "skip.toy.acton: unknown key 'acton' (known: enable, "),
        ("skip.toy.acton=cache", "; did you mean 'action'?"),
        ("skip.tyo.enable=true", "skip.tyo.enable: unknown role 'tyo' (loaded roles: toy); did you mean 'toy'?"),
        (
            "skip.toy.action=stirct",
            "unknown action (choose one of cache, repeat, strict, match, refresh); did you mean 'strict'?",
        ),
        ("skip.toy.on_mismatch=regen", "expected one of warn, regenerate, fail; did you mean 'regenerate'?"),
        (
            "skip.toy.action=skip",
            "skip.toy.action=skip: unknown action (choose one of cache, repeat, strict, match, refresh)",
        ),
        ("skip.toy.reuse_hit_memory=17", "skip.toy.reuse_hit_memory=17: expected a number of batches, 0 .. 16"),
        ("skip.toy.reuse_hit_memory=many", "skip.toy.reuse_hit_memory=many: expected a number of batches, 0 .. 16"),
        (
            "skip.toy.compression=zstd-23",
            "skip.toy.compression=zstd-23: expected auto, none, zstd or zstd-1 .. zstd-22",
        ),
        ("skip.toy.read_ahead=perhaps", "skip.toy.read_ahead=perhaps: expected true or false"),
        ("skip.toy.dump_dir=" + "x" * 5000, "5000 characters, longer than any path (4096); expected a directory path"),
    ],
)
def test_setting_mistakes_name_the_key_and_the_closest_name(override: str, line: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides(Config(), split_overrides([override])[0], ["toy"])
    assert line in str(info.value) and "\n" not in str(info.value) and len(str(info.value)) < 400


def test_settings_from_code_are_checked_by_the_same_declarations() -> None:
    from skipinject.config import RoleConfig

    with pytest.raises(ValueError, match=r"reuse_hit_memory=17: expected a number of batches, 0 \.\. 16"):
        RoleConfig(reuse_hit_memory=17)
    with pytest.raises(ValueError, match="compression='zstd-99': expected auto, none, zstd"):
        RoleConfig(compression="zstd-99")
    with pytest.raises(ValueError, match="action='skip': unknown action"):
        RoleConfig(action="skip")  # type: ignore[arg-type]


def test_an_unknown_role_names_where_it_would_come_from() -> None:
    """A role of a plugin that is not installed names the package providing it; one installed but left out by
    ``--plugins`` says so; a typo keeps its "did you mean"."""
    from skipinject.bootstrap import resolve
    from skipinject.plugin_manager import role_origin

    with pytest.raises(ConfigError) as info:
        resolve([("skip.reward.enable", "True")], plugins="rollout")
    assert str(info.value) == (
        "skip.reward.enable: unknown role 'reward' (loaded roles: rollout; see `python -m skipinject --list`; "
        "the installed plugin 'reward' is not among those --plugins chooses)"
    )
    loaded = load_plugins("rollout")
    without = ["rollout", "rollout_tq", "async_rollout"]  # an environment without the shipped extra roles
    assert role_origin("reward", loaded, without, "--plugins") == (
        "; the package skipinject-reward provides it: pip install skipinject-reward "
        "(from a clone: pip install ./plugins/reward)"
    )
    assert role_origin("advantage", loaded, without, "--plugins").startswith("; the package skipinject-advantage ")
    assert role_origin("rolout", loaded, without, "--plugins") == ""
    with pytest.raises(ConfigError, match=r"unknown role 'rolout' \(loaded roles: rollout; see [^;]*\); did you"):
        resolve([("skip.rolout.enable", "True")], plugins="rollout")


def test_a_plugin_mistake_names_the_flag_or_variable_it_came_from() -> None:
    with pytest.raises(PluginError) as info:
        load_plugins("rolout", given_as="--plugins")
    assert str(info.value).startswith("--plugins: unknown plugin 'rolout'")
    assert str(info.value).endswith("; did you mean 'rollout'?")
    with pytest.raises(PluginError, match=r"^VERL_SKIP_PLUGINS: unknown plugin 'rolout'"):
        load_plugins("rolout")
    with pytest.raises(PluginError, match=r"^--plugins: '-' is not a plugin name to exclude"):
        parse_selection("-", "--plugins")


def test_did_you_mean_only_for_close_names() -> None:
    assert did_you_mean("rolout", ["rollout", "reward"]) == "; did you mean 'rollout'?"
    assert did_you_mean("zzz", ["rollout", "reward"]) == ""


def test_unknown_cache_command_is_one_line_with_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    from skipinject.cache_tool import main as cache_main

    assert cache_main(["compat"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown command 'compat'" in err and "did you mean 'compact'?" in err


def test_a_traceback_starts_at_the_programs_own_first_frame(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(sys.modules, "__main__", sys.modules["__main__"])
    script = tmp_path / "boom.py"
    script.write_text("def f():\n    raise KeyError('x')\nf()\n")
    with pytest.raises(KeyError) as raised:
        cli._execute(cli.Program("script", str(script), []))
    frames = cli._program_frames(raised.value.__traceback__.tb_next)  # (the first: this test's own frame)
    assert frames is not None and frames.tb_frame.f_code.co_filename == str(script)
    with pytest.raises(ImportError) as missing:
        cli._execute(cli.Program("module", "no_such_module_xyz", []))
    assert cli._program_frames(missing.value.__traceback__.tb_next) is None  # runpy's own: the program never started
