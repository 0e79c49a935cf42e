"""Which targets each verl version gets, and the guard against verl < 0.9's built-in ``RolloutSkip``.

No verl needed: version ranges are checked against version strings, and the guard's phase runs
against a stand-in role runtime. The real older verls run in ``tests/e2e/test_verl_matrix.py``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from omegaconf import OmegaConf
from skipinject_advantage.role import ADVANTAGE
from skipinject_reward.role import REWARD
from skipinject_rollout.async_rollout import ASYNC_ROLLOUT
from skipinject_rollout.legacy import BUILTIN_WRAP, BuiltinSkipOff
from skipinject_rollout.rollout import ROLLOUT, cannot_fire
from skipinject_rollout_tq.plugin import make_role

from skipinject.roles import Call
from skipinject.verl.compat import version_matches

#: The CheckpointEngineManager methods the rollout roles watch (verl 0.8's and 0.9's have every one).
MANAGER_METHODS = (
    "update_weights",
    "sleep_replicas",
    "abort_replicas",
    "resume_generation_replicas",
    "wake_up_replicas",
    "release_kv_cache_replicas",
    "resume_kv_cache_replicas",
)
VERSIONS = ("0.4.1", "0.5.0", "0.6.1", "0.7.0", "0.7.1", "0.8.0", "0.9.0", "0.9.1")


def applied(role: Any, version: str) -> set[str]:
    return {t.path.rsplit(":", 1)[1] for t in role.targets if version_matches(t.verl, version)}


@pytest.mark.parametrize("version", VERSIONS)
def test_each_role_targets_what_exists_in_that_verl(version: str):
    release = tuple(int(x) for x in version.split("."))
    rollout = set()
    if release >= (0, 5):  # verl 0.4 has no agent loop (experimental/agent_loop)
        rollout.add("AgentLoopManager.generate_sequences")
    if release < (0, 7):  # the sync worker-group path (actor_rollout_ref.rollout.mode=sync) ends with 0.6
        rollout.add("RayPPOTrainer.init_workers")
    if (0, 6) <= release < (0, 9):  # verl/utils/rollout_skip.py: 0.6 to 0.8
        rollout.add("RolloutSkip.wrap_generate_sequences")
    if release >= (0, 8):  # verl/checkpoint_engine: the weight sync, deferred while a step is served
        rollout |= {f"CheckpointEngineManager.{method}" for method in MANAGER_METHODS}
    assert applied(ROLLOUT, version) == rollout
    assert applied(REWARD, version) == {"extract_reward" if release >= (0, 7, 1) else "compute_reward"}
    assert applied(ADVANTAGE, version) == {"compute_advantage"}
    assert bool(applied(ASYNC_ROLLOUT, version)) == (release >= (0, 8))
    assert bool(applied(make_role(), version)) == (release >= (0, 9))


def test_rollout_guard_is_for_the_older_builtin_only_and_sees_every_call():
    guard = [t for t in ROLLOUT.targets if t.path == BUILTIN_WRAP]
    assert len(guard) == 1 and guard[0].every_step and isinstance(guard[0].phase, BuiltinSkipOff)
    assert guard[0].verl == ">=0.6,<0.9"


def test_dev_build_of_a_newer_verl_counts_as_that_release():
    v1_submit = next(t for t in make_role().targets if t.path.endswith("_add_batch_to_generate"))
    assert version_matches(v1_submit.verl, "0.10.0.dev0")
    assert version_matches(v1_submit.verl, "0.9.2rc1")


@pytest.mark.parametrize("version", ["0.9.0", "0.9.1", "0.9.1.dev0", "0.10.0.dev0"])
def test_rollout_tq_switches_off_the_warm_up_each_v1_verl_has(version: str):
    """verl 0.9.0 has no ``_add_async_warmup_batches``: its async modes submit the warm-up batches in
    ``on_train_begin`` (at step 1, through the submit target); those are switched off there instead, and no
    target that does not exist in the install is patched (no warning that the role will not act)."""
    role = make_role()
    warm_ups = {t.path.rsplit(":", 1)[1]: t for t in role.targets if "warmup" in t.path or "on_train_begin" in t.path}
    on = {name for name, t in warm_ups.items() if version_matches(t.verl, version)}
    if version == "0.9.0":
        assert on == {"PPOTrainerColocateAsync.on_train_begin", "PPOTrainerSeparateAsync.on_train_begin"}
    else:
        assert on == {"PPOTrainer._add_async_warmup_batches"}
    assert all(t.every_step and type(t.phase).__name__ == "WarmupOff" for t in warm_ups.values())


def test_version_ranges_count_a_development_build_as_its_release():
    assert version_matches(">=0.9.1", "0.9.1.dev0") and not version_matches("<0.9.1", "0.9.1.dev0")
    assert version_matches(">=0.9,<0.9.1", "0.9.0") and not version_matches(">=0.9,<0.9.1", "0.9.1rc1")


def test_the_checks_know_the_trainers_that_ignore_use_v1():
    """verl's one-step-off and fully async mains run V0-based trainers while ``trainer.use_v1`` keeps its
    default ``true``: the V0 roles are not said to be off there; the roles those trainers never call are."""
    from skipinject_advantage.role import cannot_fire as advantage_check
    from skipinject_reward.role import cannot_fire as reward_check
    from skipinject_rollout.async_rollout import cannot_fire as async_check
    from skipinject_rollout_tq.plugin import cannot_fire as tq_check

    one_step_off = OmegaConf.create({"trainer": {"use_v1": True}, "rollout": {"nnodes": 1}})
    fully_async = OmegaConf.create({**one_step_off, "async_training": {"trigger_parameter_sync_step": 1}})
    main_ppo_v1 = OmegaConf.create({"trainer": {"use_v1": True}})
    for check in (reward_check, advantage_check):
        assert check(one_step_off) is None and check(fully_async) is None and "use_v1=True" in check(main_ppo_v1)
    assert cannot_fire(one_step_off) is None and "skip.async_rollout" in cannot_fire(fully_async)
    assert "skip.rollout (one-step-off)" in tq_check(one_step_off) and tq_check(main_ppo_v1) is None
    assert async_check(fully_async) is None
    assert "fully_async_main" in async_check(one_step_off) and "fully_async_main" in async_check(main_ppo_v1)


def test_rollout_acts_on_the_sync_worker_group_path():
    """The worker group's own generate_sequences, wrapped on the instance init_workers builds."""
    target = next(t for t in ROLLOUT.targets if t.attribute)
    assert target.path == "verl.trainer.ppo.ray_trainer:RayPPOTrainer.init_workers"
    assert target.attribute == "actor_rollout_wg.generate_sequences"
    assert target.phase is None, "one call = one unit, as the agent loop manager's (the engine's WholeCall)"
    sync = OmegaConf.create({"actor_rollout_ref": {"rollout": {"mode": "sync"}}})
    assert cannot_fire(sync) is None, "no 'cannot act' warning on the sync path any more"
    assert cannot_fire(OmegaConf.create({"actor_rollout_ref": {"rollout": {"mode": "async"}}})) is None
    assert "use_v1=True" in cannot_fire(OmegaConf.create({"trainer": {"use_v1": True}}))


