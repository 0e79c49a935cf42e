"""The plugin guide's snippets (docs/plugins.md), pip-installed and run through the runner; the verl role resolves in
the real verl (the snippets' verl-free tests are in ``tests/unit/test_readme_snippet.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_readme_snippet import USER_PROGRAM, doc, project, snippets

__all__ = ["doc", "project"]  # fixtures, used by name


def test_installed_with_pip_and_run_through_the_runner(project: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(project / "my-recipe-skip"),
        ],
        check=True,
        capture_output=True,
    )
    (tmp_path / "train.py").write_text(USER_PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(project / "recipe")])
    env["VERL_SKIP_PLUGINS"] = "judge"  # the entry-point name from the pyproject snippet

    listing = subprocess.run(
        [sys.executable, "-m", "skipinject", "--list"], env=env, capture_output=True, text=True, timeout=120
    )
    assert listing.returncode == 0, listing.stderr
    assert "plugin judge (my-recipe-skip 0.1.0)" in listing.stdout
    assert "target my_recipe.trainer:MyTrainer.score_with_judge  verl any  [ok]" in listing.stdout

    dump = tmp_path / "dump"
    argv = [sys.executable, "-m", "skipinject", "train.py", "skip.judge.enable=True", "skip.judge.steps=[1-2]"]
    argv.append(f"skip.judge.dump_dir={dump}")
    runs = [subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120) for _ in (1, 2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    first, second = runs
    assert "judge calls: 3" in first.stdout and "judge calls: 1" in second.stdout  # step 3 is not cached
    scores = [line for line in first.stdout.splitlines() if line.startswith("step ")]
    assert scores == [line for line in second.stdout.splitlines() if line.startswith("step ")]
    assert "judge step 1: miss" in first.stderr and "judge step 2: saved 4 rows" in first.stderr
    assert "judge step 1: hit, served step 1" in second.stderr and "judge step 2: hit" in second.stderr
    assert "judge step 3" not in first.stderr + second.stderr


def test_verl_role_snippet_declares_a_target_that_resolves(doc: Path) -> None:
    parts = snippets(doc)
    if "verl-role" not in parts:
        pytest.skip("no verl-role snippet")
    namespace: dict[str, object] = {}
    exec(compile(parts["verl-role"], f"{doc.name}:verl-role", "exec"), namespace)
    role = namespace["REF_LOGPROB"]
    from skipinject import Role

    assert isinstance(role, Role) and role.name == "ref_logprob"
    pytest.importorskip("verl")
    from skipinject.listing import resolve

    assert [resolve(t.path) for t in role.targets] == ["ok"]
