"""User-added roles (``plugins/reward``, ``plugins/advantage``): installed, found, chosen, and run on real verl.

Both are separate distributions that only declare a ``skipinject.plugins`` entry point; nothing in
skipinject knows them. The round trips call verl 0.9.1's real ``compute_advantage`` and
``extract_reward`` through the module attribute ``RayPPOTrainer.fit`` looks up, with real GRPO
``DataProto`` batches, the step coming from a real ``RayPPOTrainer`` entering the patched ``fit``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import site
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from skipinject import PluginError, bootstrap
from skipinject.config import Config, apply_overrides, split_overrides
from skipinject.plugins import ENTRY_POINT_GROUP, load_plugins

ROOT = Path(__file__).resolve().parent.parent
USER_PLUGINS = {
    "skipinject-reward": ("reward", "skipinject_reward", ROOT / "plugins" / "reward"),
    "skipinject-advantage": ("advantage", "skipinject_advantage", ROOT / "plugins" / "advantage"),
}
ADVANTAGE_TARGET = "verl.trainer.ppo.ray_trainer:compute_advantage"


def _usable(dist: str, module: str) -> bool:
    import importlib_metadata

    try:
        importlib_metadata.distribution(dist)
    except importlib_metadata.PackageNotFoundError:
        return False
    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="session")
def user_plugins() -> None:
    """pip-install the two plugin distributions (editable) unless they already are."""
    missing = [name for name, (_, module, _) in USER_PLUGINS.items() if not _usable(name, module)]
    if not missing:
        return
    args = [arg for name in missing for arg in ("-e", str(USER_PLUGINS[name][2]))]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", *args],
        check=True,
        capture_output=True,
    )
    # Editable installs work through a .pth file, which Python reads at start-up only.
    for directory in site.getsitepackages():
        site.addsitedir(directory)
    importlib.invalidate_caches()
    still = [name for name, (_, module, _) in USER_PLUGINS.items() if not _usable(name, module)]
    assert not still, f"{still} not importable after pip install"


@pytest.fixture
def skip_log() -> Iterator[list[str]]:
    """Messages of the ``skipinject`` logger (it may not propagate to the root logger)."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger("skipinject")
    handler, level = Collect(logging.DEBUG), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


# ---------------------------------------------------------------- discovery and selection


