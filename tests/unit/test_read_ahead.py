"""The next chosen step is read ahead while a step trains (``skip.<role>.read_ahead``), and served only
while it is still the step in the store; a read-ahead that fails changes nothing the run reports.

Real stores (uncompressed and zstd), real ``DataProto`` batches through the default codec. Each
test waits for the read-ahead (``runtime.replay.read_ahead.wait()``) where it changes the store: nothing
depends on timing. "Read no data file again" is shown by removing the step's data files once it
was read ahead: its hit still serves it, bit for bit.
"""

from __future__ import annotations

import gc
import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from skipinject.config import role_config
from skipinject.engine.runtime import RoleRuntime
from skipinject.errors import ConfigError
from skipinject.store import StepStore
from skipinject.store.compression import parse_compression
from skipinject.verl.codecs import DataProtoCodec
from tests.read_ahead_checks import (
    GENERATED,
    assert_same,
    generated,
    hit_line,
    install_targets,
    lines,
    read_ahead_lines,
    remove_data_files,
    run,
    step_location,
    wait_for_read_ahead,
)

pytest.importorskip("zstandard")

STORED = ["none", "zstd"]


@pytest.fixture
def targets(monkeypatch: pytest.MonkeyPatch) -> Any:
    return install_targets(monkeypatch)


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="skipinject")
    return caplog


@pytest.mark.parametrize("compression", STORED)
def test_the_next_cached_step_is_read_ahead_and_its_hit_reads_no_data_file(
    targets: Any, tmp_path: Path, log: pytest.LogCaptureFixture, compression: str
) -> None:
    recorded, _ = run(targets, tmp_path, (1, 2, 3), compression=compression)
    log.clear()

    def train(step: int, runtime: RoleRuntime) -> None:
        runtime.replay.read_ahead.wait()
        if step < 3:
            assert remove_data_files(tmp_path, step + 1)  # only meta.json is left to read

    served, _ = run(targets, tmp_path, (1, 2, 3), between=train, compression=compression)
    assert GENERATED == []
    for step in (1, 2, 3):
        assert_same(served[step], recorded[step])
    assert read_ahead_lines(log) == ["0 -> 1", "1 -> 2", "2 -> 3"]
    for step in (1, 2, 3):  # step 1: read while the trainer started
        assert f"served step {step} (own cache; read ahead, waited " in hit_line(log, step)
    assert not lines(log, "", logging.WARNING)


@pytest.mark.parametrize("compression", STORED)
def test_the_first_chosen_step_is_read_while_the_trainer_starts_and_its_hit_reads_no_data_file(
    targets: Any, tmp_path: Path, log: pytest.LogCaptureFixture, compression: str
) -> None:
    recorded, _ = run(targets, tmp_path, (2, 3), compression=compression)
    log.clear()

    def starting(runtime: RoleRuntime) -> None:  # fit began; its first generation has not
        runtime.replay.read_ahead.wait()
        assert remove_data_files(tmp_path, 2)  # only meta.json is left to read

    served, _ = run(targets, tmp_path, (2, 3), trained=(1, 2, 3), started=starting, compression=compression)
    assert GENERATED == [1]
    assert read_ahead_lines(log)[0] == "0 -> 2"  # the first step the settings choose and the store holds
    assert "served step 2 (own cache; read ahead, waited " in hit_line(log, 2)
    assert_same(served[2], recorded[2])
    assert not lines(log, "", logging.WARNING)


def test_a_run_without_steps_to_serve_reads_nothing_at_the_start(
    targets: Any, tmp_path: Path, log: pytest.LogCaptureFixture
) -> None:
    run(targets, tmp_path, (1, 2), compression="zstd")
    log.clear()
    threads: list[str] = []

    def starting(runtime: RoleRuntime) -> None:
        threads.extend(t.name for t in threading.enumerate() if "read-ahead" in t.name)

    run(targets, tmp_path, (1, 2), started=starting, action="refresh")
    run(targets, tmp_path, (1, 2), started=starting, read_ahead=False)
    assert threads == [] and read_ahead_lines(log) == []


@pytest.mark.parametrize("action", ["strict", "repeat"])
def test_strict_and_repeat_are_served_steps_read_ahead_too(
    targets: Any, tmp_path: Path, log: pytest.LogCaptureFixture, action: str
) -> None:
    recorded, _ = run(targets, tmp_path, (1, 2, 3), compression="zstd")
    log.clear()
    served, _ = run(targets, tmp_path, (1, 2, 3), between=wait_for_read_ahead, action=action)
    assert GENERATED == [] and read_ahead_lines(log) == ["0 -> 1", "1 -> 2", "2 -> 3"]
    for step in (2, 3):
        assert "read ahead, waited" in hit_line(log, step)
        assert_same(served[step], recorded[step])


