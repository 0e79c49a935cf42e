"""Installed as a verl user installs it: the release wheels, with the documented command, into a
fresh virtual environment that already holds real verl -- then ``--list`` and one real ``main_ppo``
pair under ``python -m skipinject`` (miss, then hit) for a built-in role and a third-party one.

The environment: a new venv (no pip, no packages of its own) whose site-packages reaches the set-up's
installed lock (verl 0.9.1, torch, Ray, tensordict, ...) through one site directory of links, with
every skipinject distribution of the set-up left out. So verl is there before skipinject, exactly as
in a user's GPU environment, nothing is downloaded, and ``pip install --no-index`` proves that the
install fetches, upgrades and replaces nothing: it installs skipinject alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from skipinject import __version__
from tests.e2e.conftest import harness, skip_lines
from tests.integration.release import build_release

pytestmark = pytest.mark.e2e

BUILT_IN = ("rollout", "async_rollout", "rollout_tq")
THIRD_PARTY = ("advantage", "skipinject-advantage")
UNTESTED = "outside the versions skipinject is tested with"


@dataclass
class VerlEnv:
    python: Path
    site: Path
    wheels: Path
    env: dict[str, str]

    def run(self, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.python), *args], cwd=cwd, env=self.env, capture_output=True, text=True, timeout=600
        )

    def pip_install(self, name: str, cwd: Path) -> list[str]:
        """The README's command, ``pip install --find-links DIR NAME``, offline: what it installed."""
        proc = self.run("-m", "pip", "install", "--no-index", "--find-links", str(self.wheels), name, cwd=cwd)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        [line] = [line for line in proc.stdout.splitlines() if line.startswith("Successfully installed ")]
        return line.split()[2:]


def _linked_site(target: Path) -> Path:
    """The set-up's site-packages without skipinject: one link per entry (its .pth files kept)."""
    source = Path(sysconfig.get_paths()["purelib"])
    target.mkdir()
    for entry in source.iterdir():
        if "skipinject" not in entry.name.lower():
            (target / entry.name).symlink_to(entry)
    return target


@pytest.fixture(scope="module")
def verl_env(tmp_path_factory: pytest.TempPathFactory) -> VerlEnv:
    tmp = tmp_path_factory.mktemp("install")
    wheels = tmp / "dist"
    build_release(wheels)
    venv = tmp / "verl-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    linked = _linked_site(tmp / "verl-site")
    (site / "_verl_environment.pth").write_text(f"import site; site.addsitedir({str(linked)!r})\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP", "PYTHON"))}
    env.pop("VIRTUAL_ENV", None)
    return VerlEnv(python, site, wheels, env)


def _listing(verl_env: VerlEnv, cwd: Path) -> str:
    proc = verl_env.run("-m", "skipinject", "--list", cwd=cwd)
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


@dataclass
class InstalledRuns:
    env: VerlEnv
    core_installed: list[str]
    plugin_installed: list[str]
    listing_core: str
    listing_both: str
    versions: str
    where: str
    dump: Path
    procs: list[Any]
    calls: list[int]


