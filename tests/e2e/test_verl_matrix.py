"""skipinject on the verls that lack SkipManager: real ``python -m skipinject -m verl.trainer.main_ppo``
V0 GRPO runs on CPU, in an environment of their own per verl version (built from
``requirements/verl-<version>.txt`` by ``tests/verl_matrix/envs.py``).

For each older verl, one pair of runs into one dump_dir proves, at once:

* ``--list`` resolves every target meant for that verl and marks the others ``[not for this verl]``;
* ``skip.rollout`` (steps 1-2): run 1 generates and caches, run 2 makes 0 generator calls;
* ``skip.reward`` and ``skip.advantage``: miss then hit, and run 2 trains on run 1's statistics;
* verl's own built-in of that version (``RolloutSkip``) is enabled in both runs as well: exactly one
  mechanism acts -- skipinject warns once and verl's RolloutSkip writes (and loads) nothing.

Which versions run: ``SKIPINJECT_VERL_MATRIX`` (comma list, e.g. ``0.8.0,0.7.1``; ``all``; ``none``),
default :data:`DEFAULT_VERSIONS` -- see ``docs/verl-versions.md`` for the CI choice. Building an
environment takes about 2.5 minutes the first time (then it is reused while its lock is unchanged).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.e2e.conftest import harness, skip_lines
from tests.e2e.test_rollout_e2e import USER_ROLES, trained_metrics
from tests.verl_matrix import envs

pytestmark = [pytest.mark.e2e, pytest.mark.verl_matrix]

OLDER = ("0.8.0", "0.7.1", "0.6.1")
#: Run by ``make test`` (and so in CI) unless SKIPINJECT_VERL_MATRIX says otherwise.
DEFAULT_VERSIONS = ("0.8.0",)
BUILTIN_WARNING = "verl's built-in rollout skip is enabled and skipinject's rollout role is on"


def selected_versions() -> tuple[str, ...]:
    wanted = os.environ.get("SKIPINJECT_VERL_MATRIX", "").strip()
    if not wanted:
        return DEFAULT_VERSIONS
    if wanted == "all":
        return OLDER
    if wanted == "none":
        return ()
    return tuple(v.strip() for v in wanted.split(",") if v.strip())


def _params() -> list[Any]:
    chosen = selected_versions()
    return [
        pytest.param(v, marks=() if v in chosen else pytest.mark.skip(reason=f"verl {v} not in SKIPINJECT_VERL_MATRIX"))
        for v in OLDER
    ]


def builtin_overrides(version: str, dump: Path) -> list[str]:
    """verl's own rollout skip of ``version``, on for steps 1-2 (its settings moved in 0.8)."""
    if harness._release(version) >= (0, 8):
        return [
            "actor_rollout_ref.rollout.skip.enable=True",
            f"actor_rollout_ref.rollout.skip.dump_dir={dump}",
            "actor_rollout_ref.rollout.skip.max_dump_step=2",
        ]
    return ["actor_rollout_ref.rollout.skip_rollout=True", f"actor_rollout_ref.rollout.skip_dump_dir={dump}"]


@dataclass
class MatrixRuns:
    version: str
    python: Path
    tmp: Path
    dump: Path
    builtin_dump: Path
    listing: str
    first: Any
    second: Any
    calls: tuple[int, int]


def assets_for(python: Path, root: Path) -> Any:
    """The harness assets built by the env's own transformers (0.6's transformers 4 cannot read 5's files)."""
    code = "import sys; from pathlib import Path; import harness; harness.build_assets(Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(harness.HERE), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run([str(python), "-c", code, str(root)], check=True, env=env, timeout=300, capture_output=True)
    return harness.build_assets(root)  # already current: returns the paths without rebuilding


