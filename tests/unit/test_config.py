"""``skip.*`` settings: OmegaConf's grammar, the structured schema, YAML files, ranges, transport."""

from __future__ import annotations

from pathlib import Path

import pytest

from skipinject.config import (
    MAX_SERIALISED_BYTES,
    Action,
    Config,
    MismatchPolicy,
    RoleConfig,
    StepSet,
    environment,
)
from skipinject.config.overrides import apply_overrides, apply_settings, load_file, split_overrides
from skipinject.errors import ConfigError

ROLES = ("rollout", "reward")


def configure(*argv: str) -> Config:
    overrides, rest = split_overrides(argv)
    assert rest == []
    return apply_overrides(Config(), overrides, ROLES)


def test_hydra_value_grammar() -> None:
    cfg = configure(
        "skip.rollout.enable=True",
        "+skip.rollout.steps=[1-4,10]",
        "++skip.rollout.action=repeat",
        "skip.rollout.dump_dir='/tmp/a b'",
        "skip.rollout.on_mismatch=fail",
    ).role("rollout")
    assert cfg.enable is True and list(cfg.steps) == [1, 2, 3, 4, 10]
    assert cfg.action is Action.repeat and cfg.action == "repeat" and cfg.on_mismatch is MismatchPolicy.fail
    assert cfg.dump_dir == "/tmp/a b"


def test_interpolation_resolves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SI_TEST_DIR", "/data/x")
    assert configure("skip.rollout.dump_dir=${oc.env:SI_TEST_DIR}/dump").role("rollout").dump_dir == "/data/x/dump"


@pytest.mark.parametrize("arg", ["~skip.rollout.enable", "~skip.rollout.enable=True", "~skip.rolout.steps"])
def test_a_hydra_deletion_of_a_setting_is_refused_not_passed_on(arg: str) -> None:
    """``~skip.rollout.enable`` went to the program as one of its arguments: the setting stayed as it was."""
    with pytest.raises(ConfigError) as info:
        split_overrides(["data.x=1", arg])
    assert str(info.value) == f"{arg}: removing a setting is not supported; leave it out to keep its default"


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "skip.rollout.action=skip",
            "skip.rollout.action=skip: unknown action (choose one of cache, repeat, strict, match, refresh)",
        ),
        ("skip.rollout.enable=maybe", "skip.rollout.enable=maybe: expected true or false"),
        ("skip.rollout.stepz=[1]", "skip.rollout.stepz: unknown key 'stepz'"),
        ("skip.rollot.enable=true", "skip.rollot.enable: unknown role 'rollot'"),
        ("skip.rollout.steps=5-1", "skip.rollout.steps=5-1: range '5-1' goes backwards"),
        ("skip.rollout.enable=[1,", "skip.rollout.enable=[1,: cannot parse the value"),
        ("skip.rollout.dump_dir=", "skip.rollout.dump_dir=: expected a directory path"),
        ("skip.rollout.enable=2", "skip.rollout.enable=2: expected true or false"),
        ("skip.rollout.trust_upstream=-1", "skip.rollout.trust_upstream=-1: expected true or false"),
        ("skip.rollout.dump_dir=true", "skip.rollout.dump_dir=true: expected a directory path"),
    ],
)
def test_errors_are_one_line_naming_key_and_value(override: str, line: str) -> None:
    with pytest.raises(ConfigError) as info:
        configure(override)
    assert str(info.value).startswith(line) and "\n" not in str(info.value)


def test_ranges_stay_ranges() -> None:
    steps = configure("skip.rollout.steps=[0-1000000000]").role("rollout").steps
    assert steps.spans == ((0, 1_000_000_000),) and 999_999_999 in steps and 1_000_000_001 not in steps
    assert StepSet.parse("[1-3,2-8,10]").format() == "[1-8,10]"


