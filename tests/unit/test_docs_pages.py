"""The pages a user reads: a README that shows the Quickstart first and stays short, table cells that fit on
a screen, figures that come from results files (with when, where and at what load they were measured), no
development diary, and the stated bounds and links of the code as it is."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from skipinject.config import MAX_STEP
from tests import readme_sync
from tests.conftest import ROOT
from tests.verl_matrix import ledger

README = ROOT / "README.md"
#: Every page a user reads (the generated blocks' pages, the changelog, the examples' and plugins' READMEs).
USER_PAGES = [
    *readme_sync.PAGES,
    ROOT / "CHANGELOG.md",
    *sorted(ROOT.glob("examples/*/README.md")),
    *sorted(ROOT.glob("plugins/*/README.md")),
]
#: How a development diary shows: work items, work rounds and sessions, branches, re-runs, the machine it ran on.
DIARY = {
    "an issue number": r"\bissues? ?#?\d+\b|\(#\d+\)",
    "a work round": r"\bround \d+\b",
    "a work session": r"\b(?:session \d+|this session|helpers? (?:session|engineer)s?|worktree)\b",
    "a branch": r"\b(?:helper|work|feature|topic|our|my) branch(?:es)?\b",
    "a re-run": r"\bre-(?:run|measured)\b",
    "the machine the work ran on": r"\bon this VM\b",
}


def test_the_quickstart_is_on_the_first_screen_and_the_readme_stays_short() -> None:
    lines = README.read_text().splitlines()
    assert "## Quickstart" in lines[:25], "the Quickstart must start within the README's first 25 lines"
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move detail to docs/"


def test_no_readme_table_cell_is_longer_than_200_characters() -> None:
    long = []
    for number, line in enumerate(README.read_text().splitlines(), 1):
        if line.startswith("|"):
            long += [(number, len(cell)) for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1]) if len(cell) > 202]
    assert not long, f"README.md cells over 200 characters (line, length): {long}; move the detail to docs/"


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_no_page_reads_like_a_development_diary(page: Path) -> None:
    text = readme_sync._BLOCK.sub("", page.read_text())
    found = [
        f"{page.name}:{number}: {what}: {line.strip()[:100]}"
        for number, line in enumerate(text.splitlines(), 1)
        for what, pattern in DIARY.items()
        if re.search(pattern, line, re.IGNORECASE)
    ]
    assert not found, "the project speaks of itself, in the present:\n" + "\n".join(found)


def test_every_results_file_says_when_where_and_at_what_load_it_was_measured() -> None:
    files = [*sorted((ROOT / "benchmarks" / "results").glob("*.json")), ROOT / "tests" / "reliability" / "results.json"]
    assert len(files) > 1
    for path in files:
        results = json.loads(path.read_text())
        assert {"date", "machine", "load_average", "commit", "command", "figures"} <= set(results), path
        assert {"cores", "memory_gib", "cpu"} <= set(results["machine"]), path
        assert {"start", "end"} == set(results["load_average"]), path


def test_the_reliability_page_states_the_step_bound_of_the_code() -> None:
    stated = re.findall(r"step numbers are bounded \(([\d,]+)\)", (ROOT / "docs" / "reliability.md").read_text())
    assert stated == [f"{MAX_STEP:,}"], stated


def test_the_files_the_project_files_name_exist() -> None:
    """Paths of the package named in the changelog and the project's metadata are files of the package."""
    named = re.findall(r"skipinject/[\w/]+\.py", (ROOT / "CHANGELOG.md").read_text())
    named += re.findall(r"skipinject/[\w/]+\.py", (ROOT / "pyproject.toml").read_text())
    missing = sorted({path for path in named if not (ROOT / path).is_file()})
    assert not missing, f"named but not in the package: {missing}"


def test_the_matrix_ledger_records_each_pair_that_ran_and_keeps_the_others(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    results.write_text(
        json.dumps({"0.4.1": {"outcome": "passed", "tests": 5, "seconds": 90, "date": "d", "commit": "c"}})
    )
    runs = ledger.Ledger()
    for test in ("test_rollout_cache_then_hit", "test_list_resolves_every_role_meant_for_this_verl"):
        node = f"tests/e2e/test_verl_matrix.py::{test}[0.8.0]"
        runs.add(node, "setup", "passed", 100.0)
        runs.add(node, "call", "passed", 1.0)
    runs.add("tests/e2e/test_verl_matrix.py::test_rollout_cache_then_hit[0.7.1]", "setup", "failed", 5.0)
    runs.add("tests/e2e/test_verl_matrix.py::test_rollout_cache_then_hit[0.5.0]", "setup", "skipped", 0.0)
    runs.add("tests/e2e/test_verl_matrix.py::test_rollout_cache_then_hit[0.5.0]", "teardown", "passed", 0.0)
    runs.add("tests/e2e/test_rollout_e2e.py::test_x", "call", "passed", 1.0)
    runs.write("abc123", results)
    recorded = ledger.load(results)
    assert set(recorded) == {"0.8.0", "0.7.1", "0.4.1"}
    assert recorded["0.8.0"] | {"date": "d"} == {
        "outcome": "passed",
        "tests": 2,
        "seconds": 202,
        "date": "d",
        "commit": "abc123",
    }
    assert recorded["0.7.1"]["outcome"] == "failed"
    assert recorded["0.4.1"]["commit"] == "c"
