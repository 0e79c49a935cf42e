"""The last run of each older-verl pair: ``tests/verl_matrix/results.json``, written by the matrix tests.

Each pair of ``tests/e2e/test_verl_matrix.py`` that ran records its outcome (passed when every test of the
pair passed), the date, the commit and how long its tests took; ``docs/verl-versions.md``'s table of what
is proven where is rendered from this file (``python tests/readme_sync.py``), never written by hand.
"""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results.json"
_PAIR_TEST = re.compile(r"test_verl_matrix\.py::\w+\[(?P<pair>[\w.-]+)\]$")


class Ledger:
    """Outcomes of the matrix tests of one pytest session, by pair id."""

    def __init__(self) -> None:
        self.pairs: dict[str, dict[str, Any]] = {}

    def add(self, nodeid: str, when: str, outcome: str, duration: float) -> None:
        """One phase's report of a test (pytest's ``setup``/``call``/``teardown``); skipped tests are no run."""
        match = _PAIR_TEST.search(nodeid)
        if match is None or outcome == "skipped":
            return
        if when == "teardown" and match["pair"] not in self.pairs:
            return  # the teardown of a test that was skipped at setup: no run
        pair = self.pairs.setdefault(match["pair"], {"tests": set(), "failed": False, "seconds": 0.0})
        pair["seconds"] += duration
        pair["failed"] = pair["failed"] or outcome == "failed"
        if when == "call":
            pair["tests"].add(nodeid)

    def write(self, commit: str, path: Path = RESULTS) -> None:
        """Merge this session's pairs into the results file (pairs not run keep their last record)."""
        if not self.pairs:
            return
        recorded = load(path)
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        for pair, run in self.pairs.items():
            recorded[pair] = {
                "outcome": "failed" if run["failed"] else "passed",
                "tests": len(run["tests"]),
                "seconds": round(run["seconds"]),
                "date": date,
                "commit": commit,
            }
        path.write_text(json.dumps(dict(sorted(recorded.items())), indent=1) + "\n")


def load(path: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """The last recorded run of each pair, by pair id."""
    return json.loads(path.read_text()) if path.exists() else {}
