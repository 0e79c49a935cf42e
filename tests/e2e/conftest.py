"""Shared fixtures of the end-to-end runs: the CPU harness and its tiny local assets, and the
fixtures several test modules share (each costs minutes, so it is built once per session):

* :func:`installed_env`: the release wheels installed, with the documented command, into a fresh
  virtual environment that already holds real verl (``test_install.py`` checks the installation);
* :func:`v0_runs`: the V0 ``main_ppo`` pair (run 1 misses and caches, run 2 hits) of the rollout,
  advantage and reward roles, run by that environment's python -- so the pair is at once the
  installed wheels' real run (``test_install.py``), the V0 roles' proof (``test_rollout_e2e.py``,
  run 2's rollout ``repeat`` with validation included, scored by another reward) and the recording
  the V0 ``match`` run is served from;
* :func:`async_recording`: run 1 of the fully async trainer (``match`` on an empty cache: it records
  like ``cache``; the ``reward`` role records the trainer's steps 1 and 2 beside it), which the fully
  async ``cache`` run and ``match`` run are served from.

A test that serves a later run from a shared recording copies its dump dir first
(:func:`copy_dump`): no test sees what another test's run wrote.

The environments of the older verls the session's matrix tests need are built in the background
from the start of the session (pip, mostly one core, beside the runs before them, which mostly use
one core too): the matrix fixture's own build then waits for it and finds it done.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.verl_matrix import ledger

HARNESS_DIR = ROOT / "examples" / "verl_cpu"
if str(HARNESS_DIR) not in sys.path:
    sys.path.insert(0, str(HARNESS_DIR))

import harness  # noqa: E402

_BACKGROUND_BUILDS: list[subprocess.Popen[bytes]] = []


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start building the environments of the older verls the chosen matrix tests need."""
    from tests.verl_matrix import envs
    from tests.verl_matrix.pairs import Pair

    versions = set()
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or item.get_closest_marker("skip"):
            continue
        versions.update(p.version for p in callspec.params.values() if isinstance(p, Pair))
    for version in sorted(versions):
        if envs.is_built(version):
            continue
        log = session.config.rootpath / ".venvs" / f"verl-{version}.build.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            command = [sys.executable, str(Path(envs.__file__)), version]
            _BACKGROUND_BUILDS.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT))


_MATRIX_RUNS = ledger.Ledger()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each older-verl pair's outcome, for tests/verl_matrix/results.json."""
    _MATRIX_RUNS.add(report.nodeid, report.when, report.outcome, report.duration)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for build in _BACKGROUND_BUILDS:
        build.wait()
    from benchmarks.results import commit

    _MATRIX_RUNS.write(commit())


SKIPINJECT_MAIN_PPO = (sys.executable, "-m", "skipinject", "-m", "verl.trainer.main_ppo")
SKIPINJECT_FULLY_ASYNC = (
    sys.executable,
    "-m",
    "skipinject",
    "-m",
    "verl.experimental.fully_async_policy.fully_async_main",
)


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return harness.build_assets(tmp_path_factory.mktemp("verl_cpu_assets"))


def skip_lines(proc: Any, role: str) -> list[str]:
    """skipinject's decision lines for ``role`` from a run's output (Ray forwards worker logs)."""
    return [
        line.split("skipinject ", 1)[1]
        for line in (proc.stdout + proc.stderr).splitlines()
        if "skipinject " in line and f" {role} step " in line
    ]


def copy_dump(dump: Path, target: Path) -> Path:
    """A private copy of a shared recording's dump dir (modes and times kept) for a run that may write."""
    shutil.copytree(dump, target, symlinks=True)
    return target


def launch(
    assets: Any, tmp: Path, name: str, overrides: list[str], *, fully_async: bool = False, timeout: float = 900
) -> tuple[Any, list[dict]]:
    """One run under ``python -m skipinject`` (this set-up's install): rc 0 asserted, output kept in
    ``tmp/{name}.stdout.txt`` / ``.stderr.txt``; returns it and its generation records."""
    gen_log = tmp / f"{name}.gen.jsonl"
    run = harness.run_fully_async if fully_async else harness.run_main_ppo
    launcher = SKIPINJECT_FULLY_ASYNC if fully_async else SKIPINJECT_MAIN_PPO
    proc = run(
        assets, overrides, gen_log=gen_log, launcher=launcher, timeout=timeout, env_extra={"RAY_DEDUP_LOGS": "0"}
    )
    (tmp / f"{name}.stdout.txt").write_text(proc.stdout)
    (tmp / f"{name}.stderr.txt").write_text(proc.stderr)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc, harness.generate_calls(gen_log)


