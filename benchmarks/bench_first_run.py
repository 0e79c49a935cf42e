"""A newcomer's first minutes: ``make setup``, ``make demo`` and (``--test``) ``make test`` timed in a fresh clone.

The clone is of this checkout's commit, in a temporary directory, so nothing of this checkout (its
``.venv``, pip's work there) is reused; pip's own download cache is, as on any machine that has
installed Python packages before. ``make demo`` and ``make test`` start Ray and real verl trainers:
on a shared machine, ``--lock FILE`` holds the lock the other heavy runs take (``flock``) around them.

    python benchmarks/bench_first_run.py [--test] [--lock FILE] [--record]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import results  # noqa: E402


def timed(command: list[str], cwd: Path, log: Path) -> float:
    """Seconds ``command`` took; its output goes to ``log``; a failure stops the benchmark."""
    started = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.call(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    elapsed = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"{' '.join(command)} failed with exit status {code} after {elapsed:.0f} s: see {log}")
    return elapsed


@contextlib.contextmanager
def held(lock: Path | None) -> Iterator[None]:
    """``lock`` held exclusively (``flock``), as the other heavy runs of a shared machine take it."""
    if lock is None:
        yield
        return
    with lock.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--test", action="store_true", help="also time `make test` (the whole suite)")
    parser.add_argument("--keep", action="store_true", help="keep the clone and its logs")
    parser.add_argument("--lock", type=Path, help="a lock file to hold (flock) while the demo and the tests run")
    results.add_argument(parser)
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="skipinject-first-run-"))
    clone = work / "skipinject"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "checkout", "--quiet", results.commit().removesuffix("+changes")], cwd=clone, check=True)
    figures = {"setup_s": timed(["make", "setup"], clone, work / "setup.log")}
    with held(args.lock):
        figures["demo_s"] = timed(["make", "demo"], clone, work / "demo.log")
        if args.test:
            figures["test_s"] = timed(["make", "test"], clone, work / "test.log")
    print(", ".join(f"{name.removesuffix('_s')} {seconds:.0f} s" for name, seconds in figures.items()))
    if args.record:
        results.record("first_run", {key: round(value, 1) for key, value in figures.items()}, load_start)
    if args.keep:
        print(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
