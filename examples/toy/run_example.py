"""Run the toy trainer twice under skipinject: run 1 generates and caches steps 1-2, run 2 loads them.

python examples/toy/run_example.py     # or: make example
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="skipinject_toy_") as dump_dir:
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
        print("$", " ".join(command[2:]))
        for run in (1, 2):
            print(f"--- run {run}", flush=True)
            started = time.perf_counter()
            proc = subprocess.run(command, cwd=HERE, check=False)
            print(f"--- run {run}: exit {proc.returncode} in {time.perf_counter() - started:.1f} s", flush=True)
            if proc.returncode:
                return proc.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