class _Batch:
    def __init__(self, **meta: Any) -> None:
        self.meta_info = meta


def test_rollout_bypasses_validation_only():
    """Validation always runs the original; verl 0.4-0.6's REMAX baseline (meta do_sample=False) is a
    training call like the step's sampled one: recorded and replayed as the step's second call."""

    def runs_original(**meta: Any) -> bool:
        return ROLLOUT.bypass(Call("t", lambda b: b, None, (_Batch(**meta),), {}))

    assert runs_original(validate=True, global_steps=1)
    assert not runs_original(do_sample=False, global_steps=1), "REMAX's baseline is the step's call 2"
    assert not runs_original(global_steps=1), "the step's generation"
    assert not runs_original()


def test_rollout_check_warns_on_verl_04s_async_server_manager(monkeypatch):
    import skipinject_rollout.rollout as rollout

    monkeypatch.setattr(rollout, "installed_verl_matches", lambda spec: version_matches(spec, "0.4.1"))
    reason = cannot_fire(OmegaConf.create({"actor_rollout_ref": {"rollout": {"mode": "async"}}}))
    assert reason and "AsyncLLMServerManager" in reason
    assert cannot_fire(OmegaConf.create({"actor_rollout_ref": {"rollout": {"mode": "sync"}}})) is None


class _Runtime:
    """What the guard's phase uses of a role runtime."""

    def __init__(self) -> None:
        self.role = ROLLOUT
        self.name = ROLLOUT.name
        self._seen: set[Any] = set()

    def once(self, key: Any, level: int, message: str, *args: Any) -> None:
        if key not in self._seen:
            self._seen.add(key)
            logging.getLogger("skipinject").log(level, message, *args)


class _Trainer:
    def __init__(self, **config: Any) -> None:
        self.config = OmegaConf.create({"trainer": {"total_training_steps": 2}, **config})


