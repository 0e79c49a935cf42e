"""The start of a run in the driver: one line per setting that cannot work, then one line per role
saying what it will do and how many of its chosen steps are cached (issue 34, part 1)."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from skipinject import Call, Role, StepSource, Target
from skipinject.config import Config, RoleConfig, StepSet
from skipinject.errors import ConfigError
from skipinject.report import start
from skipinject.testing import IntCodec, RoleRun, ToyTrainer

pytestmark = pytest.mark.unit


class Trainer(ToyTrainer):
    def generate(self, index: int) -> int:
        return 10 * self.global_steps + index


def toy_role() -> Role:
    return Role(
        name="toyrole",
        targets=[Target(f"{__name__}:Trainer.generate")],
        step=StepSource.attribute("global_steps"),
        codec=IntCodec(),
        cache_subdir="",
    )


def config(**roles: RoleConfig) -> Config:
    return Config(roles=roles)


def lines_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "skipinject"]


def test_an_enabled_role_without_steps_and_steps_without_enable_are_one_line_each() -> None:
    found = start.setting_problems(
        config(a=RoleConfig(enable=True), b=RoleConfig(steps=(1, 2, 3)), c=RoleConfig(enable=True, steps=(1,))),
        disabled=False,
    )
    assert found == [
        (
            logging.WARNING,
            "skip.a.enable=true but skip.a.steps is empty: the role acts at no step "
            "(give skip.a.steps=[1,2] or a range like 1-64)",
        ),
        (
            logging.WARNING,
            "skip.b.steps=1-3 is given but skip.b.enable is false: the role is off (add skip.b.enable=true)",
        ),
    ]
    assert start.setting_problems(config(c=RoleConfig(enable=True, steps=(1,))), disabled=False) == []


def test_skipinject_disabled_by_the_environment_says_so_once() -> None:
    found = start.setting_problems(
        config(a=RoleConfig(enable=True, steps=(1,)), b=RoleConfig(enable=True)), disabled=True
    )
    assert found == [
        (
            logging.WARNING,
            "skipinject is off (SKIPINJECT_DISABLE is set): skip.a and 1 more role(s) will not act in this run",
        )
    ]
    assert start.setting_problems(config(a=RoleConfig()), disabled=True) == []


def test_a_dump_dir_that_cannot_hold_a_cache_warns_or_stops_a_strict_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    settings = RoleConfig(enable=True, steps=(1,), dump_dir=str(blocker / "cache"))
    problem = start.dump_dir_problem("r", settings)
    assert problem == f"skip.r.dump_dir={blocker}/cache: {blocker} is not a directory: nothing can be cached there"
    assert start.check_settings(config(r=settings), disabled=False) == [(logging.WARNING, problem)]
    strict = RoleConfig(enable=True, steps=(1,), dump_dir=str(blocker), action="strict")
    with pytest.raises(ConfigError, match=r"not a directory.*action=strict relies on the cache"):
        start.check_settings(config(r=strict), disabled=False)
    assert start.dump_dir_problem("r", RoleConfig(enable=True, dump_dir=str(tmp_path / "new" / "dir"))) is None


def test_a_dump_dir_other_users_can_write_is_not_trusted(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    problem = start.dump_dir_problem("r", RoleConfig(enable=True, dump_dir=str(shared)))
    assert problem is not None and "writable by" in problem and "trust_dir_permissions" in problem
    assert (
        start.dump_dir_problem("r", RoleConfig(enable=True, dump_dir=str(shared), trust_dir_permissions=True)) is None
    )


def test_a_default_dump_dir_without_a_home_directory_is_a_line_not_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``HOME`` and a uid without a passwd entry (a container): ``~`` cannot be expanded."""
    import pwd

    def no_entry(uid: int) -> Any:
        raise KeyError(uid)

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    problem = start.dump_dir_problem("r", RoleConfig(enable=True, steps=(1,)))
    assert problem is not None and problem.startswith("skip.r.dump_dir=~/.verl/rollout_dump: not a usable directory")
    with pytest.raises(ConfigError, match=r"^skip\.r\.dump_dir=~/\.verl/rollout_dump: not a usable directory path"):
        start.check_settings(config(r=RoleConfig(enable=True, steps=(1,), action="strict")), disabled=False)