def test_yaml_file_is_merged_under_the_command_line(tmp_path: Path) -> None:
    path = tmp_path / "skip.yaml"
    path.write_text("skip:\n  rollout:\n    enable: true\n    steps: [1, 2, 3]\n    action: repeat\n")
    base = apply_settings(Config(), load_file(path), ROLES)
    cfg = apply_overrides(base, split_overrides(["skip.rollout.steps=[7]"])[0], ROLES).role("rollout")
    assert cfg.enable is True and list(cfg.steps) == [7] and cfg.action is Action.repeat


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rollout:\n  enable: true\n", "expected one top-level mapping `skip:`"),
        ("skip:\n  rollout:\n    enable: perhaps\n", "skip.rollout.enable=perhaps: expected true or false"),
        ("skip:\n  rollout: [1]\n", "skip.rollout: expected a mapping"),
        ("skip: {rollout: {enable: true\n", "cannot read it"),
    ],
)
def test_bad_yaml_is_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "skip.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        apply_settings(Config(), load_file(path), ROLES)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_missing_or_huge_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_file(tmp_path / "nope.yaml")
    huge = tmp_path / "huge.yaml"
    huge.write_bytes(b"#" * (2 << 20))
    with pytest.raises(ConfigError, match="not a settings file"):
        load_file(huge)
    with pytest.raises(ConfigError, match=r"cannot open it \(embedded null byte\)$"):  # enable(settings_file=...)
        load_file(f"{tmp_path}/skip\x00.yaml")


def test_transport_round_trip_and_compaction() -> None:
    many = "[" + ",".join(str(i) for i in range(0, 20000, 2)) + "]"
    cfg = Config(
        plugins="rollout",
        plugin_sources={"rollout": "skipinject_rollout.rollout"},
        roles={"rollout": configure("skip.rollout.enable=1", f"skip.rollout.steps={many}").role("rollout")},
    )
    text = cfg.to_json()
    assert len(text) < MAX_SERIALISED_BYTES and Config.from_json(text) == cfg


def test_transport_refuses_what_cannot_reach_children() -> None:
    scattered = "[" + ",".join(str(i) for i in range(0, 600000, 2)) + "]"
    cfg = Config(roles={"rollout": configure(f"skip.rollout.steps={scattered}").role("rollout")})
    with pytest.raises(ConfigError) as info:
        cfg.to_json()
    assert str(info.value).startswith("skip.rollout.steps: 300000 separate steps")


@pytest.mark.parametrize("text", ["", "{", '{"version": 1}', "z1:" + "!" * 10, "x" * (MAX_SERIALISED_BYTES * 3)])
def test_bad_serialised_config_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="cannot read the serialised skipinject config"):
        Config.from_json(text)


