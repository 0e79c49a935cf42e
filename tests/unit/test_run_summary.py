"""The run's summary (issue 34, part 2): counts per process, added up by the driver at the end, said in
one block, written as JSON, and kept as running totals for the trainer's metrics."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from skipinject import Call, Role, StepSource, Target
from skipinject.config.environment import ENV_RUN_REPORT, ENV_SUMMARY
from skipinject.report import tally
from skipinject.testing import IntCodec, RoleRun, ToyTrainer

pytestmark = pytest.mark.unit


@pytest.fixture
def report_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv(ENV_RUN_REPORT, str(directory))
    return directory


def test_each_process_writes_its_counts_and_the_driver_adds_them_up(report_dir: Path) -> None:
    mine = tally.Tally()
    mine.add("rollout", served_steps=1, bytes_read=2048, generation_s_saved=1.5)
    mine.add("rollout", served_steps=1, generation_s_saved=2.0)
    (report_dir / "999999.json").write_text(json.dumps({"roles": {"rollout": {"generated_steps": 1}, "reward": {}}}))
    merged = tally.collect(report_dir)
    assert merged["rollout"]["served_steps"] == 2 and merged["rollout"]["generated_steps"] == 1
    assert merged["rollout"]["generation_s_saved"] == 3.5 and merged["rollout"]["bytes_read"] == 2048
    assert set(merged) == {"rollout", "reward"} and not list(report_dir.glob(".*"))
    assert mine.metrics()["skipinject/served_steps_total"] == 2
    assert mine.metrics()["skipinject/generation_s_saved_total"] == 3.5


def test_what_is_not_a_process_file_is_left_out(report_dir: Path) -> None:
    (report_dir / "1.json").write_text("not json")
    (report_dir / "2.json").write_text(json.dumps({"roles": {"x": {"served_steps": "9", "failed_steps": -1}}}))
    (report_dir / "3.json").write_text(json.dumps({"roles": {"../x": {"served_steps": 1}}, "other": 1}))
    (report_dir / "4.json").write_text(" " * (tally.MAX_FILE_BYTES + 10))
    (report_dir / "5.json").symlink_to(report_dir / "2.json")
    os.mkfifo(report_dir / "6.json")
    (report_dir / "7.json").write_text(json.dumps({"roles": {"x": {"served_steps": 1}}}))
    assert tally.collect(report_dir) == {"x": {**dict.fromkeys(tally.FIELDS, 0), "served_steps": 1}}


def test_a_report_directory_others_could_write_is_not_written(report_dir: Path) -> None:
    report_dir.chmod(0o777)
    tally.Tally().add("rollout", served_steps=1)
    assert list(report_dir.iterdir()) == []


def test_the_summary_block_names_each_role_and_the_time_saved() -> None:
    counts = {
        "rollout": {**dict.fromkeys(tally.FIELDS, 0), "served_steps": 2, "generated_steps": 1, "bytes_read": 3 << 20},
        "async_rollout": {**dict.fromkeys(tally.FIELDS, 0), "served_rows": 6, "generated_rows": 2},
    }
    counts["rollout"].update(generation_s_saved=41.25, rescored_rows=16)
    assert tally.render(counts, ["rollout", "reward"]) == [
        "summary: rollout: 2 steps served, 1 generated, 0 failed; 16 rows re-scored; 3.0 MiB read; "
        "41.2 s of generation saved",
        "summary: reward: 0 steps served, 0 generated, 0 failed; 0 B read; 0.0 s of generation saved",
        "summary: async_rollout: 0 steps served, 0 generated, 0 failed; rows 6 served, 2 generated; 0 B read; "
        "0.0 s of generation saved",
        "summary: 41.2 s of generation saved in all",
    ]


def test_the_driver_says_the_summary_once_writes_the_json_and_removes_its_directory(
    report_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "summary.json"
    monkeypatch.setenv(ENV_SUMMARY, str(target))
    tally.Tally().add("rollout", served_steps=1, generation_s_saved=2.5)
    end = tally.RunEnd(report_dir, ["rollout"])
    with caplog.at_level(logging.INFO, "skipinject"):
        end.say()
        end.say()
    said = [record.getMessage() for record in caplog.records if record.getMessage().startswith("summary:")]
    assert said[-1] == "summary: 2.5 s of generation saved in all" and len(said) == 2
    data = json.loads(target.read_text())
    assert data["roles"]["rollout"]["served_steps"] == 1 and data["total"]["generation_s_saved"] == 2.5
    assert not report_dir.exists()


def test_begin_makes_a_private_directory_and_hands_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import atexit

    monkeypatch.delenv(ENV_RUN_REPORT, raising=False)
    end = tally.begin(["rollout"])
    assert end is not None
    try:
        assert os.environ[ENV_RUN_REPORT] == str(end.directory)
        assert (end.directory.stat().st_mode & 0o777) == 0o700
        assert tally.report_dir() == end.directory
    finally:
        atexit.unregister(end.say)
        end.say()


# ---------------------------------------------------------------- what the engine counts

#: Seconds the toy generator takes per call.
GENERATION_S = 0.05


class Trainer(ToyTrainer):
    def generate(self, index: int) -> int:
        time.sleep(GENERATION_S)
        return 10 * self.global_steps


def toy_role() -> Role:
    return Role(
        name="toyrole",
        targets=[Target(f"{__name__}:Trainer.generate")],
        step=StepSource.attribute("global_steps"),
        codec=IntCodec(),
        cache_subdir="",
    )


def counted() -> dict[str, float]:
    return dict(tally.TALLY.roles.get("toyrole", {}))


def test_a_saved_step_records_its_generation_time_and_a_hit_counts_exactly_that(tmp_path: Path) -> None:
    tally.TALLY.clear()
    with RoleRun(toy_role(), tmp_path, [1, 2]):
        Trainer(calls={2: 2}).fit(3)
    assert counted()["generated_steps"] == 2 and counted()["served_steps"] == 0
    layout = tmp_path / "e_p" / "GBS4_N2_in8_out8"
    recorded = [json.loads((layout / str(step) / "meta.json").read_text())["generation_s"] for step in (1, 2)]
    assert recorded[0] >= GENERATION_S and recorded[1] >= 2 * GENERATION_S, "every call of the step is counted"
    tally.TALLY.clear()
    with RoleRun(toy_role(), tmp_path, [1, 2]) as run:
        Trainer(calls={2: 2}).fit(3)
    hits = run.hits()
    assert len(hits) == 3 and all(float(line.split(" in ")[-1].split(" s;")[0]) < GENERATION_S for line in hits)
    assert counted()["served_steps"] == 2 and counted()["generated_steps"] == 0
    assert counted()["generation_s_saved"] == pytest.approx(sum(recorded), abs=1e-9)
    assert counted()["bytes_read"] > 0
    totals = tally.TALLY.metrics()
    assert totals["skipinject/served_steps_total"] == 2
    assert totals["skipinject/generation_s_saved_total"] == pytest.approx(sum(recorded), abs=1e-9)


def test_a_cache_that_cannot_serve_counts_as_failed_and_generated(tmp_path: Path) -> None:
    tally.TALLY.clear()
    with RoleRun(toy_role(), tmp_path, [1]):
        Trainer().fit(1)
    step = tmp_path / "e_p" / "GBS4_N2_in8_out8" / "1"
    damaged = next(step.glob("objects-*.json"))
    damaged.write_bytes(damaged.read_bytes()[:-2] + b"!}")
    tally.TALLY.clear()
    with RoleRun(toy_role(), tmp_path, [1]):
        Trainer().fit(1)
    assert counted()["failed_steps"] == 1 and counted()["generated_steps"] == 1 and counted()["served_steps"] == 0


def test_the_trainers_metrics_get_the_running_totals() -> None:
    tally.TALLY.clear()
    tally.TALLY.add("toyrole", served_steps=3, generation_s_saved=4.5)
    logged: list[Any] = []

    def log(data: Any, step: int) -> None:
        logged.append((data, step))

    call = Call(tally.METRICS_TARGET, log, None, (), {"data": {"actor/loss": 0.1}, "step": 7})
    tally.MetricsInterceptor().sync(call, lambda *a, **k: log(*a, **k) if (a or k) else log(**call.kwargs))
    assert logged == [
        (
            {
                "actor/loss": 0.1,
                **{f"skipinject/{key}_total": 0 for key in tally.FIELDS},
                "skipinject/served_steps_total": 3,
                "skipinject/generation_s_saved_total": 4.5,
            },
            7,
        )
    ]
    tally.TALLY.clear()


def test_a_summary_that_cannot_be_written_leaves_no_file_beside_its_target(
    report_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``SKIPINJECT_SUMMARY`` naming a directory: one warning, and no ``.name.xxxx`` private copy left there."""
    target = tmp_path / "summaries"
    target.mkdir()
    monkeypatch.setenv(ENV_SUMMARY, str(target))
    with caplog.at_level(logging.WARNING, "skipinject"):
        tally.RunEnd(report_dir, ["rollout"]).say()
    assert any("cannot write the summary there" in record.getMessage() for record in caplog.records)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["summaries"] and not any(target.iterdir())
