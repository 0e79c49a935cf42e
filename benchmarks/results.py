"""The results file of a benchmark: its figures with the date, machine, load and commit they were measured at.

Each benchmark run with ``--record`` writes ``benchmarks/results/<name>.json``; the figures the
documentation shows are rendered from these files (``python tests/readme_sync.py``), and
``tests/unit/test_readme_facts.py`` fails when a page's figure is not its results file's. A run without
``--record`` (other sizes, smoke tests) only prints.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--record``: write the results file (the documentation's figures) after the run."""
    parser.add_argument(
        "--record", action="store_true", help="write benchmarks/results/<name>.json, which the docs' figures come from"
    )


def machine() -> dict[str, Any]:
    """Cores, memory and CPU model of this machine."""
    model = platform.processor() or platform.machine()
    memory_kib = 0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_kib = int(line.split()[1])
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "memory_gib": round(memory_kib / 2**20, 1),
        "cpu": model,
        "python": platform.python_version(),
    }


#: The code a figure depends on: a checkout whose files here differ from its commit is marked ``+changes``.
MEASURED = ("skipinject", "plugins", "benchmarks", "examples", "tests/reliability")


def commit() -> str:
    """The checkout's commit, ``+changes`` when the measured code differs from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *MEASURED],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def record(name: str, figures: Any, load_start: float, path: Path | None = None) -> Path:
    """Write ``figures`` with when, where and under what load they were measured; returns the file."""
    target = path or RESULTS / f"{name}.json"
    data = {
        "benchmark": name,
        "command": " ".join(["python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "load_average": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
        "commit": commit(),
        "figures": figures,
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {os.path.relpath(target, ROOT)}", file=sys.stderr)
    return target


def load(name: str) -> dict[str, Any]:
    """A benchmark's results file."""
    return json.loads((RESULTS / f"{name}.json").read_text())