def test_role_config_accepts_plain_values_from_code() -> None:
    cfg = RoleConfig(enable=True, steps=(3, 1, 2), action="strict")  # type: ignore[arg-type]
    assert cfg.steps == (1, 2, 3) and cfg.action is Action.strict and cfg.allows(2) and not cfg.allows(4)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SKIPINJECT_LOG_LEVEL": "LOUD"}, "SKIPINJECT_LOG_LEVEL='LOUD': expected one of DEBUG"),
        ({"SKIPINJECT_DISABLE": "maybe"}, "SKIPINJECT_DISABLE='maybe': expected 1 or 0"),
    ],
)
def test_environment_variables_are_validated(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        environment.check(env)
    assert str(info.value).startswith(message)


def test_environment_defaults() -> None:
    assert environment.log_level({}) == "INFO" and environment.log_level({"SKIPINJECT_LOG_LEVEL": "warn"}) == "WARNING"
    assert environment.disabled({}) is False and environment.disabled({"SKIPINJECT_DISABLE": "On"}) is True


@pytest.mark.parametrize(
    ("body", "start"),
    [
        ('    action: "repeat\\n"', "skip.rollout.action='repeat\\n': unknown action"),
        ('    action: "\\e[31mred"', "skip.rollout.action='\\x1b[31mred': unknown action"),
        ('    steps: "1\\nx"', "skip.rollout.steps='1\\nx': '1\\nx' is not a step"),
        ('    "en\\nable": true', "skip.rollout.'en\\nable': unknown key 'en\\nable'"),
        ('    enable: true\n  "roll\\nout": {}', "--skip-config "),
    ],
)
def test_a_value_or_key_with_a_line_break_or_escape_is_quoted_in_the_one_line(
    tmp_path: Path, body: str, start: str
) -> None:
    """A YAML ``>`` block or a quoted ``\\n`` put a line break (or a terminal escape) raw into the error."""
    settings = tmp_path / "skip.yaml"
    settings.write_text("skip:\n  rollout:\n" + body + "\n")
    with pytest.raises(ConfigError) as info:
        apply_settings(Config(), load_file(settings), ROLES)
    message = str(info.value)
    assert message.startswith(start) and message.isprintable(), message


@pytest.mark.parametrize("given", ["cache", "runs/../cache"])
def test_transport_anchors_a_relative_dump_dir_to_the_drivers_directory(
    given: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray's workers may start in another directory: they get the path the user meant, not their own."""
    monkeypatch.chdir(tmp_path)
    cfg = Config(roles={"rollout": configure(f"skip.rollout.dump_dir={given}").role("rollout")})
    text = cfg.to_json()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    back = Config.from_json(text).roles["rollout"]
    assert back.dump_dir == str(tmp_path / given)
    assert back.root.path == (tmp_path / "cache").resolve()


@pytest.mark.parametrize("given", ["/srv/cache", "~/cache", "memory://bucket/cache"])
def test_transport_keeps_an_absolute_home_or_remote_dump_dir(given: str) -> None:
    if given.startswith("memory://"):
        pytest.importorskip("fsspec")
    cfg = Config(roles={"rollout": configure(f"skip.rollout.dump_dir={given}").role("rollout")})
    assert Config.from_json(cfg.to_json()).roles["rollout"].dump_dir == given


@pytest.mark.parametrize(
    ("settings", "line"),
    [
        ({"enable": 99999999999999999999}, "skip.rollout.enable=99999999999999999999: expected true or false"),
        ({"dump_dir": object()}, "skip.rollout.dump_dir=<object object at"),
        ({"dump_dir": True}, "skip.rollout.dump_dir=True: expected a directory path"),
    ],
)
def test_settings_from_code_are_not_coerced(settings: dict[str, object], line: str) -> None:
    """A number is no boolean and an object's ``str()`` no path: refused, not read as ``True`` or a directory."""
    with pytest.raises(ConfigError) as info:
        apply_settings(Config(), {"rollout": settings}, ROLES)
    assert str(info.value).startswith(line)


def test_plain_booleans_and_a_numbered_directory_are_still_taken() -> None:
    config = configure("skip.rollout.enable=1", "skip.rollout.read_ahead=no", "skip.rollout.dump_dir=123")
    role = config.role("rollout")
    assert role.enable is True and role.read_ahead is False and role.dump_dir.endswith("123")


@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        ({"plugins": ["rollout"]}, "skipinject.enable: plugins=['rollout']: expected a comma list"),
        ({"settings": [("rollout", {})]}, "skipinject.enable: settings=[('rollout', {})]: expected a mapping"),
        ({"settings_file": 3}, "skipinject.enable: settings_file=3: expected a file path"),
    ],
)
def test_enable_refuses_arguments_of_the_wrong_type_in_one_line(arguments: dict[str, object], line: str) -> None:
    from skipinject import enable

    with pytest.raises(ConfigError) as info:
        enable(**arguments)  # type: ignore[arg-type]
    assert str(info.value).startswith(line)
    with pytest.raises(ConfigError, match="override=123: expected"):
        enable(123)  # type: ignore[arg-type]
