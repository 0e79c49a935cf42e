"""Bad input: every bad value gives an error of skipinject's own type naming it, never a raw exception.

Property-based (hypothesis) over the parsers a user's text reaches: ``skip.<role>.<key>=value``
overrides, step lists and ranges, the serialised config, sample ids, dotted target paths and
``VERL_SKIP_PLUGINS``; plus the runner itself in subprocesses: a bad override exits 2 before the
program starts, with exactly one stderr line naming the key.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skipinject.config import (
    MAX_STEP,
    ROLE_KEYS,
    Action,
    Config,
    RoleConfig,
    StepSet,
    role_config,
)
from skipinject.config.overrides import apply_overrides, split_overrides
from skipinject.errors import ConfigError, PluginError, SkipInjectError, TargetError
from skipinject.plugin_manager import PluginSelection, load_plugins, parse_selection
from skipinject.roles import StepSource, TargetPath
from tests.reliability import helpers as h


def parse_steps(text: str, key: str = "steps") -> StepSet:
    return StepSet.parse(text, key)


ROOT = Path(__file__).resolve().parents[2]
ROLES = ("rollout", "toy")
COUNTS: dict[str, list[int]] = {}  # parser -> [examples, rejected with our error, raw exceptions]
FAST = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _tally(name: str, rejected: bool) -> None:
    row = COUNTS.setdefault(name, [0, 0, 0])
    row[0] += 1
    row[1] += int(rejected)


def _raw(name: str, value: Any, exc: BaseException) -> AssertionError:
    COUNTS.setdefault(name, [0, 0, 0])[2] += 1
    return AssertionError(f"{name}({value!r}) raised {type(exc).__name__}: {exc}")


def _names_value(message: str, *values: str) -> bool:
    return any(v in message or repr(v) in message or repr(v)[1:-1] in message for v in values)


_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=24)
_STEPISH = st.one_of(
    _TEXT,
    st.from_regex(r"\[?( ?[0-9x\-]{0,9} ?,?){0,4}\]?", fullmatch=True),
    st.lists(st.integers(-5, MAX_STEP + 5), max_size=5).map(lambda xs: "[" + ",".join(map(str, xs)) + "]"),
    st.tuples(st.integers(-2, MAX_STEP + 2), st.integers(-2, MAX_STEP + 2)).map(lambda t: f"{t[0]}-{t[1]}"),
    st.sampled_from(["1" * 5000, "٣", "[1,,2]", "[1-", "1-2-3", " [ 3 ] ", "'[1,2]'", "[1]]", "0-99999999999999"]),
)


# ---------------------------------------------------------------- steps


@FAST
@given(text=_STEPISH)
def test_parse_steps_returns_steps_or_names_the_value(text: str) -> None:
    try:
        steps = parse_steps(text, "skip.toy.steps")
    except ConfigError as exc:
        _tally("parse_steps", True)
        assert "skip.toy.steps" in str(exc) and _names_value(str(exc), text, text.strip())
        return
    except Exception as exc:
        raise _raw("parse_steps", text, exc) from exc
    _tally("parse_steps", False)
    # Checked on the ranges: listing the steps of "0-1000000000" would take tens of GB.
    bounds = [b for span in steps.spans for b in span]
    assert all(type(b) is int and 0 <= b <= MAX_STEP for b in bounds)
    assert all(lo <= hi for lo, hi in steps.spans)
    assert all(high + 1 < low for high, low in zip(bounds[1::2], bounds[2::2], strict=False))  # disjoint, merged


@FAST
@given(
    items=st.lists(st.one_of(st.integers(0, 5000), st.tuples(st.integers(0, 3000), st.integers(0, 2000))), max_size=6)
)
def test_parse_steps_means_what_it_says(items: list[Any]) -> None:
    expected: set[int] = set()
    parts = []
    for item in items:
        if isinstance(item, tuple):
            low, high = item[0], item[0] + item[1]
            expected.update(range(low, high + 1))
            parts.append(f"{low}-{high}")
        else:
            expected.add(item)
            parts.append(str(item))
    assert parse_steps("[" + ", ".join(parts) + "]") == tuple(sorted(expected))
    _tally("parse_steps", False)


# ---------------------------------------------------------------- overrides


_ARG = st.one_of(
    _TEXT,
    st.builds(
        lambda p, r, k, v: f"{p}skip.{r}.{k}={v}",
        st.sampled_from(["", "+", "++", "+++"]),
        st.sampled_from([*ROLES, "nope", "", "a.b"]),
        st.sampled_from([*ROLE_KEYS, "foo", ""]),
        _STEPISH,
    ),
    st.builds(lambda p, rest: f"{p}skip.{rest}", st.sampled_from(["", "+", "++"]), _TEXT),
)


@FAST
@given(argv=st.lists(_ARG, max_size=5))
def test_overrides_are_taken_out_validated_and_named(argv: list[str]) -> None:
    try:
        ours, rest = split_overrides(argv)
        config = apply_overrides(Config(), ours, ROLES)
    except ConfigError as exc:
        _tally("overrides", True)
        message = str(exc)
        assert message.startswith("skip.") and any(message.startswith(a.lstrip("+").partition("=")[0]) for a in argv), (
            message
        )
        return
    except Exception as exc:
        raise _raw("overrides", argv, exc) from exc
    _tally("overrides", False)
    assert not any(a.lstrip("+").startswith("skip.") and a.startswith(("skip.", "+skip.", "++skip.")) for a in rest)
    for cfg in config.roles.values():
        assert isinstance(cfg.enable, bool) and isinstance(cfg.trust_upstream, bool)
        assert isinstance(cfg.action, Action) and all(type(s) is int for s in cfg.steps)


@FAST
@given(role=st.sampled_from(ROLES), key=st.sampled_from(ROLE_KEYS), raw=_STEPISH)
def test_each_key_rejects_bad_values_by_name(role: str, key: str, raw: str) -> None:
    dotted = f"skip.{role}.{key}"
    try:
        cfg = apply_overrides(Config(), [(dotted, raw)], ROLES).role(role)
    except ConfigError as exc:
        _tally("overrides", True)
        assert str(exc).startswith(dotted) and _names_value(str(exc), raw, raw.strip(), raw.strip().strip("'\""))
        return
    except Exception as exc:
        raise _raw("overrides", (dotted, raw), exc) from exc
    _tally("overrides", False)
    assert getattr(cfg, key) is not None


_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-3, MAX_STEP + 3) | st.floats(allow_nan=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=2),
    max_leaves=5,
)


@FAST
@given(values=st.one_of(st.dictionaries(st.one_of(st.sampled_from(ROLE_KEYS), _TEXT), _VALUE, max_size=4), _VALUE))
def test_role_config_from_mapping_names_the_bad_key(values: Any) -> None:
    try:
        cfg = role_config("toy", values)
    except ConfigError as exc:
        _tally("role_config_from_mapping", True)
        assert "skip.toy" in str(exc)
        return
    except Exception as exc:
        raise _raw("role_config_from_mapping", values, exc) from exc
    _tally("role_config_from_mapping", False)
    assert isinstance(cfg, RoleConfig) and isinstance(values, dict)


def test_role_config_from_omegaconf() -> None:
    from omegaconf import OmegaConf

    node = OmegaConf.create({"enable": True, "steps": [3, 1, 2], "action": "repeat", "dump_dir": "/tmp/x"})
    cfg = role_config("toy", node)
    assert cfg.enable is True and cfg.steps == (1, 2, 3) and cfg.action == "repeat"
    _tally("role_config_from_mapping", False)


@FAST
@given(
    text=st.one_of(
        _TEXT,
        st.builds(
            lambda v: '{"version": 1, "roles": ' + v + "}",
            st.sampled_from(["[]", "1", '{"x": 1}', '{"x": {"steps": "a"}}', "null"]),
        ),
    )
)
def test_serialised_config_is_checked(text: str) -> None:
    try:
        Config.from_json(text)
    except ConfigError:
        _tally("Config.from_json", True)
        return
    except Exception as exc:
        raise _raw("Config.from_json", text, exc) from exc
    _tally("Config.from_json", False)


@FAST
@given(
    spans=st.lists(st.tuples(st.integers(0, MAX_STEP), st.integers(0, 2000)), max_size=4),
    singles=st.lists(st.integers(0, MAX_STEP), max_size=8),
)
def test_serialised_config_round_trips_and_stays_small(spans: list[tuple[int, int]], singles: list[int]) -> None:
    steps = set(singles)
    for low, width in spans:
        steps.update(range(low, min(low + width, MAX_STEP) + 1))
    cfg = Config(roles={"toy": RoleConfig(enable=True, steps=tuple(sorted(steps)), action="repeat")})
    text = cfg.to_json()
    assert Config.from_json(text) == cfg
    assert len(text) < 2000, "steps are serialised as ranges (the config travels in an environment variable)"
    _tally("Config.from_json", False)


def test_a_huge_step_range_serialises_compactly() -> None:
    cfg = Config(roles={"toy": RoleConfig(enable=True, steps=parse_steps(f"0-{MAX_STEP}"))})
    text = cfg.to_json()
    assert len(text) < 1000
    assert Config.from_json(text).role("toy").allows(MAX_STEP)


# ---------------------------------------------------------------- sample ids, targets, plugin lists


@FAST
@given(
    value=st.one_of(
        _TEXT,
        st.integers(),
        st.none(),
        st.binary(max_size=8),
        st.from_regex(r"(uid_)?sample_[0-9]{1,6000}_[0-9]{1,6000}\n?", fullmatch=True),
        st.sampled_from(["sample_1_٣", "uid_sample_0_7\n", "sample__1", "sample_1_2_3"]),
    )
)
def test_sample_ids_give_a_step_or_none(value: Any) -> None:
    from skipinject_rollout.async_rollout import parse_sample_id

    try:
        step = parse_sample_id(value)
    except Exception as exc:
        raise _raw("parse_sample_id", value, exc) from exc
    _tally("parse_sample_id", step is None)
    assert step is None or (type(step) is int and step >= 0)


@pytest.mark.parametrize(
    ("sample_id", "step"),
    [
        ("sample_0_7", 7),
        ("uid_sample_3_12", 12),
        ("sample_1_0", 0),
        ("sample_1", None),
        ("uid_sample_1_x", None),
        ("", None),
    ],
)
def test_sample_ids_known_forms(sample_id: str, step: int | None) -> None:
    from skipinject_rollout.async_rollout import parse_sample_id

    assert parse_sample_id(sample_id) == step


@FAST
@given(
    text=st.one_of(
        _TEXT,
        st.from_regex(r"[a-z_.]{0,8}:[A-Za-z_.]{0,8}", fullmatch=True),
        st.sampled_from(["a:b\n", "a.b:C.d", "verl:", ":x", "a:b:c", "a..b:c", "1a:b"]),
    )
)
def test_target_paths_parse_or_name_the_path(text: str) -> None:
    try:
        path = TargetPath.parse(text)
    except TargetError as exc:
        _tally("TargetPath.parse", True)
        assert repr(text) in str(exc)
        return
    except Exception as exc:
        raise _raw("TargetPath.parse", text, exc) from exc
    _tally("TargetPath.parse", False)
    assert str(path) == text


@pytest.mark.parametrize("value", [None, 3, b"a:b", ["a:b"]])
def test_target_paths_of_other_types(value: Any) -> None:
    with pytest.raises(TargetError, match="target"):
        TargetPath.parse(value)


@FAST
@given(
    text=st.one_of(
        _TEXT,
        st.lists(
            st.sampled_from(["rollout", "-reward", "a.b:c", "-", " ", "x:y:z", "-a.b:c", "mod:attr", "1x", "a-b", "é"]),
            max_size=4,
        ).map(",".join),
    )
)
def test_plugin_selection_parses_or_names_the_item(text: str) -> None:
    try:
        selection = parse_selection(text)
    except PluginError as exc:
        _tally("parse_selection", True)
        assert "VERL_SKIP_PLUGINS" in str(exc)
        assert any(repr(item.strip()) in str(exc) for item in text.split(",")), str(exc)
        return
    except Exception as exc:
        raise _raw("parse_selection", text, exc) from exc
    _tally("parse_selection", False)
    assert isinstance(selection, PluginSelection)


_UNKNOWN = st.from_regex(r"zz_si_nope_[a-z0-9_]{1,8}(\.[a-z_]{1,5})?(:[A-Za-z_]{1,5})?", fullmatch=True)


@settings(max_examples=60, deadline=None)
@given(
    names=st.lists(
        st.one_of(_UNKNOWN, _UNKNOWN.map(lambda n: "-" + n.split(":")[0].split(".")[0])), min_size=1, max_size=3
    )
)
def test_unknown_plugins_are_named(names: list[str]) -> None:
    text = ",".join(["rollout", *names])
    try:
        load_plugins(text)
    except PluginError as exc:
        _tally("load_plugins", True)
        assert any(n.lstrip("-") in str(exc) for n in names), str(exc)
        return
    except Exception as exc:
        raise _raw("load_plugins", text, exc) from exc
    raise AssertionError(f"{text!r} loaded")


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("os", "os"),
        ("json:dumps", "json:dumps"),
        ("json.nope", "json.nope"),
        ("json:nope", "json:nope"),
        ("-nope", "nope"),
        ("rollout,rollout_x", "rollout_x"),
        ("skipinject_rollout.common", "skipinject_rollout.common"),
    ],
)
def test_plugin_names_that_are_not_plugins(text: str, named: str) -> None:
    with pytest.raises(PluginError) as info:
        load_plugins(text)
    _tally("load_plugins", True)
    assert named in str(info.value)


# ---------------------------------------------------------------- a failing step source never breaks a call


def test_a_broken_step_extractor_runs_the_original(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def boom(call: Any) -> int:
        raise ValueError("bad uid 'sample_x'")

    role = h.toy_role(step=StepSource.per_call(boom))
    rt = h.runtime(tmp_path, role=role)
    target = h.ToyTarget()
    with caplog.at_level("WARNING", logger="skipinject"):
        for step in (1, 2):
            h.call(rt, target, step)
    assert target.calls == [1, 2]
    lines = h.records(caplog)
    assert len(lines) == 1 and "bad uid 'sample_x'" in lines[0]


_ERRORS = {"TargetPath.parse": "TargetError", "parse_selection": "PluginError", "load_plugins": "PluginError"}


@pytest.fixture(scope="module", autouse=True)
def _record_counts(module_ledger: Any) -> Iterator[None]:
    """After the module: one ledger line per parser the property tests above fed (each of them
    fails on its own at the first raw exception)."""
    COUNTS.clear()
    yield
    for name, (examples, rejected, raw_count) in sorted(COUNTS.items()):
        if name == "parse_sample_id":
            outcome = f"no step (None) for {rejected}, a step for {examples - rejected}; never an exception"
        else:
            error = _ERRORS.get(name, "ConfigError")
            outcome = f"{rejected} rejected with a {error} naming the value, {examples - rejected} accepted"
        module_ledger(
            "bad input", f"`{name}`: generated values (hypothesis) and known bad ones", examples, outcome, raw_count
        )


# ---------------------------------------------------------------- the runner


CLI_CASES = [
    (["-m", "json.tool", "skip.rollout.steps=[1,x]"], {}, "skip.rollout.steps"),
    (["{script}", "skip.rollout.steps=[1,x]"], {}, "skip.rollout.steps"),
    (["{script}", "skip.nope.enable=true"], {}, "skip.nope"),
    (["{script}", "skip.rollout.foo=1"], {}, "skip.rollout.foo"),
    (["{script}", "skip.rollout.action=bogus"], {}, "skip.rollout.action"),
    (["{script}", "skip.rollout.enable=maybe"], {}, "skip.rollout.enable"),
    (["{script}", "+skip.rollout.steps=5-1"], {}, "skip.rollout.steps"),
    (["{script}", "++skip.rollout.dump_dir="], {}, "skip.rollout.dump_dir"),
    (["{script}", "skip.rollout.steps"], {}, "skip.rollout.steps"),
    (["{script}", "skip.rollout.trust_upstream=maybe"], {}, "skip.rollout.trust_upstream"),
    (["{script}", "skip.rollout.enable=true"], {"VERL_SKIP_PLUGINS": "nope"}, "nope"),
    (["--plugins", "-nope", "{script}"], {}, "nope"),
]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP"))}
    env.update(extra)
    return env


@pytest.mark.integration  # a runner process per bad input: too slow for the unit tier
def test_runner_rejects_bad_input_before_the_program_starts(tmp_path: Path, ledger: Any) -> None:
    marker = tmp_path / "program-started"
    script = tmp_path / "program.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    procs = []
    for args, extra, _ in CLI_CASES:
        argv = [a.replace("{script}", str(script)) for a in args]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "skipinject", *argv],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=_env(**extra),
                cwd=ROOT,
            )
        )
    failures = []
    for proc, (args, extra, named) in zip(procs, CLI_CASES, strict=True):
        _, err = proc.communicate(timeout=120)
        lines = err.strip().splitlines()
        ok = proc.returncode == 2 and len(lines) == 1 and named in lines[0] and lines[0].startswith("skipinject: ")
        if not ok:
            failures.append((args, extra, proc.returncode, err))
    started = marker.exists()
    ledger(
        "bad input",
        "`python -m skipinject` with a bad override / plugin list (12 kinds, subprocesses)",
        len(CLI_CASES),
        f"exit 2 with one stderr line naming the key: {len(CLI_CASES) - len(failures)}; "
        f"program started: {int(started)}",
        len(failures) + int(started),
    )
    assert not failures and not started, failures


def test_runner_hands_a_huge_step_range_to_child_processes(tmp_path: Path) -> None:
    """The resolved config travels in an environment variable: a long step range must not overflow it."""
    script = tmp_path / "spawns.py"
    script.write_text(
        "import subprocess, sys\nsys.exit(subprocess.run([sys.executable, '-c', 'print(1)']).returncode)\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "skipinject",
            str(script),
            "skip.rollout.enable=true",
            f"skip.rollout.steps=0-{MAX_STEP}",
            f"skip.rollout.dump_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        env=_env(SKIPINJECT_LOG_LEVEL="ERROR"),
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_errors_are_ours() -> None:
    assert issubclass(ConfigError, SkipInjectError) and issubclass(PluginError, SkipInjectError)
    assert issubclass(TargetError, SkipInjectError)


@pytest.mark.parametrize(
    ("meta", "said"),
    [
        ({"reward": {"settings": {"reward.reward_kwargs.table": "x" * (20 << 20)}}}, "more than the 16,777,216"),
        ({"reward": {"settings": {"deep": __import__("functools").reduce(lambda v, _: [v], range(40), 1)}}}, "nested"),
    ],
    ids=["20-MB-reward_kwargs", "40-levels"],
)
def test_the_writer_refuses_a_meta_json_every_reader_would_refuse(
    tmp_path: Path, meta: dict[str, Any], said: str, ledger: Any
) -> None:
    """Saved, such a step would be ``cache unusable`` for every later run; refused at save time in one line,
    nothing of it is left, and the step is simply generated again."""
    from skipinject.errors import CacheError
    from skipinject.store import StepStore

    store = StepStore(tmp_path / "exp_proj" / "GBS4_N2_in8_out8", "toy", h.CONTEXT)
    with pytest.raises(CacheError) as info:
        store.save(1, h.codec_payload(2), meta)
    message = str(info.value)
    assert said in message and "\n" not in message and len(message) < 300, message[:300]
    assert not store.step_dir(1).exists() or not any(store.step_dir(1).iterdir()), "nothing half-written"
    assert 1 not in store.step_numbers_on_disk()
    ledger("bad input", f"a meta.json every reader would refuse ({said.split()[0]} ...)", 1, "refused at save", 0)


# ---------------------------------------------------------------- the cache tool's arguments


def _tool(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    from skipinject.cache_tool import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _two_steps(tmp_path: Path) -> Any:
    from tests.unit.test_cache_tool_upkeep import payload, store_at

    store = store_at(str(tmp_path / "dump"))
    store.save(1, payload(1))
    store.save(2, payload(2))
    return store


def test_prune_max_size_of_400_digits_is_one_line(tmp_path: Path, capsys: Any, ledger: Any) -> None:
    _two_steps(tmp_path)
    code, _out, err = _tool(capsys, "prune", tmp_path / "dump", "--max-size", "9" * 400)
    assert code == 2 and "internal error" not in err and len(err.strip().splitlines()) == 1, err
    assert "more than any store holds" in err and len(err) < 300
    ledger("cache tool", "prune --max-size with a 400-digit number", 1, "one line, exit 2", 0)


def test_rm_checks_every_name_before_removing_any(tmp_path: Path, capsys: Any, ledger: Any) -> None:
    store = _two_steps(tmp_path)
    code, _out, err = _tool(capsys, "rm", store.step_dir(1), store.step_dir(7))
    assert code == 2 and "nothing removed" in err and len(err.strip().splitlines()) == 1, err
    assert store.step_numbers_on_disk() == [1, 2], "the existing step named first is kept"
    ledger("cache tool", "rm A B with B missing", 1, "nothing removed, one line", 0)


def test_rm_of_a_step_named_twice_counts_it_once(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, ledger: Any
) -> None:
    store = _two_steps(tmp_path)
    monkeypatch.chdir(store.project_dir)
    code, out, _ = _tool(capsys, "rm", "2", store.step_dir(2), "./2", "--dry-run", "--json")
    import json

    doc = json.loads(out)
    assert code == 0 and len(doc["removed"]) == 1 and doc["files"] == len(list(store.step_dir(2).iterdir()))
    code, out, err = _tool(capsys, "rm", "2", "2")
    assert code == 0 and out.count("removed ") == 2 and store.step_numbers_on_disk() == [1], (out, err)
    ledger("cache tool", "rm 2 2, --dry-run of a step named twice", 2, "counted and removed once", 0)


def test_rm_of_a_directory_that_is_no_step_walks_nothing(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch, ledger: Any
) -> None:
    import skipinject.cache_tool.scan as scan

    walked: list[Path] = []
    real = scan.step_dirs

    def counted(backend: Any, root: Path, *args: Any) -> Any:
        if not root.is_relative_to(tmp_path / "dump"):
            raise AssertionError(f"walked {root}")
        for found in real(backend, root, *args):
            walked.append(found)
            yield found

    monkeypatch.setattr(scan, "step_dirs", counted)
    for name in ("/", tmp_path):
        code, _, err = _tool(capsys, "rm", name)
        assert code == 2 and "no skipinject step there" in err and len(err.strip().splitlines()) == 1, err
        assert "walked" not in err
    store = _two_steps(tmp_path)
    (store.step_dir(2) / "9").mkdir()  # a step named by a number is looked at, nothing below it
    code, _, _ = _tool(capsys, "rm", store.step_dir(2), "--dry-run")
    assert code == 0 and walked == [store.step_dir(2)]
    ledger("cache tool", "rm / and rm of a directory that is no step", 2, "one line, nothing walked", 0)


@pytest.mark.parametrize("plugins", ["no_such_plugin_xyz", "-no_such_plugin_xyz", "not a name!"])
def test_enable_with_an_unknown_plugin_raises_config_error(plugins: str, ledger: Any) -> None:
    """As docs/runner.md says: a wrong setting of ``enable()`` is a ``ConfigError`` (and still a ``PluginError``
    for code that catches that), one line naming it; nothing is installed."""
    from skipinject import bootstrap

    started = bootstrap._started
    with pytest.raises(ConfigError) as info:
        bootstrap.enable("skip.rollout.enable=True", "skip.rollout.steps=[1]", plugins=plugins)
    assert isinstance(info.value, PluginError) and "\n" not in str(info.value)
    assert plugins.lstrip("-").split()[0] in str(info.value) and bootstrap._started == started
    ledger("bad input", f"enable(plugins={plugins!r})", 1, "ConfigError, one line", 0)
