"""The engine's decisions: cache, repeat and strict step choice, bypass, input mismatches."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from skipinject import bootstrap
from skipinject.config import Config, RoleConfig
from skipinject.errors import CacheMissError, PromptMismatchError
from skipinject.plugin_manager import load_plugins


def start(tmp_path: Path, **settings: Any) -> Any:
    cfg = RoleConfig(enable=True, dump_dir=str(tmp_path), **settings)
    plugins = load_plugins("skipinject_toy_plugin:plugin")
    return bootstrap.start(Config(roles={"toy": cfg}), plugins)


def fit(toy: Any, steps: int, shift: int = 0) -> tuple[list[Any], list[str]]:
    toy.CALLS.clear()
    trainer = toy.Trainer()
    outputs = []
    for step in range(1, steps + 1):
        trainer.global_steps = step
        outputs.append(trainer.generate([step + shift]))
    return outputs, list(toy.CALLS)


def test_cache_miss_saves_then_hit_skips_the_target(toy: Any, tmp_path: Path, caplog):
    start(tmp_path, steps=(1, 3))
    with caplog.at_level(logging.INFO, logger="skipinject"):
        first, calls = fit(toy, 3)
    assert calls == ["generate"] * 3
    assert sorted(p.name for p in (tmp_path / "skipinject_default" / "toy").iterdir()) == ["1", "3"]
    bootstrap.stop()
    start(tmp_path, steps=(1, 3))
    with caplog.at_level(logging.INFO, logger="skipinject"):
        second, calls = fit(toy, 3)
    assert calls == ["generate"], "only step 2, which is not in steps, runs"
    assert second == first
    messages = [r.getMessage() for r in caplog.records]
    assert sum("toy step 1: miss" in m for m in messages) == 1
    assert sum("toy step 1: hit, served step 1" in m for m in messages) == 1
    assert not any("step 2" in m for m in messages), "steps outside skip.<role>.steps are not touched"


@pytest.mark.parametrize(
    ("cached", "requested", "served"),
    [([2, 5], 5, 5), ([2, 5], 4, 2), ([2, 5], 9, 5), ([5, 7], 3, 5), ([2, 3, 7], 6, 3)],
)
def test_repeat_serves_exact_else_largest_below_else_smallest_above(
    toy: Any, tmp_path: Path, caplog, cached: list[int], requested: int, served: int
):
    start(tmp_path, steps=tuple(cached))
    trainer = toy.Trainer()
    for step in cached:
        trainer.global_steps = step
        trainer.generate([step])
    bootstrap.stop()
    start(tmp_path, steps=(requested,), action="repeat")
    toy.CALLS.clear()
    trainer.global_steps = requested
    with caplog.at_level(logging.INFO, logger="skipinject"):
        out = trainer.generate([requested])
    assert toy.CALLS == []
    assert out == {"responses": [served * 10], "step": served}
    assert any(f"toy step {requested}: hit, served step {served}" in r.getMessage() for r in caplog.records)


def test_repeat_with_nothing_cached_runs_and_saves(toy: Any, tmp_path: Path):
    start(tmp_path, steps=(4,), action="repeat")
    _, calls = fit(toy, 4)
    assert calls.count("generate") == 4
    assert (tmp_path / "skipinject_default" / "toy" / "4" / "meta.json").is_file()


def test_strict_stops_on_a_miss(toy: Any, tmp_path: Path):
    start(tmp_path, steps=(1,), action="strict")
    trainer = toy.Trainer()
    trainer.global_steps = 1
    with pytest.raises(CacheMissError, match="toy step 1"):
        trainer.generate([1])


def test_disabled_role_installs_nothing(toy: Any, tmp_path: Path):
    plugins = load_plugins("skipinject_toy_plugin:plugin")
    assert bootstrap.start(Config(roles={"toy": RoleConfig(enable=False, steps=(1,))}), plugins) is None
    assert type(toy.Trainer.__dict__["generate"]).__name__ == "function"


def test_clock_role_reads_the_trainer_step(toy: Any, tmp_path: Path):
    plugins = load_plugins("skipinject_toy_plugin:plugin")
    config = Config(roles={"toy_score": RoleConfig(enable=True, dump_dir=str(tmp_path), steps=(2,))})
    bootstrap.start(config, plugins)
    toy.CALLS.clear()
    first = toy.Trainer().fit(3)
    assert toy.CALLS.count("score") == 3
    bootstrap.stop()
    bootstrap.start(config, plugins)
    toy.CALLS.clear()
    assert toy.Trainer().fit(3) == first
    assert toy.CALLS.count("score") == 2, "step 2 of score is served from the cache"


class _Batch(list):
    """A list of prompts carrying verl-style ``meta_info``."""

    def __init__(self, prompts: list[int], validate: bool = False) -> None:
        super().__init__(prompts)
        self.meta_info = {"validate": validate}


def test_validation_batches_are_never_skipped_nor_saved(toy: Any, tmp_path: Path):
    start(tmp_path, steps=(1,))
    trainer = toy.Trainer()
    trainer.global_steps = 1
    toy.CALLS.clear()
    for _ in range(2):
        assert trainer.generate(_Batch([1], validate=True)) == {"responses": [10], "step": 1}
    assert toy.CALLS == ["generate", "generate"]
    assert not (tmp_path / "skipinject_default").exists()
    trainer.generate(_Batch([1]))
    assert toy.CALLS.count("generate") == 3, "a training call is handled (recorded) as usual"


def _fingerprint_role(tmp_path: Path, policy: str) -> tuple[Any, Any]:
    """A role over the toy trainer whose inputs are fingerprinted per row."""
    from skipinject_toy_plugin import JsonCodec

    from skipinject import Role, StepSource, Target
    from skipinject.engine import Engine

    role = Role(
        name="toy_fp",
        targets=[Target("toy_targets:Trainer.generate")],
        step=StepSource.attribute("global_steps"),
        codec=JsonCodec(),
        fingerprint=lambda call: [str(p) for p in call.batch],
    )
    config = Config(roles={"toy_fp": RoleConfig(enable=True, dump_dir=str(tmp_path), steps=(1,), on_mismatch=policy)})
    engine = Engine(config, {"toy_fp": (role, "test")})
    engine.start()
    return engine, role


@pytest.mark.parametrize("policy", ["warn", "regenerate", "fail"])
def test_inputs_that_changed_are_reported_and_handled_by_policy(toy: Any, tmp_path: Path, caplog, policy: str):
    def run(prompts: list[int]) -> Any:
        engine, _ = _fingerprint_role(tmp_path, policy)
        try:
            trainer = toy.Trainer()
            trainer.global_steps = 1
            return trainer.generate(prompts)
        finally:
            engine.stop()

    run([1, 2])
    toy.CALLS.clear()
    assert run([1, 2]) == {"responses": [10, 20], "step": 1}
    assert toy.CALLS == [], "same inputs: a plain hit"
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        if policy == "fail":
            with pytest.raises(PromptMismatchError, match="1 of 2 rows"):
                run([1, 3])
            return
        out = run([1, 3])
    lines = [r.getMessage() for r in caplog.records if "other inputs" in r.getMessage()]
    assert len(lines) == 1 and "1 of 2 rows" in lines[0]
    if policy == "warn":
        assert out == {"responses": [10, 20], "step": 1} and toy.CALLS == []
    else:
        assert out == {"responses": [10, 30], "step": 1} and toy.CALLS == ["generate"]
