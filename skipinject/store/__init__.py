"""The on-disk cache (docs/cache-format.md): upstream's directory layout, a step committed by its ``meta.json``
written last, data files under fresh names checked by size and checksum, nothing run when loaded. The one door
is :class:`StepStore`; names and bounds are in :mod:`skipinject.store.format`."""

from skipinject.payload import Payload
from skipinject.store.format import FORMAT, FORMAT_VERSION, META_NAME
from skipinject.store.step_store import RemoteStepStore, StepEntry, StepStore
from skipinject.store.writer import StepWriter, writer_versions

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
