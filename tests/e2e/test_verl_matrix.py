"""skipinject on the verls that lack SkipManager: real ``python -m skipinject -m verl.trainer.main_ppo``
V0 GRPO runs on CPU, in an environment of their own per verl version (built from
``requirements/verl-<version>.txt`` by ``tests/verl_matrix/envs.py``).

For each older verl (and rollout path: verl 0.6 has two), one pair of runs into one dump_dir proves,
at once:

* ``--list`` resolves every target meant for that verl and marks the others ``[not for this verl]``;
* ``skip.rollout`` (steps 1-2): run 1 generates and caches, run 2 makes 0 generator calls;
* ``skip.reward`` and ``skip.advantage``: miss then hit, and run 2 trains on run 1's statistics;
* verl's own built-in of that version (``RolloutSkip``, 0.6-0.8) is enabled in both runs as well:
  exactly one mechanism acts -- skipinject warns once and verl's RolloutSkip writes (and loads) nothing.

The sync worker-group pairs (``actor_rollout_ref.rollout.mode=sync``: 0.6.1-sync, 0.5.0, 0.4.1) also
validate before training: validation generates the same in both runs (never served from the cache).

Pairs of several worker-group calls per step (:data:`CALL_PAIRS`, verl <= 0.6's sync path):
``0.6.1-sync-dapo`` and ``0.5.0-dapo`` run DAPO's recipe loop (``tests/fixtures/recipes/dapo_recipe_wg.py``),
``0.6.1-sync-remax`` REMAX (a sampled and a greedy baseline call per step); run 1 records every call,
run 2 replays them call by call with 0 generator calls. They are chosen by their id only (or ``all``).

Which pairs run: ``SKIPINJECT_VERL_MATRIX`` (comma list of versions, which pick every pair of that
version, or pair ids such as ``0.6.1-sync``; ``all``; ``none``), default :data:`DEFAULT_VERSIONS` --
see ``docs/verl-versions.md`` for the CI choice. Building an environment the first time hard-links
every distribution ``.venv`` holds at the pinned version and pip-installs the rest (0.8.0: 7 of 127
pins; 1-3 minutes on a loaded machine instead of 5-6); then it is reused while its lock is unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIXTURES, ROOT
from tests.e2e.conftest import harness, skip_lines
from tests.e2e.test_dapo_recipe_e2e import REWARD, RecipeLog
from tests.e2e.test_rollout_e2e import USER_ROLES, trained_metrics
from tests.verl_matrix import envs

pytestmark = [pytest.mark.e2e, pytest.mark.verl_matrix]

OLDER = ("0.8.0", "0.7.1", "0.6.1", "0.5.0", "0.4.1")


@dataclass(frozen=True)
class Pair:
    """One pair of runs: a verl version and its ``actor_rollout_ref.rollout.mode`` (None: the harness's)."""

    version: str
    rollout_mode: str | None = None
    #: Another trainer than main_ppo's GRPO (``dapo``: the recipe fixture; ``remax``): chosen by its id only.
    variant: str | None = None

    @property
    def id(self) -> str:
        return "-".join(part for part in (self.version, self.rollout_mode, self.variant) if part)

    @property
    def sync(self) -> bool:
        """Generation through the worker group (verl < 0.6 has only that path on CPU)."""
        return self.rollout_mode == "sync" or harness._release(self.version) < (0, 6)


#: verl 0.6.1 runs twice: through the agent loop (``mode=async``) and through the worker group.
PAIRS = (Pair("0.8.0"), Pair("0.7.1"), Pair("0.6.1"), Pair("0.6.1", "sync"), Pair("0.5.0"), Pair("0.4.1"))
#: Several generation calls per step on the worker-group path: DAPO's recipe loop, REMAX's baseline.
#: verl 0.5.0's REMAX is not among them: it deep-copies the already repeated batch as its baseline
#: batch (n x the prompts) and fails to union it with the prompts when rollout.n > 1 (its own bug).
CALL_PAIRS = (Pair("0.6.1", "sync", "dapo"), Pair("0.5.0", variant="dapo"), Pair("0.6.1", "sync", "remax"))
#: Run by ``make test`` (and so in CI) unless SKIPINJECT_VERL_MATRIX says otherwise.
DEFAULT_VERSIONS = ("0.8.0",)
BUILTIN_WARNING = "verl's built-in rollout skip is enabled and skipinject's rollout role is on"


def selected_versions() -> tuple[str, ...]:
    """Versions and pair ids chosen by SKIPINJECT_VERL_MATRIX."""
    wanted = os.environ.get("SKIPINJECT_VERL_MATRIX", "").strip()
    if not wanted:
        return DEFAULT_VERSIONS
    if wanted == "all":
        return OLDER + tuple(pair.id for pair in CALL_PAIRS)
    if wanted == "none":
        return ()
    return tuple(v.strip() for v in wanted.split(",") if v.strip())


def _params(pairs: tuple[Pair, ...] = PAIRS) -> list[Any]:
    """The pairs as parameters; those SKIPINJECT_VERL_MATRIX does not choose are skipped (a variant by id only)."""
    chosen = selected_versions()
    return [
        pytest.param(
            pair,
            id=pair.id,
            marks=()
            if pair.id in chosen or (pair.version in chosen and pair.variant is None)
            else pytest.mark.skip(reason=f"verl {pair.id} not in SKIPINJECT_VERL_MATRIX"),
        )
        for pair in pairs
    ]


def has_builtin(version: str) -> bool:
    """verl 0.6-0.8 have ``RolloutSkip`` (``verl/utils/rollout_skip.py``); 0.4/0.5 have no built-in."""
    return (0, 6) <= harness._release(version) < (0, 9)


def builtin_overrides(version: str, dump: Path) -> list[str]:
    """verl's own rollout skip of ``version``, on for steps 1-2 (its settings moved in 0.8; none before 0.6)."""
    if not has_builtin(version):
        return []
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
    pair: Pair
    python: Path
    tmp: Path
    dump: Path
    builtin_dump: Path
    listing: str
    first: Any
    second: Any
    calls: tuple[int, int]
    #: Sequences generated by validation in each run (sync pairs validate before training).
    validation_calls: tuple[int, int] = (0, 0)


def assets_for(python: Path, root: Path) -> Any:
    """The harness assets built by the env's own transformers (0.6's transformers 4 cannot read 5's files)."""
    code = "import sys; from pathlib import Path; import harness; harness.build_assets(Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(harness.HERE), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run([str(python), "-c", code, str(root)], check=True, env=env, timeout=300, capture_output=True)
    return harness.build_assets(root)  # already current: returns the paths without rebuilding


def run_twice(
    pair: Pair,
    python: Path,
    assets: Any,
    tmp: Path,
    overrides: list[str],
    *,
    module: str = "verl.trainer.main_ppo",
    run_env: Callable[[str], dict[str, str]] | None = None,
) -> list[tuple[Any, list[dict]]]:
    """Run 1 then run 2 of ``python -m skipinject -m <module>`` (``run_env(run)``: more environment for
    ``run1``/``run2``): each run's process and generation records."""
    launcher = (str(python), "-m", "skipinject", "-m", module)
    runs = []
    for run in ("run1", "run2"):
        gen_log = tmp / f"{run}.gen.jsonl"
        proc = harness.run_main_ppo(
            assets,
            overrides,
            gen_log=gen_log,
            launcher=launcher,
            timeout=900,
            env_extra={"RAY_DEDUP_LOGS": "0", **(run_env(run) if run_env else {})},
        )
        (tmp / f"{run}.stdout.txt").write_text(proc.stdout)
        (tmp / f"{run}.stderr.txt").write_text(proc.stderr)
        assert proc.returncode == 0, f"verl {pair.id} {run} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        assert harness.count_server_starts(gen_log) > 0, "the generation log is wired"
        runs.append((proc, harness.generate_calls(gen_log)))
    return runs


def pair_env(pair: Pair, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """The pair's verl environment (built if needed), a fresh directory and harness assets built by that env."""
    python = envs.build(pair.version)
    assert harness.verl_version(python) == pair.version
    tmp = tmp_path_factory.mktemp(f"verl-{pair.id}")
    return python, tmp, assets_for(python, tmp / "assets")


@pytest.fixture(scope="module", params=_params())
def matrix(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> MatrixRuns:
    pair: Pair = request.param
    version = pair.version
    python, tmp, assets = pair_env(pair, tmp_path_factory)
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
        rollout_mode=pair.rollout_mode,
        extra=[
            "skip.rollout.enable=True",
            "skip.rollout.steps=[1,2]",
            *users,
            *builtin_overrides(version, builtin_dump),
            # The worker group also generates validation: it must run in both runs, never be served.
            *(["trainer.val_before_train=True"] if pair.sync else []),
        ],
    )
    procs, calls, validation = [], [], []
    for proc, records in run_twice(pair, python, assets, tmp, overrides):
        procs.append(proc)
        calls.append(sum(int(r.get("n_sequences", 1)) for r in records if not r.get("validate")))
        validation.append(sum(int(r.get("n_sequences", 1)) for r in records if r.get("validate")))
    return MatrixRuns(
        version,
        pair,
        python,
        tmp,
        dump,
        builtin_dump,
        listing.stdout,
        procs[0],
        procs[1],
        (calls[0], calls[1]),
        (validation[0], validation[1]),
    )


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
        "verl.experimental.agent_loop.agent_loop:AgentLoopManager.generate_sequences": "ok"
        if release >= (0, 5)
        else "not for this verl",
        "verl.trainer.ppo.ray_trainer:RayPPOTrainer.init_workers->actor_rollout_wg.generate_sequences": "ok"
        if release < (0, 7)
        else "not for this verl",
        "verl.utils.rollout_skip:RolloutSkip.wrap_generate_sequences": "ok"
        if has_builtin(matrix.version)
        else "not for this verl",
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
    output = matrix.first.stdout + matrix.first.stderr
    assert "cannot act in this run" not in output, "the rollout role acts on this path: no such warning"


def test_sync_path_validation_is_never_served(matrix: MatrixRuns):
    """The worker group generates validation too: it runs the original in both runs, unchanged."""
    if not matrix.pair.sync:
        pytest.skip(f"verl {matrix.pair.id} generates through the agent loop (validation off in this pair)")
    assert matrix.validation_calls[0] > 0, "validation before training went through the worker group"
    assert matrix.validation_calls[1] == matrix.validation_calls[0]
    assert matrix.calls[0] == harness.TRAIN_BATCH * harness.ROLLOUT_N * 2, "2 steps of 4 prompts x n=2"


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
    if not has_builtin(matrix.version):
        for proc in (matrix.first, matrix.second):
            assert BUILTIN_WARNING not in proc.stdout + proc.stderr
        pytest.skip(f"verl {matrix.version} has no built-in rollout skip: skipinject is the only mechanism")
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


# -- several worker-group calls per step (verl <= 0.6): DAPO's recipe loop, REMAX's baseline -----------


@dataclass
class CallRuns:
    pair: Pair
    dump: Path
    first: Any
    second: Any
    #: Each run's generation records (one per worker-group call) outside validation.
    records: tuple[list[dict], list[dict]]
    #: What the DAPO recipe logged in each run (None for REMAX).
    recipe: tuple[RecipeLog, RecipeLog] | None = None


def _call_pair(pair: Pair, tmp_path_factory: pytest.TempPathFactory, total_steps: int) -> CallRuns:
    python, tmp, assets = pair_env(pair, tmp_path_factory)
    dump = tmp / "dump"
    extra = ["skip.rollout.enable=True", "skip.rollout.steps=[1,2]"]
    module, run_env = "verl.trainer.main_ppo", None
    if pair.variant == "dapo":
        reward = tmp / "dapo_reward.py"
        reward.write_text(REWARD)
        extra.append(f"custom_reward_function.path={reward}")  # top-level before verl 0.7
        module = "dapo_recipe_wg"
        path = os.pathsep.join([harness.harness_env(assets, None)["PYTHONPATH"], str(FIXTURES / "recipes")])

        def run_env(run: str) -> dict[str, str]:
            return {"PYTHONPATH": path, "DAPO_RECIPE_LOG": str(tmp / f"{run}.recipe.jsonl")}
    else:
        extra.append("algorithm.adv_estimator=remax")  # after the harness's grpo: the last value wins
    overrides = harness.main_ppo_overrides(
        assets,
        use_v1=False,
        total_steps=total_steps,
        dump_dir=dump,
        verl=pair.version,
        rollout_mode=pair.rollout_mode,
        extra=extra,
    )
    runs = run_twice(pair, python, assets, tmp, overrides, module=module, run_env=run_env)
    (first, records1), (second, records2) = runs
    recipe = None
    if pair.variant == "dapo":
        recipe = (RecipeLog(tmp / "run1.recipe.jsonl"), RecipeLog(tmp / "run2.recipe.jsonl"))
    training = ([r for r in records1 if not r.get("validate")], [r for r in records2 if not r.get("validate")])
    return CallRuns(pair, dump, first, second, training, recipe)


@pytest.fixture(scope="module", params=_params(tuple(p for p in CALL_PAIRS if p.variant == "dapo")))
def dapo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CallRuns:
    return _call_pair(request.param, tmp_path_factory, total_steps=3)


@pytest.fixture(scope="module", params=_params(tuple(p for p in CALL_PAIRS if p.variant == "remax")))
def remax(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CallRuns:
    return _call_pair(request.param, tmp_path_factory, total_steps=2)


def _sequences(records: list[dict]) -> int:
    return sum(int(r.get("n_sequences", 1)) for r in records)


def test_dapo_recipe_on_the_worker_group_replays_call_by_call(dapo: CallRuns) -> None:
    """verl <= 0.6's DAPO loop: several ``actor_rollout_wg.generate_sequences`` calls per step."""
    assert dapo.recipe is not None
    log1, log2 = dapo.recipe
    per_call = harness.TRAIN_BATCH * harness.ROLLOUT_N
    assert sorted(log1.trained) == [1, 2, 3]
    assert log1.calls(1) + log1.calls(2) > 2, f"no extra batch drawn at steps 1-2 ({log1.drawn}): proves nothing"
    assert len(dapo.records[0]) == sum(map(log1.calls, (1, 2, 3))), "run 1 generates every call, one wg call each"
    assert _sequences(dapo.records[0]) == per_call * sum(map(log1.calls, (1, 2, 3)))
    lines1 = skip_lines(dapo.first, "rollout")
    assert not any(": hit" in line for line in lines1), f"run 1 served a call from its own cache: {lines1}"
    for step in (1, 2):
        meta = json.loads((harness.cache_dir(dapo.dump) / str(step) / "meta.json").read_text())
        assert meta["calls"] == log1.calls(step), f"step {step} records every generation call of run 1"
    for step in (1, 2):
        assert log2.drawn[step] == log1.drawn[step], f"step {step}: run 2 draws the batches run 1 drew"
        assert log2.trained[step] == log1.trained[step], f"step {step}: run 2 trains on run 1's prompts"
        assert log2.digests[step] == log1.digests[step], f"step {step}: run 2 trains on run 1's responses and scores"
    assert log2.drawn[3][0] == log1.drawn[3][0], "after the replayed steps the dataloader is where run 1's was"
    assert len(dapo.records[1]) == log2.calls(3), "0 generator calls at steps 1-2: only step 3 generates"
    hits = [line for line in skip_lines(dapo.second, "rollout") if ": hit" in line]
    assert len(hits) == log1.calls(1) + log1.calls(2), hits
    busiest = max((1, 2), key=log1.calls)
    calls = log1.calls(busiest)
    assert any(f"rollout step {busiest}: hit (call {calls} of {calls})" in line for line in hits), hits


def test_remax_baseline_is_recorded_and_replayed(remax: CallRuns) -> None:
    """REMAX: a sampled call then a greedy baseline call (``do_sample=False``) per step, both replayed."""
    first, second = remax.records
    per_step = [(r.get("do_sample"), int(r["n_sequences"])) for r in first]
    sampled = harness.TRAIN_BATCH * harness.ROLLOUT_N
    assert per_step == [(True, sampled), (False, harness.TRAIN_BATCH)] * 2, per_step
    for step in (1, 2):
        meta = json.loads((harness.cache_dir(remax.dump) / str(step) / "meta.json").read_text())
        assert meta["calls"] == 2, f"step {step} records the sample and the baseline call"
    assert second == [], "run 2 is served from the cache: no generator call, the baseline's neither"
    hits = [line for line in skip_lines(remax.second, "rollout") if ": hit" in line]
    for step in (1, 2):
        assert any(f"rollout step {step}: hit (call 2 of 2)" in line for line in hits), hits
    one, two = trained_metrics(remax.first), trained_metrics(remax.second)
    assert len(one) == len(two) == 2
    assert one == two, "run 2 trains on run 1's samples and baselines"
