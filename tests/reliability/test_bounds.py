"""Bounds on what a user's text may cost: YAML bombs, huge step lists, a decompression bomb in the
variable handed to children, and the runner's own command line (``--skip-config`` twice, a FIFO).

A bomb must not hang: the runner runs in a subprocess with a generous timeout, and the test asserts
on behaviour (refused with one line of our own error, before OmegaConf saw the document), never on
timings.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from skipinject.config import Config, StepSet
from skipinject.config.overrides import apply_overrides, apply_settings, load_file, parse_overrides
from skipinject.config.schema import _COMPRESSED
from skipinject.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
#: A bomb refused at once still gets this long on a loaded machine; today's code took minutes.
TIMEOUT = 120

#: ~300 bytes of settings whose aliases expand to 9**7 values when composed.
FILE_BOMB = "skip:\n  rollout:\n    steps: &a [1,1,1,1,1,1,1,1,1]\n" + "".join(
    f"    {c}: &{c} [{','.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdef", "bcdefg", strict=True)
)
#: ~200 characters of a command-line value in YAML flow syntax: 9**8 lists when composed.
VALUE_BOMB = (
    "[&a [1,1,1,1,1,1,1,1,1],"
    + ",".join(f"&{chr(98 + i)} [{','.join([f'*{chr(97 + i)}'] * 9)}]" for i in range(7))
    + "]"
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP"))}
    env.update(extra)
    return env


def _runner(*options: str, overrides: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skipinject", *options, "-c", "print('program started')", *overrides],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=TIMEOUT,
    )


def _one_error_line(proc: subprocess.CompletedProcess[str], *words: str) -> bool:
    lines = proc.stderr.strip().splitlines()
    return (
        proc.returncode == 2
        and "program started" not in proc.stdout
        and len(lines) == 1
        and lines[0].startswith("skipinject: error: ")
        and all(w in lines[0] for w in words)
    )


@pytest.fixture
def no_omegaconf_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """OmegaConf must never be handed a refused document."""
    from omegaconf import OmegaConf

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("OmegaConf parsed a document that should have been refused before")

    monkeypatch.setattr(OmegaConf, "load", refuse)
    monkeypatch.setattr(OmegaConf, "create", refuse)
    monkeypatch.setattr(OmegaConf, "from_dotlist", refuse)


def test_alias_bombs_are_refused_in_one_line(tmp_path: Path, ledger: Any) -> None:
    settings = tmp_path / "bomb.yaml"
    settings.write_text(FILE_BOMB)
    assert len(FILE_BOMB) < 310 and len(VALUE_BOMB) < 250
    procs = [
        _runner("--skip-config", str(settings)),
        _runner(overrides=(f"skip.rollout.enable={VALUE_BOMB}",)),
    ]
    ok = [_one_error_line(procs[0], "--skip-config", "anchors"), _one_error_line(procs[1], "skip.rollout.enable")]
    lost = ok.count(False)
    ledger("bad input", f"YAML alias bombs: a {len(FILE_BOMB)}-byte --skip-config, a {len(VALUE_BOMB)}-character "
           "command-line value in flow syntax (runner in a subprocess)", 2,
           f"exit 2 with one line naming the file or key: {ok.count(True)}", lost)  # fmt: skip
    assert lost == 0, [p.stderr[-500:] for p in procs]


def test_bombs_never_reach_omegaconf(tmp_path: Path, no_omegaconf_parse: None) -> None:
    settings = tmp_path / "bomb.yaml"
    settings.write_text(FILE_BOMB)
    with pytest.raises(ConfigError, match="anchors"):
        load_file(settings)
    with pytest.raises(ConfigError, match=r"skip\.rollout\.enable=.*aliases|anchors"):
        parse_overrides([("skip.rollout.enable", VALUE_BOMB)])
    deep = tmp_path / "deep.yaml"
    deep.write_text("skip:\n  rollout:\n    steps: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nest"):
        load_file(deep)


def test_a_huge_step_list_in_yaml_is_refused_before_omegaconf(
    tmp_path: Path, no_omegaconf_parse: None, ledger: Any
) -> None:
    settings = tmp_path / "steps.yaml"
    items = 130_000
    settings.write_text("skip:\n  rollout:\n    steps: [" + ",".join(str(2 * i) for i in range(items)) + "]\n")
    with pytest.raises(ConfigError, match="ranges like 1-128") as caught:
        load_file(settings)
    lost = int("\n" in str(caught.value))
    ledger("bad input", f"a --skip-config steps list of {items:,} separate items ({settings.stat().st_size:,} bytes)",
           1, "ConfigError before OmegaConf parsed it, one line naming the file", lost)  # fmt: skip


def test_a_decompression_bomb_in_the_child_config_is_refused(ledger: Any) -> None:
    """The writer never writes a configuration that expands past its bound; the reader stops there."""
    body = b'{"version":2' + b" " * 4_000_000 + b', "roles": {}}'
    bomb = _COMPRESSED + base64.b85encode(zlib.compress(body, 9)).decode()
    assert len(bomb) < 6000
    seen: list[int] = []
    real = zlib.decompressobj

    class Counting:
        def __init__(self) -> None:
            self.inner = real()

        def decompress(self, data: bytes, max_length: int = 0) -> bytes:
            out = self.inner.decompress(data, max_length)
            seen.append(len(out))
            return out

        @property
        def unconsumed_tail(self) -> bytes:
            return self.inner.unconsumed_tail

    import skipinject.config.schema as transport

    transport.zlib.decompressobj = Counting  # type: ignore[assignment]
    try:
        with pytest.raises(ConfigError, match="expands beyond"):
            Config.from_json(bomb)
    finally:
        transport.zlib.decompressobj = real  # type: ignore[assignment]
    lost = int(max(seen) > transport.MAX_EXPANDED_BYTES + 1)
    ledger("bad input", f"SKIPINJECT_CONFIG of {len(bomb):,} bytes decompressing to {len(body):,}", 1,
           f"ConfigError after decompressing {max(seen):,} bytes", lost)  # fmt: skip
    assert lost == 0


def test_the_runner_refuses_skip_config_twice(tmp_path: Path) -> None:
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("skip:\n  rollout:\n    enable: true\n")
    second.write_text("skip:\n  rollout:\n    steps: [1]\n")
    proc = _runner("--skip-config", str(first), f"--skip-config={second}")
    assert _one_error_line(proc, "--skip-config", "twice"), proc.stderr


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_skip_config_naming_a_fifo_or_a_directory_says_what_it_is(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "settings.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    with pytest.raises(ConfigError) as caught:
        load_file(path)
    assert ("a pipe" if kind == "fifo" else "a directory") in str(caught.value)
    assert "no such file" not in str(caught.value)


def test_oc_env_in_steps_works_alike_on_the_command_line_and_in_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SI_TEST_STEPS", "[1-3,7]")
    settings = tmp_path / "s.yaml"
    settings.write_text("skip:\n  rollout:\n    steps: ${oc.env:SI_TEST_STEPS}\n")
    from_file = apply_settings(Config(), load_file(settings), ["rollout"])
    from_line = apply_overrides(Config(), [("skip.rollout.steps", "${oc.env:SI_TEST_STEPS}")], ["rollout"])
    assert from_file.role("rollout").steps == from_line.role("rollout").steps == StepSet([(1, 3), (7, 7)])


def test_an_over_long_dump_dir_is_a_problem_of_dump_dir() -> None:
    with pytest.raises(ConfigError) as caught:
        config = apply_overrides(
            Config(), [("skip.rollout.enable", "true"), ("skip.rollout.dump_dir", "/d" * 100_000)], ["rollout"]
        )
        config.to_json()
    assert str(caught.value).startswith("skip.rollout.dump_dir=")


@pytest.mark.parametrize("settings", [[], ["rollout"], "rollout"])
def test_settings_that_are_no_mapping_are_one_config_error(settings: object) -> None:
    with pytest.raises(ConfigError) as caught:
        apply_settings(Config(), settings, ["rollout"])  # type: ignore[arg-type]
    assert str(caught.value).startswith("settings: a mapping of roles to their settings, not ")


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_the_memory_budget_reads_the_limit_of_the_process_own_cgroup_and_its_ancestors(
    tmp_path: Path, version: str
) -> None:
    """A limit set on the slice or container a run is in (not on the file system's root cgroup) bounds what a
    step may rebuild; cgroup v1's "no limit" number is none."""
    from skipinject.store.hit_memory import cgroup_limits

    if version == "v2":
        membership, base, name = "0::/user.slice/run-42.scope\n", tmp_path, "memory.max"
    else:
        membership = "4:memory:/user.slice/run-42.scope\n3:cpuset:/\n"
        base, name = tmp_path / "memory", "memory.limit_in_bytes"
    own = base / "user.slice" / "run-42.scope"
    own.mkdir(parents=True)
    (base / name).write_text("9223372036854771712\n" if version == "v1" else "max\n")
    (base / "user.slice" / name).write_text(f"{8 << 30}\n")
    (own / name).write_text(f"{2 << 30}\n")
    assert sorted(cgroup_limits(membership, str(tmp_path))) == [2 << 30, 8 << 30]
    assert cgroup_limits("0::/../../etc\n", str(tmp_path)) == [], "no path leaves the cgroup mount"
