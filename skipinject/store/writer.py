"""Writing a step: fresh data-file names, fsync, and meta.json replaced last (complete or absent)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import stat
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from skipinject._version import __version__
from skipinject.cluster import node_identity
from skipinject.errors import CorruptCacheError
from skipinject.store.checksums import _digest
from skipinject.store.format import _SAFE_NAME, FORMAT, FORMAT_VERSION, META_NAME, _meta_digest
from skipinject.store.garbage import ACTIVE_WRITE_IDS, collect
from skipinject.store.payload import Payload
from skipinject.store.tensorfile import write_tensors

if TYPE_CHECKING:
    from skipinject.store.step_store import StepStore


# ---------------------------------------------------------------- writing


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_file_atomic(path: Path, write: Callable[[BinaryIO], object], write_id: str | None = None) -> None:
    """Write through a temporary name, fsync, then rename: the name holds all or nothing.

    The temporary name carries the writer's id (see :mod:`skipinject.store.garbage`)."""
    tmp = path.with_name(f".{path.name}.tmp-{write_id or uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def make_private_dirs(path: Path) -> list[Path]:
    """Create ``path`` and missing parents readable by the owner only; returns those it created."""
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    created = []
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            continue
        created.append(directory)
    return created


class StepWriter:
    """Collects the parts of one step and commits them with one ``meta.json`` replace."""

    def __init__(self, store: StepStore, step: int) -> None:
        self.store = store
        self.step = step
        self.write_id = f"{int(time.time())}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        ACTIVE_WRITE_IDS.add(self.write_id)
        self.parts: dict[str, dict[str, Any]] = {}
        self._written: list[Path] = []
        self._created: list[Path] = []

    @property
    def directory(self) -> Path:
        return self.store.step_dir(self.step)

    def add_part(self, payload: Payload, part: str = "") -> None:
        """Write one part's files (invisible to readers until :meth:`commit`).

        Parts may follow a commit (a step growing call by call): the next commit publishes them too."""
        if part and not _SAFE_NAME.match(part):
            raise ValueError(f"bad part name {part!r}")
        ACTIVE_WRITE_IDS.add(self.write_id)  # again, after a commit: not collected while being written
        part_dir = self.directory / part if part else self.directory
        if os.path.lexists(self.directory):
            _refuse_link(self.directory)
        self._created.extend(make_private_dirs(part_dir))
        for directory in {self.directory, part_dir}:
            _refuse_link(directory)
        algo = self.store.checksum_algo
        checksums: dict[str, str] = {}
        tensors_path = part_dir / f"tensors-{self.write_id}.bin"
        self._written.append(tensors_path)
        _write_file_atomic(
            tensors_path,
            lambda h: checksums.__setitem__("tensors", write_tensors(h, payload.tensors, algo)),
            self.write_id,
        )
        objects_path = part_dir / f"objects-{self.write_id}.json"
        self._written.append(objects_path)
        blob = json.dumps(payload.objects, separators=(",", ":"), allow_nan=True).encode()
        _write_file_atomic(objects_path, lambda h: h.write(blob), self.write_id)
        checksums["objects"] = _digest(blob, algo)
        files: dict[str, Any] = {}
        for kind, path in (("tensors", tensors_path), ("objects", objects_path)):
            files[kind] = {"name": path.name, "size": path.stat().st_size, "checksum": checksums[kind]}
        self.parts[part] = {"dir": part, "rows": payload.rows, "files": files}

    def commit(self, meta: Mapping[str, Any]) -> Path:
        """Publish the step: write ``meta.json`` last, atomically. Returns the step directory."""
        text = self.meta_record(meta)
        _refuse_link(self.directory)
        _write_file_atomic(self.directory / META_NAME, lambda h: h.write(text), self.write_id)
        _fsync_dir(self.directory)
        self._written.clear()
        self._created.clear()
        ACTIVE_WRITE_IDS.discard(self.write_id)
        # the step is committed; leftovers of earlier or concurrent saves are collected (never raises)
        collect(self.store.project_dir, step=self.step)
        return self.directory

    def meta_record(self, meta: Mapping[str, Any]) -> bytes:
        """The ``meta.json`` committing the parts written so far, with ``meta`` (role-specific keys)."""
        record = dict(meta)
        record.update(
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "role": self.store.role,
                "step": self.step,
                "global_steps": self.step,
                "context": dict(self.store.context),
                "checksum_algo": self.store.checksum_algo,
                "parts": [self.parts[name] for name in sorted(self.parts, key=_part_order)],
                "rows": sum(p["rows"] or 0 for p in self.parts.values()),
                "writer": writer_versions(),
                "node": node_identity(),  # which node wrote the step (multi-node clusters)
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
        )
        if self.store.plugin:
            record["plugin"] = self.store.plugin
        record["meta_checksum"] = _meta_digest(record)
        return json.dumps(record, indent=1, sort_keys=True).encode()

    def abort(self) -> None:
        """Remove what this writer wrote, and the directories it created if empty (best effort)."""
        for path in self._written:
            with contextlib.suppress(OSError):
                path.unlink()
        for directory in reversed(self._created):
            with contextlib.suppress(OSError):
                directory.rmdir()
        self._written.clear()
        self._created.clear()
        ACTIVE_WRITE_IDS.discard(self.write_id)


def _refuse_link(directory: Path) -> None:
    """Never write through a step or part directory that is a symlink (or not a directory)."""
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise CorruptCacheError(f"{directory} is {kind}; not writing through it")


def _part_order(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (-1, name)


_VERSIONS: dict[str, str] = {}


def writer_versions() -> dict[str, str]:
    """Versions of what wrote a cache (skipinject, verl, torch, python)."""
    if not _VERSIONS:
        from importlib.metadata import PackageNotFoundError, version

        _VERSIONS["skipinject"] = __version__
        _VERSIONS["python"] = platform.python_version()
        for dist in ("verl", "torch", "tensordict"):
            try:
                _VERSIONS[dist] = version(dist)
            except PackageNotFoundError:
                pass
    return dict(_VERSIONS)