def rollout_records(directory: Path) -> dict[int, list[dict]]:
    """verl's own per-step generation dumps (``trainer.rollout_data_dir``): step -> records."""
    return {
        int(path.stem): [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for path in sorted(directory.glob("*.jsonl"))
    }


#: Another reward function than the harness's (which scores ``min(len / 40, 1)``, in [0, 1]): a run
#: replaying a recording with it must train on these scores of the served responses
#: (``skip.<role>.rescore``). A digest of the answer's words, in [-2, -1): no score of the harness's
#: reward is one of it, two different answers (nearly) never score alike (so group filtering, which
#: drops groups of equal scores, drops none), and each is exact in float32.
OTHER_REWARD = '''"""Toy reward: a digest of the answer's words, in [-2, -1)."""
import hashlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    words = " ".join(solution_str.split()).encode()
    return -1.0 - int(hashlib.sha256(words).hexdigest()[:4], 16) / 65536
'''
#: The file :data:`OTHER_REWARD` is written to (lines naming the reward name it).
OTHER_REWARD_FILE = "other_reward.py"


def other_reward(tmp: Path) -> list[str]:
    """The override making a run score with :data:`OTHER_REWARD` (a file written under ``tmp``)."""
    path = tmp / OTHER_REWARD_FILE
    path.write_text(OTHER_REWARD)
    return [f"reward.custom_reward_function.path={path}"]


def other_score(text: str) -> float:
    """:data:`OTHER_REWARD`'s score of an answer (as verl dumps it: the decoded response)."""
    words = " ".join(text.split()).encode()
    return -1.0 - int(hashlib.sha256(words).hexdigest()[:4], 16) / 65536


# -- the installed environment ------------------------------------------------------------

#: The user-added roles of the V0 pair: distributions of their own (``plugins/advantage``, ``plugins/reward``).
USER_ROLES = ("advantage", "reward")
#: The third-party role ``test_install.py`` installs beside the built-in ones: (role, distribution).
THIRD_PARTY = ("advantage", "skipinject-advantage")


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


@dataclass
class InstalledEnv:
    """The environment and what each step of installing into it showed (``test_install.py`` checks them)."""

    env: VerlEnv
    verl_first: bool
    skipinject_absent: bool
    core_installed: list[str]
    plugin_installed: list[str]
    listing_core: subprocess.CompletedProcess[str]
    listing_both: subprocess.CompletedProcess[str]
    versions: str
    where: str
    reward_installed: list[str]


@pytest.fixture(scope="session")
def installed_env(tmp_path_factory: pytest.TempPathFactory) -> InstalledEnv:
    """A new venv (no pip, no packages of its own) whose site-packages reaches the set-up's installed
    lock through one site directory of links, every skipinject distribution left out; then
    ``skipinject``, ``skipinject-advantage`` and ``skipinject-reward`` installed into it from the
    release wheels, one at a time, with ``pip install --no-index --find-links``."""
    from tests.integration.release import build_release

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
    verl_env = VerlEnv(python, site, wheels, env)

    cwd = tmp_path_factory.mktemp("install-cwd")
    verl_first = verl_env.run("-c", "import verl, torch, ray, tensordict", cwd=cwd).returncode == 0
    skipinject_absent = verl_env.run("-c", "import skipinject", cwd=cwd).returncode != 0
    core_installed = verl_env.pip_install("skipinject", cwd)
    listing_core = verl_env.run("-m", "skipinject", "--list", cwd=cwd)
    plugin_installed = verl_env.pip_install(THIRD_PARTY[1], cwd)  # a third-party role, installed beside it
    listing_both = verl_env.run("-m", "skipinject", "--list", cwd=cwd)
    versions = verl_env.run("-m", "skipinject", "--version", cwd=cwd).stdout
    code = "import skipinject, skipinject_rollout, skipinject_advantage as a; print(skipinject.__file__, a.__file__)"
    where = verl_env.run("-c", code, cwd=cwd).stdout
    reward_installed = verl_env.pip_install("skipinject-reward", cwd)  # the V0 pair's second user role
    return InstalledEnv(
        verl_env,
        verl_first,
        skipinject_absent,
        core_installed,
        plugin_installed,
        listing_core,
        listing_both,
        versions,
        where,
        reward_installed,
    )


# -- the V0 pair --------------------------------------------------------------------------


def v0_overrides(assets: Any, tmp: Path, dump: Path, run: str, steps: int, *extra: str) -> list[str]:
    return harness.main_ppo_overrides(
        assets,
        use_v1=False,
        total_steps=steps,
        dump_dir=dump,
        extra=["skip.rollout.enable=True", f"trainer.rollout_data_dir={tmp / run}", *extra],
    )


@dataclass
class V0Runs:
    tmp: Path
    dump: Path
    first: Any
    second: Any
    #: Sequences each run generated for training (run 2: every step served, so none).
    calls: tuple[int, int]
    #: Sequences run 2's validation before training generated (run 1 does not validate).
    validation: int


#: Run 2 of the V0 pair: steps 1-3 chosen with ``action=repeat`` (steps 1 and 2 are served as
#: cached, step 3 is served step 2), and validation before training, which is never served. It
#: scores with another reward function (:func:`other_reward`): the served rollouts are re-scored by
#: it; at steps 1-2 the reward role then serves run 1's reward, which wins (its order).
V0_RUN_2 = ("skip.rollout.steps=[1,2,3]", "skip.rollout.action=repeat", "trainer.val_before_train=True")


@pytest.fixture(scope="session")
def v0_runs(assets: Any, installed_env: InstalledEnv, tmp_path_factory: pytest.TempPathFactory) -> V0Runs:
    """Two runs into one dump_dir with rollout, advantage and reward on at steps 1 and 2, launched by
    the installed environment's ``python -m skipinject -m verl.trainer.main_ppo``: run 1 trains 2
    steps; run 2 trains 3 with the rollout role's ``repeat`` and another reward (:data:`V0_RUN_2`)."""
    tmp = tmp_path_factory.mktemp("v0")
    dump = tmp / "dump"
    users = [f"skip.{role}.{key}" for role in USER_ROLES for key in ("enable=True", "steps=[1,2]")]
    users += [f"skip.{role}.dump_dir={dump}" for role in USER_ROLES]
    launcher = (str(installed_env.env.python), "-m", "skipinject", "-m", "verl.trainer.main_ppo")
    env_extra = {"RAY_DEDUP_LOGS": "0", "PYTHONPATH": str(harness.HERE)}  # the CPU shim only, not this tree
    procs, records = [], []
    runs = (("run1", 2, ("skip.rollout.steps=[1,2]",)), ("run2", 3, (*V0_RUN_2, *other_reward(tmp))))
    for run, steps, extra in runs:
        gen_log = tmp / f"{run}.gen.jsonl"
        overrides = v0_overrides(assets, tmp, dump, run, steps, *extra, *users)
        proc = harness.run_main_ppo(
            assets, overrides, gen_log=gen_log, launcher=launcher, timeout=900, env_extra=env_extra
        )
        (tmp / f"{run}.stdout.txt").write_text(proc.stdout)
        (tmp / f"{run}.stderr.txt").write_text(proc.stderr)
        assert proc.returncode == 0, f"{run} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        procs.append(proc)
        records.append(harness.generate_calls(gen_log))
    # Run 1 does not validate: its generations are training's. Run 2's validation generates before any
    # training step (weights of step 0) prompts of the validation set, none of which training saw.
    trained = {record["prompt"] for record in records[0]}
    validation = [r for r in records[1] if int(r["global_steps"]) == 0 and r["prompt"] not in trained]
    calls = [sum(int(r.get("n_sequences", 1)) for r in run) for run in records]
    validated = sum(int(r.get("n_sequences", 1)) for r in validation)
    return V0Runs(tmp, dump, procs[0], procs[1], (calls[0], calls[1] - validated), validated)


# -- the fully async recording ------------------------------------------------------------

#: Prompts the fully async runs feed, one at a time (each a chosen step: feed index 1-4).
ASYNC_PROMPTS = 4


def async_reward(dump: Path) -> list[str]:
    """The ``reward`` role beside ``async_rollout``: the fully async trainer's steps 1 and 2 (4 prompts,
    2 per step), in the same dump dir."""
    return ["skip.reward.enable=True", "skip.reward.steps=[1,2]", f"skip.reward.dump_dir={dump}"]


def async_overrides(assets: Any, dump: Path, *extra: str) -> list[str]:
    """The fully async runs: 4 prompts fed one at a time, all chosen, two trainer steps."""
    return harness.fully_async_overrides(
        assets,
        total_rollout_steps=ASYNC_PROMPTS,
        dump_dir=dump,
        extra=["skip.async_rollout.enable=True", f"skip.async_rollout.steps=[1-{ASYNC_PROMPTS}]", *extra],
    )


@dataclass
class AsyncRecording:
    tmp: Path
    dump: Path
    first: Any
    generated: list[dict]


@pytest.fixture(scope="session")
def async_recording(assets: Any, tmp_path_factory: pytest.TempPathFactory) -> AsyncRecording:
    """Run 1 of the fully async trainer with ``action=match`` and nothing cached: every feed index
    generates and is saved as ``cache`` saves it (row keys included). The ``reward`` role, enabled
    beside it, records the trainer's reward of steps 1 and 2 (``extract_reward``, which the trainer
    imports from ``verl.trainer.ppo.reward``; its Ray actor classes pickled with the role's patches)."""
    tmp = tmp_path_factory.mktemp("async")
    dump = tmp / "dump"
    overrides = async_overrides(assets, dump, "skip.async_rollout.action=match", *async_reward(dump))
    first, generated = launch(assets, tmp, "async1", overrides, fully_async=True)
    return AsyncRecording(tmp, dump, first, generated)
