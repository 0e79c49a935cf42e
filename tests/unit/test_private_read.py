"""A verified read of a large file: its checksum chunks are read on every core, each hashed by the thread that
read it, into the private memory the hit is served from (never a mapping of the file)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from skipinject.store import checksums
from skipinject.store.checksums import _digest, read_private
from skipinject.store.format import TREE_CHUNK
from skipinject.store.hit_memory import anonymous

pytest.importorskip("xxhash")


def test_a_large_file_is_read_in_chunks_on_several_threads_and_checksummed_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = np.random.default_rng(7).integers(0, 256, 2 * TREE_CHUNK + 12345, dtype=np.uint8).tobytes()
    path = tmp_path / "tensors"
    path.write_bytes(data)
    monkeypatch.setattr(checksums, "workers", lambda: 3)
    readers: list[str] = []
    pread = checksums._pread_exact

    def noted(fd: int, view: memoryview, offset: int, shown: Path) -> None:
        readers.append(threading.current_thread().name)
        pread(fd, view, offset, shown)

    monkeypatch.setattr(checksums, "_pread_exact", noted)
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer, digest = read_private(fd, len(data), anonymous, "xxh3_64-tree", path)
    finally:
        os.close(fd)
    assert digest == _digest(data, "xxh3_64-tree")  # what the writer recorded
    assert bytes(buffer) == data
    assert len(readers) == 3 and all(name.startswith("skipinject-read") for name in readers)
    assert len(set(readers)) > 1 or os.cpu_count() == 1
    buffer.close()
