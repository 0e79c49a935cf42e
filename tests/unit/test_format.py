"""One format module: docs/cache-format.md holds its table, and every reader agrees on names (issue 21)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from skipinject.cache_tool.scan import scan
from skipinject.store import Payload, RemoteStepStore, StepStore, format
from skipinject.store.garbage import ABANDONED_AFTER, find_leftovers
from skipinject.store.remote import open_remote
from tests.conftest import ROOT

DOC = ROOT / "docs" / "cache-format.md"
BEGIN, END = "<!-- format-table: python -m skipinject.store.format -->\n", "<!-- /format-table -->\n"


def test_docs_cache_format_holds_the_format_modules_table() -> None:
    text = DOC.read_text()
    assert BEGIN in text and END in text, "docs/cache-format.md lost its generated table"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert table == format.reference_table(), "regenerate it: python -m skipinject.store.format"


def test_docs_cache_format_states_the_modules_bounds_and_names() -> None:
    text = DOC.read_text()
    assert f"at most {format.MAX_META_BYTES >> 20} MiB + 1 bytes" in text
    assert f"`format_version` | `{format.FORMAT_VERSION}`" in text
    for name in (format.META_NAME, format.tensors_name("{write_id}"), format.objects_name("{write_id}")):
        assert name in text
    assert "decimal step number (ASCII digits, no sign, no leading zeros)" in text


def test_cache_tool_doc_states_the_one_meta_bound() -> None:
    text = (ROOT / "docs" / "cache-tool.md").read_text()
    bounds = re.findall(r"`meta.json` is read bounded \(([0-9]+) MiB\)", text)
    assert bounds == [str(format.MAX_META_BYTES >> 20)]


@pytest.mark.parametrize(
    ("name", "step"), [("0", True), ("7", True), ("123456789012", True), ("007", False), ("00", False), ("²", False)]
)
def test_the_step_rule(name: str, step: bool) -> None:
    assert (format.STEP_NAME.fullmatch(name) is not None) is step
    assert (format.PART_NAME.fullmatch(name) is not None) is (step and len(name) <= 6)


def _payload(value: float) -> Payload:
    return Payload(tensors={"x": torch.full((4,), value)}, objects={"v": value}, rows=1)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_every_local_reader_agrees_that_007_is_no_step(tmp_path: Path) -> None:
    """The store's listing, the garbage collector and the cache tool's walk: ``7`` is a step, ``007`` none."""
    project = tmp_path / "dump" / "exp_proj" / "GBS4_N2_in32_out16"
    store = StepStore(project, "rollout", {"run": 1})
    store.save(7, _payload(7.0))
    old = time.time() - ABANDONED_AFTER - 60
    wid = f"{int(old)}-{_dead_pid()}-deadbeef"
    for directory in ("7", "007"):
        (project / directory).mkdir(exist_ok=True)
        leftover = project / directory / format.tensors_name(wid)
        leftover.write_bytes(b"\0" * 10)
        os.utime(leftover, (old, old))

    assert store.step_numbers_on_disk() == [7]
    assert [p.path.parent.name for p in find_leftovers(project)] == ["7"]
    assert [(i.path.name, i.step) for i in scan(tmp_path / "dump")] == [("7", 7)]


def test_the_remote_readers_agree_that_007_is_no_step() -> None:
    url = f"memory://skipinject-tests/{uuid.uuid4().hex}"
    fs, root = open_remote(url)
    store = RemoteStepStore(root / "project", "toy", {"run": 1}, fs)
    store.save(7, _payload(7.0))
    fs.pipe_file((root / "project" / "007" / format.tensors_name("1-2-deadbeef")).path, b"\0" * 10)
    assert store.step_numbers_on_disk() == [7]
    assert [(i.path.name, i.step, i.state) for i in scan(url, [])] == [("7", 7, "complete")]