@pytest.fixture(scope="module", params=_params())
def matrix(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> MatrixRuns:
    version = request.param
    python = envs.build(version)
    assert harness.verl_version(python) == version
    tmp = tmp_path_factory.mktemp(f"verl-{version}")
    assets = assets_for(python, tmp / "assets")
    dump, builtin_dump = tmp / "dump", tmp / "builtin"
    listing = subprocess.run(
        [str(python), "-m", "skipinject", "--list"], capture_output=True, text=True, cwd=tmp, timeout=300
    )
    assert listing.returncode == 0, listing.stderr[-3000:]
    users = [f"skip.{role}.{key}" for role in USER_ROLES for key in ("enable=True", "steps=[1,2]")]
    users += [f"skip.{role}.dump_dir={dump}" for role in USER_ROLES]
    overrides = harness.main_ppo_overrides(
        assets,
        use_v1=False,
        total_steps=2,
        dump_dir=dump,
        verl=version,
        extra=[
            "skip.rollout.enable=True",
            "skip.rollout.steps=[1,2]",
            *users,
            *builtin_overrides(version, builtin_dump),
        ],
    )
    launcher = (str(python), "-m", "skipinject", "-m", "verl.trainer.main_ppo")
    procs, calls = [], []
    for run in ("run1", "run2"):
        gen_log = tmp / f"{run}.gen.jsonl"
        proc = harness.run_main_ppo(
            assets,
            overrides,
            gen_log=gen_log,
            launcher=launcher,
            timeout=900,
            env_extra={"RAY_DEDUP_LOGS": "0"},
        )
        (tmp / f"{run}.stdout.txt").write_text(proc.stdout)
        (tmp / f"{run}.stderr.txt").write_text(proc.stderr)
        assert proc.returncode == 0, f"verl {version} {run} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        assert harness.count_server_starts(gen_log) > 0, "the generation log is wired"
        procs.append(proc)
        calls.append(harness.count_generate_calls(gen_log))
    return MatrixRuns(version, python, tmp, dump, builtin_dump, listing.stdout, procs[0], procs[1], tuple(calls))


def _target_states(listing: str) -> dict[str, str]:
    states = {}
    for line in listing.splitlines():
        parts = line.split()
        if parts and parts[0] in ("target", "clock"):
            states[parts[1]] = line.rsplit("[", 1)[-1].rstrip("]")
    return states


def test_list_resolves_every_role_meant_for_this_verl(matrix: MatrixRuns):
    states = _target_states(matrix.listing)
    assert f"verl: {matrix.version}" in matrix.listing
    release = harness._release(matrix.version)
    wanted = {
        "verl.experimental.agent_loop.agent_loop:AgentLoopManager.generate_sequences": "ok",
        "verl.utils.rollout_skip:RolloutSkip.wrap_generate_sequences": "ok",
        "verl.trainer.ppo.ray_trainer:RayPPOTrainer.fit": "ok",
        "verl.trainer.ppo.ray_trainer:compute_advantage": "ok",
        "verl.trainer.ppo.ray_trainer:extract_reward": "ok" if release >= (0, 7, 1) else "not for this verl",
        "verl.trainer.ppo.ray_trainer:compute_reward": "not for this verl" if release >= (0, 7, 1) else "ok",
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._add_batch_to_generate": "not for this verl",
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.sample": "not for this verl",
        "verl.experimental.fully_async_policy.fully_async_rollouter:"
        "FullyAsyncAgentLoopManager.generate_sequences_single": "ok" if release >= (0, 8) else "not for this verl",
    }
    assert {path: states.get(path) for path in wanted} == wanted
    assert not [line for line in matrix.listing.splitlines() if "[missing" in line], matrix.listing
    # The V1 trainer's fit is no clock on a verl without it (nothing listed as missing).
    assert "verl.trainer.ppo.v1.trainer_base:PPOTrainer.fit" not in states


def test_rollout_cache_then_hit(matrix: MatrixRuns):
    layout = harness.cache_dir(matrix.dump)
    assert matrix.calls[0] > 0
    assert sorted(p.name for p in layout.iterdir() if p.name.isdigit()) == ["1", "2"]
    assert all((layout / s / "meta.json").is_file() for s in ("1", "2"))
    lines = skip_lines(matrix.first, "rollout")
    assert any("rollout step 1: miss" in line for line in lines), lines
    assert matrix.calls[1] == 0, "run 2 is served from the cache: no generator call"
    lines = skip_lines(matrix.second, "rollout")
    assert sum("hit, served step" in line for line in lines) == 2, lines


def test_user_roles_cache_then_hit_with_the_same_statistics(matrix: MatrixRuns):
    layout = harness.cache_dir(matrix.dump)
    for role in USER_ROLES:
        assert sorted(p.name for p in (layout / role).iterdir()) == ["1", "2"], role
        lines = skip_lines(matrix.first, role)
        assert sum(f"{role} step {s}: miss" in line for line in lines for s in (1, 2)) == 2, lines
        lines = skip_lines(matrix.second, role)
        hits = [line for line in lines if "hit, served step" in line]
        assert len(hits) == 2 and not any(": miss" in line for line in lines), lines
    one, two = trained_metrics(matrix.first), trained_metrics(matrix.second)
    assert len(one) == len(two) == 2
    assert one == two


def test_builtin_enabled_too_exactly_one_mechanism_acts(matrix: MatrixRuns):
    for proc in (matrix.first, matrix.second):
        output = proc.stdout + proc.stderr
        assert output.count(BUILTIN_WARNING) == 1, "one warning per run"
        assert "Successfully patched" not in output, "verl's RolloutSkip never wrapped the rollout"
    written = [p for p in matrix.builtin_dump.rglob("*") if p.is_file()] if matrix.builtin_dump.exists() else []
    assert written == [], f"verl's RolloutSkip wrote {written}"
    assert not list(matrix.dump.rglob("genstep_*")) and not list(matrix.dump.rglob("gen_batch.dp"))


def test_env_tool_is_idempotent(matrix: MatrixRuns):
    """A second build of an up-to-date environment does nothing (the stamp matches the lock)."""
    assert envs.is_built(matrix.version)
    assert envs.build(matrix.version) == matrix.python
    assert (ROOT / "requirements" / f"verl-{matrix.version}.txt").is_file()
