"""Real ``python -m skipinject -m verl.trainer.main_ppo`` runs of verl's V1 TransferQueue trainer on CPU.

Run 1 generates steps 1 and 2 and caches them; run 2 (same command) injects them from the cache
into TransferQueue, never calls the generator, and trains to the end (rc 0): in ``sync`` mode, and
in ``separate_async`` with ``parameter_sync_step=2`` (two mini-batches per step, one commit).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import SKIPINJECT_MAIN_PPO, harness, rollout_records, skip_lines
from tests.integration.test_cache_tool import check_real_dump

pytestmark = pytest.mark.e2e

ROLE = "rollout_tq"


def _run(assets: Any, tmp: Path, name: str, overrides: list[str]) -> tuple[Any, int]:
    gen_log = tmp / f"{name}.gen.jsonl"
    proc = harness.run_main_ppo(
        assets,
        overrides,
        gen_log=gen_log,
        launcher=SKIPINJECT_MAIN_PPO,
        timeout=1200,
        env_extra={"RAY_DEDUP_LOGS": "0"},
    )
    (tmp / f"{name}.stdout.txt").write_text(proc.stdout)
    (tmp / f"{name}.stderr.txt").write_text(proc.stderr)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc, harness.count_generate_calls(gen_log)


def _generations(directory: Path) -> dict[int, Counter]:
    """verl's per-step generation dumps as multisets of (prompt, response, score): row order may differ."""
    return {
        step: Counter((r["input"], r["output"], round(float(r["score"]), 5)) for r in records)
        for step, records in rollout_records(directory).items()
    }


@pytest.mark.parametrize(
    ("trainer_mode", "sync_step", "gbs"),
    [pytest.param("sync", 1, harness.TRAIN_BATCH, id="sync"), pytest.param("separate_async", 2, 1, id="separate_k2")],
)
def test_v1_rollout_tq_cache_then_hit(assets: Any, tmp_path: Path, trainer_mode: str, sync_step: int, gbs: int):
    dump = tmp_path / "dump"

    def overrides(run: str) -> list[str]:
        return harness.main_ppo_overrides(
            assets,
            use_v1=True,
            trainer_mode=trainer_mode,
            parameter_sync_step=sync_step,
            total_steps=2,
            dump_dir=dump,
            extra=[
                f"skip.{ROLE}.enable=True",
                f"skip.{ROLE}.steps=[1,2]",
                f"trainer.rollout_data_dir={tmp_path / run}",
            ],
        )

    # Run 1: both steps generated, each cached as one commit of `parameter_sync_step` parts.
    first, calls_1 = _run(assets, tmp_path, "run1", overrides("run1"))
    assert calls_1 >= 2 * harness.TRAIN_BATCH * harness.ROLLOUT_N
    layout = harness.cache_dir(dump, gbs=gbs)
    assert sorted(p.name for p in layout.iterdir()) == ["1", "2"]
    for step in ("1", "2"):
        meta = json.loads((layout / step / "meta.json").read_text())
        assert [part["dir"] for part in meta["parts"]] == [str(i) for i in range(sync_step)]
        assert meta["rows"] == harness.TRAIN_BATCH * harness.ROLLOUT_N
    assert not list(layout.rglob("tq_batch.pt")), "only skipinject's safe format is written"
    lines = skip_lines(first, ROLE)
    assert (
        sum(
            f"{ROLE} step {s}: saved {harness.TRAIN_BATCH * harness.ROLLOUT_N} trajectories" in line
            for line in lines
            for s in (1, 2)
        )
        == 2
    ), lines

    # Run 2: both steps injected from the cache; the generator is never called; training finishes.
    second, calls_2 = _run(assets, tmp_path, "run2", overrides("run2"))
    assert calls_2 == 0, f"run 2 called the generator {calls_2} times"
    lines = skip_lines(second, ROLE)
    assert sum("hit, served step" in line and "rollout not submitted" in line for line in lines) == 2, lines
    assert not any(": saved" in line for line in lines), "a served step is not saved again"
    if trainer_mode != "sync":
        assert "async warm-up prefetch switched off" in second.stdout + second.stderr
    one, two = _generations(tmp_path / "run1"), _generations(tmp_path / "run2")
    assert sorted(one) == sorted(two) == [1, 2]
    for step in (1, 2):
        assert two[step] == one[step], f"step {step}: run 2 trained on other trajectories than run 1 generated"
    check_real_dump(dump, {ROLE}, tmp_path)  # `skipinject cache ...` on the k-part steps these runs wrote
