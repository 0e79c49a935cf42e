"""The verl stack is the environment's: skipinject declares none of torch, tensordict, ray and verl,
warns once at start when the installed ones are outside the tested versions, and ``--version`` says
what is installed (skipinject, its plugin API, every plugin and the stack)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from skipinject import API_VERSION, __version__
from skipinject.verl import stack

ROOT = Path(__file__).resolve().parents[2]
STACK = ("verl", "torch", "tensordict", "ray")
BUILT_IN = ("rollout", "async_rollout", "rollout_tq")
WARNING = "outside the versions skipinject is tested with"


def _pins(lock: Path) -> dict[str, str]:
    pins = {}
    for line in lock.read_text().splitlines():
        name, sep, pinned = line.split("#")[0].strip().partition("==")
        if sep and name.lower() in STACK:
            pins[name.lower()] = pinned.strip()
    return pins


LOCKS = sorted([ROOT / "requirements" / "lock.txt", *(ROOT / "requirements").glob("verl-*.txt")])


@pytest.mark.parametrize("lock", LOCKS, ids=lambda p: p.name)
def test_every_lock_the_suite_runs_is_inside_the_tested_ranges(lock: Path) -> None:
    pins = _pins(lock)
    assert set(pins) == set(STACK), f"{lock.name} pins {sorted(pins)}"
    found = stack.components(lambda name: pins.get(name))
    assert stack.outside_tested(found) == [], [c.describe() for c in found]
    assert stack.warning_text(found) is None


def test_core_declares_none_of_the_stack_so_pip_never_replaces_it() -> None:
    """A requirement on torch/verl/ray/tensordict could make pip upgrade or replace the user's (CUDA) build."""
    for pyproject in [ROOT / "pyproject.toml", *sorted((ROOT / "plugins").glob("*/pyproject.toml"))]:
        project = tomllib.loads(pyproject.read_text())["project"]
        declared = [*project.get("dependencies", [])]
        declared += [req for reqs in project.get("optional-dependencies", {}).values() for req in reqs]
        names = {re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0].lower() for req in declared}
        assert not names & set(STACK), f"{pyproject.relative_to(ROOT)} declares {sorted(names & set(STACK))}"


def test_local_builds_and_prereleases_count_as_their_release() -> None:
    versions = {"verl": "0.9.1", "torch": "2.13.0+cu128", "tensordict": "0.10.0", "ray": "2.60.0"}
    assert stack.warning_text(stack.components(versions.get)) is None
    versions["torch"] = "2.13.0a0+git1234"  # an NGC-style build of the tested release
    assert stack.warning_text(stack.components(versions.get)) is None


def test_one_warning_names_every_package_outside_and_only_those(caplog: pytest.LogCaptureFixture) -> None:
    versions = {"verl": "0.9.1", "torch": "2.6.0+cu124", "tensordict": "0.10.0", "ray": "2.43.0"}
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        text = stack.warn_if_untested(versions.get)
    assert [r.getMessage() for r in caplog.records] == [text]
    assert text is not None and "torch 2.6.0+cu124" in text and "ray 2.43.0" in text
    assert "verl 0.9.1" not in text.split(WARNING)[0] and "tensordict 0.10.0" not in text.split(WARNING)[0]
    assert "torch >=2.13,<2.14" in text and "--version" in text  # the ranges, and what to report


def test_a_program_without_verl_or_ray_is_no_untested_stack_but_a_missing_torch_is() -> None:
    assert stack.warning_text(stack.components({"torch": "2.13.0"}.get)) is None
    text = stack.warning_text(stack.components({"verl": "0.9.1"}.get))
    assert text is not None and "torch not installed (it comes with verl)" in text


def _runner(args: list[str], *, pythonpath: str = "") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP"))}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run(
        [sys.executable, "-m", "skipinject", *args], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT
    )


def _fake_distribution(site: Path, name: str, version: str) -> None:
    """What an installer leaves for ``name`` (the metadata only): ``importlib.metadata`` finds it first."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_runner_warns_once_at_start_of_a_run_in_an_untested_environment(tmp_path: Path) -> None:
    args = [
        "-c",
        "print('ran')",
        "skip.rollout.enable=True",
        "skip.rollout.steps=[1]",
        f"skip.rollout.dump_dir={tmp_path}",
    ]
    as_tested = _runner(args)
    assert as_tested.returncode == 0 and as_tested.stdout == "ran\n", as_tested.stderr
    assert WARNING not in as_tested.stderr

    _fake_distribution(tmp_path / "site", "torch", "2.5.1")
    untested = _runner(args, pythonpath=str(tmp_path / "site"))
    assert untested.returncode == 0 and untested.stdout == "ran\n", untested.stderr  # the program still runs
    lines = [line for line in untested.stderr.splitlines() if WARNING in line]
    assert len(lines) == 1 and "torch 2.5.1" in lines[0], untested.stderr
    assert lines[0].startswith("skipinject WARNING: "), "on the skipinject logger"


def test_version_prints_core_api_each_plugin_and_the_stack() -> None:
    proc = _runner(["--version"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"skipinject {__version__} (plugin API {API_VERSION[0]}.{API_VERSION[1]})"
    plugins = {line.split()[1]: line.split(None, 2)[2] for line in lines if line.startswith("plugin ")}
    for name in BUILT_IN:  # shipped inside the core's wheel, found through its entry points
        assert plugins[name] == f"skipinject {__version__} (built in)", proc.stdout
    for name, dist in (("reward", "skipinject-reward"), ("advantage", "skipinject-advantage")):
        if name in plugins:  # distributions of their own, installed by the set-up
            assert plugins[name] == f"{dist} {__version__}", proc.stdout
    stack_line = lines[-1]
    for name in STACK:
        assert re.search(rf"\b{name} (\S+|\(not installed\))", stack_line), stack_line
