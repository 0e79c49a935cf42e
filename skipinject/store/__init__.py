"""The on-disk cache (docs/cache-format.md): upstream's directory layout, a step committed by its ``meta.json``
written last, data files under fresh names checked by size and checksum, nothing run when loaded. The one door
is :class:`StepStore`; names and bounds are in :mod:`skipinject.store.format`.

The names below are imported at their first use: a process that only patches a target (every Ray worker
of a run) reads no cache, and pays for none of it at start-up."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skipinject.payload import Payload
    from skipinject.store.format import FORMAT, FORMAT_VERSION, META_NAME
    from skipinject.store.step_store import RemoteStepStore, StepEntry, StepStore
    from skipinject.store.writer import StepWriter, writer_versions


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'skipinject.store' has no attribute {name!r}")
    from skipinject import payload
    from skipinject.store import format, step_store, writer

    home = {"Payload": payload, "StepWriter": writer, "writer_versions": writer}.get(name)
    if home is None:
        home = format if name in ("FORMAT", "FORMAT_VERSION", "META_NAME") else step_store
    value = getattr(home, name)
    globals()[name] = value
    return value


__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "META_NAME",
    "Payload",
    "RemoteStepStore",
    "StepEntry",
    "StepStore",
    "StepWriter",
    "writer_versions",
]
