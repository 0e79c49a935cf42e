"""A toy trainer for the read-ahead tests (``skip.<role>.read_ahead``), local and in S3.

verl's loop in small: each step's batch comes from ``generate_sequences`` (a real ``DataProto`` of
padded rollout tensors, each generation different), and ``between`` runs while the step "trains",
where a test waits for the read-ahead and then changes the store under it.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from verl.protocol import DataProto

from skipinject import Role, StepSource, Target
from skipinject.config import Config, RoleConfig
from skipinject.engine import Engine
from skipinject.engine.runtime import RoleRuntime
from tests.unit.test_compression import padded_batch

MODULE = "si_read_ahead_targets"
_seeds = itertools.count(1)
#: The steps the target ran at (a hit does not call it).
GENERATED: list[int] = []

Between = Callable[[int, RoleRuntime], None]


class Trainer:
    def __init__(self, between: Callable[[int], None] | None = None, started: Callable[[], None] | None = None) -> None:
        self.between = between
        self.started = started
        self.global_steps = 0

    def fit(self, steps: Sequence[int], *, keep: bool = True) -> dict[int, DataProto]:
        """One call per step; the batches trained on (none with ``keep=False``: each is dropped by
        the next step, as verl's loop drops its batch). ``started`` runs first (verl's own start-up
        in ``fit``: checkpoint, validation)."""
        out: dict[int, DataProto] = {}
        batch: DataProto | None = None
        if self.started is not None:
            self.started()
        for step in steps:
            self.global_steps = step
            batch = self.generate_sequences(step)
            if keep:
                out[step] = batch
            if self.between is not None:
                self.between(step)
            batch = None
        return out

    def generate_sequences(self, step: int) -> DataProto:
        GENERATED.append(step)
        return generated(step)


def generated(step: int) -> DataProto:
    """A new rollout batch (never equal to an earlier one)."""
    seed = next(_seeds)
    return DataProto.from_dict(
        tensors=padded_batch(rows=16, prompt=24, response=40, seed=seed),
        non_tensors={"uid": np.array([f"{seed}-{row}" for row in range(16)], dtype=object)},
        meta_info={"step": step},
    )


def install_targets(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The trainer's module, importable for the test (a test module's ``targets`` fixture)."""
    module = type(sys)(MODULE)
    module.Trainer = type("Trainer", (Trainer,), {})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, MODULE, module)
    GENERATED.clear()
    return module


def make_role(phase: Any = None) -> Role:
    return Role(
        name="gen",
        targets=[Target(f"{MODULE}:Trainer.generate_sequences", phase=phase)],
        step=StepSource.attribute("global_steps"),
        clocks=[f"{MODULE}:Trainer.fit"],
    )


def run(
    targets: Any,
    dump: Path | str,
    steps: Sequence[int],
    *,
    trained: Sequence[int] | None = None,
    between: Between | None = None,
    started: Callable[[RoleRuntime], None] | None = None,
    keep: bool = True,
    phase: Any = None,
    **settings: Any,
) -> tuple[dict[int, DataProto], RoleRuntime]:
    """A run (a fresh engine, as a new process) training ``trained`` (default: ``steps``), the role
    enabled at ``steps`` (its target's calls handled by ``phase``, default the engine's): the batches
    trained on and the role's runtime (after the run ended)."""
    config = Config(roles={"gen": RoleConfig(enable=True, dump_dir=str(dump), steps=tuple(steps), **settings)})
    engine = Engine(config, {"gen": (make_role(phase), "test")})
    engine.start()
    runtime = engine.runtimes["gen"]
    GENERATED.clear()
    try:
        hook = None if between is None else (lambda step: between(step, runtime))
        start = None if started is None else (lambda: started(runtime))
        return targets.Trainer(hook, start).fit(trained if trained is not None else steps, keep=keep), runtime
    finally:
        engine.stop()


def step_location(dump: Path | str, step: int) -> Any:
    """Step ``step``'s directory (a RemotePath under an fsspec URL)."""
    if "://" in str(dump):
        from skipinject.store.remote import open_remote

        _, root = open_remote(str(dump))
        return root / "skipinject_default" / "gen" / str(step)
    return Path(dump) / "skipinject_default" / "gen" / str(step)


def remove_data_files(dump: Path | str, step: int) -> list[str]:
    """Remove every file of a step but its ``meta.json`` (a hit that still reads them fails); their names."""
    location = step_location(dump, step)
    if isinstance(location, Path):
        removed = [p for p in location.rglob("*") if p.is_file() and p.name != "meta.json"]
        for path in removed:
            path.unlink()
        return [p.name for p in removed]
    from skipinject.store.remote import open_remote

    fs, _ = open_remote(str(dump))
    names = [name for name in fs.find(location.path) if not name.endswith("/meta.json")]
    fs.rm(names)
    return names


def assert_same(got: DataProto, expected: DataProto) -> None:
    """Every tensor equal bit for bit (dtype, shape, values) and every non-tensor column equal."""
    assert sorted(got.batch.keys()) == sorted(expected.batch.keys())
    for name in expected.batch.keys():
        a, b = got.batch[name], expected.batch[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name
    assert sorted(got.non_tensor_batch) == sorted(expected.non_tensor_batch)
    for name, column in expected.non_tensor_batch.items():
        assert list(got.non_tensor_batch[name]) == list(column), name


def lines(caplog: pytest.LogCaptureFixture, text: str, level: int = logging.DEBUG) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "skipinject" and r.levelno >= level and text in r.getMessage()
    ]


def read_ahead_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The steps read ahead, as ``"after -> step"``."""
    out = []
    for message in lines(caplog, "ahead from"):
        words = message.split()
        out.append(f"{words[2].rstrip(':')} -> {words[5]}")
    return out


def hit_line(caplog: pytest.LogCaptureFixture, step: int) -> str:
    (line,) = lines(caplog, f"gen step {step}: hit")
    return line


def wait_for_read_ahead(step: int, runtime: RoleRuntime) -> None:
    runtime.replay.read_ahead.wait()
