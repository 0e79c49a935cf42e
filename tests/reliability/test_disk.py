"""Full and read-only disks: training goes on, each step's failure is logged once, nothing partial remains.

* disk full, for real: ``dump_dir`` on a 1 MiB tmpfs (mounted by the test: needs root or
  CAP_SYS_ADMIN, else skipped) and a payload larger than that; then the tmpfs is grown and the
  next step caches normally;
* disk full at a random byte: the store's ``open`` is patched so that writes fail with ENOSPC
  after a seeded random number of bytes (any file of the save: tensors, objects, meta.json);
* read-only: a tmpfs remounted ``ro`` and a directory made immutable with ``chattr +i`` (root
  ignores permission bits, so ``chmod 0o500`` only runs as a non-root user); a cache already there
  is still served;
* unreadable cache directory (listing fails with EACCES, simulated by a patch).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.reliability import helpers as h

SEED = 6


def _run(*cmd: str) -> bool:
    return subprocess.run(cmd, capture_output=True).returncode == 0


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    if not shutil.which("mount") or not _run(
        "mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)
    ):
        pytest.skip("cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN)")
    try:
        yield path
    finally:
        _run("umount", "-l", str(path))


def _leftovers(root: Path) -> list[Path]:
    """Everything under ``root`` except ``root`` itself."""
    return sorted(root.rglob("*")) if root.exists() else []


def _big_target() -> h.ToyTarget:
    return h.ToyTarget(rows=64, width=2048)  # ~3.5 MB of tensors


def test_disk_full_on_a_real_tmpfs(tmp_path: Path, caplog: pytest.LogCaptureFixture, ledger: Any) -> None:
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        rt = h.runtime(mnt / "dump")
        target = _big_target()
        caplog.set_level(logging.INFO, logger="skipinject")
        results = [h.call(rt, target, step) for step in (1, 1, 2)]
        warnings = h.records(caplog)
        left = _leftovers(mnt)
        ok_results = all(
            h.same_batch(r, h.make_batch(64, 2048, seed=1000 + s, step=s))
            for r, s in zip(results, (1, 1, 2), strict=True)
        )
        # space comes back: the next step caches as usual
        assert _run("mount", "-o", "remount,size=64m", str(mnt))
        h.call(rt, target, 3)
        cached = h.store_of(rt).verified(3) is not None
        lost = int(not ok_results) + len(left) + int(not cached) + int(target.calls != [1, 1, 2, 3])
        ledger(
            "disk",
            "dump_dir on a full 1 MiB tmpfs (3.5 MB step), 3 calls on 2 steps, then space freed",
            4,
            f"results returned: 3/3; warnings: {len(warnings)} (one per step); files or dirs left: {len(left)}; "
            f"next step cached: {cached}",
            lost,
        )
        assert ok_results and target.calls == [1, 1, 2, 3]
        assert len(warnings) == 2 and all("No space left on device" in w for w in warnings), warnings
        assert left == [], left
        assert cached


class _FullDisk:
    """``open`` for the store whose files fail with ENOSPC once ``budget`` bytes were written in all."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.written = 0
        self.failed_in = ""

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = open(file, mode, *args, **kwargs)  # noqa: SIM115 - returned to the caller
        return _Handle(handle, self, Path(file).name) if "w" in mode else handle


class _Handle:
    def __init__(self, handle: Any, disk: _FullDisk, name: str) -> None:
        self._handle = handle
        self._disk = disk
        self._name = name

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        disk = self._disk
        if disk.budget is not None and disk.written + len(view) > disk.budget:
            room = max(disk.budget - disk.written, 0)
            self._handle.write(view[:room])
            disk.written += room
            disk.failed_in = self._name
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        disk.written += len(view)
        return self._handle.write(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def __enter__(self) -> _Handle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.close()


def test_disk_full_at_random_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, ledger: Any
) -> None:
    rng = random.Random(SEED)
    measure = _FullDisk(None)
    h.patch_store_open(monkeypatch, measure.open)
    h.call(h.runtime(tmp_path / "measure"), h.ToyTarget(), 0)
    total = measure.written
    trials = 30
    lost = 0
    warned = 0
    left_total = 0
    where: dict[str, int] = {"tensors": 0, "objects": 0, "meta.json": 0}
    dump = tmp_path / "dump"
    caplog.set_level(logging.WARNING, logger="skipinject")
    for trial in range(trials):
        step = trial + 1
        disk = _FullDisk(rng.randrange(0, total))
        h.patch_store_open(monkeypatch, disk.open)
        caplog.clear()
        target = h.ToyTarget()
        result = h.call(h.runtime(dump), target, step)
        lines = h.records(caplog)
        warned += len(lines)
        left = _leftovers(dump)
        left_total += len(left)
        if not h.same_batch(result, h.make_batch(4, 8, seed=1000 + step, step=step)) or target.calls != [step]:
            lost += 1
        if len(lines) != 1 or "No space left on device" not in lines[0] or left:
            lost += 1
        where[next(k for k in where if disk.failed_in.startswith(f".{k}"))] += 1
    ledger(
        "disk",
        f"ENOSPC after a seeded random byte of a {total}-byte save (any file), fresh step each",
        trials,
        f"results returned: {trials}/{trials}; one warning line each: {warned}; ENOSPC in "
        + ", ".join(f"{k} {v}" for k, v in where.items())
        + f"; files or dirs left: {left_total}",
        lost,
    )
    assert lost == 0


