"""The removal primitive never reaches anything through a link, and settings YAML is bounded before parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from skipinject.config.overrides import MAX_NODES, check_yaml
from skipinject.errors import ConfigError
from skipinject.store.files import LinkedPath, open_below, remove_name, remove_step


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    (victim / "0").mkdir(parents=True)
    for path in (victim / "meta.json", victim / "objects-1-1-deadbeef.json", victim / "0" / "tensors-1-1-deadbeef.bin"):
        path.write_text("victim")
    return victim


def test_a_step_that_is_a_link_removes_nothing(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    (tmp_path / "dump" / "proj").mkdir(parents=True)
    (tmp_path / "dump" / "proj" / "3").symlink_to(victim)
    with pytest.raises(LinkedPath):
        remove_step(tmp_path / "dump", tmp_path / "dump" / "proj" / "3", lambda part, name, info: True)
    assert len(list(victim.rglob("*"))) == 4


def test_a_project_that_is_a_link_is_not_walked_through(tmp_path: Path) -> None:
    victim = tmp_path / "elsewhere"
    (victim / "3").mkdir(parents=True)
    (victim / "3" / "objects-1-1-deadbeef.json").write_text("victim")
    (tmp_path / "dump").mkdir()
    (tmp_path / "dump" / "proj").symlink_to(victim)
    with pytest.raises(LinkedPath), open_below(tmp_path / "dump", ["proj", "3"]):
        pass
    remove_name(tmp_path / "dump", tmp_path / "dump" / "proj" / "3" / "objects-1-1-deadbeef.json")
    assert (victim / "3" / "objects-1-1-deadbeef.json").exists()


def test_a_real_step_is_removed_meta_first_with_its_empty_parts(tmp_path: Path) -> None:
    step = tmp_path / "dump" / "proj" / "3"
    step.parent.mkdir(parents=True)
    _victim(tmp_path).rename(step)
    (step / "notes.txt").write_text("not ours")
    files, _ = remove_step(tmp_path / "dump", step, lambda part, name, info: name != "notes.txt")
    assert files == 3 and sorted(p.name for p in step.rglob("*")) == ["notes.txt"]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("skip: {rollout: {steps: &a [1, 2]}}", "skip.rollout.steps: YAML anchors"),
        ("a: [1]\nb: *a\n", "YAML aliases"),
        ("skip:\n  r:\n    k: " + "[" * 40 + "]" * 40, "skip.r.k: YAML nested more than"),
        ("skip:\n  r:\n    steps: [" + ",".join(["1"] * (MAX_NODES + 1)) + "]", "skip.r.steps: more than"),
        ("skip: [1,", "cannot parse the value (YAML:"),
    ],
)
def test_settings_yaml_is_refused_in_one_line_naming_the_key(text: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_yaml(text, "W")
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_ordinary_settings_pass() -> None:
    check_yaml("skip:\n  rollout: {enable: true, steps: [1-4, 10], dump_dir: /data/skip}\n", "W")
