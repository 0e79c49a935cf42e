"""The runner's own command line: ``-c``, ``--skip-config``, environment variables, exit 2 in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = (sys.executable, "-m", "skipinject")


def run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP"))}
    return subprocess.run([*RUNNER, *args], capture_output=True, text=True, env={**clean, **env}, timeout=120)


def test_dash_c_runs_code_like_python() -> None:
    code = "import sys; print(__name__, sys.argv); sys.exit(4)"
    ours = run(["-c", code, "a", "b"])
    plain = subprocess.run([sys.executable, "-c", code, "a", "b"], capture_output=True, text=True)
    assert ours.returncode == plain.returncode == 4 and ours.stdout == plain.stdout


def test_an_interrupted_program_ends_as_under_python(tmp_path: Path) -> None:
    """Ctrl-C: killed by SIGINT, the traceback from the program's first frame (not the runner's frames)."""
    script = tmp_path / "interrupted.py"
    script.write_text("def train():\n    raise KeyboardInterrupt\n\ntrain()\n")
    ours = run([str(script)])
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert ours.returncode == plain.returncode == -2 and ours.stderr == plain.stderr, ours.stderr


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SKIPINJECT_LOG_LEVEL": "chatty"}, "SKIPINJECT_LOG_LEVEL"),
        ({"SKIPINJECT_DISABLE": "sometimes"}, "SKIPINJECT_DISABLE"),
        ({"SKIPINJECT_DEBUG": "verbose"}, "SKIPINJECT_DEBUG"),
        ({"VERL_SKIP_PLUGINS": "rollout,,rollout,-nope_xyz"}, "nope_xyz"),
    ],
)
def test_bad_environment_exits_2_in_one_line(env: dict[str, str], named: str) -> None:
    proc = run(["-c", "print('started')"], **env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and named in lines[0] and "started" not in proc.stdout


def test_duplicated_plugin_name_is_accepted_once() -> None:
    proc = run(["-c", "print('started')"], VERL_SKIP_PLUGINS="rollout,rollout")
    assert proc.returncode == 0 and proc.stdout.strip() == "started", proc.stderr


def test_skip_config_file_is_read_and_validated(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(f"skip:\n  rollout:\n    enable: true\n    steps: 1-3\n    dump_dir: {tmp_path}\n")
    code = "import os, json; print(os.environ['SKIPINJECT_CONFIG'])"
    proc = run(["--skip-config", str(good), "-c", code, "skip.rollout.action=repeat"])
    assert proc.returncode == 0, proc.stderr
    assert '"steps":"[1-3]"' in proc.stdout and '"action":"repeat"' in proc.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("skip:\n  rollout:\n    steps: [x]\n")
    proc = run(["--skip-config", str(bad), "-c", "print('started')"])
    assert proc.returncode == 2 and proc.stderr.strip().startswith("skipinject: error: skip.rollout.steps")


def test_too_many_scattered_steps_are_refused_before_the_program_starts(tmp_path: Path) -> None:
    """Accepted settings must reach every process (an environment variable is at most 128 KiB on Linux)."""
    settings = tmp_path / "many.yaml"
    steps = ",".join(str(i) for i in range(0, 200000, 2))  # 100k steps, ~490 KB: a settings file
    settings.write_text(f"skip:\n  rollout:\n    enable: true\n    steps: [{steps}]\n")
    proc = run(["--skip-config", str(settings), "-c", "print('started')"])
    lines = proc.stderr.strip().splitlines()
    assert (
        proc.returncode == 2 and len(lines) == 1 and "skip.rollout.steps" in lines[0] and "started" not in proc.stdout
    )


def test_cache_tool_validates_its_variable_too() -> None:
    proc = run(["cache", "ls", "/nonexistent-dump-dir"], SKIPINJECT_DEBUG="verbose")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "SKIPINJECT_DEBUG" in lines[0]


def test_without_a_role_setting_the_runner_loads_no_plugin_and_no_engine() -> None:
    """Issue 25 item 5: the runner's own start-up costs almost nothing when no setting names a role."""
    code = (
        "import sys; loaded = [m for m in sys.modules if m.startswith(('skipinject_', 'skipinject.engine', "
        "'skipinject.store', 'omegaconf', 'pluggy'))]; print(sorted(loaded))"
    )
    assert run(["-c", code]).stdout.strip() == "[]"
    with_role = run(["-c", code, "skip.rollout.enable=False"])
    assert with_role.returncode == 0 and "skipinject_rollout" in with_role.stdout, with_role.stderr


