"""The deferred weight sync (``skipinject_rollout.weight_sync``) on a trainer shaped like verl's colocated ones.

:class:`Trainer` calls its manager as ``RayPPOTrainer.fit`` calls ``CheckpointEngineManager``: a sleep at
set-up, a sync before the first step and after each actor update, a sleep after each generation. The manager
moves the trainer's weights (a version number) into its engine; the generator records which weights and
which step each generation saw and refuses to generate on a sleeping engine. A served step must leave the
engine alone; everything that reaches it must see exactly the weights it sees without skipinject.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from skipinject_rollout.weight_sync import (
    BEFORE_TRAINING,
    SYNCS,
    before_generation,
    manager_targets,
    recorded_meta,
    served,
)

from skipinject import Role, StepSource, Target
from skipinject.report.tally import TALLY
from skipinject.testing import IntCodec, RoleRun, ToyTrainer

HERE = __name__
TOTAL = 3


@dataclass
class Batch:
    meta_info: dict[str, Any]


@dataclass
class Manager:
    """``CheckpointEngineManager`` as the trainer sees it; ``engine_*``: what the rollout engine holds."""

    trainer_weights: int = 0
    engine_weights: int | None = None
    engine_step: int | None = None
    awake: bool = False
    gate_open: bool = True
    calls: list[str] = field(default_factory=list)

    def __hash__(self) -> int:  # a manager is weakly held by identity
        return id(self)

    def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        assert not self.awake, "verl syncs into a sleeping engine"
        self.calls.append(f"sync {global_steps}")
        self.engine_weights, self.engine_step, self.awake = self.trainer_weights, global_steps, True
        return {}

    def sleep_replicas(self) -> None:
        self.calls.append("sleep")
        self.awake = False

    def wake_up_replicas(self) -> None:
        self.calls.append("wake")
        self.awake = True

    def abort_replicas(self) -> None:
        self.calls.append("abort")
        self.gate_open = False

    def resume_generation_replicas(self) -> None:
        self.calls.append("resume")
        self.gate_open = True

    def release_kv_cache_replicas(self) -> None:
        self.calls.append("release")

    def resume_kv_cache_replicas(self) -> None:
        self.calls.append("kv")


class Generator:
    def __init__(self, manager: Manager) -> None:
        self.manager = manager
        self.seen: list[tuple[str, int | None, int | None]] = []

    def generate(self, batch: Batch) -> int:
        manager = self.manager
        assert manager.awake and manager.gate_open, "the engine generates only awake, its gate open"
        what = "validation" if batch.meta_info.get("validate") else f"step {batch.meta_info['global_steps']}"
        self.seen.append((what, manager.engine_weights, manager.engine_step))
        manager.calls.append(f"generate {what}")
        return 10 * int(batch.meta_info["global_steps"])


class Trainer(ToyTrainer):
    """verl's V0 ``fit`` (``colocate_async``: ``async_mode``, the V1 mode's abort and resume around them)."""

    def __init__(self, *, test_freq: int = 0, validate_first: bool = False, async_mode: bool = False) -> None:
        super().__init__()
        self.total_training_steps = TOTAL
        self.manager = Manager()
        self.generator = Generator(self.manager)
        self.test_freq, self.validate_first, self.async_mode = test_freq, validate_first, async_mode
        self.manager.sleep_replicas()  # init_workers: the engine asleep before fit

    def validate(self) -> None:
        self.generator.generate(Batch({"global_steps": self.global_steps, "validate": True}))

    def fit(self, steps: Any = ()) -> list[Any]:
        manager = self.manager
        self.global_steps = 0
        manager.update_weights(self.global_steps)
        if self.validate_first:
            self.validate()
        self.global_steps = 1
        while self.global_steps <= self.total_training_steps:
            self.outputs.append(self.generator.generate(Batch({"global_steps": self.global_steps})))
            if self.async_mode:
                manager.abort_replicas()
            manager.sleep_replicas()
            manager.trainer_weights = self.global_steps  # the actor update
            manager.update_weights(self.global_steps)
            if self.async_mode:
                manager.resume_generation_replicas()
            if self.test_freq and self.global_steps % self.test_freq == 0:
                self.validate()
            self.global_steps += 1
        return self.outputs


def role(keeps: str | None = None) -> Role:
    """The test's rollout role; ``keeps``: why its trainer keeps every sync (``None``: it may defer)."""
    return Role(
        name="gen",
        targets=[
            Target(f"{HERE}:Generator.generate", before=before_generation),
            *manager_targets(lambda config: keeps, manager=f"{HERE}:Manager", verl=None),
        ],
        step=StepSource.meta("global_steps").or_else(StepSource.clock("global_steps"), BEFORE_TRAINING),
        codec=IntCodec(),
        clocks=[f"{HERE}:Trainer.fit"],
        record_meta=lambda call: recorded_meta(),
        on_hit=lambda result, call, info: (served(info.requested_step, info.meta), result)[1],
    )


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    SYNCS.clear()
    TALLY.clear()
    yield
    SYNCS.clear()
    TALLY.clear()


