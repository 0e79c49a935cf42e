"""Leftovers of killed or concurrent saves are collected by any later save and never taken from a live writer."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from skipinject.store import Payload, StepStore, garbage
from skipinject.store.garbage import ABANDONED_AFTER, Leftover, find_leftovers, remove_leftovers

OLD = ABANDONED_AFTER + 60


@pytest.fixture(autouse=True)
def _fresh_scan_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(garbage, "_LAST_SCAN", {})


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _payload(value: float = 1.0) -> Payload:
    return Payload(tensors={"x": torch.full((1000,), value)}, objects={"v": value}, rows=1)


def _plant(folder: Path, name: str, size: int = 1000, age: float = OLD) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(b"\0" * size)
    stamp = time.time() - age
    os.utime(path, (stamp, stamp))
    return path


def _killed_save(step_dir: Path, pid: int, age: float = OLD) -> list[Path]:
    wid = f"{int(time.time() - age)}-{pid}-deadbeef"
    return [
        _plant(step_dir, f"tensors-{wid}.bin", 5000, age),
        _plant(step_dir, f"objects-{wid}.json", 100, age),
        _plant(step_dir, f".tensors-{wid}.bin.tmp-{wid}", 700, age),
        _plant(step_dir, f".meta.json.tmp-{wid}", 50, age),
    ]


def test_a_later_save_of_another_step_collects_a_killed_save(tmp_path: Path) -> None:
    store = StepStore(tmp_path / "proj", "toy", {})
    store.save(1, _payload())
    planted = _killed_save(store.step_dir(3), _dead_pid())
    planted += _killed_save(store.step_dir(1) / "0", _dead_pid())
    garbage._LAST_SCAN.clear()  # a new run (process): its first save scans the whole project
    store.save(7, _payload(2.0))
    assert [p for p in planted if p.exists()] == []
    assert store.verified(1) and store.verified(7)


def test_find_and_remove_report_files_and_bytes(tmp_path: Path) -> None:
    store = StepStore(tmp_path / "proj", "toy", {})
    store.save(1, _payload())
    planted = _killed_save(store.step_dir(2), _dead_pid())
    found = find_leftovers(store.project_dir)
    assert sorted(f.path for f in found) == sorted(planted)
    assert all(isinstance(f, Leftover) and f.reason for f in found)
    assert remove_leftovers(found) == (4, 5850)
    assert find_leftovers(store.project_dir) == []
    assert store.verified(1)


def test_files_of_live_or_recent_writers_are_kept(tmp_path: Path) -> None:
    store = StepStore(tmp_path / "proj", "toy", {})
    # a writer of this process that has written a part but not committed yet, its files made old
    writer = store.begin(5)
    writer.add_part(_payload(), "0")
    for path in (store.step_dir(5) / "0").iterdir():
        os.utime(path, (time.time() - OLD, time.time() - OLD))
    alive = _killed_save(store.step_dir(6), 1)  # pid 1 is alive: another process still writing
    young = _killed_save(store.step_dir(8), _dead_pid(), age=5)  # dead pid, but 5 s old
    store.save(9, _payload())
    assert all(p.exists() for p in alive + young)
    assert len(list((store.step_dir(5) / "0").iterdir())) == 2
    writer.commit({})
    assert store.load(store.verified(5))


def test_a_leftover_naming_a_pid_no_process_can_have_stops_no_collection(tmp_path: Path, capsys) -> None:
    """A write id's pid of 10 digits (past what ``kill`` takes): that file is kept (whose it is is unknown),
    the rest collected; ``cache prune --partial`` says so, never an internal OverflowError."""
    from skipinject.cache_tool import main

    store = StepStore(tmp_path / "proj", "toy", {})
    store.save(1, _payload())
    foreign = _killed_save(store.step_dir(2), 9_999_999_999)
    planted = _killed_save(store.step_dir(3), _dead_pid())
    assert garbage.collect(store.project_dir, force=True) == (4, 5850)
    assert [p for p in planted if p.exists()] == [] and all(p.exists() for p in foreign)
    planted = _killed_save(store.step_dir(3), _dead_pid())
    assert main(["prune", "--partial", str(tmp_path)]) == 0
    assert "removed 1 step(s), 4 file(s)" in capsys.readouterr().out
    assert [p for p in planted if p.exists()] == [] and all(p.exists() for p in foreign)


def test_named_files_symlinks_and_unreadable_meta_are_never_touched(tmp_path: Path) -> None:
    store = StepStore(tmp_path / "proj", "toy", {})
    store.save(1, _payload())
    named = list(store.step_dir(1).iterdir())
    for path in named:
        os.utime(path, (time.time() - OLD, time.time() - OLD))
    elsewhere = tmp_path / "victim"
    victims = _killed_save(elsewhere, _dead_pid())
    (store.project_dir / "4").symlink_to(elsewhere)
    unreadable = store.step_dir(5)
    kept = _killed_save(unreadable, _dead_pid())
    (unreadable / "meta.json").write_text("{not json")
    found = find_leftovers(store.project_dir)
    assert found == []
    store.save(2, _payload())
    assert all(p.exists() for p in named + victims + kept)


def test_remove_rechecks_before_unlinking(tmp_path: Path) -> None:
    store = StepStore(tmp_path / "proj", "toy", {})
    planted = _killed_save(store.step_dir(2), _dead_pid())
    found = find_leftovers(store.project_dir)
    assert len(found) == 4
    os.utime(planted[0])  # written again since it was found: not abandoned any more
    planted[1].unlink()
    planted[1].symlink_to(tmp_path / "elsewhere")  # replaced by a link: not ours
    files, _ = remove_leftovers(found)
    assert files == 2
    assert planted[0].exists() and planted[1].is_symlink()


def test_a_whole_project_scan_runs_at_most_once_per_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = StepStore(tmp_path / "proj", "toy", {})
    scans: list[Path] = []
    real = garbage.find_leftovers
    whole = lambda p, **k: (k.get("steps") is None and scans.append(p)) or real(p, **k)  # noqa: E731
    monkeypatch.setattr(garbage, "find_leftovers", whole)
    for step in range(5):
        store.save(step, _payload())
    assert len(scans) == 1


def test_empty_part_directories_of_uncommitted_steps_go_too(tmp_path: Path) -> None:
    store = StepStore(tmp_path / "proj", "toy", {})
    planted = _killed_save(store.step_dir(3) / "1", _dead_pid())
    part = store.step_dir(3) / "1"
    os.utime(part, (time.time() - OLD, time.time() - OLD))
    files, size = remove_leftovers(find_leftovers(store.project_dir))
    assert (files, size) == (4, 5850)
    assert not part.exists() and not any(p.exists() for p in planted)


def test_empty_step_directories_left_by_dead_claims_are_collected(tmp_path: Path) -> None:
    """``match``'s rows records claim a number by creating its directory; a writer that died there (or a
    forger's thousands of them) leaves empty directories the collector removes once 10 minutes old."""
    store = StepStore(tmp_path / "rows", "toy", {})
    store.save(1, _payload())
    dead = [store.step_dir(number) for number in range(2, 2000)]
    for directory in dead:
        directory.mkdir()
        os.utime(directory, (time.time() - OLD, time.time() - OLD))
    fresh = store.step_dir(2000)
    fresh.mkdir()  # a claim being written right now
    garbage.collect(store.project_dir, force=True)
    assert not any(directory.exists() for directory in dead)
    assert fresh.is_dir() and store.step_numbers_on_disk() == [1, 2000]


