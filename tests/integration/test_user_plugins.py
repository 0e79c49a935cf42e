"""User-added roles (``plugins/reward``, ``plugins/advantage``): installed, found, chosen, and run on real verl.

Both are separate distributions that only declare a ``skipinject.plugins`` entry point; nothing in
skipinject knows them. The round trips call verl 0.9.1's real ``compute_advantage`` and
``extract_reward`` through the module attribute ``RayPPOTrainer.fit`` looks up, with real GRPO
``DataProto`` batches, the step coming from a real ``RayPPOTrainer`` entering the patched ``fit``.

Each role's own round trips on real verl are beside it: ``plugins/reward/tests``, ``plugins/advantage/tests``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from skipinject import PluginError
from skipinject.plugin_manager import ENTRY_POINT_GROUP, load_plugins
from skipinject.testing import RoleRun, call, grpo_batch, v0_trainer

ADVANTAGE_TARGET = "verl.trainer.ppo.ray_trainer:compute_advantage"

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


def test_both_roles_together_through_the_runner_config(
    user_plugins: None, tmp_path: Path, counted_compute_advantage: list[int], counted_extract_reward: list[int]
) -> None:
    """``VERL_SKIP_PLUGINS=reward,advantage``: one engine, two user roles, caches in their own subdirs."""
    from verl.trainer.config import AlgoConfig

    for _run in range(2):
        with RoleRun("reward,advantage", tmp_path, "[1]") as run:
            _trainer = v0_trainer(1)
            batch = grpo_batch(1, scores=True)
            reward, _extra = call("verl.trainer.ppo.reward:extract_reward", batch)
            batch.batch["token_level_rewards"] = reward
            call(ADVANTAGE_TARGET, batch, "grpo", num_repeat=2, config=AlgoConfig(adv_estimator="grpo"))
    assert len(counted_extract_reward) == 1 and len(counted_compute_advantage) == 1
    run.assert_hit(1, role="reward")
    run.assert_hit(1, role="advantage")
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
    assert "plugin rollout (skipinject 0.1.0)" in out  # built in: shipped in the core wheel
    assert "  role reward: step from clock:global_steps" in out
    assert "  role advantage: step from clock:global_steps" in out
    assert "target verl.trainer.ppo.reward:extract_reward  verl >=0.7.1  [ok]" in out
    assert "target verl.trainer.ppo.reward:compute_reward  verl <0.7.1  [not for this verl]" in out
    assert f"target {ADVANTAGE_TARGET}  verl any  [ok]" in out
    assert "clock  verl.trainer.ppo.ray_trainer:RayPPOTrainer.fit  [ok]" in out
    assert "FAILED" not in out
