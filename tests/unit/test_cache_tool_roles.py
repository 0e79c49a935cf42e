"""``skipinject cache`` on a third-party role exactly like on the built-ins (issue 21).

The caches are written by the real engine running the toy plugin (a codec on the public plugin API
that stores plain JSON objects, no codec header): the tool lists, verifies, shows, diffs and prunes
them, decoding through the installed plugin's own codec, or names the plugin when it is missing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from skipinject import bootstrap
from skipinject.cache_tool import main
from skipinject.config import Config, RoleConfig
from skipinject.plugin_manager import load_plugins


@pytest.fixture
def dump(toy: Any, tmp_path: Path) -> Path:
    """Steps 1 and 2 of role ``toy``, written by the engine with the toy plugin's JsonCodec."""
    root = tmp_path / "dump"
    config = Config(roles={"toy": RoleConfig(enable=True, dump_dir=str(root), steps=(1, 2))})
    bootstrap.start(config, load_plugins("toy"))
    trainer = toy.Trainer()
    for step in (1, 2):
        trainer.global_steps = step
        trainer.generate([step])
    bootstrap.stop()
    return root


def step_dir(root: Path, step: int) -> Path:
    (found,) = [p for p in root.rglob(str(step)) if (p / "meta.json").is_file()]
    return found


def run(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, dict[str, Any]]:
    code, out, err = run(capsys, *argv, "--json")
    assert out, err
    return code, json.loads(out)


@pytest.fixture
def with_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_SKIP_PLUGINS", "toy")


@pytest.fixture
def without_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy plugin is not among this environment's plugins (the built-ins are)."""
    monkeypatch.setenv("VERL_SKIP_PLUGINS", "-toy")


def test_the_engine_records_the_plugin_and_no_codec_header(dump: Path) -> None:
    meta = json.loads((step_dir(dump, 1) / "meta.json").read_text())
    assert meta["role"] == "toy" and meta["plugin"] == "toy"
    assert meta["step"] == meta["global_steps"] == 1  # the step also under the trainer's name for it
    objects = next(step_dir(dump, 1).glob("objects-*.json"))
    assert "codec" not in json.loads(objects.read_text())  # plain objects: the built-ins' header is not a rule


def test_every_key_of_a_saved_steps_meta_json_is_in_the_format_documents_table(dump: Path) -> None:
    meta = json.loads((step_dir(dump, 1) / "meta.json").read_text())
    text = (Path(__file__).resolve().parents[2] / "docs" / "cache-format.md").read_text()
    table = {
        key
        for line in text.splitlines()
        if line.startswith("| `")
        for key in re.findall(r"`(\w+)`", line.split(" | ")[0])
    }
    assert sorted(set(meta) - table) == []