def test_a_usage_record_left_without_its_step_is_collected(tmp_path: Path) -> None:
    """A hit counted while ``cache rm``/``prune`` removed the step leaves its directory holding only
    ``usage.json``: collected like a dead claim once 10 minutes old; a committed step's record stays."""
    store = StepStore(tmp_path / "rows", "toy", {})
    store.save(1, _payload())
    store.note_hit(1)
    orphan = store.step_dir(2)
    orphan.mkdir()
    (orphan / "usage.json").write_text('{"hits": 1, "last_served": 1.0}')
    os.utime(orphan, (time.time() - OLD, time.time() - OLD))
    garbage.collect(store.project_dir, force=True)
    assert not orphan.exists()
    assert (store.step_dir(1) / "usage.json").is_file() and store.step_numbers_on_disk() == [1]


def test_upstream_file_only_from_real_trusted_step_dirs(tmp_path: Path) -> None:
    store = StepStore(tmp_path / "proj", "toy", {})
    (store.step_dir(1) / "0").mkdir(parents=True)
    (store.step_dir(1) / "gen_batch.dp").write_bytes(b"x")
    (store.step_dir(1) / "0" / "tq_batch.pt").write_bytes(b"x")
    assert store.upstream_file(1, "gen_batch.dp") == store.step_dir(1) / "gen_batch.dp"
    assert store.upstream_file(1, "0/tq_batch.pt") == store.step_dir(1) / "0" / "tq_batch.pt"
    assert store.upstream_file(1, "../1/gen_batch.dp") is None
    store.step_dir(2).symlink_to(store.step_dir(1))
    assert store.upstream_file(2, "gen_batch.dp") is None
    os.mkfifo(store.step_dir(1) / "fifo.dp")
    assert store.upstream_file(1, "fifo.dp") is None
    os.chmod(store.step_dir(1), 0o777)
    assert store.upstream_file(1, "gen_batch.dp") is None


def test_interrupted_names_data_files_without_meta(tmp_path: Path) -> None:
    store = StepStore(tmp_path / "proj", "toy", {})
    assert store.interrupted(1) is None
    _killed_save(store.step_dir(1) / "0", _dead_pid())
    assert "interrupted" in (store.interrupted(1) or "")
    store.save(2, _payload())
    assert store.interrupted(2) is None
    store.step_dir(3).symlink_to(store.step_dir(1))
    assert store.interrupted(3) is None