def test_entry_points_of_both_distributions(user_plugins: None) -> None:
    import importlib_metadata

    found = {ep.name: ep for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert found["reward"].value == "skipinject_reward.role"
    assert found["advantage"].value == "skipinject_advantage.role"
    assert found["reward"].dist.name == "skipinject-reward"
    assert found["advantage"].dist.name == "skipinject-advantage"


def test_load_plugins_finds_them_with_everything_else(user_plugins: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VERL_SKIP_PLUGINS", raising=False)
    plugins = load_plugins()
    by_name = {p.name: p for p in plugins.plugins}
    assert {"reward", "advantage", "rollout"} <= set(by_name)
    assert by_name["reward"].distribution == "skipinject-reward"
    assert [r.name for r in by_name["advantage"].roles] == ["advantage"]
    assert {"reward", "advantage", "rollout"} <= set(plugins.roles)
    assert not plugins.failures


def test_select_only_reward(user_plugins: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_SKIP_PLUGINS", "reward")
    plugins = load_plugins()
    assert [p.name for p in plugins.plugins] == ["reward"]
    assert set(plugins.roles) == {"reward"}


def test_exclude_reward(user_plugins: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_SKIP_PLUGINS", "-reward")
    names = {p.name for p in load_plugins().plugins}
    assert "reward" not in names
    assert {"advantage", "rollout"} <= names


def test_module_path_loads_plugin_without_its_entry_point(user_plugins: None) -> None:
    plugins = load_plugins("skipinject_advantage.role")
    (plugin,) = plugins.plugins
    assert plugin.distribution is None and plugin.source == "skipinject_advantage.role"
    assert set(plugins.roles) == {"advantage"}


def test_module_attr_path(user_plugins: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``module:attr`` naming a plugin object that reuses the installed reward role."""
    (tmp_path / "my_team_roles.py").write_text(
        "from skipinject import hookimpl\n"
        "from skipinject_reward.role import REWARD\n\n"
        "class Team:\n"
        "    @hookimpl\n"
        "    def skipinject_roles(self):\n"
        "        return [REWARD]\n\n"
        "plugin = Team()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("VERL_SKIP_PLUGINS", "my_team_roles:plugin,advantage")
    plugins = load_plugins()
    assert [p.name for p in plugins.plugins] == ["my_team_roles:plugin", "advantage"]
    assert set(plugins.roles) == {"reward", "advantage"}
    sys.modules.pop("my_team_roles", None)


@pytest.mark.parametrize("selection", ["rewrd", "-rewrd", "reward,advantge"])
def test_unknown_name_is_an_error_naming_it(
    user_plugins: None, monkeypatch: pytest.MonkeyPatch, selection: str
) -> None:
    monkeypatch.setenv("VERL_SKIP_PLUGINS", selection)
    bad = selection.split(",")[-1].lstrip("-")
    with pytest.raises(PluginError, match=bad) as info:
        load_plugins()
    assert "reward" in str(info.value) and "advantage" in str(info.value)  # lists what is installed


# ---------------------------------------------------------------- real verl round trips


def _run_config() -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "trainer": {"experiment_name": "e", "project_name": "p", "use_v1": False},
            "data": {"train_batch_size": 4, "max_prompt_length": 5, "max_response_length": 6},
            "actor_rollout_ref": {"rollout": {"n": 2}},
            "algorithm": {"adv_estimator": "grpo", "use_pf_ppo": False},
        }
    )


class _StopFit(Exception):
    pass


class _Executor:
    @property
    def _shutdown(self) -> bool:
        raise _StopFit


def enter_fit(global_steps: int) -> Any:
    """A real ``RayPPOTrainer`` entering the patched ``fit`` (stopped at its first line): the clock."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.config = _run_config()
    trainer._dump_executor = _Executor()
    with pytest.raises(_StopFit):
        trainer.fit()
    trainer.global_steps = global_steps
    return trainer


def grpo_batch(seed: int = 0, prompts: int = 4, n: int = 2, prompt_len: int = 5, response_len: int = 6) -> Any:
    """A V0 training batch as it reaches ``compute_advantage``: tokens, masks, outcome rewards, fresh uids."""
    from verl import DataProto

    gen = torch.Generator().manual_seed(seed)
    rows = prompts * n
    lengths = torch.randint(1, response_len + 1, (rows,), generator=gen)
    response_mask = (torch.arange(response_len)[None, :] < lengths[:, None]).long()
    prompt_ids = torch.randint(3, 400, (prompts, prompt_len), generator=gen).repeat_interleave(n, dim=0)
    responses = torch.randint(3, 400, (rows, response_len), generator=gen) * response_mask
    scores = torch.rand(rows, generator=gen)
    token_level_rewards = torch.zeros(rows, response_len)
    token_level_rewards[torch.arange(rows), lengths - 1] = scores
    uids = np.repeat(np.array([str(uuid.uuid4()) for _ in range(prompts)], dtype=object), n)
    return DataProto.from_dict(
        tensors={
            "prompts": prompt_ids,
            "responses": responses,
            "input_ids": torch.cat([prompt_ids, responses], dim=1),
            "attention_mask": torch.cat([torch.ones(rows, prompt_len, dtype=torch.long), response_mask], dim=1),
            "response_mask": response_mask,
            "token_level_scores": token_level_rewards.clone(),
            "token_level_rewards": token_level_rewards,
        },
        non_tensors={"uid": uids, "data_source": np.array(["toy"] * rows, dtype=object)},
        meta_info={"global_token_num": [prompt_len] * rows},
    )


def _config(role: str, dump_dir: Path, steps: str = "[1,2]", *more: str) -> tuple[Config, Any]:
    """What ``python -m skipinject ... skip.<role>.enable=True ...`` resolves, for one plugin."""
    plugins = load_plugins(role)
    argv = [f"skip.{role}.enable=True", f"skip.{role}.steps={steps}", f"skip.{role}.dump_dir={dump_dir}", *more]
    overrides, rest = split_overrides(argv)
    assert rest == []
    config = apply_overrides(Config(), overrides, plugins.roles)
    return Config(plugins=role, roles=config.roles), plugins


@pytest.fixture
def counted_compute_advantage(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Count real ``compute_advantage`` runs: a counting layer *under* skipinject's wrapper."""
    from verl.trainer.ppo import ray_trainer

    calls: list[int] = []
    original = ray_trainer.compute_advantage

    @functools.wraps(original)
    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(ray_trainer, "compute_advantage", counting)
    yield calls
    bootstrap.stop()  # unpatch before monkeypatch puts the original back


def call_like_fit(batch: Any) -> Any:
    """``compute_advantage`` exactly as ``RayPPOTrainer.fit`` calls it (looked up in ray_trainer)."""
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import ray_trainer

    return ray_trainer.compute_advantage(
        batch,
        adv_estimator="grpo",
        gamma=1.0,
        lam=1.0,
        num_repeat=2,
        norm_adv_by_std_in_grpo=True,
        config=AlgoConfig(adv_estimator="grpo"),
    )


def start(config: Config, plugins: Any) -> Any:
    bootstrap.stop()
    engine = bootstrap.start(config, plugins)
    assert engine is not None and set(engine.runtimes) == set(config.enabled_roles)
    return engine


def _lines(log: list[str], needle: str) -> list[str]:
    return [line for line in log if needle in line]


def test_advantage_miss_then_hit_on_real_compute_advantage(
    user_plugins: None, tmp_path: Path, counted_compute_advantage: list[int], skip_log: list[str]
) -> None:
    from verl.trainer.ppo import core_algos

    config, plugins = _config("advantage", tmp_path)

    # Run 1: computes and saves steps 1 and 2.
    start(config, plugins)
    from skipinject.injector import INJECTOR

    assert INJECTOR.is_patched(ADVANTAGE_TARGET)
    first: dict[int, Any] = {}
    for step in (1, 2):
        trainer = enter_fit(step)
        batch = grpo_batch(seed=step)
        out = call_like_fit(batch)
        assert out is batch
        first[step] = out.batch["advantages"].clone()
    assert len(counted_compute_advantage) == 2
    assert len(_lines(skip_log, ": miss (")) == 2 and len(_lines(skip_log, "saved 8 rows")) == 2
    step_dir = tmp_path / "e_p" / "GBS4_N2_in5_out6" / "advantage" / "1"
    assert (step_dir / "meta.json").is_file()

    # Sanity: what was computed is verl's GRPO advantage.
    check = grpo_batch(seed=1)
    expected, _ = core_algos.compute_grpo_outcome_advantage(
        check.batch["token_level_rewards"], check.batch["response_mask"], check.non_tensor_batch["uid"]
    )
    torch.testing.assert_close(first[1], expected)

    # Run 2: a new engine, same dump_dir, new uids as in a new run; the original is not called.
    bootstrap.stop()
    skip_log.clear()
    start(config, plugins)
    for step in (1, 2):
        trainer = enter_fit(step)
        batch = grpo_batch(seed=step)
        batch.non_tensor_batch["uid"] = np.repeat(np.array([str(uuid.uuid4()) for _ in range(4)], dtype=object), 2)
        keep = {k: batch.batch[k].clone() for k in ("responses", "token_level_rewards")}
        out = call_like_fit(batch)
        assert out is batch, "a hit returns the trainer's own batch, like compute_advantage"
        torch.testing.assert_close(out.batch["advantages"], first[step], rtol=0, atol=0)
        torch.testing.assert_close(out.batch["returns"], first[step], rtol=0, atol=0)
        for key, value in keep.items():
            assert torch.equal(out.batch[key], value)
        assert trainer.global_steps == step
    assert len(counted_compute_advantage) == 2, "run 2 served both steps without calling compute_advantage"
    hits = _lines(skip_log, "hit, served step")
    assert [line.split(":")[0] for line in hits] == ["advantage step 1", "advantage step 2"]
    assert not _lines(skip_log, "other inputs")

    # Training modifying the served tensors in place never changes the cache.
    out.batch["advantages"].mul_(0)
    trainer = enter_fit(2)
    again = call_like_fit(grpo_batch(seed=2))
    torch.testing.assert_close(again.batch["advantages"], first[2], rtol=0, atol=0)

    # A step outside skip.advantage.steps always runs the original and saves nothing.
    _trainer = enter_fit(3)
    call_like_fit(grpo_batch(seed=3))
    assert len(counted_compute_advantage) == 3
    assert not (step_dir.parent / "3").exists()


def test_advantage_hit_for_other_batch_is_reported(
    user_plugins: None, tmp_path: Path, counted_compute_advantage: list[int], skip_log: list[str]
) -> None:
    config, plugins = _config("advantage", tmp_path, "[1]")
    start(config, plugins)
    _trainer = enter_fit(1)
    call_like_fit(grpo_batch(seed=1))
    bootstrap.stop()

    start(config, plugins)
    _trainer = enter_fit(1)
    other = grpo_batch(seed=1)
    other.batch["token_level_rewards"][:3] += 1.0  # three rows were scored differently this time
    call_like_fit(other)
    (warning,) = _lines(skip_log, "other inputs")
    assert "in 3 of 8 rows" in warning and "on_mismatch=warn" in warning
    assert len(counted_compute_advantage) == 1


def test_advantage_mismatch_regenerate_policy(
    user_plugins: None, tmp_path: Path, counted_compute_advantage: list[int]
) -> None:
    from verl.trainer.ppo import core_algos

    config, plugins = _config("advantage", tmp_path, "[1]", "skip.advantage.on_mismatch=regenerate")
    start(config, plugins)
    _trainer = enter_fit(1)
    call_like_fit(grpo_batch(seed=1))
    bootstrap.stop()

    start(config, plugins)
    _trainer = enter_fit(1)
    other = grpo_batch(seed=7)
    out = call_like_fit(other)
    assert len(counted_compute_advantage) == 2
    expected, _ = core_algos.compute_grpo_outcome_advantage(
        other.batch["token_level_rewards"], other.batch["response_mask"], other.non_tensor_batch["uid"]
    )
    torch.testing.assert_close(out.batch["advantages"], expected)


def test_advantage_cache_of_other_shape_is_not_served(
    user_plugins: None, tmp_path: Path, counted_compute_advantage: list[int], skip_log: list[str]
) -> None:
    config, plugins = _config("advantage", tmp_path, "[1]")
    start(config, plugins)
    _trainer = enter_fit(1)
    call_like_fit(grpo_batch(seed=1))
    bootstrap.stop()

    start(config, plugins)
    _trainer = enter_fit(1)
    bigger = grpo_batch(seed=1, prompts=6)
    out = call_like_fit(bigger)
    assert len(counted_compute_advantage) == 2
    assert out.batch["advantages"].shape == (12, 6)
    assert _lines(skip_log, "running the target instead")


def test_validation_batches_always_run_compute_advantage(
    user_plugins: None, tmp_path: Path, counted_compute_advantage: list[int]
) -> None:
    config, plugins = _config("advantage", tmp_path, "[1]")
    start(config, plugins)
    _trainer = enter_fit(1)
    call_like_fit(grpo_batch(seed=1))
    batch = grpo_batch(seed=1)
    batch.meta_info["validate"] = True
    call_like_fit(batch)
    assert len(counted_compute_advantage) == 2


def test_pf_ppo_calls_are_never_cached(
    user_plugins: None, tmp_path: Path, counted_compute_advantage: list[int]
) -> None:
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import ray_trainer

    config, plugins = _config("advantage", tmp_path, "[1]")
    start(config, plugins)
    _trainer = enter_fit(1)
    for _ in range(2):
        ray_trainer.compute_advantage(grpo_batch(seed=1), "grpo", config=AlgoConfig(use_pf_ppo=True))
    assert len(counted_compute_advantage) == 2
    assert not (tmp_path / "e_p").exists()


def _reward_batch(seed: int, scores: torch.Tensor | None = None) -> Any:
    """A V0 batch after the rollout: the reward loop's ``rm_scores`` and extra infos are in it."""
    batch = grpo_batch(seed=seed)
    rows, response_len = batch.batch["responses"].shape
    lengths = batch.batch["response_mask"].sum(-1)
    if scores is None:
        scores = torch.rand(rows, generator=torch.Generator().manual_seed(100 + seed))
    rm_scores = torch.zeros(rows, response_len)
    rm_scores[torch.arange(rows), lengths - 1] = scores
    batch.batch["rm_scores"] = rm_scores
    batch.non_tensor_batch["acc"] = np.array((scores > 0.5).tolist())
    batch.non_tensor_batch["reward_model"] = np.array(
        [{"style": "rule", "ground_truth": str(i % 4)} for i in range(rows)], dtype=object
    )
    batch.meta_info["reward_extra_keys"] = ["acc"]
    return batch


@pytest.fixture
def counted_extract_reward(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    from verl.trainer.ppo import ray_trainer

    calls: list[int] = []
    original = ray_trainer.extract_reward

    @functools.wraps(original)
    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(ray_trainer, "extract_reward", counting)
    yield calls
    bootstrap.stop()  # unpatch before monkeypatch puts the original back


def test_reward_miss_then_hit_on_real_extract_reward(
    user_plugins: None, tmp_path: Path, counted_extract_reward: list[int], skip_log: list[str]
) -> None:
    from verl.trainer.ppo import ray_trainer

    config, plugins = _config("reward", tmp_path, "[1]")
    start(config, plugins)
    _trainer = enter_fit(1)
    reward_1, extra_1 = ray_trainer.extract_reward(_reward_batch(1))
    assert isinstance(extra_1["acc"], np.ndarray)
    assert len(counted_extract_reward) == 1 and _lines(skip_log, "reward step 1: saved 8 rows")
    bootstrap.stop()

    # Run 2: same responses, but the reward function (say an LLM judge) would score them otherwise now.
    start(config, plugins)
    _trainer = enter_fit(1)
    batch = _reward_batch(1, scores=torch.zeros(8))
    reward_2, extra_2 = ray_trainer.extract_reward(batch)
    assert len(counted_extract_reward) == 1
    torch.testing.assert_close(reward_2, reward_1, rtol=0, atol=0)
    assert set(extra_2) == {"acc"} and np.array_equal(extra_2["acc"], extra_1["acc"])
    assert extra_2["acc"].dtype == extra_1["acc"].dtype
    assert _lines(skip_log, "reward step 1: hit, served step 1")
    assert not _lines(skip_log, "other inputs")

    # The trainer uses the pair exactly as it would the original's.
    batch.batch["token_level_scores"] = reward_2
    batch.non_tensor_batch.update({k: np.array(v) for k, v in extra_2.items()})


def test_reward_served_for_other_responses_is_reported(
    user_plugins: None, tmp_path: Path, counted_extract_reward: list[int], skip_log: list[str]
) -> None:
    from verl.trainer.ppo import ray_trainer

    config, plugins = _config("reward", tmp_path, "[1]")
    start(config, plugins)
    _trainer = enter_fit(1)
    ray_trainer.extract_reward(_reward_batch(1))
    bootstrap.stop()

    start(config, plugins)
    _trainer = enter_fit(1)
    other = _reward_batch(1)
    other.batch["input_ids"][0, 5] += 1  # the first response token of one row came out differently
    ray_trainer.extract_reward(other)
    (warning,) = _lines(skip_log, "other inputs")
    assert "in 1 of 8 rows" in warning


def test_both_roles_together_through_the_runner_config(
    user_plugins: None, tmp_path: Path, counted_compute_advantage: list[int], counted_extract_reward: list[int]
) -> None:
    """``VERL_SKIP_PLUGINS=reward,advantage``: one engine, two user roles, caches in their own subdirs."""
    from verl.trainer.ppo import ray_trainer

    plugins = load_plugins("reward,advantage")
    argv = [f"skip.{r}.{k}" for r in ("reward", "advantage") for k in ("enable=True", "steps=[1]")]
    argv += [f"skip.reward.dump_dir={tmp_path}", f"skip.advantage.dump_dir={tmp_path}"]
    overrides, _ = split_overrides(argv)
    config = Config(plugins="reward,advantage", roles=apply_overrides(Config(), overrides, plugins.roles).roles)
    for _run in range(2):
        start(config, plugins)
        _trainer = enter_fit(1)
        batch = _reward_batch(1)
        reward, _extra = ray_trainer.extract_reward(batch)
        batch.batch["token_level_rewards"] = reward
        call_like_fit(batch)
        bootstrap.stop()
    assert len(counted_extract_reward) == 1 and len(counted_compute_advantage) == 1
    project = tmp_path / "e_p" / "GBS4_N2_in5_out6"
    assert sorted(p.name for p in project.iterdir()) == ["advantage", "reward"]


# ---------------------------------------------------------------- --list


def test_list_shows_every_plugin_role_target_and_range(user_plugins: None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP"))}
    proc = subprocess.run(
        [sys.executable, "-m", "skipinject", "--list"], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "verl: 0.9.1" in out
    assert "plugin reward (skipinject-reward 0.1.0)" in out
    assert "plugin advantage (skipinject-advantage 0.1.0)" in out
    assert "plugin rollout (skipinject-rollout" in out
    assert "  role reward: step from clock:global_steps" in out
    assert "  role advantage: step from clock:global_steps" in out
    assert "target verl.trainer.ppo.ray_trainer:extract_reward  verl >=0.7.1  [ok]" in out
    assert "target verl.trainer.ppo.ray_trainer:compute_reward  verl <0.7.1  [not for this verl]" in out
    assert f"target {ADVANTAGE_TARGET}  verl any  [ok]" in out
    assert "clock  verl.trainer.ppo.ray_trainer:RayPPOTrainer.fit  [ok]" in out
    assert "FAILED" not in out
