"""Run the reliability suite, write what it counted to ``tests/reliability/results.json`` and render
``docs/reliability.md``'s generated blocks from it.

    python tests/reliability/report.py      # run the suite (~6 min on 2 cores), write the results, render the page

The tables and the headline are filled from the suite's own ledger (see ``conftest.py``), never by hand;
``tests/unit/test_readme_facts.py`` fails when the page's blocks are not the results file's, and
``python tests/readme_sync.py`` renders them again.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reliability.md"
RESULTS = ROOT / "tests" / "reliability" / "results.json"
AREAS = ("crash", "integrity", "concurrency", "disk", "trust", "cache tool", "bad input", "object store")
TITLES = {
    "crash": "Crash safety (SIGKILL)",
    "integrity": "Integrity (damaged or foreign caches)",
    "concurrency": "Concurrency",
    "disk": "Full and read-only disks",
    "trust": "Trust (no code from caches, no path escapes)",
    "cache tool": "Removal (cache tool, garbage collection, clean-up): links and races",
    "bad input": "Bad input",
    "object store": "Object stores (dump_dir=s3://..., a real S3 server)",
}

SUMMARIES = {
    "crash": "a saving process SIGKILLed before every fsync/rename and at random times (1- and 2-part steps)",
    "integrity": "{n} kinds of damaged, forged, hostile or foreign caches; random byte flips; forged meta.json fuzzing",
    "concurrency": "4 writers and 4 readers of one step at once",
    "disk": "disk full (real tmpfs, ENOSPC at a random byte), read-only dump_dir, unlistable cache dir",
    "trust": "planted upstream pickles, hostile names, directories other users control, symlinked steps",
    "cache tool": "steps swapped for links by another uid mid-removal; untrusted steps under prune --damaged",
    "bad input": "generated overrides, steps, configs, sample ids, targets, plugin lists; YAML bombs; the runner",
    "object store": "uploads SIGKILLed at random times, bit flips on the server, concurrent writers and readers",
}


def run_suite(summary: Path) -> tuple[int, dict[str, float]]:
    """Run the suite; returns its exit code and its wall time and CPU time."""
    env = dict(os.environ, SKIPINJECT_RELIABILITY_SUMMARY=str(summary))
    started = time.perf_counter()
    code = subprocess.call(
        [sys.executable, "-m", "pytest", "tests/reliability", "-q", "-p", "no:cacheprovider"], cwd=ROOT, env=env
    )
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return code, {
        "wall": time.perf_counter() - started,
        "cpu": usage.ru_utime + usage.ru_stime,
    }


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def load_results(path: Path = RESULTS) -> dict[str, Any]:
    """The results file of the last run of the suite."""
    return json.loads(path.read_text())


def headline(results: dict[str, Any]) -> str:
    """When, where and under what load the suite last ran, and its totals."""
    f, m, load = results["figures"], results["machine"], results["load_average"]
    rows = f["rows"]
    return (
        f"Last run: {results['date']}, commit {results['commit']}, {m['cores']} CPUs ({m['cpu']}, "
        f"{m['memory_gib']} GiB), Python {m['python']}; {f['wall_s']:.0f} s wall ({f['cpu_s']:.0f} s CPU) on a "
        f"shared machine, load average {load['start']:.1f} at start and {load['end']:.1f} at end; "
        f"{f['tests_collected']} tests, {f['tests_failed']} failed. "
        f"**{sum(r['trials'] for r in rows):,} trials, {sum(r['lost'] for r in rows)} lost.**\n"
    )


def tables(results: dict[str, Any]) -> str:
    """The summary per area and every row of the ledger, by area."""
    rows = results["figures"]["rows"]
    by_area: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_area[row["area"]].append(row)
    lines = ["## Summary\n", "| area | what was tried | how often | what was lost |", "|---|---|---:|---:|"]
    for area in AREAS:
        group = by_area.get(area, [])
        if group:
            tried = SUMMARIES[area].format(n=sum(1 for r in group if r["trials"] == 2))
            trials, lost = sum(r["trials"] for r in group), sum(r["lost"] for r in group)
            lines.append(f"| {area} | {tried} | {trials} | {lost} |")
    for area in AREAS:
        group = by_area.get(area, [])
        if not group:
            continue
        lines += [f"\n## {TITLES[area]}\n", "| what was tried | how often | outcome | lost |", "|---|---:|---|---:|"]
        lines += [f"| {_cell(r['tried'])} | {r['trials']} | {_cell(r['outcome'])} | {r['lost']} |" for r in group]
    lines.append(
        "\n*how often*: trials of that fault (for the property tests: generated examples). "
        "*lost*: a partial, damaged, foreign or untrusted cache loaded, a torn read, code from a cache run, "
        "a path outside `dump_dir`, a raw Python exception instead of skipinject's error, a training call that "
        "failed, a file left behind by a failed save, a file the cache tool (or garbage collection) removed "
        "that was not its to remove, or a decision logged in more than one line."
    )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    from benchmarks.results import record
    from tests import readme_sync

    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.json"
        code, timing = run_suite(summary)
        if not summary.exists():
            print("the suite recorded nothing", file=sys.stderr)
            return code or 1
        data = json.loads(summary.read_text())
    figures = {
        "tests_collected": data["tests_collected"],
        "tests_failed": data["tests_failed"],
        "wall_s": round(timing["wall"], 1),
        "cpu_s": round(timing["cpu"], 1),
        "rows": data["rows"],
    }
    record("reliability", figures, load_start, path=RESULTS)
    readme_sync.main()
    return code


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
