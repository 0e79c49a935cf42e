"""Lazy start-up (``skipinject/_bootstrap/sitecustomize.py``): a watched package's first import starts skipinject."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import skipinject

SITECUSTOMIZE = Path(skipinject.__file__).parent / "_bootstrap" / "sitecustomize.py"

PROBE = """
import importlib.util, runpy, sys
spec = importlib.util.spec_from_file_location("lazy_start", {sitecustomize!r})
lazy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lazy)
started = []
lazy._start_skipinject = lambda hand_on_only=False: started.append(sys.argv[1])
sys.meta_path.insert(0, lazy._StartOnImport([sys.argv[1], "ray"]))
{body}
print(started)
"""


def probe(tmp_path: Path, package: str, body: str) -> str:
    (tmp_path / f"{package}.py").write_text("print('ran as', __name__)\n")
    code = PROBE.format(sitecustomize=str(SITECUSTOMIZE), body=textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "PYTHON"))}
    proc = subprocess.run(
        [sys.executable, "-c", code, package], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_package_looked_up_before_its_import_still_starts_skipinject(tmp_path: Path) -> None:
    # find_spec is how libraries ask "is X installed?" (transformers, verl): it must not use up the watch
    body = """
    assert importlib.util.find_spec("watched_pkg") is not None
    import watched_pkg
    assert type(watched_pkg.__loader__).__name__ == "SourceFileLoader"
    """
    assert probe(tmp_path, "watched_pkg", body).splitlines()[-1] == "['watched_pkg']"


def test_a_watched_module_run_as_main_runs(tmp_path: Path) -> None:
    # python -m watched_mod: runpy asks the spec's loader for the code
    out = probe(tmp_path, "watched_mod", 'runpy.run_module("watched_mod", run_name="__main__")\nimport watched_mod')
    assert out.splitlines() == ["ran as __main__", "ran as watched_mod", "['watched_mod']"]
