"""Run the toy trainer twice under skipinject: run 1 generates and caches steps 1-2, run 2 loads them.

The cache is kept (default ``examples/toy/cache``, emptied first) so that ``skipinject cache ls``
can be tried on it next::

    python examples/toy/run_example.py [--dump-dir DIR]     # or: make example
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump-dir", type=Path, default=HERE / "cache", help="where the cache is kept")
    dump_dir = parser.parse_args().dump_dir.resolve()
    shutil.rmtree(dump_dir, ignore_errors=True)  # run 1 starts from an empty cache
    command = [
        sys.executable,
        "-m",
        "skipinject",
        "--plugins",
        "toy_skip_plugin",
        "train.py",
        "3",
        "skip.toy_rollout.enable=True",
        "skip.toy_rollout.steps=[1,2]",
        f"skip.toy_rollout.dump_dir={dump_dir}",
    ]
    print("$ python -m", " ".join(command[2:]))
    for run in (1, 2):
        print(f"--- run {run}", flush=True)
        started = time.perf_counter()
        proc = subprocess.run(command, cwd=HERE, check=False)
        print(f"--- run {run}: exit {proc.returncode} in {time.perf_counter() - started:.1f} s", flush=True)
        if proc.returncode:
            return proc.returncode
    from skipinject.invocation import command, shown_path

    print(f"the cache is kept in {dump_dir}; try: {command()} cache ls {shown_path(dump_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
