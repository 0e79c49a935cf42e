"""The reliability suite's ledger: every test records what it tried, how often and what was lost.

Set ``SKIPINJECT_RELIABILITY_SUMMARY=path.json`` to have the counts written at the end of the run
(``python tests/reliability/report.py`` does, and renders ``docs/reliability.md`` from them).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

SUMMARY_ENV = "SKIPINJECT_RELIABILITY_SUMMARY"


@dataclass
class Row:
    area: str
    tried: str
    trials: int
    outcome: str
    lost: int
    test: str = ""
    seconds: float = 0.0


@dataclass
class Ledger:
    rows: list[Row] = field(default_factory=list)

    def add(self, area: str, tried: str, trials: int, outcome: str, lost: int, test: str = "") -> None:
        self.rows.append(Row(area, tried, trials, outcome, lost, test))


_LEDGER = Ledger()


@pytest.fixture
def ledger(request: pytest.FixtureRequest) -> Iterator[Any]:
    """``ledger(area, tried, trials, outcome, lost)`` records one line of docs/reliability.md."""
    started = time.perf_counter()
    mine: list[Row] = []

    def add(area: str, tried: str, trials: int, outcome: str, lost: int) -> None:
        row = Row(area, tried, trials, outcome, lost, request.node.nodeid)
        mine.append(row)
        _LEDGER.rows.append(row)

    yield add
    for row in mine:
        row.seconds = round(time.perf_counter() - started, 2)


@pytest.fixture(scope="module")
def module_ledger(request: pytest.FixtureRequest) -> Any:
    """``module_ledger(...)`` like :func:`ledger`, for a module's own teardown to record what its tests
    tried together (property tests counting examples): no test reads what other tests counted."""

    def add(area: str, tried: str, trials: int, outcome: str, lost: int) -> None:
        _LEDGER.rows.append(Row(area, tried, trials, outcome, lost, request.node.nodeid))

    return add


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    target = os.environ.get(SUMMARY_ENV)
    if not target or not _LEDGER.rows:
        return
    failed = session.testsfailed
    data = {
        "exitstatus": int(exitstatus),
        "tests_failed": failed,
        "tests_collected": session.testscollected,
        "rows": [asdict(r) for r in _LEDGER.rows],
    }
    Path(target).write_text(json.dumps(data, indent=1))
