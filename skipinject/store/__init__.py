"""The on-disk cache: upstream's directory layout, a format that never runs code when loaded.

``{dump_dir}/{experiment}_{project}/GBS{gbs}_N{n}_in{p}_out{r}/{step}/`` holds ``meta.json`` (the commit,
written last), ``tensors-<write id>.bin`` (raw tensor bytes after a JSON index), ``objects-<write id>.json``
(tagged JSON), and ``0/ 1/ ...`` per part. A step is valid only when ``meta.json`` is ours and every file
it names has the recorded size and checksum; data files get fresh names per write, so readers never see
one change. Names and bounds: :mod:`skipinject.store.format`; the one door: :class:`StepStore`."""

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
