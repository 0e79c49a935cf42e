"""Never silent: a role enabled at chosen steps whose target no process called by the end of its first chosen
step (each trainer's way of ending a step: a log per step, the fully async trainer's log per parameter sync, an
async ``fit``) or of the run gets one line naming the role, the step, the trainer class and the likely cause;
the summary lists it; ``action=strict`` stops the run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skipinject import Role, StepSource, Target
from skipinject.config.environment import ENV_RUN_REPORT, ENV_SUMMARY
from skipinject.errors import NeverCalledError
from skipinject.injector import INJECTOR
from skipinject.report import tally
from skipinject.report.silence import StepEnd
from skipinject.testing import IntCodec, RoleRun

pytestmark = pytest.mark.unit

# The module that defines the reward function (as verl.trainer.ppo.reward does), imported by the trainers
# below before any patch: they call the function object itself, not the name the role patches.
REWARD_MODULE = "never_called_reward"


def _define_reward_module() -> types.ModuleType:
    module = types.ModuleType(REWARD_MODULE)

    def extract_reward(batch: int) -> int:
        return batch + 1

    extract_reward.__module__, extract_reward.__qualname__ = REWARD_MODULE, "extract_reward"
    module.extract_reward = extract_reward  # type: ignore[attr-defined]
    sys.modules[REWARD_MODULE] = module
    return module


bound_reward = _define_reward_module().extract_reward  # "from verl.trainer.ppo.reward import extract_reward"


class Tracking:
    """verl's ``Tracking``: one ``log`` per step with the training metrics (and validation metrics without)."""

    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, Any], int]] = []

    def log(self, data: dict[str, Any], step: int) -> None:
        self.logged.append((dict(data), step))


class RayPPOTrainer:
    """The V0 shape: ``fit`` runs each step, calls the reward through the patched module, logs the step."""

    def __init__(self, steps: int = 3, *, bypass: bool = False) -> None:
        self.global_steps = 0
        self.steps = steps
        self.bypass = bypass
        self.logger = Tracking()
        self.rewards: list[int] = []

    def reward(self, batch: int) -> int:
        if self.bypass:
            return int(bound_reward(batch))
        return int(sys.modules[REWARD_MODULE].extract_reward(batch))

    def fit(self) -> None:
        self.logger.log(data={"val/score": 0.0}, step=self.global_steps)  # validation before training
        for step in range(1, self.steps + 1):
            self.global_steps = step
            self.rewards.append(self.reward(step))
            self.logger.log(data={"training/global_step": step}, step=step)


class PPOTrainer(RayPPOTrainer):
    """The V1 shape (its own ``fit``, the same log per step)."""


class OneStepOffRayTrainer(RayPPOTrainer):
    """The one-step-off shape: an ``async def fit``."""

    async def fit(self) -> None:  # type: ignore[override]
        for step in range(1, self.steps + 1):
            self.global_steps = step
            await asyncio.sleep(0)
            self.rewards.append(self.reward(step))
            self.logger.log(data={"training/global_step": step}, step=step)


class FullyAsyncTrainer(RayPPOTrainer):
    """The fully async shape: an ``async def fit`` that logs the aggregated metrics once per parameter sync,
    ``training/global_step`` being the cycle's last step."""

    trigger_parameter_sync_step = 2

    async def fit(self) -> None:  # type: ignore[override]
        for step in range(1, self.steps + 1):
            self.global_steps = step
            self.rewards.append(self.reward(step))
            if step % self.trigger_parameter_sync_step == 0:  # aggregated: the cycle's last step, a float
                self.logger.log(data={"training/global_step": float(step)}, step=step // 2)
        self.global_steps += 1


TRAINERS = (RayPPOTrainer, PPOTrainer, OneStepOffRayTrainer, FullyAsyncTrainer)


def reward_role(trainer: type[RayPPOTrainer]) -> Role:
    return Role(
        name="reward",
        targets=[Target(f"{REWARD_MODULE}:extract_reward")],
        step=StepSource.clock("global_steps"),
        codec=IntCodec(),
        clocks=[f"{__name__}:{trainer.__name__}.fit"],
        cache_subdir="",
    )


def run_fit(trainer: RayPPOTrainer) -> None:
    result = trainer.fit()
    if asyncio.iscoroutine(result):
        asyncio.run(result)


@pytest.fixture(autouse=True)
def report_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The run's report directory (each process's record) and the step-end check on this module's Tracking."""
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv(ENV_RUN_REPORT, str(directory))
    tally.TALLY.clear()
    yield directory
    INJECTOR.uninstrument(f"{__name__}:Tracking.log")
    tally.TALLY.clear()


