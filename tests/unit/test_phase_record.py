"""A plugin's phase records and commits its steps through the phase API (plugin API 1.3).

A toy phase treats each call as one of ``PARTS`` mini-batches of its step (as rollout_tq's sample
phase does): it asks the engine whether the step is served, records each fresh result as the
step's next part and commits the step after the last one, with its own ``meta.json`` keys. It
never sees a writer or keeps a step of its own: the engine drops a step the run moves past before
its commit, and a step whose part cannot be saved.
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from skipinject import Call, Payload, PhaseContext, Role, StepSource, Target
from skipinject.config import Config, RoleConfig
from skipinject.engine import Engine
from skipinject.testing import ToyTrainer

MODULE = "si_phase_record_targets"
PARTS = 2
_tokens = itertools.count(1)
GENERATED: list[int] = []


class JsonCodec:
    def encode(self, result: Any) -> Payload:
        if result == "unsavable":
            raise ValueError("this result cannot be encoded")
        return Payload(objects={"value": result}, rows=1)

    def decode(self, payload: Payload, call: Call) -> Any:
        return payload.objects["value"]


class MiniBatches:
    """Call k of a step is its mini-batch k: served from the cached step, else recorded and committed."""

    def run(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        notes = role.notes(call, step)
        if role.served(call, step) is None:  # the step's first call decides it
            loaded = role.load(call, step)
            notes["cached"] = None if loaded is None else loaded.results
        index = notes["calls"] = notes.get("calls", 0) + 1
        if notes["cached"] is not None:
            return notes["cached"][index - 1]
        result = proceed()
        part = role.record(call, step, result)
        if part is not None and part + 1 == PARTS:
            role.commit(call, step, {"mini_batches": PARTS}, note="; a toy step")
        return result

    async def run_async(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        raise NotImplementedError


class Trainer(ToyTrainer):
    """Samples ``calls[step]`` mini-batches per step (:meth:`ToyTrainer.fit` calls ``generate``)."""

    def generate(self, *args: Any) -> Any:
        token = next(_tokens)
        GENERATED.append(token)
        return UNSAVABLE.get((self.global_steps, len(GENERATED)), f"{self.global_steps}:{token}")


#: (step, generation) -> a result the codec refuses.
UNSAVABLE: dict[tuple[int, int], str] = {}


@pytest.fixture
def targets() -> Iterator[Any]:
    module = type(sys)(MODULE)
    module.Trainer = type("Trainer", (Trainer,), {})  # type: ignore[attr-defined]
    sys.modules[MODULE] = module
    GENERATED.clear()
    UNSAVABLE.clear()
    yield module
    del sys.modules[MODULE]


def run(
    tmp_path: Path, trainer_calls: dict[int, int], module: Any, record_meta: Callable[[Call], Any] | None = None
) -> list[Any]:
    role = Role(
        name="mini",
        targets=[Target(f"{MODULE}:Trainer.generate", phase=MiniBatches())],
        step=StepSource.attribute("global_steps"),
        codec=JsonCodec(),
        clocks=[f"{MODULE}:Trainer.fit"],
        record_meta=record_meta,
    )
    config = Config(roles={"mini": RoleConfig(enable=True, dump_dir=str(tmp_path), steps=(1, 2, 3))})
    engine = Engine(config, {"mini": (role, "test")})
    engine.start()
    try:
        return module.Trainer(calls=trainer_calls).fit(list(trainer_calls))
    finally:
        engine.stop()


def step_dir(dump: Path, step: int | str = "") -> Path:
    """Where the toy trainer's run caches ``step`` (its config names the layout)."""
    return dump / "e_p" / "GBS4_N2_in8_out8" / "mini" / str(step)


def meta(dump: Path, step: int) -> dict[str, Any]:
    return json.loads((step_dir(dump, step) / "meta.json").read_text())


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "skipinject"]


def test_a_phase_records_its_parts_commits_them_once_and_is_served_them(
    targets: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="skipinject"):
        first = run(tmp_path, {1: 2, 2: 2}, targets)
    for step in (1, 2):
        assert meta(tmp_path, step)["mini_batches"] == PARTS, "the phase's own meta.json keys"
        assert [part["dir"] for part in meta(tmp_path, step)["parts"]] == ["0", "1"], "in {step}/{k}/"
        assert "calls" not in meta(tmp_path, step), "only what the phase commits (the phase's format)"
    assert sum("saved 2 rows in 2 part(s)" in m and m.endswith("; a toy step") for m in messages(caplog)) == 2

    GENERATED.clear()
    assert run(tmp_path, {1: 2, 2: 2}, targets) == first
    assert GENERATED == [], "both steps served: the phase records nothing at a served step"


def test_a_step_the_run_moves_past_before_its_commit_is_dropped(
    targets: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        run(tmp_path, {1: 1, 2: 2, 3: 1}, targets)
    assert not step_dir(tmp_path, 1).exists(), "step 1 saw one of its two mini-batches: nothing of it is left"
    assert meta(tmp_path, 2)["mini_batches"] == PARTS
    assert not step_dir(tmp_path, 3).exists(), "the run ended before step 3's commit"
    dropped = [m for m in messages(caplog) if "could not save" in m]
    assert len(dropped) == 2, dropped
    assert "mini step 1:" in dropped[0] and "1 part(s) recorded and not committed before step 2 began" in dropped[0]
    assert "mini step 3:" in dropped[1] and "before the run ended" in dropped[1]


def test_a_part_that_cannot_be_saved_drops_its_step(
    targets: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    UNSAVABLE[(1, 1)] = "unsavable"
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        run(tmp_path, {1: 2, 2: 2}, targets)
    assert not (step_dir(tmp_path, 1) / "meta.json").exists()
    assert meta(tmp_path, 2)["mini_batches"] == PARTS
    dropped = [m for m in messages(caplog) if "could not save" in m]
    assert len(dropped) == 1 and "cannot encode part 1" in dropped[0], dropped


def test_a_phase_committed_step_carries_what_the_roles_record_meta_gave_for_its_first_part(
    targets: Any, tmp_path: Path
) -> None:
    asked: list[int] = []

    def scored_by(call: Call) -> dict[str, Any]:
        asked.append(call.instance.global_steps)
        return {"reward": {"digest": "abc"}, "mini_batches": "overridden by the phase"}

    run(tmp_path, {1: 2}, targets, record_meta=scored_by)
    assert meta(tmp_path, 1)["reward"] == {"digest": "abc"}, "the role's record_meta reaches meta.json"
    assert meta(tmp_path, 1)["mini_batches"] == PARTS, "the phase's own keys win"
    assert asked == [1], "asked once per step, at its first part"