def run(dump: Path, steps: str, *overrides: str, keeps: str | None = None, **trainer: Any) -> tuple[Trainer, RoleRun]:
    """One run in a process of its own as verl's: nothing counted or pending from an earlier one."""
    SYNCS.clear()
    TALLY.clear()
    with RoleRun(role(keeps), dump, steps, *overrides) as started:
        trainer_ = Trainer(**trainer)
        trainer_.fit()
    return trainer_, started


def syncs(trainer: Trainer) -> list[str]:
    return [call for call in trainer.manager.calls if call.startswith("sync")]


def without_skipinject(**trainer: Any) -> Trainer:
    plain = Trainer(**trainer)
    plain.fit()
    return plain


def test_a_run_whose_every_step_is_served_makes_no_sync_and_no_generation(tmp_path: Path):
    first, _ = run(tmp_path, "[1-3]")
    assert first.generator.seen == without_skipinject().generator.seen  # generated alike, weights alike
    assert syncs(first) == ["sync 0", "sync 1", "sync 2"], "the sync after the last step waits for nothing"
    second, started = run(tmp_path, "[1-3]")
    assert second.outputs == first.outputs and second.generator.seen == []
    assert syncs(second) == [] and second.manager.calls == ["sleep"], "the engine is left asleep"
    deferred = [line for line in started.lines if "weight sync deferred" in line]
    assert [line.split(":")[0] for line in deferred] == ["gen step 1", "gen step 2", "gen step 3", "gen step 4"]
    counts = TALLY.roles["gen"]
    assert counts["weight_syncs_skipped"] == 4
    recorded = [json.loads(p.read_text()).get("weight_sync_s") for p in sorted(tmp_path.rglob("meta.json"))]
    assert len(recorded) == 3 and all(isinstance(s, float) and s >= 0 for s in recorded), recorded
    assert counts["weight_sync_s_saved"] == pytest.approx(sum(s for s in recorded if s > 0))


def test_a_generated_step_after_served_ones_sees_the_weights_it_sees_without_skipinject(tmp_path: Path):
    run(tmp_path, "[1,2]")
    second, started = run(tmp_path, "[1,2]")
    plain = without_skipinject()
    assert second.generator.seen == [plain.generator.seen[2]] == [("step 3", 2, 2)]
    assert syncs(second) == ["sync 2"], "one sync, with the weights and step of step 2"
    assert TALLY.roles["gen"]["weight_syncs_skipped"] == 3  # before steps 1 and 2, and after 3 (nothing follows)
    # Step 3 is no chosen step: its sync is carried out when verl makes it.
    assert not any("pending weight sync carried out" in line for line in started.lines)


def test_a_served_step_that_cannot_be_served_carries_the_pending_sync_out_before_it_generates(tmp_path: Path):
    run(tmp_path, "[1-3]")
    for data in tmp_path.rglob("*"):
        if data.is_file() and data.parent.name == "2" and data.name != "meta.json":
            data.write_bytes(b"damaged")
    second, started = run(tmp_path, "[1-3]")
    plain = without_skipinject()
    assert second.generator.seen == [plain.generator.seen[1]] == [("step 2", 1, 1)]
    assert syncs(second) == ["sync 1"]
    [line] = [line for line in started.lines if "pending weight sync carried out" in line]
    assert line.startswith("gen step 2: pending weight sync carried out before step 2's generation (weights of step 1")
    assert TALLY.roles["gen"]["weight_syncs_skipped"] == 3  # before steps 1 and 3, after 3 (one carried out)


def test_validation_between_served_steps_syncs_first(tmp_path: Path):
    run(tmp_path, "[1-3]")
    second, started = run(tmp_path, "[1-3]", test_freq=2, validate_first=True)
    plain = without_skipinject(test_freq=2, validate_first=True)
    assert second.generator.seen == plain.generator.seen[:1] + plain.generator.seen[3:4]
    assert second.generator.seen == [("validation", 0, 0), ("validation", 2, 2)]
    assert syncs(second) == ["sync 0", "sync 2"]
    carried = [line for line in started.lines if "pending weight sync carried out" in line]
    assert len(carried) == 2 and all("before validation's generation" in line for line in carried), carried


def test_never_keeps_every_sync_and_sleep(tmp_path: Path):
    run(tmp_path, "[1-3]")
    second, _ = run(tmp_path, "[1-3]", "skip.gen.defer_weight_sync=never")
    assert second.generator.seen == []
    assert syncs(second) == ["sync 0", "sync 1", "sync 2", "sync 3"]
    assert second.manager.calls.count("sleep") == 4
    assert TALLY.roles["gen"]["weight_syncs_skipped"] == 0


def test_an_engine_call_carries_the_pending_sync_out_first(tmp_path: Path):
    run(tmp_path, "[1-3]")
    SYNCS.clear()
    with RoleRun(role(), tmp_path, "[1-3]") as started:
        trainer = Trainer()
        trainer.fit()  # every step served: the sync after step 3 pending
        trainer.manager.trainer_weights = 7
        trainer.manager.wake_up_replicas()
    assert trainer.manager.calls[-2:] == ["sync 3", "wake"]
    assert trainer.manager.engine_weights == 7
    assert any("pending weight sync carried out before wake_up_replicas" in line for line in started.lines)