def test_ls_lists_a_third_party_role(dump: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = run_json(capsys, "ls", dump)
    assert code == 0
    found = [(s["role"], s["step"], s["state"]) for s in doc["steps"]]
    assert found == [("toy", 1, "complete"), ("toy", 2, "complete")]


def test_ls_names_the_default_project_of_steps_saved_without_a_verl_config(
    dump: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``{dump_dir}/skipinject_default/{role}/{step}`` (docs/cache-format.md): the project is skipinject_default."""
    assert step_dir(dump, 1) == dump / "skipinject_default" / "toy" / "1"
    code, doc = run_json(capsys, "ls", dump)
    assert code == 0
    assert {(s["project"], s["layout"], s["role"]) for s in doc["steps"]} == {("skipinject_default", "-", "toy")}
    assert [(g["project"], g["layout"], g["role"]) for g in doc["groups"]] == [("skipinject_default", "-", "toy")]


def test_verify_calls_a_healthy_third_party_cache_ok(
    dump: Path, with_plugin: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "verify", dump)
    assert code == 0, out
    assert "2 ok, 0 damaged" in out and "NOTE" not in out
    code, doc = run_json(capsys, "verify", dump)
    assert code == 0 and doc["ok"] and [s["plugin"] for s in doc["steps"]] == ["toy", "toy"]


def test_verify_of_a_path_without_a_cache_is_an_error_not_a_pass(
    dump: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wrong path (a folder holding no step) exits 2 with one line, also beside a right one: never "0 ok"."""
    empty = tmp_path / "not-the-cache"
    (empty / "sub").mkdir(parents=True)
    for argv in (["verify", empty], ["verify", "--json", empty], ["verify", dump, empty]):
        code, out, err = run(capsys, *argv)
        assert (code, out) == (2, ""), (argv, out)
        assert err == f"skipinject cache verify: error: {empty}: no cache found there (no step of skipinject or " \
            "verl below it)\n"  # fmt: skip


def test_verify_still_finds_damage_in_a_third_party_cache(
    dump: Path, with_plugin: None, capsys: pytest.CaptureFixture[str]
) -> None:
    objects = next(step_dir(dump, 2).glob("objects-*.json"))
    data = bytearray(objects.read_bytes())
    data[-2] ^= 1
    objects.write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", dump)
    assert code == 1 and "checksum mismatch" in out and "1 ok, 1 damaged" in out


def test_verify_without_the_plugin_verifies_and_names_it(
    dump: Path, without_plugin: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "verify", dump)
    assert code == 0, out
    assert "2 ok, 0 damaged" in out
    assert "NOTE:" in out and "no installed plugin provides role 'toy'" in out and "plugin 'toy'" in out


def test_show_decodes_through_the_plugins_own_codec(
    dump: Path, with_plugin: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc = run_json(capsys, "show", step_dir(dump, 1))
    assert code == 0
    assert doc["codec"] == "JsonCodec" and doc["plugin"] == "toy" and doc["note"] is None
    assert {f["name"] for f in doc["fields"]} == {"responses", "step"}
    code, out, _ = run(capsys, "show", step_dir(dump, 1))
    assert code == 0 and "decoded by plugin toy" in out and "responses" in out


def test_show_without_the_plugin_shows_the_raw_payload_and_names_the_plugin(
    dump: Path, without_plugin: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc = run_json(capsys, "show", step_dir(dump, 1))
    assert code == 0 and doc["codec"] == "raw" and doc["plugin"] is None
    assert "plugin 'toy'" in doc["note"]
    assert [f["name"] for f in doc["fields"]] == ["objects.value"]


def test_diff_compares_fields_the_plugins_codec_decoded(
    dump: Path, with_plugin: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc = run_json(capsys, "diff", step_dir(dump, 1), step_dir(dump, 2))
    assert code == 1
    (report,) = doc["steps"]
    statuses = {f["name"]: f["status"] for f in report["fields"]}
    assert statuses == {"responses": "differs", "step": "differs"}
    assert report["notes"] == []
    code, doc = run_json(capsys, "diff", step_dir(dump, 1), step_dir(dump, 1))
    assert code == 0 and not doc["differs"]


def test_prune_keeps_the_last_step_of_a_third_party_role(dump: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = run_json(capsys, "prune", dump, "--keep-last", "1")
    assert code == 0 and [(r["role"], r["step"]) for r in doc["removed"]] == [("toy", 1)]
    code, doc = run_json(capsys, "ls", dump)
    assert [(s["role"], s["step"]) for s in doc["steps"]] == [("toy", 2)]


def test_the_core_imports_no_plugin_by_name() -> None:
    """verl's formats and their loaders come from the installed plugins' roles (UpstreamFormat)."""
    import skipinject

    root = Path(skipinject.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert "import skipinject_" not in text and "from skipinject_" not in text, path


def test_the_core_names_no_built_in_role_nor_verl_file() -> None:
    """Role names and verl's file names come from the plugins' declarations (Role, UpstreamFormat):
    no string in the core's code is one of them (docstrings and help texts may mention them)."""
    import ast

    import skipinject

    named = {"rollout", "rollout_tq", "async_rollout", "gen_batch.dp", "tq_batch.pt", "new_batch.dp", "0/tq_batch.pt"}
    root = Path(skipinject.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in named:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    assert found == []
