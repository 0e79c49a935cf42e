"""verl's own caches in either layout ({step}/, verl < 0.9's genstep_{step:06d}/): loaded only when trusted."""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from skipinject import Role, StepSource, Target, UpstreamFormat
from skipinject.config import Config, RoleConfig
from skipinject.engine import Engine
from skipinject.testing import ToyTrainer

NEW = UpstreamFormat("batch.json", lambda path: json.loads(Path(path).read_text()))
#: The toy trainer's run's project directory (its config names the layout).
PROJECT = Path("e_p") / "GBS4_N2_in8_out8"
OLD = UpstreamFormat("batch.json", lambda path: json.loads(Path(path).read_text()), directory="genstep_{step:06d}")


class JsonCodec:
    def encode(self, result: Any) -> Any:
        from skipinject import Payload

        return Payload(objects={"v": result}, rows=1)

    def decode(self, payload: Any, call: Any) -> Any:
        return payload.objects["v"]


@pytest.fixture
def module() -> Any:
    mod = types.ModuleType("si_upstream_targets")

    class Trainer(ToyTrainer):
        calls = 0

        def generate(self) -> dict[str, str]:
            type(self).calls += 1
            return {"from": "target"}

    mod.Trainer = Trainer  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def run(module: Any, dump: Path, trust: bool) -> tuple[Any, int]:
    role = Role(
        name="up",
        targets=[Target("si_upstream_targets:Trainer.generate")],
        step=StepSource.attribute("global_steps"),
        codec=JsonCodec(),
        upstream=(NEW, OLD),
        cache_subdir="",
    )
    settings = RoleConfig(enable=True, steps=(3,), dump_dir=str(dump), trust_upstream=trust)
    engine = Engine(Config(roles={"up": settings}), {"up": (role, "up")})
    engine.start()
    try:
        module.Trainer.calls = 0
        return module.Trainer(global_steps=3).generate(), module.Trainer.calls
    finally:
        engine.stop()


def test_older_layout_is_loaded_only_when_trusted(module: Any, tmp_path: Path, caplog) -> None:
    old_dir = tmp_path / PROJECT / "genstep_000003"
    old_dir.mkdir(parents=True)
    (old_dir / "batch.json").write_text('{"from": "verl 0.8"}')
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        result, calls = run(module, tmp_path, trust=False)
    assert result == {"from": "target"} and calls == 1
    assert any(
        "genstep_000003/batch.json" in r.getMessage() and "did not load" in r.getMessage() for r in caplog.records
    )
    assert (old_dir / "batch.json").exists(), "verl's cache is never deleted"
    (tmp_path / PROJECT / "3").rename(tmp_path / "ours")  # only verl's cache is left
    result, calls = run(module, tmp_path, trust=True)
    assert result == {"from": "verl 0.8"} and calls == 0


def test_a_linked_older_step_directory_is_not_followed(module: Any, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "batch.json").write_text('{"from": "a link"}')
    project = tmp_path / "dump" / PROJECT
    project.mkdir(parents=True)
    (project / "genstep_000003").symlink_to(elsewhere)
    result, calls = run(module, tmp_path / "dump", trust=True)
    assert result == {"from": "target"} and calls == 1