@contextlib.contextmanager
def _read_only(method: str, root: Path) -> Iterator[None]:
    if method == "tmpfs-ro":
        assert _run("mount", "-o", "remount,ro", str(root))
        try:
            yield
        finally:
            _run("mount", "-o", "remount,rw", str(root))
    elif method == "chattr+i":
        if not shutil.which("chattr") or not _run("chattr", "+i", str(root)):
            pytest.skip("chattr +i is not supported here")
        try:
            yield
        finally:
            _run("chattr", "-i", str(root))
    else:
        if os.geteuid() == 0:
            pytest.skip("root ignores permission bits: covered by tmpfs-ro and chattr+i")
        root.chmod(0o500)
        try:
            yield
        finally:
            root.chmod(0o700)


@pytest.mark.parametrize("method", ["tmpfs-ro", "chattr+i", "chmod-0500"])
def test_read_only_dump_dir(tmp_path: Path, method: str, caplog: pytest.LogCaptureFixture, ledger: Any) -> None:
    context = tmpfs(tmp_path / "mnt", "16m") if method == "tmpfs-ro" else contextlib.nullcontext(tmp_path / "mnt")
    with context as mnt:
        mnt.mkdir(exist_ok=True)
        dump = mnt / "dump"
        h.call(h.runtime(dump), h.ToyTarget(), 1)  # a cache made while the disk was writable
        project = h.project_dir(h.runtime(dump))
        before = {p: p.stat().st_mtime_ns for p in _leftovers(mnt)}
        target = h.ToyTarget()
        caplog.set_level(logging.INFO, logger="skipinject")
        with _read_only(method, mnt if method == "tmpfs-ro" else project):
            rt = h.runtime(dump)
            if method == "tmpfs-ro":  # said at start, where root passes os.access
                from skipinject.config import RoleConfig
                from skipinject.report.start import dump_dir_problem

                said = dump_dir_problem("toy", RoleConfig(enable=True, steps=(1,), dump_dir=str(dump)))
                assert said == f"skip.toy.dump_dir={dump}: cannot be written ({dump}: read-only file system): " \
                    "nothing can be cached there"  # fmt: skip
            hit = h.call(rt, target, 1)
            results = [h.call(rt, target, step) for step in (2, 2, 3)]
        warnings = h.records(caplog)
        after = {p: p.stat().st_mtime_ns for p in _leftovers(mnt) if p.name != "usage.json"}
        after.pop(project / "1", None)  # the hit's usage record (statistics, no part of the step) where writable
        before.pop(project / "1", None)
        ok = h.same_batch(hit, h.make_batch(4, 8, seed=1001, step=1)) and all(
            h.same_batch(r, h.make_batch(4, 8, seed=1000 + s, step=s)) for r, s in zip(results, (2, 2, 3), strict=True)
        )
        reason = (
            "Read-only file system"
            if method == "tmpfs-ro"
            else "Operation not permitted"
            if method == "chattr+i"
            else "Permission denied"
        )
        # a dump_dir on a read-only file system is said once for the run; a project directory that cannot be
        # written (under a writable dump_dir) at each step that fails
        expected = 1 if method == "tmpfs-ro" else 2
        lost = int(not ok) + int(before != after) + int(target.calls != [2, 2, 3])
        lost += int(len(warnings) != expected or not all(reason in w for w in warnings))
        ledger(
            "disk",
            f"read-only dump_dir ({method}): a cached step, then 3 calls on 2 new steps",
            4,
            f"cached step served: {ok}; results returned: 3/3; warnings: {len(warnings)} "
            f"({'once for the run' if expected == 1 else 'one per step'}, '{reason}'); files changed: "
            f"{int(before != after)}",
            lost,
        )
        assert ok and target.calls == [2, 2, 3]
        assert before == after
        assert len(warnings) == expected and all(reason in w for w in warnings), warnings


