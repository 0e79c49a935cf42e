"""``action=repeat`` reads the nearest candidates only, however many steps are cached (bench_repeat.py in small)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from skipinject.store import StepStore

ROOT = Path(__file__).resolve().parents[2]


def bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_repeat", ROOT / "benchmarks" / "bench_repeat.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_repeat"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("steps", [40, 400])
def test_meta_reads_do_not_grow_with_the_cached_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int
) -> None:
    module = bench()
    from skipinject import Role, StepSource, Target
    from skipinject.config import RoleConfig
    from skipinject.engine.runtime import RoleRuntime
    from skipinject.roles import Call

    module.build(tmp_path / "skipinject_default" / "bench", steps)
    role = Role(
        name="bench", targets=[Target("json:dumps")], step=StepSource.argument("step"), codec=module.JsonCodec()
    )
    settings = RoleConfig(enable=True, steps=(steps + 5,), dump_dir=str(tmp_path), action="repeat")
    runtime = RoleRuntime(role, settings, "bench")
    reads: list[int] = []
    real = StepStore.read_meta
    monkeypatch.setattr(StepStore, "read_meta", lambda self, step, **kw: reads.append(step) or real(self, step, **kw))
    plan = runtime.plan(Call("json:dumps", repr, None, (), {}), steps + 5)
    assert plan.served_step == steps - 1 and plan.entry is not None
    assert reads == [steps - 1], "only the nearest cached step is read"
