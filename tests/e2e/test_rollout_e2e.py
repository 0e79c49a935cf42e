"""Real ``python -m skipinject -m verl.trainer.main_ppo`` runs on CPU (V0 trainer, GRPO, Ray)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import SKIPINJECT_FULLY_ASYNC, SKIPINJECT_MAIN_PPO, harness, rollout_records, skip_lines

pytestmark = pytest.mark.e2e


def _run(assets: Any, tmp: Path, name: str, overrides: list[str], launcher=SKIPINJECT_MAIN_PPO, runner=None) -> Any:
    gen_log = tmp / f"{name}.gen.jsonl"
    run = runner or harness.run_main_ppo
    proc = run(assets, overrides, gen_log=gen_log, launcher=launcher, timeout=900, env_extra={"RAY_DEDUP_LOGS": "0"})
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc, harness.count_generate_calls(gen_log)


def test_v0_rollout_cache_then_hit_then_repeat(assets: Any, tmp_path: Path):
    dump = tmp_path / "dump"

    def overrides(run: str, steps: int, *extra: str) -> list[str]:
        return harness.main_ppo_overrides(
            assets,
            use_v1=False,
            total_steps=steps,
            dump_dir=dump,
            extra=["skip.rollout.enable=True", f"trainer.rollout_data_dir={tmp_path / run}", *extra],
        )

    # Run 1: steps 1 and 2 are generated and cached.
    first, calls_1 = _run(assets, tmp_path, "run1", overrides("run1", 2, "skip.rollout.steps=[1,2]"))
    assert calls_1 > 0
    layout = harness.cache_dir(dump)
    assert sorted(p.name for p in layout.iterdir()) == ["1", "2"]
    assert all((layout / s / "meta.json").is_file() for s in ("1", "2"))
    assert not list(layout.rglob("gen_batch.dp")), "only skipinject's safe format is written"
    lines = skip_lines(first, "rollout")
    assert any("rollout step 1: miss" in line for line in lines) and any("step 2: saved" in line for line in lines)

    # Run 2: both steps served from the cache, the generator is never called, training finishes.
    second, calls_2 = _run(assets, tmp_path, "run2", overrides("run2", 2, "skip.rollout.steps=[1,2]"))
    assert calls_2 == 0
    lines = skip_lines(second, "rollout")
    assert sum("hit, served step" in line for line in lines) == 2, lines
    one, two = rollout_records(tmp_path / "run1"), rollout_records(tmp_path / "run2")
    assert sorted(one) == sorted(two) == [1, 2]
    for step in (1, 2):
        assert [r["output"] for r in two[step]] == [r["output"] for r in one[step]], f"step {step} responses differ"
        assert [r["score"] for r in two[step]] == [r["score"] for r in one[step]]
    assert "timing_s/skipinject/hit:1.0" in second.stdout.replace(" ", "") or "skipinject/hit" in second.stdout

    # Run 3: repeat; step 3 is served from step 2 (other prompts: said in one line and in the metrics);
    # validation before training still calls the generator.
    third, calls_3 = _run(
        assets,
        tmp_path,
        "run3",
        overrides(
            "run3", 3, "skip.rollout.steps=[1,2,3]", "skip.rollout.action=repeat", "trainer.val_before_train=True"
        ),
    )
    lines = skip_lines(third, "rollout")
    assert any("rollout step 3: hit, served step 2 (repeat: largest cached step below 3)" in line for line in lines)
    assert sum("other inputs" in line for line in lines) >= 1, "serving step 2's responses at step 3 must be reported"
    assert calls_3 > 0, "validation generations are never skipped"
    assert not (layout / "3").exists(), "a repeat hit does not write a new step"


def test_fully_async_rollout_cache_then_hit(assets: Any, tmp_path: Path):
    dump = tmp_path / "dump"
    overrides = harness.fully_async_overrides(
        assets,
        total_rollout_steps=4,
        dump_dir=dump,
        extra=["skip.async_rollout.enable=True", "skip.async_rollout.steps=[1,2,3,4]"],
    )
    _, calls_1 = _run(assets, tmp_path, "async1", overrides, SKIPINJECT_FULLY_ASYNC, harness.run_fully_async)
    assert calls_1 > 0
    layout = harness.cache_dir(dump, gbs=1)
    assert sorted(int(p.name) for p in layout.iterdir()) == [1, 2, 3, 4]
    second, calls_2 = _run(assets, tmp_path, "async2", overrides, SKIPINJECT_FULLY_ASYNC, harness.run_fully_async)
    assert calls_2 == 0, "feed indices 1-4 are served from the cache"
    assert sum("hit, served step" in line for line in skip_lines(second, "async_rollout")) == 4
