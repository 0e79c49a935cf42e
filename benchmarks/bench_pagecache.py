"""What writing N MB costs this machine's kernel, apart from any format: the floor under every save.

Writes one buffer (already in memory) to a new file and fsyncs it, three ways: into page-cache
pages never used before (a new file while the old ones are kept), into pages another file just
freed (the previous file deleted first), and first-touching the same amount of anonymous memory
(no file). On a VM whose host backs guest memory lazily (or takes freed pages back), fresh pages
cost far more than recycled ones; every save of a new file (skipinject's steps, upstream's dumps)
pays that, whatever it writes.

    python benchmarks/bench_pagecache.py --mb 682
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import results


def write(path: Path, buffer: np.ndarray) -> tuple[float, float]:
    start = time.perf_counter()
    with open(path, "wb") as handle:
        handle.write(memoryview(buffer))
        written = time.perf_counter()
        os.fsync(handle.fileno())
    return (written - start) * 1000, (time.perf_counter() - written) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=682)
    parser.add_argument("--dir", type=Path, default=None)
    results.add_argument(parser)
    args = parser.parse_args(argv)
    size = args.mb * 1_000_000
    load = os.getloadavg()[0]
    start = time.perf_counter()
    buffer = np.ones(size, dtype=np.uint8)  # first touch of fresh anonymous memory
    first_touch = (time.perf_counter() - start) * 1000
    del buffer
    start = time.perf_counter()
    buffer = np.ones(size, dtype=np.uint8)  # the same amount again, pages just freed
    second_touch = (time.perf_counter() - start) * 1000
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-pagecache-") as tmp:
        fresh = [write(Path(tmp) / f"new{i}", buffer) for i in range(2)]  # both kept: fresh pages each time
        for i in range(2):
            (Path(tmp) / f"new{i}").unlink()
        recycled = [write(Path(tmp) / "again", buffer)]  # into the pages the two deletions freed
    print(f"{args.mb} MB, load average {load:.1f} -> {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
    print(f"anonymous memory, first touch: {first_touch:.0f} ms; again after freeing: {second_touch:.0f} ms")
    for name, runs in (("new file, fresh page-cache pages", fresh), ("new file, pages just freed", recycled)):
        for write_ms, fsync_ms in runs:
            print(f"{name}: write {write_ms:.0f} ms + fsync {fsync_ms:.0f} ms = {write_ms + fsync_ms:.0f} ms")
    if args.record:
        figures = {"mb": args.mb, "first_touch_ms": first_touch, "second_touch_ms": second_touch}
        results.record("pagecache", {**figures, "fresh": fresh, "recycled": recycled}, load)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
