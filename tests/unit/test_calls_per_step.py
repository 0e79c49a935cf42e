"""Several calls of a target in one step: each is recorded as its own part and replayed in order.

A toy trainer calls its target k times per step (k varying by step), as DAPO's dynamic sampling
does. Run 1 must train on exactly what the target returned, call by call (never a result saved a
moment earlier in the same run); run 2 replays the calls in order without calling the target.
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skipinject import Call, Payload, Role, StepSource, Target
from skipinject.config import Config, RoleConfig
from skipinject.engine import Engine
from skipinject.errors import CacheMissError
from skipinject.testing import ToyTrainer
from skipinject.verl.layout import layout_of

MODULE = "si_calls_targets"
_tokens = itertools.count(1000)


class JsonCodec:
    def encode(self, result: Any) -> Payload:
        if int(result["responses"][0].split(":")[0]) in UNSAVABLE:
            raise ValueError("this result cannot be encoded")
        return Payload(objects={"value": result}, rows=len(result["responses"]))

    def decode(self, payload: Payload, call: Call) -> Any:
        return payload.objects["value"]


def prompts_of(batch: int | list[int]) -> list[int]:
    """The prompts of a call: given, or call ``k`` of :meth:`ToyTrainer.fit` has prompts ``2k, 2k+1``."""
    return [2 * batch, 2 * batch + 1] if isinstance(batch, int) else list(batch)


class Trainer(ToyTrainer):
    """Calls ``generate`` ``calls[step]`` times per step (:meth:`ToyTrainer.fit`), each with the next prompts."""

    def __init__(self, calls: dict[int, int]) -> None:
        super().__init__(calls=calls)

    def generate(self, batch: int | list[int]) -> dict[str, Any]:
        prompts = prompts_of(batch)
        GENERATED.append(prompts)
        token = next(_tokens)  # every real generation differs: a result served in its place shows
        return {"responses": [f"{p}:{token}" for p in prompts], "step": self.global_steps}


GENERATED: list[list[int]] = []
#: Prompts whose results the codec refuses to encode.
UNSAVABLE: set[int] = set()


@pytest.fixture
def targets() -> Iterator[Any]:
    module = type(sys)(MODULE)
    module.Trainer = type("Trainer", (Trainer,), {})  # type: ignore[attr-defined]
    sys.modules[MODULE] = module
    GENERATED.clear()
    UNSAVABLE.clear()
    yield module
    del sys.modules[MODULE]
    UNSAVABLE.clear()


def make_role(*, clock: bool = True, fingerprint: bool = False) -> Role:
    return Role(
        name="gen",
        targets=[Target(f"{MODULE}:Trainer.generate")],
        step=StepSource.attribute("global_steps"),
        codec=JsonCodec(),
        clocks=[f"{MODULE}:Trainer.fit"] if clock else [],
        fingerprint=(lambda call: [str(p) for p in prompts_of(call.batch)]) if fingerprint else None,
    )


class Run:
    """One run of the trainer under a fresh engine (as a new process would start one)."""

    def __init__(self, dump: Path, role: Role, **settings: Any) -> None:
        settings.setdefault("steps", (1, 2, 3))
        config = Config(roles={"gen": RoleConfig(enable=True, dump_dir=str(dump), **settings)})
        self.engine = Engine(config, {"gen": (role, "test")})

    def __enter__(self) -> Engine:
        self.engine.start()
        return self.engine

    def __exit__(self, *exc: object) -> None:
        self.engine.stop()


def step_dir(dump: Path, step: int) -> Path:
    return dump / layout_of(ToyTrainer().config)[0] / "gen" / str(step)


def meta(dump: Path, step: int) -> dict[str, Any]:
    return json.loads((step_dir(dump, step) / "meta.json").read_text())


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "skipinject"]


CALLS = {1: 3, 2: 1, 3: 2}


def test_run_1_trains_on_each_call_and_run_2_replays_them_in_order(targets: Any, tmp_path: Path) -> None:
    with Run(tmp_path, make_role()):
        first = targets.Trainer(CALLS).fit(3)
    assert len(GENERATED) == 6, "run 1 calls the target for every call of every step"
    assert len({r["responses"][0].split(":")[1] for r in first}) == 6, "each call got its own generation"
    assert [meta(tmp_path, s)["calls"] for s in (1, 2, 3)] == [3, 1, 2]
    assert sorted(p.name for p in step_dir(tmp_path, 1).iterdir() if p.is_dir()) == ["1", "2"]
    assert not any(p.is_dir() for p in step_dir(tmp_path, 2).iterdir()), "a one-call step is laid out as before"

    GENERATED.clear()
    with Run(tmp_path, make_role()):
        second = targets.Trainer(CALLS).fit(3)
    assert GENERATED == [], "run 2 serves every call"
    assert second == first, "call k of a step is served what call k returned in run 1"


def test_a_step_is_committed_once_the_run_moves_past_it(targets: Any, tmp_path: Path) -> None:
    with Run(tmp_path, make_role(), steps=(1,)):
        trainer = targets.Trainer(CALLS)
        trainer.global_steps = 1
        trainer.generate([0, 1])
        trainer.generate([2, 3])
        assert not (step_dir(tmp_path, 1) / "meta.json").exists(), "never committed while calls may still come"
        trainer.global_steps = 2  # a step that is not chosen: its first call still closes step 1
        trainer.generate([4, 5])
        from skipinject.engine.background import WRITER

        WRITER.flush()
        assert meta(tmp_path, 1)["calls"] == 2
        assert not step_dir(tmp_path, 2).exists()


def test_the_end_of_fit_commits_the_last_step(targets: Any, tmp_path: Path) -> None:
    with Run(tmp_path, make_role(), steps=(3,)):
        targets.Trainer(CALLS).fit(3)
        assert meta(tmp_path, 3)["calls"] == 2, "fit returned: the step is complete before the process may end"


def test_more_calls_than_recorded_run_the_extra_ones_and_say_so(
    targets: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with Run(tmp_path, make_role()):
        first = targets.Trainer(CALLS).fit(3)
    GENERATED.clear()
    with caplog.at_level(logging.INFO, logger="skipinject"), Run(tmp_path, make_role()):
        second = targets.Trainer({1: 5, 2: 1, 3: 1}).fit(3)
    assert GENERATED == [[6, 7], [8, 9]], "calls 4 and 5 of step 1 ran; step 3's second call was not asked for"
    assert second[:3] == first[:3] and second[5] == first[3] and second[6] == first[4]
    extra = [m for m in messages(caplog) if "more often than the cached step" in m]
    assert len(extra) == 1 and "gen step 1:" in extra[0] and "(3 calls" in extra[0] and "call 4" in extra[0]
    assert meta(tmp_path, 1)["calls"] == 3, "the cached step is kept as recorded"


def test_strict_stops_at_a_call_that_was_not_recorded(targets: Any, tmp_path: Path) -> None:
    with Run(tmp_path, make_role(), steps=(2,)):
        targets.Trainer(CALLS).fit(2)
    with Run(tmp_path, make_role(), steps=(2,), action="strict"):
        trainer = targets.Trainer(CALLS)
        trainer.global_steps = 2
        trainer.generate([0, 1])
        with pytest.raises(CacheMissError, match="call 2 of this step has nothing to serve"):
            trainer.generate([2, 3])


def test_every_call_is_checked_against_its_own_recorded_inputs(
    targets: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with Run(tmp_path, make_role(fingerprint=True), steps=(1,)):
        targets.Trainer(CALLS).fit(1)
    assert meta(tmp_path, 1)["call_inputs"] == [["0", "1"], ["2", "3"], ["4", "5"]]
    with caplog.at_level(logging.INFO, logger="skipinject"), Run(tmp_path, make_role(fingerprint=True), steps=(1,)):
        trainer = targets.Trainer(CALLS)
        trainer.global_steps = 1
        for prompts in ([0, 1], [2, 99], [4, 5]):
            trainer.generate(prompts)
    assert GENERATED == [[0, 1], [2, 3], [4, 5]], "warn: served"
    mismatches = [m for m in messages(caplog) if "other inputs" in m]
    assert len(mismatches) == 1 and "step 1 call 2 of 3" in mismatches[0] and "1 of 2 rows" in mismatches[0]
    hits = [m for m in messages(caplog) if "hit" in m]
    assert [("call 1 of 3" in hits[0]), ("call 3 of 3" in hits[2])] == [True, True]


def test_roles_without_a_clock_commit_after_every_call(targets: Any, tmp_path: Path) -> None:
    """No trainer tells where their step ends (a Ray actor may be killed): each call extends the commit."""
    with Run(tmp_path, make_role(clock=False), steps=(1,)):
        trainer = targets.Trainer(CALLS)
        trainer.global_steps = 1
        one = trainer.generate([0, 1])
        assert meta(tmp_path, 1)["calls"] == 1
        two = trainer.generate([2, 3])
        assert two != one and len(GENERATED) == 2, "the second call is generated, not served the first's result"
        assert meta(tmp_path, 1)["calls"] == 2
    GENERATED.clear()
    with Run(tmp_path, make_role(clock=False), steps=(1,)):
        trainer = targets.Trainer(CALLS)
        trainer.global_steps = 1
        assert [trainer.generate([0, 1]), trainer.generate([2, 3])] == [one, two]
    assert GENERATED == []


def test_a_call_that_cannot_be_saved_drops_the_whole_step(
    targets: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    UNSAVABLE.add(2)  # step 1's second call
    with caplog.at_level(logging.WARNING, logger="skipinject"), Run(tmp_path, make_role(), steps=(1, 2)):
        targets.Trainer(CALLS).fit(2)
    assert not (step_dir(tmp_path, 1) / "meta.json").exists(), "a step is replayed only as all of its calls"
    assert meta(tmp_path, 2)["calls"] == 1
    warnings = [m for m in messages(caplog) if "could not save" in m]
    assert len(warnings) == 1 and "cannot encode call 2" in warnings[0]


def test_a_recipe_trainer_overriding_fit_is_the_clock_too(targets: Any, tmp_path: Path) -> None:
    """verl's DAPO trainer overrides ``fit`` (and sets no step in the batch): its step comes from the clock."""

    class Recipe(targets.Trainer):  # type: ignore[misc,name-defined]
        def fit(self, steps: int) -> list[Any]:
            for step in range(1, steps + 1):
                self.global_steps = step
                for call in range(self.calls.get(step, 1)):
                    self.outputs.append(self.generate([2 * call]))
            return self.outputs

    role = Role(
        name="gen",
        targets=[Target(f"{MODULE}:Trainer.generate")],
        step=StepSource.clock(),
        codec=JsonCodec(),
        clocks=[f"{MODULE}:Trainer.fit"],
    )
    with Run(tmp_path, role, steps=(1,)):
        first = Recipe(CALLS).fit(1)
        assert meta(tmp_path, 1)["calls"] == 3, "the recipe's fit returning committed its last step"
        generated = len(GENERATED)
        assert Recipe(CALLS).fit(1) == first and len(GENERATED) == generated, "the next fit replays it"


def test_a_step_the_run_comes_back_to_is_never_served_its_own_recording(targets: Any, tmp_path: Path) -> None:
    """Steps 1 -> 2 -> 1 (a trainer that resumes or reruns a step): the second step 1 is generated
    again, never served what this run recorded at the first, and not saved; a later run is served the
    first recording at both visits."""
    with Run(tmp_path, make_role(), steps=(1, 2)):
        trainer = targets.Trainer(CALLS)
        first = []
        for step in (1, 2, 1):
            trainer.global_steps = step
            first.append(trainer.generate([2 * step, 2 * step + 1]))
    assert len(GENERATED) == 3 and first[2] != first[0], "the revisit was generated, not served"
    assert meta(tmp_path, 1)["calls"] == 1
    GENERATED.clear()
    with Run(tmp_path, make_role(), steps=(1, 2)):
        trainer = targets.Trainer(CALLS)
        second = []
        for step in (1, 2, 1):
            trainer.global_steps = step
            second.append(trainer.generate([2 * step, 2 * step + 1]))
    assert GENERATED == [] and second == [first[0], first[1], first[0]], "an earlier run's recording serves"
