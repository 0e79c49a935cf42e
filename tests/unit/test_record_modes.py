"""Record modes (issue 34, part 4): ``action=refresh`` generates the chosen steps again and replaces what is
cached, whole; ``save=false`` serves what is cached and never writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from skipinject import Role, StepSource, Target
from skipinject.testing import IntCodec, RoleRun, ToyTrainer

pytestmark = pytest.mark.unit

#: What the toy generator adds to its output (a new "model" between runs).
OFFSET = [0]
GENERATED: list[int] = []


class Trainer(ToyTrainer):
    def generate(self, index: int) -> int:
        GENERATED.append(self.global_steps)
        return 10 * self.global_steps + OFFSET[0]


def toy_role() -> Role:
    return Role(
        name="toyrole",
        targets=[Target(f"{__name__}:Trainer.generate")],
        step=StepSource.attribute("global_steps"),
        codec=IntCodec(),
        cache_subdir="",
    )


@pytest.fixture(autouse=True)
def _fresh_generator() -> None:
    OFFSET[0] = 0
    GENERATED.clear()


def layout(dump: Path) -> Path:
    return dump / "e_p" / "GBS4_N2_in8_out8"


def run(dump: Path, steps: int = 2, **settings: Any) -> tuple[list[Any], RoleRun]:
    with RoleRun(toy_role(), dump, range(1, steps + 1), **settings) as role_run:
        outputs = Trainer().fit(steps)
    return outputs, role_run


def test_refresh_generates_the_chosen_steps_again_and_replaces_them_whole(tmp_path: Path) -> None:
    assert run(tmp_path)[0] == [10, 20]
    first = {step: json.loads((layout(tmp_path) / str(step) / "meta.json").read_text()) for step in (1, 2)}
    OFFSET[0] = 5
    GENERATED.clear()
    outputs, refreshed = run(tmp_path, action="refresh")
    assert outputs == [15, 25] and GENERATED == [1, 2], "nothing is served"
    assert refreshed.lines_with("toyrole step 1: refresh: running the target and saving its result in place of")
    for step in (1, 2):
        directory = layout(tmp_path) / str(step)
        meta = json.loads((directory / "meta.json").read_text())
        assert meta["created"] >= first[step]["created"] and meta["parts"] != first[step]["parts"]
        named = {spec["name"] for part in meta["parts"] for spec in part["files"].values()}
        old = {spec["name"] for part in first[step]["parts"] for spec in part["files"].values()}
        assert named.isdisjoint(old) and all((directory / name).is_file() for name in named)
        # the old commit's files are left to the garbage rule (a reader may still be reading them)
    OFFSET[0] = 9
    GENERATED.clear()
    outputs, served = run(tmp_path)
    assert outputs == [15, 25] and GENERATED == [] and served.assert_hit(2), "the refreshed steps serve"


def test_save_false_serves_what_is_cached_and_writes_nothing(tmp_path: Path) -> None:
    outputs, read_only = run(tmp_path, save="false")
    assert outputs == [10, 20] and GENERATED == [1, 2]
    assert not tmp_path.exists() or not any(tmp_path.rglob("meta.json")), "a read-only run saves nothing"
    assert read_only.lines_with("toyrole step 1: miss (") and "not saving it (save=false)" in read_only.misses(1)[0]
    run(tmp_path, steps=1)  # another run records step 1
    GENERATED.clear()
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    outputs, read_only = run(tmp_path, save="false", action="refresh")
    assert outputs == [10, 20] and GENERATED == [1, 2]
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before, "not even a refresh writes"
    GENERATED.clear()
    outputs, read_only = run(tmp_path, save="false")
    assert outputs == [10, 20] and GENERATED == [2] and read_only.assert_hit(1)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