def test_colocate_async_skips_abort_and_resume_on_a_sleeping_engine_and_keeps_a_sync_after_an_abort(tmp_path: Path):
    run(tmp_path, "[1,2]", async_mode=True)
    second, _ = run(tmp_path, "[1,2]", async_mode=True)
    # Served steps 1-2: nothing reaches the engine; step 3's sync is carried out with its resume.
    assert second.manager.calls[:2] == ["sleep", "sync 2"]
    assert second.generator.seen == [("step 3", 2, 2)]
    # After step 3 (generated): aborted and put to sleep for real; the sync after that abort is carried out.
    assert second.manager.calls[-4:] == ["abort", "sleep", "sync 3", "resume"] and second.manager.gate_open

    # A gate an abort really closed (step 1 generated) may park requests that resume after the sync: that sync
    # is carried out as verl makes it (so is every later one), and each generation sees the weights it would.
    third_dump = tmp_path / "third"
    run(third_dump, "[2]", async_mode=True)
    trainer, _ = run(third_dump, "[2]", async_mode=True)
    calls = trainer.manager.calls
    assert calls[: calls.index("generate step 1") + 1] == ["sleep", "sync 0", "generate step 1"]
    after_one = calls[calls.index("generate step 1") + 1 : calls.index("generate step 3")]
    assert after_one == ["abort", "sleep", "sync 1", "resume", "abort", "sleep", "sync 2", "resume"], after_one
    assert (
        trainer.generator.seen
        == [("step 1", 0, 0), ("step 3", 2, 2)]
        == [seen for seen in without_skipinject(async_mode=True).generator.seen if seen[0] != "step 2"]
    )


def test_a_generation_of_an_unchosen_step_carries_the_pending_sync_out_first(tmp_path: Path):
    run(tmp_path, "[1-3]")
    SYNCS.clear()
    with RoleRun(role(), tmp_path, "[1-3]") as started:
        trainer = Trainer()
        trainer.fit()  # every step served: the sync after step 3 pending
        assert trainer.outputs == [10, 20, 30] and syncs(trainer) == []
        trainer.generator.generate(Batch({"global_steps": 9}))  # no chosen step: the target runs
    assert trainer.generator.seen == [("step 9", 3, 3)] and syncs(trainer) == ["sync 3"]
    assert any("pending weight sync carried out before step 9's generation" in line for line in started.lines)


def test_the_summary_counts_the_syncs_skipped_in_the_time_saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from skipinject.report import tally

    counts = {"rollout": {**dict.fromkeys(tally.FIELDS, 0), "served_steps": 2, "generation_s_saved": 20.0}}
    assert tally.render(counts)[-1] == "summary: 20.0 s of generation saved in all", "no sync skipped: as before"
    counts["rollout"].update(weight_syncs_skipped=3, weight_sync_s_saved=1.5)
    lines = tally.render(counts)
    assert "; 3 weight syncs skipped (1.5 s); 20.0 s of generation saved" in lines[0]
    assert lines[-1] == "summary: 21.5 s of generation and weight syncs saved in all"
    target = tmp_path / "summary.json"
    monkeypatch.setenv("SKIPINJECT_SUMMARY", str(target))
    directory = tmp_path / "report"
    directory.mkdir(mode=0o700)
    (directory / "1.json").write_text(json.dumps({"roles": counts}))
    tally.RunEnd(directory, ["rollout"]).say()
    written = json.loads(target.read_text())
    assert written["roles"]["rollout"]["weight_syncs_skipped"] == 3
    assert written["total"]["weight_sync_s_saved"] == 1.5


def test_a_trainer_whose_engine_generates_while_it_trains_keeps_every_sync_and_says_so(tmp_path: Path):
    run(tmp_path, "[1-3]")
    reason = "trainer.v1.trainer_mode=separate_async: the rollout engine generates while the trainer trains"
    second, started = run(tmp_path, "[1-3]", keeps=reason)
    assert second.generator.seen == [] and syncs(second) == ["sync 0", "sync 1", "sync 2", "sync 3"]
    said = [line for line in started.lines if "weight syncs are carried out as verl makes them" in line]
    assert said == [f"gen: weight syncs are carried out as verl makes them in this run ({reason})"]


def test_which_trainers_defer():
    from omegaconf import OmegaConf
    from skipinject_rollout.rollout import v0_defers
    from skipinject_rollout_tq.plugin import v1_defers

    def config(**sections: Any) -> Any:
        return OmegaConf.create({"trainer": {"use_v1": False}, **sections})

    assert v0_defers(config()) is None
    assert "hybrid_engine=False" in str(v0_defers(config(actor_rollout_ref={"hybrid_engine": False})))
    assert v0_defers(OmegaConf.create({"trainer": {"use_v1": True}}))  # the V1 trainer: rollout_tq's
    for mode, defers in (("sync", True), ("colocate_async", True), ("separate_async", False)):
        v1 = OmegaConf.create({"trainer": {"use_v1": True, "v1": {"trainer_mode": mode}}})
        assert (v1_defers(v1) is None) == defers, mode
