"""The on-disk cache: upstream's directory layout, a format that never runs code when loaded.

Layout (upstream's names, so users find caches where verl put them)::

    {dump_dir}/{experiment}_{project}/GBS{gbs}_N{n}_in{prompt_len}_out{response_len}/{step}/
        meta.json                      # the commit record, written last (atomic replace)
        tensors-<write id>.bin         # plain tensors: raw bytes + a JSON index (see below)
        objects-<write id>.json        # non-tensor values as tagged JSON
        0/ 1/ ...                      # the same per part, for roles saving several parts a step

Where the files are is a backend's business (:mod:`skipinject.store.backend`: local files, or an
fsspec filesystem for a ``dump_dir`` URL); one :class:`StepStore` holds the format's logic for both.
Every name, pattern and bound of the format is in :mod:`skipinject.store.format`.

A step is valid only when ``meta.json`` is ours, names every part, and every file it names has
the recorded size and checksum. Data files get a fresh name per write, so a reader never sees a
file change under it and an interrupted writer leaves only files no ``meta.json`` names.

The tensor file is ``MAGIC``, a little-endian u64 index length, the JSON index (name, dtype, shape,
offset, nbytes per tensor) padded to 64 bytes, then each tensor's bytes at a 64-byte aligned offset.
Loading it runs no code: the file is mapped copy-on-write once, checksummed through that mapping
(which also pulls it into this process), and tensors are views of it (``torch.frombuffer``), so a
verified hit costs one pass over the bytes, and in-place writes to a loaded tensor stay private.
"""

from skipinject.payload import Payload
from skipinject.store.format import FORMAT, FORMAT_VERSION, META_NAME
from skipinject.store.payload import StepEntry
from skipinject.store.step_store import RemoteStepStore, StepStore
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