@contextlib.contextmanager
def started(role: Role, tmp_path: Path, steps: str = "[1,2]", **settings: Any) -> Iterator[RoleRun]:
    """A run of ``role`` whose step ends are this module's ``Tracking.log`` calls."""
    with RoleRun(role, tmp_path / "dump", steps, **settings) as run:
        assert run.engine is not None
        INJECTOR.instrument(f"{__name__}:Tracking.log", StepEnd(run.engine.silence), owner="test")
        yield run


def never_lines(run: RoleRun) -> list[str]:
    return [line for line in run.lines if "was never called" in line]


@pytest.mark.parametrize("trainer_class", TRAINERS, ids=lambda cls: cls.__name__)
def test_a_trainer_that_calls_the_target_gets_no_line(trainer_class: type[RayPPOTrainer], tmp_path: Path) -> None:
    with started(reward_role(trainer_class), tmp_path) as run:
        trainer = trainer_class()
        run_fit(trainer)
    assert trainer.rewards == [2, 3, 4] and never_lines(run) == []
    assert "reward" in tally.TALLY.called and tally.TALLY.silent == {}


@pytest.mark.parametrize("trainer_class", TRAINERS, ids=lambda cls: cls.__name__)
def test_a_trainer_that_calls_the_function_under_another_binding_is_said_at_its_first_chosen_step(
    trainer_class: type[RayPPOTrainer], tmp_path: Path, report_dir: Path
) -> None:
    with started(reward_role(trainer_class), tmp_path) as run:
        trainer = trainer_class(bypass=True)
        run_fit(trainer)
    assert trainer.rewards == [2, 3, 4], "the trainer runs on, unchanged"
    expected = (
        f"skip.reward: step 1 ended and extract_reward was never called: {trainer_class.__name__} calls "
        f"{REWARD_MODULE}.extract_reward as {__name__}.bound_reward, not through {REWARD_MODULE}:extract_reward, "
        "the name the role patches"
    )
    assert never_lines(run) == [expected], "one line, at the end of step 1 (the fully async trainer's first log)"
    record = json.loads((report_dir / f"{os.getpid()}.json").read_text())
    assert record["silent"] == {"reward": expected} and "called" not in record


def test_a_role_called_in_another_process_is_not_said(tmp_path: Path, report_dir: Path) -> None:
    """The fully async Rollouter calls its target in its own process: its record counts."""
    (report_dir / "999999.json").write_text(json.dumps({"roles": {}, "called": ["reward"]}))
    with started(reward_role(FullyAsyncTrainer), tmp_path) as run:
        run_fit(FullyAsyncTrainer(bypass=True))
    assert never_lines(run) == [] and tally.TALLY.silent == {}


def test_the_run_end_judges_steps_no_log_ended(tmp_path: Path) -> None:
    """Step 3 of a fully async run that syncs every 2 steps is never logged: the end of ``fit`` says it."""
    with started(reward_role(FullyAsyncTrainer), tmp_path, "[3]") as run:
        run_fit(FullyAsyncTrainer(bypass=True))
    assert [line.split(":")[1] for line in never_lines(run)] == [" the run ended and extract_reward was never called"]


def test_a_chosen_step_the_run_never_reaches_is_not_said(tmp_path: Path) -> None:
    with started(reward_role(RayPPOTrainer), tmp_path, "[9]") as run:
        run_fit(RayPPOTrainer(bypass=True))
    assert never_lines(run) == []


def test_strict_stops_the_run_at_the_end_of_the_first_chosen_step(tmp_path: Path) -> None:
    trainer = RayPPOTrainer(bypass=True)
    with (
        started(reward_role(RayPPOTrainer), tmp_path, "[2]", action="strict"),
        pytest.raises(NeverCalledError) as raised,
    ):
        run_fit(trainer)
    assert str(raised.value).startswith("skip.reward: step 2 ended and extract_reward was never called: RayPPOTrainer")
    assert str(raised.value).endswith("(skip.reward.action=strict)") and trainer.rewards == [2, 3], "step 3 never ran"


class Submitting:
    """A V1 trainer base whose submit is the role's target."""

    def __init__(self) -> None:
        self.global_steps = 0
        self.logger = Tracking()
        self.submitted = 0

    def submit(self) -> None:
        self.submitted += 1

    def fit(self, steps: int = 2) -> None:
        for step in range(1, steps + 1):
            self.global_steps = step
            self.submit()
            self.logger.log(data={"training/global_step": step}, step=step)


class StreamingTrainer(Submitting):
    """A subclass overriding the submit target (verl's streaming fully async V1 mode does)."""

    def submit(self) -> None:
        self.submitted += 10


