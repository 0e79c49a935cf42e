"""How skipinject is started from a shell: the command that works as printed here, and the one line said when
the Python running skipinject lacks one of its dependencies (a system ``python3`` in a clone, say).

Imports nothing of skipinject, nor any dependency: it must work where they are missing."""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import sys
from pathlib import Path

#: skipinject's own dependencies (pyproject.toml's ``dependencies``), by the module each one imports as.
DEPENDENCIES = {
    "wrapt": "wrapt>=1.16",
    "importlib_metadata": "importlib-metadata>=6",
    "pluggy": "pluggy>=1.3",
    "omegaconf": "omegaconf>=2.3",
    "packaging": "packaging>=23",
    "zstandard": "zstandard>=0.22",
}


def shown_path(path: Path | str, cwd: Path | None = None) -> str:
    """``path`` as a shell takes it, relative to ``cwd`` (default: the current directory) when inside it."""
    path, base = Path(path), Path.cwd() if cwd is None else cwd
    try:
        relative = path.relative_to(base)
    except ValueError:
        return shlex.quote(str(path))
    text = str(relative)
    return shlex.quote(text if "/" in text else f"./{text}")


def command(cwd: Path | None = None) -> str:
    """The command that runs skipinject with this Python, typed in a shell at ``cwd``: ``skipinject`` when that
    is the console script on ``PATH``, else the console script beside this Python (a virtual environment's
    ``bin``, which need not be on ``PATH``), else this Python's ``-m skipinject``."""
    python = Path(sys.executable)
    script = python.parent / "skipinject"
    if script.is_file() and os.access(script, os.X_OK):
        on_path = shutil.which("skipinject")
        if on_path is not None and Path(on_path).resolve() == script.resolve():
            return "skipinject"
        return shown_path(script, cwd)
    return f"{shown_path(python, cwd)} -m skipinject"


def missing_dependency(exc: BaseException) -> str | None:
    """The line for ``exc`` when it is one of skipinject's dependencies that cannot be imported: every missing
    one named, and how to go on; ``None`` for any other error."""
    if not isinstance(exc, ModuleNotFoundError) or (exc.name or "").partition(".")[0] not in DEPENDENCIES:
        return None
    missing = [module for module in DEPENDENCIES if _absent(module)] or [(exc.name or "").partition(".")[0]]
    python = shlex.quote(sys.executable)
    wanted = " ".join(shlex.quote(DEPENDENCIES[module]) for module in missing)
    names = ", ".join(DEPENDENCIES[module].partition(">")[0] for module in missing)
    return (
        f"this Python ({sys.executable}) lacks skipinject's dependencies: {names}. Run skipinject with the Python "
        f"it is installed in (in a clone, after make setup: .venv/bin/skipinject), or install them into this "
        f"one: {python} -m pip install {wanted}"
    )


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True
