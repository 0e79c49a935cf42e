"""``skipinject.testing``: a role run in this process, a target called where its caller looks it up,
hit and miss asserted from the run's own log lines (and refused when they did not happen)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from skipinject import Role, StepSource, Target, bootstrap
from skipinject.testing import IntCodec, RoleRun, call, resolve


def make_role(module: str) -> Role:
    return Role(
        name="doubled",
        targets=[Target(f"{module}:plain")],
        step=StepSource.argument("x"),
        codec=IntCodec(),
    )


def test_a_run_misses_then_hits_and_the_asserts_say_so(fresh_module_name: str, tmp_path: Path) -> None:
    module: Any = importlib.import_module(fresh_module_name)
    with RoleRun(make_role(fresh_module_name), tmp_path, [3]) as run:
        assert call(f"{fresh_module_name}:caller_of_plain", 3) == 6
        assert resolve(f"{fresh_module_name}:plain") is module.plain  # the patched one, looked up now
    assert run.assert_miss(3).startswith("doubled step 3: miss (")
    assert run.misses() == [run.assert_miss(3)] and run.hits() == []
    with pytest.raises(AssertionError, match="no hit of step 3"):
        run.assert_hit(3)

    with RoleRun(make_role(fresh_module_name), tmp_path, [3]) as again:
        assert call(f"{fresh_module_name}:caller_of_plain", 3) == 6
    assert module.CALLS == ["plain"], "run 2 was served"
    assert "served step 3" in again.assert_hit(3)
    with pytest.raises(AssertionError, match="no miss of step 3"):
        again.assert_miss(3)
    with pytest.raises(AssertionError, match=r"no hit of step 3 \(served step 2\)"):
        again.assert_hit(3, served=2)


def test_settings_are_checked_as_the_runner_checks_them(fresh_module_name: str, tmp_path: Path) -> None:
    from skipinject.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--verbose: not a skip\.<role>\.<key>=<value> override$"):
        RoleRun(make_role(fresh_module_name), tmp_path, [1], "--verbose")
    with pytest.raises(ConfigError, match=r"skip\.doubled\.action=sometimes"):
        RoleRun(make_role(fresh_module_name), tmp_path, [1], action="sometimes")
    run = RoleRun(make_role(fresh_module_name), tmp_path, "[1-3]", "skip.doubled.action=repeat")
    assert run.config.role("doubled").action.value == "repeat" and 2 in run.config.role("doubled").steps


def test_a_run_started_without_with_is_stopped_by_the_next(fresh_module_name: str, tmp_path: Path) -> None:
    import logging

    log = logging.getLogger("skipinject")
    handlers = list(log.handlers)
    first = RoleRun(make_role(fresh_module_name), tmp_path, [1]).start()
    second = RoleRun(make_role(fresh_module_name), tmp_path, [1]).start()
    assert first.engine is None and second.engine is not None
    first.stop()  # already stopped: the second run goes on
    assert second.engine is not None and bootstrap._engine is second.engine
    RoleRun.stop_all()
    assert log.handlers == handlers, "no log handler left behind"
