"""The decision is pure (store, settings, upstream formats in; a Plan out) and its strict/fallback
rule is the one every phase gets through ``PhaseContext.load``: a miss or a damaged cache runs the
target (one line), ``action=strict`` stops the run, and so does a cache ``prepare`` cannot use."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from skipinject import Call, CodecError, Loaded, Payload, Role, StepSource, Target
from skipinject.config import RoleConfig
from skipinject.engine.replay import plan_step
from skipinject.engine.runtime import RoleRuntime
from skipinject.errors import CacheMissError, CorruptCacheError
from skipinject.store import StepStore


class Values:
    def encode(self, result: int) -> Payload:
        return Payload(objects={"value": result}, rows=1)

    def decode(self, payload: Payload, call: Call) -> int:
        value = payload.objects.get("value")
        if not isinstance(value, int):
            raise CodecError("no value")
        return value


ROLE = Role(name="values", targets=[Target("json:dumps")], step=StepSource.argument("step"), codec=Values())
CALL = Call("json:dumps", repr, None, (), {})


def runtime(dump: Path, **settings: Any) -> RoleRuntime:
    return RoleRuntime(ROLE, RoleConfig(enable=True, dump_dir=str(dump), steps=(1, 2, 3), **settings), "test")


def saved(rt: RoleRuntime, *steps: int) -> StepStore:
    store = rt.store_for(CALL)
    assert isinstance(store, StepStore)
    for step in steps:
        store.save(step, Values().encode(step * 10))
    return store


def test_plan_step_needs_no_runtime(tmp_path: Path) -> None:
    store = saved(runtime(tmp_path), 2)
    settings = RoleConfig(enable=True, dump_dir=str(tmp_path), steps=(1, 2, 3), action="repeat")
    plan = plan_step("values", store, settings, (), 3)
    assert plan.entry is not None and plan.served_step == 2 and plan.serves
    assert plan.reason == "repeat: largest cached step below 3"
    assert not plan_step("values", store, RoleConfig(dump_dir=str(tmp_path)), (), 3).serves
    with pytest.raises(CacheMissError, match=r"values step 3: skip\.values\.action=strict and no cache at"):
        plan_step("values", store, RoleConfig(dump_dir=str(tmp_path), action="strict"), (), 3)


def test_load_serves_every_part_decoded_and_prepared(tmp_path: Path) -> None:
    rt = runtime(tmp_path)
    saved(rt, 1)
    loaded = rt.load(CALL, 1, lambda got: [value + 1 for value in got.results])
    assert isinstance(loaded, Loaded) and loaded.results == [10] and loaded.value == [11]
    assert loaded.plan.served_step == 1 and loaded.plan.source == rt.store_for(CALL).step_dir(1)


def test_load_is_none_on_a_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="skipinject"):
        assert runtime(tmp_path).load(CALL, 1) is None
    assert any(r.getMessage().startswith("values step 1: miss (") for r in caplog.records)


def prepare_fails(loaded: Loaded) -> Any:
    raise CodecError("this cache does not fit the call")


def test_a_cache_prepare_cannot_use_runs_the_target_in_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rt = runtime(tmp_path)
    saved(rt, 1)
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        assert rt.load(CALL, 1, prepare_fails) is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("values step 1: cannot load ") and "CodecError: this cache does not fit" in line
    assert line.endswith("running the target instead")


def test_strict_stops_the_run_for_what_cannot_serve(tmp_path: Path) -> None:
    rt = runtime(tmp_path, action="strict")
    with pytest.raises(CacheMissError, match="action=strict"):
        rt.load(CALL, 1)
    saved(rt, 1)
    with pytest.raises(CorruptCacheError, match=r"values step 1: cannot load .*CodecError: this cache does not fit"):
        rt.load(CALL, 1, prepare_fails)
    store = rt.store_for(CALL)
    damaged = next(p for p in store.step_dir(1).iterdir() if p.name.startswith("objects-"))
    damaged.write_bytes(damaged.read_bytes()[:-1] + b" ")
    with pytest.raises(CacheMissError, match="checksum mismatch"):
        rt.load(CALL, 1)