@pytest.mark.parametrize(
    ("args", "prefix"),
    [
        (["cache", "ls", "."], "skipinject cache ls: error: "),
        (["--version"], "skipinject: error: "),
        (["-c", "pass", "skip.rollout.enable=True"], "skipinject: error: "),
    ],
)
def test_a_python_without_skipinjects_dependencies_says_which_and_how_to_install(
    args: list[str], prefix: str, tmp_path: Path
) -> None:
    """skipinject from a clone's sources with a Python that lacks its dependencies (``-S``: no site-packages):
    one line naming them and the command that installs them, exit 2 — not an internal error or a traceback."""
    from tests.conftest import ROOT

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP"))}
    done = subprocess.run(
        [sys.executable, "-S", "-m", "skipinject", *args],
        capture_output=True,
        text=True,
        env={**clean, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"{prefix}this Python ({sys.executable}) lacks skipinject's dependencies: wrapt, ")
    assert line.endswith(f"{sys.executable} -m pip install 'wrapt>=1.16' 'importlib-metadata>=6' 'pluggy>=1.3' "
                         "'omegaconf>=2.3' 'packaging>=23' 'zstandard>=0.22'")  # fmt: skip


def test_the_dependencies_named_are_the_packages(tmp_path: Path) -> None:
    import tomllib

    from skipinject.invocation import DEPENDENCIES
    from tests.conftest import ROOT

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert sorted(DEPENDENCIES.values()) == sorted(declared)


def test_the_program_sees_builtins_as_python_gives_them(tmp_path: Path) -> None:
    """``__builtins__`` is the module in a script, ``-c`` code and a ``-m`` module, as under python."""
    (tmp_path / "prog.py").write_text("__builtins__.DEBUG = 1\nprint(DEBUG)\n")
    for args in (["-c", "__builtins__.DEBUG = 1; print(DEBUG)"], [str(tmp_path / "prog.py")]):
        assert run([*args, "skip.rollout.enable=True"]).stdout == "1\n"
    module = subprocess.run(
        [*RUNNER, "-m", "prog", "skip.rollout.enable=True"], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert module.stdout == "1\n", module.stderr


def test_a_program_read_from_stdin_runs_as_under_python() -> None:
    code = "import sys; print(__name__, sys.argv)"
    ours = subprocess.run([*RUNNER, "-", "a"], input=code, capture_output=True, text=True, timeout=120)
    plain = subprocess.run([sys.executable, "-", "a"], input=code, capture_output=True, text=True)
    assert ours.returncode == plain.returncode == 0 and ours.stdout == plain.stdout, ours.stderr


def test_dash_c_runs_in_a_removed_working_directory(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    code = f"import os; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); import subprocess, sys; " + (
        "sys.exit(subprocess.run([sys.executable, '-m', 'skipinject', '-c', 'print(7)']).returncode)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "7\n", done.stderr


def test_a_users_sitecustomize_is_the_one_its_children_import(tmp_path: Path) -> None:
    """The runner's start-up module runs the user's ``sitecustomize`` and leaves it as the module of that name."""
    (tmp_path / "sitecustomize.py").write_text("GREETING = 'hi'\n")
    reads = "import sitecustomize; print(sitecustomize.GREETING)"
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {reads!r}])"
    done = run(["-c", child, "skip.rollout.enable=True", "skip.rollout.steps=[1]"], PYTHONPATH=str(tmp_path))
    assert done.stdout == "hi\n", done.stderr