def test_a_subclass_overriding_a_method_target_is_named(tmp_path: Path) -> None:
    role = Role(
        name="submit",
        targets=[Target(f"{__name__}:Submitting.submit")],
        step=StepSource.clock("global_steps"),
        codec=IntCodec(),
        clocks=[f"{__name__}:Submitting.fit"],
        cache_subdir="",
    )
    with started(role, tmp_path, "[1]") as run:
        StreamingTrainer().fit()
    assert never_lines(run) == [
        "skip.submit: step 1 ended and Submitting.submit was never called: StreamingTrainer overrides submit in "
        f"{__name__}.StreamingTrainer, so {__name__}:Submitting.submit is not called"
    ]


def test_the_summary_lists_the_roles_never_called(
    report_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "summary.json"
    monkeypatch.setenv(ENV_SUMMARY, str(target))
    line = "skip.reward: step 1 ended and extract_reward was never called: FullyAsyncTrainer calls ..."
    (report_dir / "1.json").write_text(json.dumps({"roles": {}, "silent": {"reward": line, "advantage": "x"}}))
    (report_dir / "2.json").write_text(json.dumps({"roles": {}, "called": ["advantage"]}))
    end = tally.RunEnd(report_dir, ["reward", "advantage", "rollout"])
    with caplog.at_level(logging.INFO, "skipinject"):
        end.say()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [f"summary: {line}"], "a role another process called after all is not listed"
    assert json.loads(target.read_text())["never_called"] == {"reward": line}


class Batch:
    def __init__(self, validate: bool) -> None:
        self.meta_info = {"validate": validate}


class ValidatingTrainer(RayPPOTrainer):
    """Calls the target with validation batches only (never skipped, so not the role being called)."""

    def reward(self, batch: int) -> int:
        return int(sys.modules[REWARD_MODULE].extract_reward(Batch(validate=True)) is None) + batch + 1


def test_validation_calls_do_not_count_as_the_role_being_called(tmp_path: Path) -> None:
    module = sys.modules[REWARD_MODULE]
    original = module.extract_reward
    module.extract_reward = lambda batch: None  # type: ignore[attr-defined]
    try:
        with started(reward_role(ValidatingTrainer), tmp_path, "[1]") as run:
            run_fit(ValidatingTrainer())
    finally:
        module.extract_reward = original  # type: ignore[attr-defined]
    assert [line.split(" was never called")[0] for line in never_lines(run)] == [
        "skip.reward: step 1 ended and extract_reward"
    ]


def test_the_step_end_keeps_the_trainers_metrics_totals(tmp_path: Path) -> None:
    with started(reward_role(RayPPOTrainer), tmp_path, "[1]"):
        tally.TALLY.add("reward", served_steps=2)
        tracking = Tracking()
        tracking.log(data={"training/global_step": 5, "actor/loss": 0.5}, step=5)
    logged, step = tracking.logged[0]
    assert step == 5 and logged["actor/loss"] == 0.5 and logged["skipinject/served_steps_total"] == 2


def test_the_start_says_which_role_the_entry_modules_trainers_do_not_reach(tmp_path: Path) -> None:
    """Before the run: a trainer class the program's main module holds whose module binds the target's function
    under a name not patched (verl's one-step-off main: ``OneStepOffRayTrainer``), or overrides a method target."""
    from skipinject.report.silence import entry_lines

    role = reward_role(RayPPOTrainer)
    with started(role, tmp_path, "[1]") as run:
        lines = entry_lines(run.config, {"reward": role}, [sys.modules[__name__]])
        assert entry_lines(run.config, {"reward": role}, [types.ModuleType("main_without_trainers")]) == []
    assert lines == [
        f"skip.reward may not act in this run: RayPPOTrainer calls {REWARD_MODULE}.extract_reward as "
        f"{__name__}.bound_reward, not through {REWARD_MODULE}:extract_reward, the name the role patches"
    ]
    submit = Role(
        name="submit",
        targets=[Target(f"{__name__}:Submitting.submit")],
        step=StepSource.clock("global_steps"),
        codec=IntCodec(),
        clocks=[f"{__name__}:Submitting.fit"],
        cache_subdir="",
    )
    main = types.ModuleType("main_with_a_streaming_trainer")
    main.StreamingTrainer = StreamingTrainer  # type: ignore[attr-defined]
    with started(submit, tmp_path, "[1]") as run:
        assert entry_lines(run.config, {"submit": submit}, [main]) == [
            f"skip.submit may not act in this run: StreamingTrainer overrides submit in {__name__}.StreamingTrainer, "
            f"so {__name__}:Submitting.submit is not called"
        ]
