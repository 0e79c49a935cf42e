"""The plugin guide's snippets (docs/plugins.md) work as printed: extracted, installed, run.

The snippets are taken from ``docs/plugins.md``, written into a temporary distribution, and run through a cache miss
then hit on a toy trainer: in this process (loaded by module path through ``VERL_SKIP_PLUGINS``)
and through the real runner after ``pip install`` (found by its entry point). No verl needed.
"""

from __future__ import annotations

import importlib
import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from skipinject import bootstrap
from skipinject.config import Config
from skipinject.config.overrides import apply_overrides, split_overrides
from skipinject.plugin_manager import load_plugins

ROOT = Path(__file__).resolve().parents[2]
_SNIPPET = re.compile(r"<!-- snippet: (?P<name>[\w-]+) -->\s*```(?P<lang>\w*)\n(?P<code>.*?)^```", re.S | re.M)

TOY_TRAINER = '''\
"""A verl-style recipe trainer whose judge is expensive (the toy target of the snippet)."""

CALLS = []


class MyTrainer:
    def __init__(self, global_steps=0):
        self.global_steps = global_steps

    def score_with_judge(self, responses):
        CALLS.append(list(responses))
        return [len(text) / 10 for text in responses]
'''

USER_PROGRAM = """\
from my_recipe.trainer import CALLS, MyTrainer

trainer = MyTrainer()
for step in (1, 2, 3):
    trainer.global_steps = step
    print(f"step {step}: {trainer.score_with_judge([f'answer {step}-{i} ' * i for i in range(4)])}")
print(f"judge calls: {len(CALLS)}")
"""


def snippets(path: Path) -> dict[str, str]:
    """``<!-- snippet: NAME -->`` followed by a fenced block, by name."""
    return {m["name"]: m["code"] for m in _SNIPPET.finditer(path.read_text())}


def documents() -> list[Path]:
    """docs/plugins.md, the plugin guide (the snippets are tested as printed there)."""
    return [ROOT / "docs" / "plugins.md"]


@pytest.fixture(params=documents(), ids=lambda p: p.name)
def doc(request: pytest.FixtureRequest) -> Path:
    return request.param


@pytest.fixture
def project(tmp_path: Path, doc: Path) -> Path:
    """The plugin distribution of the snippets, plus the toy recipe package, under ``tmp_path``."""
    parts = snippets(doc)
    assert {"pyproject", "plugin"} <= set(parts), f"{doc} lacks the pyproject/plugin snippets"
    dist = tmp_path / "my-recipe-skip"
    dist.mkdir()
    (dist / "pyproject.toml").write_text(parts["pyproject"])
    (dist / "my_recipe_skip.py").write_text(parts["plugin"])
    recipe = tmp_path / "recipe" / "my_recipe"
    recipe.mkdir(parents=True)
    (recipe / "__init__.py").write_text("")
    (recipe / "trainer.py").write_text(TOY_TRAINER)
    return tmp_path


@pytest.fixture
def skip_log() -> Iterator[list[str]]:
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger("skipinject")
    handler, level = Collect(logging.DEBUG), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


@pytest.fixture
def importable(project: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(project / "my-recipe-skip"))
    monkeypatch.syspath_prepend(str(project / "recipe"))
    importlib.invalidate_caches()
    yield
    bootstrap.stop()
    for name in [n for n in sys.modules if n.split(".")[0] in ("my_recipe", "my_recipe_skip")]:
        sys.modules.pop(name)


def test_snippets_are_present_and_fenced(doc: Path) -> None:
    parts = snippets(doc)
    assert '[project.entry-points."skipinject.plugins"]' in parts["pyproject"]
    assert "@hookimpl" in parts["plugin"] and "def skipinject_roles()" in parts["plugin"]
    assert len(parts["plugin"].splitlines()) <= 60, "a few dozen lines"