def test_the_role_line_counts_the_chosen_steps_cached_in_the_runs_layout(tmp_path: Path) -> None:
    with RoleRun(toy_role(), tmp_path, [1, 2]):
        Trainer().fit(2)
    roles = {"toyrole": toy_role()}
    run_config = Trainer().config
    layout = tmp_path / "e_p" / "GBS4_N2_in8_out8"

    def line(**settings: Any) -> str:
        found = start.layout_lines(
            config(toyrole=RoleConfig(enable=True, dump_dir=str(tmp_path), **settings)), roles, run_config
        )
        assert len(found) == 1 and found[0][0] == logging.INFO
        return found[0][1]

    assert line(steps=StepSet.parse("1-3")) == f"toyrole: cache steps 1-3 in {layout}: 2 cached, 1 to generate"
    assert line(steps=(2,), action="strict") == f"toyrole: strict step 2 in {layout}: 1 cached"
    assert (
        line(steps=(3, 4), action="strict")
        == f"toyrole: strict steps 3-4 in {layout}: 0 cached, 2 missing: the run stops at the first"
    )
    assert line(steps=StepSet.parse("1-10"), action="repeat") == (
        f"toyrole: repeat steps 1-10 in {layout}: 2 cached, 8 served from the nearest of the 2 cached step(s)"
    )
    assert line(steps=StepSet.parse("1-3"), action="refresh") == (
        f"toyrole: refresh steps 1-3 in {layout}: 2 cached, all generated and saved again"
    )
    assert line(steps=StepSet.parse("1-3"), save=False) == (
        f"toyrole: cache steps 1-3 in {layout}: 2 cached, 1 to generate; read-only (save=false): nothing is saved"
    )
    other = dict(run_config, data={**run_config["data"], "max_response_length": 16})
    found = start.layout_lines(
        config(toyrole=RoleConfig(enable=True, dump_dir=str(tmp_path), steps=StepSet.parse("1-3"))), roles, other
    )
    assert found[0][1].endswith("GBS4_N2_in8_out16: 0 cached, 3 to generate")
    last = dict(run_config, trainer={**run_config["trainer"], "total_training_steps": 2})
    found = start.layout_lines(
        config(toyrole=RoleConfig(enable=True, dump_dir=str(tmp_path), steps=StepSet.parse("1-64"))), roles, last
    )
    assert found[0][1].endswith(
        ": 2 cached, 0 to generate; steps 3-64 come after the run's last step (trainer.total_training_steps=2): "
        "never reached"
    ), "steps past the run's last are not counted, and said"


def test_chosen_steps_after_the_runs_last_step_are_named_in_the_start_line(tmp_path: Path) -> None:
    """``steps=[2-5]`` in a 2-step run: the start line says which chosen steps the run never reaches."""
    run_config = Trainer().config
    roles = {"toyrole": toy_role()}

    def line(steps: str, last: Any) -> str:
        found = start.layout_lines(
            config(toyrole=RoleConfig(enable=True, dump_dir=str(tmp_path), steps=StepSet.parse(steps))),
            roles,
            dict(run_config, trainer={**run_config["trainer"], "total_training_steps": last}),
        )
        return found[0][1].split("GBS4_N2_in8_out8: ", 1)[1]

    assert line("2-5", 2) == (
        "0 cached, 1 to generate; steps 3-5 come after the run's last step (trainer.total_training_steps=2): "
        "never reached"
    )
    assert line("[1,4]", 3) == (
        "0 cached, 1 to generate; step 4 comes after the run's last step (trainer.total_training_steps=3): "
        "never reached"
    )
    assert line("1-2", 2) == line("1-2", None) == "0 cached, 2 to generate", "all reached, or the last not known"


