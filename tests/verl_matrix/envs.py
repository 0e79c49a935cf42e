"""Build one virtual environment per tested verl version, from its pinned lock.

    python tests/verl_matrix/envs.py 0.8.0          # builds .venvs/verl-0.8.0 (idempotent)
    python tests/verl_matrix/envs.py --python 0.8.0 # prints the env's python, building if needed

Each lock is ``requirements/verl-<version>.txt`` (``requirements/lock.txt`` for 0.9.1): exact
``==`` pins installed with ``--no-deps`` after ``torch==2.13.0`` (an unpinned torch pulls a
multi-GB CUDA build; verl's own pins conflict with what it really needs on CPU). skipinject (with
the built-in roles) and every plugin distribution under ``plugins/`` are then installed editable.
A stamp holding a hash of the lock and of the project metadata makes a second call a no-op.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"
VERSIONS = ("0.9.1", "0.8.0", "0.7.1", "0.6.1", "0.5.0", "0.4.1")
NEWEST = "0.9.1"
#: Distributions of older set-ups whose roles now ship inside skipinject's own wheel.
OBSOLETE = ("skipinject-rollout", "skipinject-rollout-tq")


def lock_file(version: str) -> Path:
    if version == NEWEST:
        return ROOT / "requirements" / "lock.txt"
    return ROOT / "requirements" / f"verl-{version}.txt"


def env_dir(version: str) -> Path:
    if version == NEWEST:
        return ROOT / ".venv"
    return ROOT / ".venvs" / f"verl-{version}"


def env_python(version: str) -> Path:
    return env_dir(version) / "bin" / "python"


def _plugins() -> list[Path]:
    return sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml"))


def _digest(version: str) -> str:
    h = hashlib.sha256(TORCH.encode())
    for path in [lock_file(version), ROOT / "pyproject.toml", *(p / "pyproject.toml" for p in _plugins())]:
        h.update(path.read_bytes())
    return h.hexdigest()


def _stamp(version: str) -> Path:
    return env_dir(version) / ".skipinject-matrix-stamp"


def is_built(version: str) -> bool:
    stamp = _stamp(version)
    return env_python(version).exists() and stamp.exists() and stamp.read_text() == _digest(version)


def build(version: str, *, quiet: bool = True) -> Path:
    """Create (or bring up to date) the env for ``version``; return its python."""
    if version not in VERSIONS:
        raise SystemExit(f"unknown verl version {version!r}; tested: {', '.join(VERSIONS)}")
    if is_built(version):
        return env_python(version)
    py = env_python(version)
    q = ["-q"] if quiet else []
    if not py.exists():
        env_dir(version).parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(env_dir(version))], check=True)
    pip = [str(py), "-m", "pip", "install", *q, "--disable-pip-version-check"]
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, "--no-deps", "-r", str(lock_file(version))], check=True)
    uninstall = [str(py), "-m", "pip", "uninstall", "-q", "-y", "--disable-pip-version-check", *OBSOLETE]
    subprocess.run(uninstall, check=True, capture_output=True)  # pip skips, with a warning, what is absent
    editable = [a for p in [ROOT, *_plugins()] for a in ("-e", str(p))]
    subprocess.run([*pip, "--no-deps", "--no-build-isolation", *editable], check=True)
    _stamp(version).write_text(_digest(version))
    return py


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", nargs="+", metavar="VERSION", help=f"one of {', '.join(VERSIONS)}")
    parser.add_argument("--python", action="store_true", help="print the python of each env")
    args = parser.parse_args(argv)
    for version in args.versions:
        start = time.monotonic()
        fresh = not is_built(version)
        py = build(version)
        if args.python:
            print(py)
        else:
            took = f"built in {time.monotonic() - start:.0f} s" if fresh else "up to date"
            print(f"verl {version}: {py} ({took})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
