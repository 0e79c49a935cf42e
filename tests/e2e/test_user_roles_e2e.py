"""User-added roles in a real ``python -m skipinject -m verl.trainer.main_ppo`` V0 run on CPU.

``skip.advantage`` and ``skip.reward`` come from ``plugins/advantage`` and ``plugins/reward``,
installed as distributions of their own; nothing in skipinject or verl knows them. The calls run
in verl's ``TaskRunner`` Ray actor, where the hooks arrive through the runner's bootstrap.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import SKIPINJECT_MAIN_PPO, harness, skip_lines

pytestmark = pytest.mark.e2e

#: Statistics that do not depend on response lengths: scores are summed over all tokens, and GRPO gives
#: every token of a row the same advantage, so token-masked max/min are the rows' max/min.
_METRIC = re.compile(r"(critic/(?:score/(?:mean|max|min)|(?:advantages|returns)/(?:max|min))):(-?[0-9.e+-]+)")


def trained_metrics(proc: Any) -> list[dict[str, float]]:
    """Per training step, the score and advantage statistics verl logged to the console."""
    steps = []
    for line in proc.stdout.splitlines():
        found = dict(_METRIC.findall(line))
        if found:
            steps.append({key: float(value) for key, value in found.items()})
    return steps


def test_v0_advantage_and_reward_cache_then_hit(assets: Any, tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    skip = [
        "skip.advantage.enable=True",
        "skip.advantage.steps=[1,2]",
        f"skip.advantage.dump_dir={dump}",
        "skip.reward.enable=True",
        "skip.reward.steps=[1,2]",
        f"skip.reward.dump_dir={dump}",
    ]
    overrides = harness.main_ppo_overrides(assets, use_v1=False, total_steps=2, extra=skip)
    assert "trainer.use_v1=False" in overrides

    runs = []
    for name in ("run1", "run2"):
        proc = harness.run_main_ppo(
            assets,
            overrides,
            gen_log=tmp_path / f"{name}.gen.jsonl",
            launcher=SKIPINJECT_MAIN_PPO,
            timeout=900,
            env_extra={"RAY_DEDUP_LOGS": "0"},
        )
        assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        runs.append(proc)
    first, second = runs

    layout = harness.cache_dir(dump)
    for role in ("advantage", "reward"):
        assert sorted(p.name for p in (layout / role).iterdir()) == ["1", "2"], role
        assert all((layout / role / step / "meta.json").is_file() for step in ("1", "2"))
        lines = skip_lines(first, role)
        assert sum(f"{role} step {s}: miss" in line for line in lines for s in (1, 2)) == 2, lines
        assert sum(f"{role} step {s}: saved 8 rows" in line for line in lines for s in (1, 2)) == 2, lines

        lines = skip_lines(second, role)
        hits = [line for line in lines if "hit, served step" in line]
        assert [h.split(": hit")[0].split("INFO: ")[-1] for h in hits] == [f"{role} step 1", f"{role} step 2"], lines
        assert not any(": miss" in line for line in lines), lines

    # Run 2 trained on the served values: verl's logged statistics of them are run 1's, step by step.
    # (The rollout is not skipped here, so its fresh responses differ from run 1's; skipinject says so.)
    one, two = trained_metrics(first), trained_metrics(second)
    assert len(one) == len(two) == 2 and all(len(step) == 7 for step in one)
    assert one == two
    assert harness.count_generate_calls(tmp_path / "run2.gen.jsonl") > 0