def test_the_role_lines_are_said_once_when_verl_gets_its_config(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    watch = start.RunStart(
        config(toyrole=RoleConfig(enable=True, dump_dir=str(tmp_path), steps=(1,))), {"toyrole": toy_role()}
    )
    called = []

    def run_ppo(config: Any, task_runner_class: Any = None) -> str:
        called.append(config)
        return "ran"

    run_config = Trainer().config
    with caplog.at_level(logging.INFO, "skipinject"):
        for _ in range(2):
            call = Call(start.RUN_ENTRY, run_ppo, None, (run_config,), {})
            assert watch.sync(call, lambda: run_ppo(run_config)) == "ran"
        watch.at_ray_init()
    assert lines_of(caplog) == [f"toyrole: cache step 1 in {tmp_path}/e_p/GBS4_N2_in8_out8: 0 cached, 1 to generate"]
    assert len(called) == 2


def test_without_verl_config_the_line_comes_at_ray_init(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = RoleConfig(enable=True, dump_dir=str(tmp_path), steps=StepSet.parse("1-4"))
    watch = start.RunStart(config(toyrole=settings), {})
    with caplog.at_level(logging.INFO, "skipinject"):
        watch.at_ray_init()
        watch.at_ray_init()
    assert lines_of(caplog) == [
        f"toyrole: cache steps 1-4 in {tmp_path}/<experiment>_<project>/GBS…_N…_in…_out…: the layout is the trainer's"
    ]


def run_runner(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "skipinject", "-c", "pass", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_the_runner_says_each_problem_before_the_program_and_stops_a_strict_run(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    done = run_runner("skip.rollout.steps=[1,2]", "skip.rollout_tq.enable=True")
    assert done.returncode == 0
    assert done.stderr.splitlines() == [
        "skipinject WARNING: skip.rollout.steps=1-2 is given but skip.rollout.enable is false: the role is off "
        "(add skip.rollout.enable=true)",
        "skipinject WARNING: skip.rollout_tq.enable=true but skip.rollout_tq.steps is empty: the role acts at no "
        "step (give skip.rollout_tq.steps=[1,2] or a range like 1-64)",
    ]
    done = run_runner("skip.rollout.enable=True", "skip.rollout.steps=[1]", env={"SKIPINJECT_DISABLE": "1"})
    assert done.returncode == 0 and "skipinject is off (SKIPINJECT_DISABLE is set)" in done.stderr
    strict = [f"skip.rollout.dump_dir={blocker}", "skip.rollout.action=strict"]
    done = run_runner("skip.rollout.enable=True", "skip.rollout.steps=[1]", *strict)
    assert done.returncode == 2
    assert done.stderr == (
        f"skipinject: error: skip.rollout.dump_dir={blocker}: {blocker} is not a directory: nothing can be cached "
        "there (skip.rollout.action=strict relies on the cache)\n"
    )


def test_the_driver_resolves_the_batch_size_the_v1_trainer_will_use(tmp_path: Path) -> None:
    """verl's V1 trainer sets ``data.gen_batch_size=1`` when it starts (async modes, group filtering): the
    driver's config does not say so yet, the start line does."""
    from skipinject.verl.layout import trainer_batch_size

    run_config = Trainer().config
    v1 = {**run_config, "trainer": {**run_config["trainer"], "use_v1": True}}
    assert trainer_batch_size(run_config) is None and trainer_batch_size(v1) is None  # V0; V1 sync mode
    separate = {**v1, "trainer": {**v1["trainer"], "v1": {"trainer_mode": "separate_async"}}}
    filtering = {**v1, "algorithm": {"filter_groups": {"enable": True}}}
    assert trainer_batch_size(separate) == trainer_batch_size(filtering) == 1
    settings = RoleConfig(enable=True, dump_dir=str(tmp_path), steps=(1,))
    found = start.layout_lines(config(toyrole=settings), {"toyrole": toy_role()}, separate)
    assert found[0][1] == f"toyrole: cache step 1 in {tmp_path}/e_p/GBS1_N2_in8_out8: 0 cached, 1 to generate"


def test_a_miss_names_the_same_step_cached_under_another_layout_or_run_name(tmp_path: Path) -> None:
    """Issue 34, part 3: a changed layout field or run name is named, as settings, at a miss."""
    from skipinject.report.misses import nearest_cache

    with RoleRun(toy_role(), tmp_path, [1]):
        Trainer(response_length=16).fit(1)
    settings = RoleConfig(enable=True, dump_dir=str(tmp_path), steps=(1, 2))
    here = start.open_store("toyrole", toy_role(), settings, Trainer(response_length=8).config)
    assert nearest_cache(here, 1) == (
        f"cached under another layout, {tmp_path}/e_p/GBS4_N2_in8_out16/1: data.max_response_length is 16 there, 8 here"
    )
    assert nearest_cache(here, 2) is None
    elsewhere = start.open_store("toyrole", toy_role(), settings, Trainer(experiment="e2", response_length=16).config)
    assert nearest_cache(elsewhere, 1) == (
        f"cached under another run name, {tmp_path}/e_p/GBS4_N2_in8_out16/1: "
        "trainer.experiment_name is 'e' there, 'e2' here"
    )


def test_the_search_for_the_nearest_cache_is_bounded(tmp_path: Path) -> None:
    import time

    from skipinject.report.misses import nearest_cache

    run = tmp_path / "e_p"
    for index in range(10_000):  # a layout of 10,000 cached steps, and many other layouts
        (run / "GBS4_N2_in8_out16" / str(index)).mkdir(parents=True)
    for gbs in range(5, 2000):
        (run / f"GBS{gbs}_N2_in8_out8").mkdir()
    (run / "GBS4_N2_in8_out16" / "9999" / "meta.json").write_text("{}")
    settings = RoleConfig(enable=True, dump_dir=str(tmp_path), steps=(9999,))
    here = start.open_store("toyrole", toy_role(), settings, Trainer().config)
    started = time.perf_counter()
    found = nearest_cache(here, 9999)
    assert time.perf_counter() - started < 0.5
    assert found is not None and "GBS4_N2_in8_out16/9999" in found


def test_at_ray_init_the_line_comes_from_the_config_of_the_run_ppo_calling_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``python -m skipinject -m verl.trainer.main_ppo`` runs main_ppo as ``__main__``: its ``run_ppo`` is
    seen when it starts Ray."""
    settings = RoleConfig(enable=True, dump_dir=str(tmp_path), steps=(1,))
    watch = start.RunStart(config(toyrole=settings), {"toyrole": toy_role()})

    def run_ppo(config: Any, task_runner_class: Any = None) -> None:
        watch.at_ray_init()  # as ray.init's interceptor calls it

    with caplog.at_level(logging.INFO, "skipinject"):
        run_ppo(Trainer().config)
    assert lines_of(caplog) == [f"toyrole: cache step 1 in {tmp_path}/e_p/GBS4_N2_in8_out8: 0 cached, 1 to generate"]


def test_at_ray_init_the_line_comes_from_a_launchers_own_config(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A launcher of the user's that holds verl's config under any name and starts Ray itself gets the
    layout line and the role's caveat (said only where verl's config is known); other locals that
    merely have a ``trainer`` attribute (a module, an object) are not taken for a config."""
    import types

    settings = RoleConfig(enable=True, dump_dir=str(tmp_path), steps=(1,))
    role = dataclasses.replace(toy_role(), caveat=lambda run, _: f"not exact with {run['trainer']['mode']}")
    watch = start.RunStart(config(toyrole=settings), {"toyrole": role})
    run_config = Trainer().config
    run_config["trainer"]["mode"] = "separate_async"

    def launch(composed: Any) -> None:
        module = types.SimpleNamespace(trainer=types.SimpleNamespace())  # like `import verl`: not a config
        assert module
        watch.at_ray_init()  # as ray.init's interceptor calls it

    with caplog.at_level(logging.INFO, "skipinject"):
        launch(run_config)
    assert lines_of(caplog) == [
        f"toyrole: cache step 1 in {tmp_path}/e_p/GBS4_N2_in8_out8: 0 cached, 1 to generate",
        "toyrole: not exact with separate_async",
    ]


def test_a_dump_dir_that_is_a_run_or_layout_directory_is_said_at_start(tmp_path: Path) -> None:
    """``dump_dir`` pointed at ``…/e_p`` (or ``…/e_p/GBS…``) would cache one level below it and find nothing:
    one line at start naming the directory to give (an error under ``strict``, which relies on the cache)."""
    with RoleRun(toy_role(), tmp_path, [1]):
        Trainer().fit(1)
    run, layout = tmp_path / "e_p", tmp_path / "e_p" / "GBS4_N2_in8_out8"
    assert (layout / "1" / "meta.json").is_file()
    found = start.check_settings(config(r=RoleConfig(enable=True, steps=(1,), dump_dir=str(run))), disabled=False)
    assert found == [
        (
            logging.WARNING,
            f"skip.r.dump_dir={run} holds GBS4_N2_in8_out8/, a cache layout: it is a run's directory, and this run "
            f"caches in {run}/<experiment>_<project>/GBS…/, finding none of it; give skip.r.dump_dir={tmp_path}",
        )
    ]
    problem = start.run_directory_problem("r", RoleConfig(enable=True, steps=(1,), dump_dir=str(layout)))
    assert problem is not None and "holds step 1/: it is a layout's directory" in problem
    assert problem.endswith(f"give skip.r.dump_dir={tmp_path}")
    strict = RoleConfig(enable=True, steps=(1,), dump_dir=str(run), action="strict")
    with pytest.raises(ConfigError, match=r"a run's directory.*action=strict relies on the cache"):
        start.check_settings(config(r=strict), disabled=False)
    right = RoleConfig(enable=True, steps=(1,), dump_dir=str(tmp_path))
    assert start.check_settings(config(r=right), disabled=False) == []


def toy_run(dump_dir: str) -> subprocess.CompletedProcess[str]:
    """The toy example's trainer, 2 steps under the runner, both chosen, caching in ``dump_dir``."""
    import os

    from tests.conftest import ROOT

    args = ["--plugins", "toy_skip_plugin", "train.py", "2", "skip.toy_rollout.enable=True"]
    args += ["skip.toy_rollout.steps=[1,2]", f"skip.toy_rollout.dump_dir={dump_dir}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKIPINJECT", "VERL_SKIP"))}
    return subprocess.run(
        [sys.executable, "-m", "skipinject", *args],
        cwd=ROOT / "examples" / "toy",
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_a_dump_dir_that_is_a_file_or_cannot_be_written_is_one_line_at_start(tmp_path: Path) -> None:
    """A file as ``dump_dir``: one line at start, not three (nor ``file type 100000``); one that cannot be
    created (``/proc`` refuses even root, whom ``os.access`` lets through): one line at start, not one per step."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = toy_run(str(blocker))
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "summary:" not in line]
    assert said == [
        f"skipinject WARNING: skip.toy_rollout.dump_dir={blocker}: {blocker} is not a directory: nothing can be "
        "cached there"
    ]
    done = toy_run("/proc/skipinject-no-such-dir")
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        "skipinject WARNING: skip.toy_rollout.dump_dir=/proc/skipinject-no-such-dir: cannot be created (/proc: "
    ), done.stderr
    assert warnings[0].endswith("): nothing can be cached there")


def test_a_regular_file_is_named_so() -> None:
    import stat

    from skipinject.store.files import file_kind

    assert file_kind(stat.S_IFREG | 0o644) == "a regular file"