@pytest.fixture(scope="module")
def installed(verl_env: VerlEnv, assets: Any, tmp_path_factory: pytest.TempPathFactory) -> InstalledRuns:
    tmp = tmp_path_factory.mktemp("installed-runs")
    assert verl_env.run("-c", "import verl, torch, ray, tensordict", cwd=tmp).returncode == 0, "verl is there first"
    assert verl_env.run("-c", "import skipinject", cwd=tmp).returncode != 0, "and skipinject is not"

    core_installed = verl_env.pip_install("skipinject", tmp)
    listing_core = _listing(verl_env, tmp)
    plugin_installed = verl_env.pip_install(THIRD_PARTY[1], tmp)  # a third-party role, installed beside it
    listing_both = _listing(verl_env, tmp)
    versions = verl_env.run("-m", "skipinject", "--version", cwd=tmp).stdout
    code = "import skipinject, skipinject_rollout, skipinject_advantage as a; print(skipinject.__file__, a.__file__)"
    where = verl_env.run("-c", code, cwd=tmp).stdout

    dump = tmp / "dump"
    overrides = harness.main_ppo_overrides(
        assets,
        use_v1=False,
        total_steps=1,
        dump_dir=dump,
        extra=[
            "skip.rollout.enable=True",
            "skip.rollout.steps=[1]",
            "skip.advantage.enable=True",
            "skip.advantage.steps=[1]",
            f"skip.advantage.dump_dir={dump}",
        ],
    )
    launcher = (str(verl_env.python), "-m", "skipinject", "-m", "verl.trainer.main_ppo")
    env_extra = {"RAY_DEDUP_LOGS": "0", "PYTHONPATH": str(harness.HERE)}  # the CPU shim only, not this tree
    procs, calls = [], []
    for run in ("run1", "run2"):
        gen_log = tmp / f"{run}.gen.jsonl"
        proc = harness.run_main_ppo(
            assets, overrides, gen_log=gen_log, launcher=launcher, timeout=900, env_extra=env_extra
        )
        assert proc.returncode == 0, f"{run} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        procs.append(proc)
        calls.append(harness.count_generate_calls(gen_log))
    return InstalledRuns(
        verl_env, core_installed, plugin_installed, listing_core, listing_both, versions, where, dump, procs, calls
    )


def test_the_documented_command_installs_skipinject_alone(installed: InstalledRuns) -> None:
    """The stack (torch, verl, ray, tensordict) and every other requirement is the environment's: untouched."""
    assert installed.core_installed == [f"skipinject-{__version__}"]
    assert installed.plugin_installed == [f"skipinject-advantage-{__version__}"]
    site = str(installed.env.site)
    assert installed.where.split()[0].startswith(site) and installed.where.split()[1].startswith(site), installed.where


def test_list_shows_every_built_in_role_ok_with_no_second_command(installed: InstalledRuns) -> None:
    blocks = _plugin_blocks(installed.listing_core)
    assert set(blocks) == set(BUILT_IN), installed.listing_core
    for name in BUILT_IN:
        assert blocks[name][0] == f"plugin {name} (skipinject {__version__})"
        _all_resolve(blocks[name])
    assert "FAILED" not in installed.listing_core


def test_list_shows_the_third_party_role_beside_them(installed: InstalledRuns) -> None:
    blocks = _plugin_blocks(installed.listing_both)
    assert set(blocks) == {*BUILT_IN, THIRD_PARTY[0]}, installed.listing_both
    assert blocks[THIRD_PARTY[0]][0] == f"plugin {THIRD_PARTY[0]} ({THIRD_PARTY[1]} {__version__})"
    _all_resolve(blocks[THIRD_PARTY[0]])
    assert f"plugin rollout        skipinject {__version__} (built in)" in installed.versions, installed.versions
    assert f"plugin advantage      skipinject-advantage {__version__}" in installed.versions, installed.versions


def test_a_real_verl_run_misses_then_hits_for_the_built_in_and_the_third_party_role(installed: InstalledRuns) -> None:
    first, second = installed.procs
    for proc in installed.procs:
        assert UNTESTED not in proc.stdout + proc.stderr, "the lock's stack is the tested one: no warning"
    assert installed.calls[0] > 0 and installed.calls[1] == 0, installed.calls
    layout = harness.cache_dir(installed.dump)
    assert (layout / "1" / "meta.json").is_file() and (layout / "advantage" / "1" / "meta.json").is_file()
    for role in ("rollout", "advantage"):
        assert any(f"{role} step 1: miss" in line for line in skip_lines(first, role)), skip_lines(first, role)
        hits = skip_lines(second, role)
        assert any(f"{role} step 1: hit, served step 1" in line for line in hits), hits
        assert not any(": miss" in line for line in hits), hits