def test_unreadable_cache_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, ledger: Any
) -> None:
    dump = tmp_path / "dump"
    h.call(h.runtime(dump), h.ToyTarget(), 1)
    real_iterdir, real_is_file, real_scandir = Path.iterdir, Path.is_file, os.scandir

    def denied(path: Path) -> bool:
        return str(path).startswith(str(dump))

    def iterdir(self: Path) -> Any:
        if denied(self):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_iterdir(self)

    def is_file(self: Path) -> bool:
        if denied(self):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_is_file(self)

    def scandir(path: Any = ".") -> Any:
        if denied(Path(os.fsdecode(path)) if not isinstance(path, int) else Path("/")):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_scandir(path)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    monkeypatch.setattr(Path, "is_file", is_file)
    monkeypatch.setattr(os, "scandir", scandir)
    target = h.ToyTarget()
    caplog.set_level(logging.WARNING, logger="skipinject")
    rt = h.runtime(dump, action="repeat")
    result = h.call(rt, target, 2)
    warnings = h.records(caplog)
    ok = target.calls == [2] and h.same_batch(result, h.make_batch(4, 8, seed=1002, step=2))
    lost = int(not ok) + int(len(warnings) != 1)
    ledger(
        "disk",
        "cache directory cannot be listed (EACCES), action=repeat",
        1,
        f"result returned: {ok}; warnings: {len(warnings)}",
        lost,
    )
    assert ok and len(warnings) == 1 and "Permission denied" in warnings[0], warnings


@pytest.mark.parametrize("method", ["tmpfs-ro", "chattr+i", "chmod-0500"])
def test_prune_and_rm_on_a_read_only_cache_say_what_they_kept(
    tmp_path: Path, method: str, capsys: pytest.CaptureFixture[str], ledger: Any
) -> None:
    """Nothing can be deleted: each step is reported kept with why, never "removed"."""
    from skipinject.cache_tool import main

    context = tmpfs(tmp_path / "mnt", "16m") if method == "tmpfs-ro" else contextlib.nullcontext(tmp_path / "mnt")
    with context as mnt:
        mnt.mkdir(exist_ok=True)
        dump = mnt / "dump"
        for step in (1, 2, 3):
            h.call(h.runtime(dump), h.ToyTarget(), step)
        project = h.project_dir(h.runtime(dump))
        for found in _leftovers(mnt):  # no save could still be writing them
            os.utime(found, (1, 1))
        before = _leftovers(mnt)
        steps = [project / str(step) for step in (1, 2, 3)]  # chattr +i and chmod: each step directory
        with contextlib.ExitStack() as stack:
            for where in [mnt] if method == "tmpfs-ro" else steps:
                stack.enter_context(_read_only(method, where))
            pruned = main(["prune", "--keep-last", "1", str(dump)])
            pruned_out = capsys.readouterr().out
            removed = main(["rm", str(project / "3")])
            rm_out = capsys.readouterr().out
        reason = {"tmpfs-ro": "Read-only file system", "chattr+i": "Operation not permitted"}.get(method, "Permission")
        kept = [line for line in (pruned_out + rm_out).splitlines() if line.startswith("kept ")]
        lost = int(_leftovers(mnt) != before) + int(len(kept) != 3 or not all(reason in line for line in kept))
        ledger(
            "disk",
            f"cache prune --keep-last 1 and rm on a read-only cache ({method}), 3 steps",
            2,
            f"steps reported kept with why: {len(kept)} of 3; reported removed: "
            f"{pruned_out.count('removed /') + rm_out.count('removed /')}; exit statuses {pruned}, {removed}",
            lost,
        )
        assert _leftovers(mnt) == before
        assert "removed 0 step(s), 0 file(s)" in pruned_out and "removed 0 step(s)" in rm_out, pruned_out + rm_out
        assert len(kept) == 3 and all(reason in line for line in kept), kept
        assert (pruned, removed) == (0, 1)