def test_plugin_snippet_is_lint_clean(project: Path) -> None:
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff not installed")
    select = "E,F,W,I,B,UP,RUF,SIM"
    proc = subprocess.run(
        [str(ruff), "check", "--isolated", "--select", select, "--line-length", "120", "my_recipe_skip.py"],
        cwd=project / "my-recipe-skip",
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_miss_then_hit_loaded_by_module_path(
    importable: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, skip_log: list[str]
) -> None:
    monkeypatch.setenv("VERL_SKIP_PLUGINS", "my_recipe_skip")
    plugins = load_plugins()
    assert [p.name for p in plugins.plugins] == ["my_recipe_skip"] and set(plugins.roles) == {"judge"}
    dump = tmp_path / "dump"
    overrides, _ = split_overrides(["skip.judge.enable=True", "skip.judge.steps=[1,2]", f"skip.judge.dump_dir={dump}"])
    config = Config(plugins="my_recipe_skip", roles=apply_overrides(Config(), overrides, plugins.roles).roles)
    responses = ["4", "13", "a longer answer"]

    results = []
    for _run in range(2):
        bootstrap.stop()
        assert bootstrap.start(config, plugins) is not None
        from my_recipe.trainer import CALLS, MyTrainer

        trainer = MyTrainer(global_steps=1)
        results.append(trainer.score_with_judge(responses))
    assert results[0] == results[1] == [0.1, 0.2, 1.5]
    assert len(CALLS) == 1, "run 2 served step 1 without calling the judge"
    assert any(line.startswith("judge step 1: miss") for line in skip_log)
    assert any(line.startswith("judge step 1: hit, served step 1") for line in skip_log)
    assert (dump / "skipinject_default" / "judge" / "1" / "meta.json").is_file()

    # Later runs: scores cached for other responses are reported (fingerprint), a wrong-sized cache not served.
    bootstrap.stop()
    bootstrap.start(config, plugins)
    MyTrainer(global_steps=1).score_with_judge(["4", "13", "another answer!"])
    assert any("other inputs in 1 of 3 rows" in line for line in skip_log)
    bootstrap.stop()
    bootstrap.start(config, plugins)
    assert MyTrainer(global_steps=1).score_with_judge(["just one"]) == [0.8]
    assert len(CALLS) == 2


def test_the_readmes_test_passes_with_the_test_kit(importable: None, tmp_path: Path, doc: Path) -> None:
    """The guide's ``tests/test_judge.py`` (``skipinject.testing``) runs as printed."""
    namespace: dict[str, object] = {}
    exec(compile(snippets(doc)["plugin-test"], "test_judge.py", "exec"), namespace)
    test = namespace["test_judge_scores_are_cached_then_served"]
    test(tmp_path / "dump")  # type: ignore[operator]
    from my_recipe.trainer import CALLS

    assert len(CALLS) == 1, "run 2 was served"


def test_the_cache_tool_lists_verifies_shows_diffs_and_prunes_the_readmes_role(
    importable: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``skipinject cache`` on the plugin guide's judge role (a codec storing plain JSON, whose ``decode`` checks
    the call's responses): listed, verified by sizes and checksums, shown and compared raw with the reason
    its codec gave, pruned, exactly like a built-in role's."""
    import json

    from skipinject.cache_tool import main

    monkeypatch.setenv("VERL_SKIP_PLUGINS", "my_recipe_skip")
    plugins = load_plugins()
    dump = tmp_path / "dump"
    steps = "skip.judge.steps=[1,2]"
    overrides, _ = split_overrides(["skip.judge.enable=True", steps, f"skip.judge.dump_dir={dump}"])
    bootstrap.start(Config(roles=apply_overrides(Config(), overrides, plugins.roles).roles), plugins)
    from my_recipe.trainer import MyTrainer

    MyTrainer(global_steps=1).score_with_judge(["4", "13"])
    MyTrainer(global_steps=2).score_with_judge(["4", "a longer one"])
    bootstrap.stop()
    capsys.readouterr()

    assert main(["ls", str(dump), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["steps"]
    assert [(s["role"], s["step"], s["state"], s["rows"]) for s in listed] == [
        ("judge", 1, "complete", 2),
        ("judge", 2, "complete", 2),
    ]
    assert main(["verify", str(dump)]) == 0
    assert "2 ok, 0 damaged" in capsys.readouterr().out
    assert (
        main(
            [
                "diff",
                str(dump / "skipinject_default" / "judge" / "1"),
                str(dump / "skipinject_default" / "judge" / "2"),
                "--json",
            ]
        )
        == 1
    )
    (report,) = json.loads(capsys.readouterr().out)["steps"]
    assert {f["name"]: f["status"] for f in report["fields"]} == {"objects.scores": "differs"}
    assert main(["show", str(dump / "skipinject_default" / "judge" / "1"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["role"] == "judge" and shown["plugin"] == "my_recipe_skip" and shown["codec"] == "raw"
    assert "ScoresCodec did not decode it here" in shown["note"]
    assert [f["name"] for f in shown["fields"]] == ["objects.scores"]
    assert main(["prune", str(dump), "--keep-last", "1", "--json"]) == 0
    assert [(r["role"], r["step"]) for r in json.loads(capsys.readouterr().out)["removed"]] == [("judge", 1)]
    assert main(["ls", str(dump), "--json"]) == 0
    assert [(s["role"], s["step"]) for s in json.loads(capsys.readouterr().out)["steps"]] == [("judge", 2)]
