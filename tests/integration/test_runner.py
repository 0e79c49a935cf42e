"""``python -m skipinject``: runs programs as python does, validates config first, reaches children."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FIXTURES, ROOT, toy_env

RUNNER = (sys.executable, "-m", "skipinject")


def run(args: list[str], env: dict[str, str], cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*RUNNER, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def result_of(proc: subprocess.CompletedProcess) -> dict[str, Any]:
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(f"no RESULT line:\n{proc.stdout}\n{proc.stderr}")


def test_script_runs_like_python(toy_site: Path):
    script = str(FIXTURES / "behaves_like_python.py")
    env = toy_env(toy_site)
    plain = subprocess.run([sys.executable, script, "a", "b"], capture_output=True, text=True, env=env)
    ours = run([script, "a", "b", "skip.toy.enable=false"], env)
    assert ours.returncode == plain.returncode == 0
    assert result_of(ours) == result_of(plain)

    for args, code in ((["exit", "3"], 3), (["raise"], 1)):
        plain = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env)
        ours = run([script, *args], env)
        assert ours.returncode == plain.returncode == code
    assert "ValueError: boom from the program" in ours.stderr
    assert "Traceback" in ours.stderr


def test_module_runs_like_python_dash_m(toy_site: Path, tmp_path: Path):
    env = toy_env(toy_site)
    data = tmp_path / "x.json"
    data.write_text('{"b": 1, "a": 2}')
    plain = subprocess.run(
        [sys.executable, "-m", "json.tool", "--sort-keys", str(data)], capture_output=True, text=True, env=env
    )
    ours = run(["-m", "json.tool", "--sort-keys", str(data), "++skip.toy.steps=[1]"], env)
    assert ours.returncode == 0 and ours.stdout == plain.stdout


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("skip.toy.steps=[1,x]", "skip.toy.steps"),
        ("skip.toy.enable=maybe", "skip.toy.enable"),
        ("skip.toy.action=skip", "skip.toy.action"),
        ("skip.toy.colour=red", "colour"),
        ("skip.nosuchrole.enable=true", "nosuchrole"),
        ("+skip.toy=1", "skip.toy"),
        ("skip.toy.enable", "skip.toy.enable"),
    ],
)
def test_bad_config_exits_2_before_the_program_with_one_line(toy_site: Path, override: str, named: str):
    script = str(FIXTURES / "behaves_like_python.py")
    proc = run(["--plugins", "toy", script, override], toy_env(toy_site))
    assert proc.returncode == 2
    assert "RESULT" not in proc.stdout, "the program must not start"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and lines[0].startswith("skipinject: error:")


def test_unknown_plugin_exits_2(toy_site: Path):
    proc = run(["--plugins", "toy,nope", str(FIXTURES / "behaves_like_python.py")], toy_env(toy_site))
    assert proc.returncode == 2 and "'nope'" in proc.stderr


def test_version_and_help(toy_site: Path):
    assert run(["--version"], toy_env(toy_site)).stdout.startswith("skipinject ")
    assert "usage:" in run(["--help"], toy_env(toy_site)).stdout


def test_list_shows_plugins_roles_and_targets(toy_site: Path):
    out = run(["--list"], toy_env(toy_site)).stdout
    assert "plugin toy (skipinject-toy-plugin 1.2.3)" in out
    assert "role toy_score" in out
    assert "target toy_targets:score  verl any  [ok]" in out
    assert "verl.experimental.agent_loop.agent_loop:AgentLoopManager.generate_sequences" in out


def test_miss_then_hit_in_the_program_and_in_its_child_process(toy_site: Path, tmp_path: Path):
    """Hooks and config reach a child Python process the program starts (SPEC §7)."""
    script = str(FIXTURES / "child_program.py")
    args = [
        "--plugins",
        "toy",
        script,
        "2",
        "skip.toy.enable=True",
        "skip.toy.steps=[1,2]",
        f"skip.toy.dump_dir={tmp_path}",
    ]
    first = run(args, toy_env(toy_site))
    assert first.returncode == 0, first.stderr
    result = result_of(first)
    assert result["argv"] == [script, "2"], "skip.* overrides must not reach the program"
    assert result["parent"][1].count("generate") == 2  # run 1, parent: miss → generated and saved
    assert result["child"][1].count("generate") == 0  # the child ran later: served from the cache
    assert result["child"][0] == result["parent"][0]
    assert "toy step 1: miss" in first.stderr and "toy step 1: saved" in first.stderr

    second = result_of(run(args, toy_env(toy_site)))
    assert second["parent"][1].count("generate") == 0
    assert second["parent"][0] == result["parent"][0]


def test_disable_env_turns_everything_off(toy_site: Path, tmp_path: Path):
    script = str(FIXTURES / "child_program.py")
    args = [
        "--plugins",
        "toy",
        script,
        "1",
        "skip.toy.enable=True",
        "skip.toy.steps=[1]",
        f"skip.toy.dump_dir={tmp_path}",
    ]
    for _ in range(2):
        result = result_of(run(args, toy_env(toy_site, SKIPINJECT_DISABLE="1")))
        assert result["parent"][1].count("generate") == 1 and result["child"][1].count("generate") == 1
    assert not any(tmp_path.iterdir())


@pytest.mark.ray
def test_hooks_reach_a_real_ray_actor(toy_site: Path, tmp_path: Path):
    """Run 1 misses in the actor and run 2 hits there. The driver's summary counts what the actor did:
    in run 2 the actor does not see the driver's report directory, as on another node, and its counts
    reach the driver through the cluster's key-value store."""
    script = str(FIXTURES / "ray_program.py")
    args = [
        "--plugins",
        "toy",
        script,
        "2",
        "skip.toy.enable=True",
        "skip.toy.steps=[2]",
        f"skip.toy.dump_dir={tmp_path}",
    ]
    env = toy_env(toy_site, RAY_DEDUP_LOGS="0")
    first = run(args, env, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    one = result_of(first)
    assert one["pid"] != one["driver_pid"]
    assert one["wrapper"] == "SkipinjectWrapper", "the target must be patched inside the actor"
    assert one["calls"].count("generate") == 2
    assert (tmp_path / "skipinject_default" / "toy" / "2" / "meta.json").is_file()
    assert "summary: toy: 0 steps served, 1 generated, 0 failed" in first.stderr, first.stderr[-3000:]

    second = run([*args[:4], "other-node", *args[4:]], env, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    two = result_of(second)
    assert two["calls"].count("generate") == 1, "step 2 must be served from the cache inside the actor"
    assert two["outputs"] == one["outputs"]
    assert "summary: toy: 1 steps served, 0 generated, 0 failed" in second.stderr, second.stderr[-3000:]
    # (The actor's "hit" log line is forwarded by Ray asynchronously and may miss the driver's shutdown.)
    os.environ.pop("SKIPINJECT_CONFIG", None)


CONSOLE_SCRIPT = Path(sys.executable).parent / "skipinject"


def test_the_console_script_is_python_dash_m_skipinject(tmp_path: Path):
    """``skipinject`` has the current directory first on sys.path, as ``python -m skipinject`` has: a plugin
    module beside the script loads (examples/toy), and the program sees the same sys.path either way."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP", "PYTHONPATH"))}
    toy = ROOT / "examples" / "toy"
    settings = ["skip.toy_rollout.enable=True", "skip.toy_rollout.steps=[1]", f"skip.toy_rollout.dump_dir={tmp_path}"]
    for command in ([str(CONSOLE_SCRIPT)], list(RUNNER)):
        proc = subprocess.run(
            [*command, "--plugins", "toy_skip_plugin", "train.py", "1", *settings],
            capture_output=True,
            text=True,
            env=env,
            cwd=toy,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert "toy_rollout step 1:" in proc.stderr
    show = "import json, sys; print(json.dumps(sys.path))"
    (tmp_path / "show.py").write_text(show)
    for program in (["-c", show], ["show.py"], ["-m", "show"]):
        paths = [
            subprocess.run([*command, *program], capture_output=True, text=True, env=env, cwd=tmp_path).stdout
            for command in ([str(CONSOLE_SCRIPT)], list(RUNNER), [sys.executable])
        ]
        assert json.loads(paths[0]) == json.loads(paths[1]) == json.loads(paths[2]), program


def test_the_programs_traceback_is_pythons(tmp_path: Path):
    script = tmp_path / "boom.py"
    script.write_text("def fail():\n    raise ValueError('boom')\n\nfail()\n")
    (tmp_path / "broken.py").write_text("x = (\n")
    for program in (["boom.py", "a"], ["broken.py"], ["-c", "import json; json.loads('{')"]):
        plain = subprocess.run([sys.executable, *program], capture_output=True, text=True, cwd=tmp_path)
        ours = subprocess.run([*RUNNER, *program], capture_output=True, text=True, cwd=tmp_path)
        assert ours.returncode == plain.returncode == 1
        assert ours.stderr == plain.stderr, program


@pytest.mark.parametrize(
    ("args", "env", "code", "line"),
    [
        (
            ["-m", "nosuch.module"],
            {},
            1,
            "skipinject: error: Error while finding module specification for 'nosuch.module'",
        ),
        (["-m", "json"], {}, 1, "skipinject: error: No module named json.__main__; 'json' is a package"),
        (["nosuch.py"], {}, 2, "skipinject: error: can't open file 'nosuch.py': no such file"),
        (["--plugins", "rolout", "-c", "0"], {}, 2, "skipinject: error: --plugins: unknown plugin 'rolout'"),
        (
            ["-c", "0"],
            {"VERL_SKIP_PLUGINS": "rolout"},
            2,
            "skipinject: error: VERL_SKIP_PLUGINS: unknown plugin 'rolout'",
        ),
        (["-c", "0", "skip.rollout.acton=cache"], {}, 2, "skipinject: error: skip.rollout.acton: unknown key"),
        (["--plugin", "rollout", "-c", "0"], {}, 2, "skipinject: error: unrecognized arguments: --plugin; did you"),
        (["cache", "compat"], {}, 2, "skipinject cache: error: unknown command 'compat'"),
    ],
)
def test_every_user_error_is_one_line(tmp_path: Path, args: list[str], env: dict[str, str], code: int, line: str):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP"))}
    proc = subprocess.run([*RUNNER, *args], capture_output=True, text=True, env={**clean, **env}, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1 and lines[0].startswith(line), proc.stderr
    if "rolout" in line or "acton" in line or "compat" in line:
        assert "did you mean" in lines[0]


@pytest.mark.parametrize("mode", ["enable", "auto"])
def test_enable_from_python_installs_skipinject_here_and_in_child_processes(
    toy_site: Path, tmp_path: Path, mode: str
) -> None:
    """``skipinject.enable(...)`` and ``import skipinject.auto``: a launcher started by plain python gets
    what the runner gives, in its own process and in the Python processes it starts."""
    settings = ["skip.toy.enable=True", "skip.toy.steps=[1,2]", f"skip.toy.dump_dir={tmp_path}"]
    command = [sys.executable, str(FIXTURES / "enable_program.py"), mode, "2", *settings]
    env = toy_env(toy_site, VERL_SKIP_PLUGINS="toy")
    first = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert first.returncode == 0, first.stderr
    result = result_of(first)
    assert result["argv"][1:] == ["2"], "skip.* settings must not reach the program"
    assert result["parent"][1].count("generate") == 2 and result["child"][1].count("generate") == 0
    assert "toy step 1: miss" in first.stderr and "toy step 1: saved" in first.stderr
    assert first.stderr.count("already installed in this process") == (1 if mode == "enable" else 0)
    second = result_of(subprocess.run(command, capture_output=True, text=True, env=env, timeout=120))
    assert second["parent"][1].count("generate") == 0 and second["parent"][0] == result["parent"][0]
    bad = subprocess.run([*command, "skip.toy.action=sometimes"], capture_output=True, text=True, env=env)
    assert bad.returncode != 0 and "skip.toy.action=sometimes" in bad.stderr and "RESULT" not in bad.stdout
