"""One StepStore over a storage seam: the backend comes from ``dump_dir``, in one place (issue 21)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from skipinject import bootstrap
from skipinject.store import StepStore
from skipinject.store.local import LocalFiles
from skipinject.store.remote import FsspecFiles
from tests.remote_checks import start


@pytest.mark.parametrize("where", ["local", "memory"])
def test_the_engine_opens_one_store_class_whose_backend_comes_from_dump_dir(toy: Any, tmp_path: Path, where: str):
    dump_dir = str(tmp_path / "dump") if where == "local" else f"memory://skipinject-tests/{uuid.uuid4().hex}"
    engine = start(dump_dir, steps=(1,))
    trainer = toy.Trainer()
    trainer.global_steps = 1
    trainer.generate([1])
    (store,) = engine.runtimes["toy"].opened()
    bootstrap.stop()
    assert type(store) is StepStore
    assert type(store.backend) is (LocalFiles if where == "local" else FsspecFiles)
    assert store.read_meta(1)["role"] == "toy" and store.step_numbers_on_disk() == [1]


def test_no_store_module_subclasses_the_store() -> None:
    """A new backend is a small class beside LocalFiles and FsspecFiles, never a StepStore subclass."""
    import skipinject.store as package

    for path in Path(package.__file__).parent.glob("*.py"):
        assert "(StepStore)" not in path.read_text(), path


#: What a backend does: bytes by name, and the few directory operations of a file system (each
#: justified in skipinject/store/backend.py's docstring). Trust rules beyond POSIX owners, claims,
#: garbage collection, the format and decoding are the store's.
BYTES_ONLY = {
    "names",
    "stat",
    "versions",
    "read_bytes",
    "open_step",
    "write",
    "replace",
    "remove",
    "prepare",
    "make_dir",
    "check_trust",
}


@pytest.mark.parametrize("backend", ["Backend", "LocalFiles", "FsspecFiles"])
def test_a_backend_moves_bytes_only(backend: str) -> None:
    from skipinject.store import backend as protocol
    from skipinject.store import local, remote

    cls = {"Backend": protocol.Backend, "LocalFiles": local.LocalFiles, "FsspecFiles": remote.FsspecFiles}[backend]
    public = {name for name in vars(cls) if not name.startswith("_") and callable(getattr(cls, name))}
    assert public == BYTES_ONLY


def test_a_step_reader_reads_bytes_only() -> None:
    from skipinject.store import backend as protocol
    from skipinject.store import local, remote

    for cls in (protocol.StepFiles, local._LocalStep, remote._RemoteStep):
        public = {name for name in vars(cls) if not name.startswith("_") and callable(getattr(cls, name))}
        assert public == {"read_meta", "read", "stream", "close"}, cls