def _call(trainer: _Trainer) -> Call:
    return Call(BUILTIN_WRAP, lambda: None, trainer, (), {})


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_builtin_rollout_skip_is_not_wrapped_while_the_role_acts(caplog, mode: str):
    runtime, phase, wrapped = _Runtime(), BuiltinSkipOff(cannot_fire), []
    call = _call(_Trainer(actor_rollout_ref={"rollout": {"mode": mode}}))
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        assert phase.run(runtime, call, 0, lambda: wrapped.append(1)) is None
        assert asyncio.run(phase.run_async(runtime, call, 0, lambda: wrapped.append(1))) is None
    assert wrapped == []
    assert sum("RolloutSkip is turned off" in r.getMessage() for r in caplog.records) == 1


def test_builtin_rollout_skip_stays_on_when_the_role_cannot_act(caplog):
    runtime, phase, wrapped = _Runtime(), BuiltinSkipOff(lambda config: "a reason of the role's check"), []
    call = _call(_Trainer(actor_rollout_ref={"rollout": {"mode": "sync"}}))
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        phase.run(runtime, call, 0, lambda: wrapped.append(1))
    assert wrapped == [1], "skipinject cannot act, so the user's built-in still does"
    assert any("left on" in r.getMessage() for r in caplog.records)


def test_harness_overrides_follow_the_launchers_verl(tmp_path):
    import sys

    from tests.conftest import ROOT

    sys.path.insert(0, str(ROOT / "examples" / "verl_cpu"))
    try:
        import harness
    finally:
        sys.path.remove(str(ROOT / "examples" / "verl_cpu"))
    assets = harness._assets_at(tmp_path)

    def keys(version: str) -> set[str]:
        overrides = harness.main_ppo_overrides(assets, use_v1=False, total_steps=2, verl=version)
        return {o.split("=", 1)[0].lstrip("+") for o in overrides}

    assert "trainer.use_v1" in keys("0.9.1") and "trainer.use_v1" in keys("0.10.0.dev0")
    for version in ("0.8.0", "0.7.1", "0.6.1"):
        assert "trainer.use_v1" not in keys(version), version
        with pytest.raises(ValueError, match="no V1 trainer"):
            harness.main_ppo_overrides(assets, use_v1=True, total_steps=2, verl=version)
    assert "reward.custom_reward_function.path" in keys("0.7.1")
    assert "custom_reward_function.path" in keys("0.6.1") and "reward.custom_reward_function.path" not in keys("0.6.1")
    assert "actor_rollout_ref.rollout.mode" in keys("0.6.1") and "actor_rollout_ref.rollout.mode" not in keys("0.7.1")
    sync = harness.main_ppo_overrides(assets, use_v1=False, total_steps=2, verl="0.6.1", rollout_mode="sync")
    assert "actor_rollout_ref.rollout.mode=sync" in sync and "actor_rollout_ref.rollout.mode=async" not in sync
    for version in ("0.5.0", "0.4.1"):  # no agent loop on CPU there (0.4: none at all): the worker group
        overrides = harness.main_ppo_overrides(assets, use_v1=False, total_steps=2, verl=version)
        assert "actor_rollout_ref.rollout.mode=sync" in overrides, version
        assert "ray_init.num_cpus" in keys(version) and "ray_kwargs.ray_init.num_cpus" not in keys(version)
        assert "actor_rollout_ref.actor.fsdp_config.strategy" not in keys(version), "0.4/0.5: actor.strategy only"
    assert "actor_rollout_ref.rollout.agent.num_workers" in keys("0.5.0")
    assert "actor_rollout_ref.rollout.agent.num_workers" not in keys("0.4.1")
    assert "reward.num_workers" in keys("0.9.1") and "reward.num_workers" in keys("0.8.0")
    assert "reward.num_workers" not in keys("0.7.1"), "one reward-loop worker only where the key is verified"
    with pytest.raises(ValueError, match="no sync rollout mode"):
        harness.main_ppo_overrides(assets, use_v1=False, total_steps=2, verl="0.7.1", rollout_mode="sync")
    assert "actor_rollout_ref.actor.fsdp_config.strategy" in keys("0.7.1")
    assert "actor_rollout_ref.actor.fsdp_config.strategy" not in keys("0.8.0")


def test_a_dev_build_of_a_release_counts_as_that_release():
    """verl's neo tree is 0.9.0.dev0: a 0.9 tree for every target range (none of 0.6-0.8's, all of 0.9's)."""
    assert version_matches(">=0.9", "0.9.0.dev0") and version_matches(">=0.5", "0.9.0.dev0")
    assert not version_matches("<0.9", "0.9.0.dev0") and not version_matches(">=0.6,<0.9", "0.9.0.dev0")
    assert version_matches(">=0.9", "0.9.1+local") and not version_matches(">=0.9", "0.8.0")