def test_a_step_read_ahead_has_its_tensors_rebuilt_in_the_background(
    targets: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hit of a compressed step read ahead only decodes its parts: the tensors (widened, derived,
    most of a cold hit's fresh memory) were rebuilt by the read-ahead's thread."""
    import skipinject.store.step_store as step_store

    run(targets, tmp_path, (1, 2, 3), compression="zstd")
    rebuilt_in: list[str] = []
    rebuild = step_store.read_tensors

    def recorded(*args: Any, **kwargs: Any) -> Any:  # calls through: only where it runs is noted
        rebuilt_in.append(threading.current_thread().name)
        return rebuild(*args, **kwargs)

    monkeypatch.setattr(step_store, "read_tensors", recorded)
    run(targets, tmp_path, (1, 2, 3), between=wait_for_read_ahead)
    assert GENERATED == []
    assert rebuilt_in == ["skipinject-read-ahead-gen"] * 3  # step 1's while the trainer started


class LoadingPhase:
    """A phase serving through ``PhaseContext.load`` (as ``rollout_tq``'s does): the plan's reason kept."""

    def __init__(self) -> None:
        self.reasons: dict[int, str] = {}

    def run(self, role: Any, call: Any, step: int, proceed: Any) -> Any:
        loaded = role.load(call, step)
        if loaded is None:
            return proceed()
        self.reasons[step] = loaded.plan.reason
        return loaded.results[0]


def test_a_phase_loading_through_the_context_is_served_steps_read_ahead(
    targets: Any, tmp_path: Path, log: pytest.LogCaptureFixture
) -> None:
    recorded, _ = run(targets, tmp_path, (1, 2, 3), compression="zstd")
    log.clear()
    phase = LoadingPhase()
    served, _ = run(targets, tmp_path, (1, 2, 3), between=wait_for_read_ahead, phase=phase)
    assert GENERATED == [] and read_ahead_lines(log) == ["0 -> 1", "1 -> 2", "2 -> 3"]
    assert all(phase.reasons[step].startswith("own cache; read ahead, waited ") for step in (1, 2, 3))
    for step in (1, 2, 3):
        assert_same(served[step], recorded[step])


@pytest.mark.parametrize("compression", STORED)
def test_a_step_read_ahead_is_served_bit_for_bit_as_a_normal_load(
    targets: Any, tmp_path: Path, log: pytest.LogCaptureFixture, compression: str
) -> None:
    recorded, _ = run(targets, tmp_path, (1, 2, 3), compression=compression)
    log.clear()
    ahead, _ = run(targets, tmp_path, (1, 2, 3), between=wait_for_read_ahead, compression=compression)
    assert [step for step in (2, 3) if "read ahead" in hit_line(log, step)] == [2, 3]
    log.clear()
    normal, _ = run(targets, tmp_path, (1, 2, 3), compression=compression, read_ahead=False)
    assert not lines(log, "read ahead")
    assert GENERATED == []
    for step in (1, 2, 3):
        assert_same(ahead[step], normal[step])
        assert_same(ahead[step], recorded[step])


def test_a_step_recorded_anew_or_removed_after_it_was_read_ahead_is_read_again(
    targets: Any, tmp_path: Path, log: pytest.LogCaptureFixture
) -> None:
    run(targets, tmp_path, (1, 2, 3), compression="zstd")
    meta = json.loads((step_location(tmp_path, 2) / "meta.json").read_text())
    store = StepStore(step_location(tmp_path, 2).parent, "gen", meta["context"], compression=parse_compression("zstd"))
    anew = generated(2)
    log.clear()

    def train(step: int, runtime: RoleRuntime) -> None:
        runtime.replay.read_ahead.wait()
        if step == 1:  # another run records step 2 again
            store.save(2, DataProtoCodec().encode(anew), {"inputs": None, "calls": 1})
        if step == 2:  # and removes step 3
            shutil.rmtree(step_location(tmp_path, 3))

    served, _ = run(targets, tmp_path, (1, 2, 3), between=train)
    assert read_ahead_lines(log) == ["0 -> 1", "1 -> 2", "2 -> 3"]
    assert_same(served[2], anew)
    assert "read ahead" not in hit_line(log, 2)
    assert GENERATED == [3]
    assert lines(log, "gen step 3: miss")
    assert not lines(log, "", logging.WARNING)


def test_a_damaged_next_step_is_reported_once_and_generated_again(
    targets: Any, tmp_path: Path, log: pytest.LogCaptureFixture
) -> None:
    recorded, _ = run(targets, tmp_path, (1, 2, 3), compression="zstd")
    meta = json.loads((step_location(tmp_path, 2) / "meta.json").read_text())
    tensors = step_location(tmp_path, 2) / meta["parts"][0]["files"]["tensors"]["name"]
    data = bytearray(tensors.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tensors.write_bytes(bytes(data))
    log.clear()
    served, _ = run(targets, tmp_path, (1, 2, 3), between=wait_for_read_ahead)
    assert read_ahead_lines(log) == ["0 -> 1", "1 -> 2", "2 -> 3"]
    (warning,) = lines(log, "", logging.WARNING)
    assert "gen step 2: cache unusable, not loaded:" in warning and "checksum mismatch" in warning
    assert GENERATED == [2]
    with pytest.raises(AssertionError):
        assert_same(served[2], recorded[2])
    assert "read ahead" in hit_line(log, 3)
    assert_same(served[3], recorded[3])
    log.clear()
    again, _ = run(targets, tmp_path, (2,))  # the step was saved anew
    assert GENERATED == [] and lines(log, "gen step 2: hit")
    assert_same(again[2], served[2])


def test_read_ahead_false_reads_nothing_in_the_background(
    targets: Any, tmp_path: Path, log: pytest.LogCaptureFixture
) -> None:
    run(targets, tmp_path, (1, 2, 3), compression="zstd")
    log.clear()
    threads: list[str] = []

    def train(step: int, runtime: RoleRuntime) -> None:
        threads.extend(t.name for t in threading.enumerate() if "read-ahead" in t.name)
        if step < 3:
            remove_data_files(tmp_path, step + 1)

    run(targets, tmp_path, (1, 2, 3), between=train, read_ahead=False)
    assert threads == [] and read_ahead_lines(log) == []
    assert GENERATED == [2, 3]  # their data files were gone when their plans read them


def test_the_setting_is_a_boolean_and_a_wrong_value_names_the_key() -> None:
    assert role_config("gen", {}).read_ahead is True
    assert role_config("gen", {"read_ahead": "false"}).read_ahead is False
    with pytest.raises(ConfigError, match=r"^skip\.gen\.read_ahead=sometimes: expected true or false$"):
        role_config("gen", {"read_ahead": "sometimes"})


def test_only_steps_the_settings_allow_and_the_store_holds_are_read_ahead(
    targets: Any, tmp_path: Path, log: pytest.LogCaptureFixture
) -> None:
    run(targets, tmp_path, (1, 2, 3, 4), compression="zstd")
    step_location(tmp_path, 6).mkdir()  # a step directory with nothing committed in it
    log.clear()
    run(targets, tmp_path, (1, 3, 6), trained=range(1, 8), between=wait_for_read_ahead)
    # step 2 is cached but not chosen; after 3, step 4 is cached but not chosen and 6 is chosen but not cached
    assert read_ahead_lines(log) == ["0 -> 1", "1 -> 3"]
    assert GENERATED == [2, 4, 5, 6, 7]


def _nothing_held(runtime: RoleRuntime) -> int:
    """Bytes of the role's hit memory still held once every batch is gone (a leaked entry holds its slot)."""
    gc.collect()
    runtime.hit_memory.clear()
    return runtime.hit_memory.nbytes


def test_a_step_read_ahead_is_let_go_when_the_run_ends(
    targets: Any, tmp_path: Path, log: pytest.LogCaptureFixture
) -> None:
    run(targets, tmp_path, (1, 2, 3), compression="zstd")
    log.clear()
    _, runtime = run(
        targets, tmp_path, (1, 2, 3), trained=(1, 2), between=wait_for_read_ahead, keep=False, reuse_hit_memory=16
    )
    assert read_ahead_lines(log) == ["0 -> 1", "1 -> 2", "2 -> 3"]  # step 3 is read ahead, never trained
    assert _nothing_held(runtime) == 0


def test_a_step_read_ahead_is_let_go_when_the_run_moves_past_it(
    targets: Any, tmp_path: Path, log: pytest.LogCaptureFixture
) -> None:
    run(targets, tmp_path, (1, 2, 3), compression="zstd")
    log.clear()
    held: dict[int, int] = {}

    def train(step: int, runtime: RoleRuntime) -> None:
        runtime.replay.read_ahead.wait()
        if step == 4:  # the run skipped step 3 (the role's target was not called there)
            held[step] = _nothing_held(runtime)

    run(targets, tmp_path, (1, 2, 3), trained=(1, 2, 4), between=train, keep=False, reuse_hit_memory=16)
    assert read_ahead_lines(log) == ["0 -> 1", "1 -> 2", "2 -> 3"]
    assert held == {4: 0}


def test_ending_the_run_never_waits_for_a_read_ahead_that_hangs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-ahead stuck in a store read (a hung mount, a download without a timeout) of a step the run
    never reaches: ``close()`` returns at once; the read's entry is let go whenever it ends."""
    from skipinject.engine.replay import ReadAhead
    from skipinject.store import Payload

    store = StepStore(tmp_path / "project", "toy", {"run": 1})
    store.save(2, Payload(tensors={}, objects={"x": 1}, rows=None))
    hung, entered = threading.Event(), threading.Event()
    verified = store.verified
    entries: list[Any] = []

    def stuck(step: int) -> Any:
        entered.set()
        hung.wait(60)
        entries.append(verified(step))
        return entries[-1]

    monkeypatch.setattr(store, "verified", stuck)
    reader = ReadAhead("toy")
    reader.start(store, 1, lambda step: True)
    reading = reader._reading
    assert reading is not None and reading.thread is not None
    assert entered.wait(30), "the read began"
    closed = threading.Thread(target=reader.close, daemon=True)
    closed.start()
    closed.join(5)
    assert not closed.is_alive(), "close() waited for the hung read"
    hung.set()
    reading.thread.join(30)
    assert len(entries) == 1 and not entries[0].blobs, "the entry read after close() is let go"
