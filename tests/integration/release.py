"""Build every distribution of the repository as a release does: an sdist from the source tree, then
the wheel from that unpacked sdist (what ``python -m build`` does), by calling hatchling's PEP 517
hooks in a subprocess -- no build isolation, so nothing is fetched (hatchling is in the lock)."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def projects() -> dict[str, Path]:
    """Distribution directory name -> project directory: the core, then each ``plugins/*`` distribution."""
    found = {"skipinject": ROOT}
    for pyproject in sorted((ROOT / "plugins").glob("*/pyproject.toml")):
        found[pyproject.parent.name] = pyproject.parent
    return found


@dataclass(frozen=True)
class Release:
    sdist: Path
    wheel: Path


def _hook(project: Path, hook: str, out: Path) -> Path:
    code = f"import sys, hatchling.build as b; print(b.{hook}(sys.argv[1]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(out)], cwd=project, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{hook} of {project} failed:\n{proc.stderr[-3000:]}"
    return out / proc.stdout.strip().splitlines()[-1]


def build_release(out: Path) -> dict[str, Release]:
    """sdist and wheel of every distribution in ``out`` (wheels built from the unpacked sdists)."""
    out.mkdir(parents=True, exist_ok=True)
    unpacked = out / "unpacked"
    built = {}
    for name, project in projects().items():
        sdist = _hook(project, "build_sdist", out)
        with tarfile.open(sdist) as archive:
            archive.extractall(unpacked, filter="data")
        source = unpacked / sdist.name.removesuffix(".tar.gz")
        built[name] = Release(sdist, _hook(source, "build_wheel", out))
    return built
