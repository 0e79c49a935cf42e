"""Build one virtual environment per tested verl version, from its pinned lock.

    python tests/verl_matrix/envs.py 0.8.0          # builds .venvs/verl-0.8.0 (idempotent)
    python tests/verl_matrix/envs.py --python 0.8.0 # prints the env's python, building if needed

Each lock is ``requirements/verl-<version>.txt`` (``requirements/lock.txt`` for 0.9.1): exact
``==`` pins installed with ``--no-deps`` after ``torch==2.13.0`` (an unpinned torch pulls a
multi-GB CUDA build; verl's own pins conflict with what it really needs on CPU). skipinject (with
the built-in roles) and every plugin distribution under ``plugins/`` are then installed editable.
A stamp holding a hash of the lock and of the project metadata makes a second call a no-op.

Most pins of an older verl's lock are the set-up's own (torch, Ray, transformers, ...): before pip
runs, every distribution ``.venv`` holds at exactly the pinned version is hard-linked into the new
environment, file by file from its ``RECORD`` (:func:`seed`), so pip installs only the few that
differ (verl, numpy, pandas, ...): a build takes well under a minute instead of 5-6.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"
VERSIONS = ("0.9.1", "0.9.0", "0.8.0", "0.7.1", "0.6.1", "0.5.0", "0.4.1")
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


def site_packages(env: Path) -> Path:
    """An environment's site-packages (its python is this interpreter's version: both come from it)."""
    return env / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(lock: Path) -> dict[str, str]:
    """``name==version`` lines of a lock (normalised name -> version); options and comments skipped."""
    found = {}
    for line in lock.read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep and name and not name.startswith("-"):
            found[_normalise(name)] = version.split(";", 1)[0].strip()
    return found


def _metadata(dist_info: Path) -> tuple[str, str]:
    name = version = ""
    with open(dist_info / "METADATA", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if not line.strip():
                break
            key, _, value = line.partition(":")
            if key == "Name":
                name = value.strip()
            elif key == "Version":
                version = value.strip()
    return _normalise(name), version


def _matches(installed: str, pinned: str) -> bool:
    """``2.13.0+cpu`` satisfies ``==2.13.0`` (a pin without a local label ignores it, as pip does)."""
    return installed == pinned or installed.startswith(pinned + "+")


def _place(source: Path, target: Path, base_env: Path, env: Path) -> None:
    """A hard link of ``source`` at ``target``; a script whose shebang names the base env's python is
    rewritten for the new env instead (a copy), and a copy is made where linking is impossible."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shebang = f"#!{base_env}/bin/".encode()
    with open(source, "rb") as handle:
        head = handle.read(len(shebang))
    if head == shebang:
        data = source.read_bytes().replace(shebang, f"#!{env}/bin/".encode(), 1)
        target.write_bytes(data)
        shutil.copymode(source, target)
        return
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def seed(env: Path, lock: Path, base_env: Path) -> list[str]:
    """Hard-link into ``env`` every distribution of ``base_env`` that ``lock`` pins at its version.

    Only installed-from-an-index distributions (no ``direct_url.json``: editable and local installs
    are left to pip) that ``env`` does not have yet. A file is never written through a link: pip
    replaces files (unlink, then write) and Python writes bytecode to a new file, so the two
    environments cannot change each other. Returns the names linked; pip installs the rest.
    """
    base_site, site = site_packages(base_env), site_packages(env)
    if not base_site.is_dir() or not site.is_dir():
        return []
    wanted = pins(lock)
    present = {_metadata(d)[0] for d in site.glob("*.dist-info") if (d / "METADATA").is_file()}
    linked = []
    for dist_info in sorted(base_site.glob("*.dist-info")):
        record = dist_info / "RECORD"
        if not record.is_file() or not (dist_info / "METADATA").is_file() or (dist_info / "direct_url.json").exists():
            continue
        name, version = _metadata(dist_info)
        if name in present or name not in wanted or not _matches(version, wanted[name]):
            continue
        with open(record, newline="", encoding="utf-8") as handle:
            paths = [row[0] for row in csv.reader(handle) if row]
        # The dist-info last: a distribution interrupted half-way is not installed for pip.
        paths.sort(key=lambda relative: relative.startswith(dist_info.name + "/"))
        for relative in paths:
            source = Path(os.path.normpath(base_site / relative))
            if source.is_relative_to(base_site):
                target = site / source.relative_to(base_site)
            elif source.is_relative_to(base_env):
                target = env / source.relative_to(base_env)
            else:
                continue  # outside the environment: not ours to copy
            if source.is_file() and not target.exists():
                _place(source, target, base_env, env)
        linked.append(name)
    return linked


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


@contextlib.contextmanager
def _building(version: str) -> Iterator[None]:
    """One build of an env at a time: a second caller (the test session's background build and the
    test that needs the env) waits, then finds it built."""
    lock = env_dir(version).with_name(env_dir(version).name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(version: str, *, quiet: bool = True) -> Path:
    """Create (or bring up to date) the env for ``version``; return its python."""
    if version not in VERSIONS:
        raise SystemExit(f"unknown verl version {version!r}; tested: {', '.join(VERSIONS)}")
    if is_built(version):
        return env_python(version)
    with _building(version):
        if not is_built(version):
            _build(version, quiet=quiet)
    return env_python(version)


def _build(version: str, *, quiet: bool) -> None:
    py = env_python(version)
    q = ["-q"] if quiet else []
    if not py.exists():
        env_dir(version).parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(env_dir(version))], check=True)
    if version != NEWEST:
        seed(env_dir(version), lock_file(version), env_dir(NEWEST))
    pip = [str(py), "-m", "pip", "install", *q, "--disable-pip-version-check"]
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, "--no-deps", "-r", str(lock_file(version))], check=True)
    uninstall = [str(py), "-m", "pip", "uninstall", "-q", "-y", "--disable-pip-version-check", *OBSOLETE]
    subprocess.run(uninstall, check=True, capture_output=True)  # pip skips, with a warning, what is absent
    editable = [a for p in [ROOT, *_plugins()] for a in ("-e", str(p))]
    subprocess.run([*pip, "--no-deps", "--no-build-isolation", *editable], check=True)
    _stamp(version).write_text(_digest(version))


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
