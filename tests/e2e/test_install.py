"""Installed as a verl user installs it: the release wheels, with the documented command, into a
fresh virtual environment that already holds real verl -- then ``--list`` and a real ``main_ppo``
pair under ``python -m skipinject`` (miss, then hit) for a built-in role and third-party ones.

The environment (:func:`tests.e2e.conftest.installed_env`): a new venv (no pip, no packages of its
own) whose site-packages reaches the set-up's installed lock (verl 0.9.1, torch, Ray, tensordict, ...)
through one site directory of links, with every skipinject distribution of the set-up left out. So
verl is there before skipinject, exactly as in a user's GPU environment, nothing is downloaded, and
``pip install --no-index`` proves that the install fetches, upgrades and replaces nothing: it installs
skipinject alone. The pair is the session's V0 pair (:func:`tests.e2e.conftest.v0_runs`), which
runs in this environment: rollout (built in) with the advantage and reward roles (installed beside it).
"""

from __future__ import annotations

import pytest

from skipinject import __version__
from tests.e2e.conftest import THIRD_PARTY, InstalledEnv, V0Runs, harness, skip_lines

pytestmark = pytest.mark.e2e

BUILT_IN = ("rollout", "async_rollout", "rollout_tq")
UNTESTED = "outside the versions skipinject is tested with"


def _listing(proc) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert UNTESTED not in proc.stderr
    return proc.stdout


def _plugin_blocks(listing: str) -> dict[str, list[str]]:
    blocks: dict[str, list[str]] = {}
    current: list[str] = []
    for line in listing.splitlines():
        if line.startswith("plugin "):
            current = blocks.setdefault(line.split()[1], [line])
        elif current:
            current.append(line)
    return blocks


def _all_resolve(block: list[str]) -> None:
    states = [line.rsplit("[", 1)[1].rstrip("]") for line in block if line.strip().startswith(("target", "clock"))]
    assert states and "ok" in states, block
    assert set(states) <= {"ok", "not for this verl"}, block


def test_the_documented_command_installs_skipinject_alone(installed_env: InstalledEnv) -> None:
    """The stack (torch, verl, ray, tensordict) and every other requirement is the environment's: untouched."""
    installed = installed_env
    assert installed.verl_first, "verl is there first"
    assert installed.skipinject_absent, "and skipinject is not"
    assert installed.core_installed == [f"skipinject-{__version__}"]
    assert installed.plugin_installed == [f"skipinject-advantage-{__version__}"]
    assert installed.reward_installed == [f"skipinject-reward-{__version__}"]
    site = str(installed.env.site)
    assert installed.where.split()[0].startswith(site) and installed.where.split()[1].startswith(site), installed.where


def test_list_shows_every_built_in_role_ok_with_no_second_command(installed_env: InstalledEnv) -> None:
    listing = _listing(installed_env.listing_core)
    blocks = _plugin_blocks(listing)
    assert set(blocks) == set(BUILT_IN), listing
    for name in BUILT_IN:
        assert blocks[name][0] == f"plugin {name} (skipinject {__version__})"
        _all_resolve(blocks[name])
    assert "FAILED" not in listing


def test_list_shows_the_third_party_role_beside_them(installed_env: InstalledEnv) -> None:
    installed = installed_env
    listing = _listing(installed.listing_both)
    blocks = _plugin_blocks(listing)
    assert set(blocks) == {*BUILT_IN, THIRD_PARTY[0]}, listing
    assert blocks[THIRD_PARTY[0]][0] == f"plugin {THIRD_PARTY[0]} ({THIRD_PARTY[1]} {__version__})"
    _all_resolve(blocks[THIRD_PARTY[0]])
    assert f"plugin rollout        skipinject {__version__} (built in)" in installed.versions, installed.versions
    assert f"plugin advantage      skipinject-advantage {__version__}" in installed.versions, installed.versions


def test_a_real_verl_run_misses_then_hits_for_the_built_in_and_the_third_party_roles(
    installed_env: InstalledEnv, v0_runs: V0Runs
) -> None:
    first, second = v0_runs.first, v0_runs.second
    assert first.args[0] == str(installed_env.env.python), "the pair runs in the installed environment"
    for proc in (first, second):
        assert UNTESTED not in proc.stdout + proc.stderr, "the lock's stack is the tested one: no warning"
    assert v0_runs.calls[0] > 0 and v0_runs.calls[1] == 0, v0_runs.calls
    layout = harness.cache_dir(v0_runs.dump)
    for role_dir in (layout, layout / "advantage", layout / "reward"):
        assert (role_dir / "1" / "meta.json").is_file(), role_dir
    for role in ("rollout", "advantage", "reward"):
        assert any(f"{role} step 1: miss" in line for line in skip_lines(first, role)), skip_lines(first, role)
        hits = skip_lines(second, role)
        assert any(f"{role} step 1: hit, served step 1" in line for line in hits), hits
        assert not any(": miss" in line for line in hits), hits
