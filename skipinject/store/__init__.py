"""The on-disk cache (docs/cache-format.md): upstream's directory layout, a step committed by its ``meta.json``
written last, data files under fresh names checked by size and checksum, nothing run when loaded. The one door
is :class:`StepStore`; code outside this package imports only the names below, never a module of it.

The names below are imported at their first use, each from its own module only: a process that only patches
a target (every Ray worker of a run) reads no cache, and pays for none of it at start-up."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skipinject.payload import Payload as Payload
    from skipinject.store.compression import Compression as Compression
    from skipinject.store.compression import compression_for as compression_for
    from skipinject.store.compression import parse_compression as parse_compression
    from skipinject.store.files import bounded_dir_problem as bounded_dir_problem
    from skipinject.store.files import file_kind as file_kind
    from skipinject.store.files import open_plain as open_plain
    from skipinject.store.files import read_head as read_head
    from skipinject.store.files import unresolved_problem as unresolved_problem
    from skipinject.store.format import FORMAT as FORMAT
    from skipinject.store.format import FORMAT_VERSION as FORMAT_VERSION
    from skipinject.store.format import MAX_INDEXED_ROWS as MAX_INDEXED_ROWS
    from skipinject.store.format import MAX_ROW_INDEX_BYTES as MAX_ROW_INDEX_BYTES
    from skipinject.store.format import META_NAME as META_NAME
    from skipinject.store.format import ROW_INDEX_NAME as ROW_INDEX_NAME
    from skipinject.store.format import ROWS_DIR as ROWS_DIR
    from skipinject.store.format import STEP_NAME as STEP_NAME
    from skipinject.store.format import is_ours as is_ours
    from skipinject.store.format import meta_digest as meta_digest
    from skipinject.store.garbage import remove_leftovers as remove_leftovers
    from skipinject.store.hit_memory import HitMemory as HitMemory
    from skipinject.store.meta import StepMeta as StepMeta
    from skipinject.store.mounts import is_network_path as is_network_path
    from skipinject.store.step_store import RemoteStepStore as RemoteStepStore
    from skipinject.store.step_store import StepEntry as StepEntry
    from skipinject.store.step_store import StepStore as StepStore
    from skipinject.store.step_store import StoredFile as StoredFile
    from skipinject.store.step_store import list_step as list_step
    from skipinject.store.step_store import read_record as read_record
    from skipinject.store.tree import MAX_DEPTH as MAX_DEPTH
    from skipinject.store.tree import Backend as Backend
    from skipinject.store.tree import backend_for as backend_for
    from skipinject.store.tree import local_kind as local_kind
    from skipinject.store.tree import location_for as location_for
    from skipinject.store.tree import read_json as read_json
    from skipinject.store.tree import walk as walk
    from skipinject.store.writer import StepWriter as StepWriter
    from skipinject.store.writer import writer_versions as writer_versions

#: Each name's module, imported at the name's first use (tests/unit/test_import_graph.py reads this table).
_HOMES = {
    "payload": "Payload",
    "compression": "Compression compression_for parse_compression",
    "files": "bounded_dir_problem file_kind open_plain read_head unresolved_problem",
    "format": "FORMAT FORMAT_VERSION MAX_INDEXED_ROWS MAX_ROW_INDEX_BYTES META_NAME ROW_INDEX_NAME ROWS_DIR "
    "STEP_NAME is_ours meta_digest",
    "garbage": "remove_leftovers",
    "hit_memory": "HitMemory",
    "meta": "StepMeta",
    "mounts": "is_network_path",
    "step_store": "RemoteStepStore StepEntry StepStore StoredFile list_step read_record",
    "tree": "MAX_DEPTH Backend backend_for local_kind location_for read_json walk",
    "writer": "StepWriter writer_versions",
}
_HOME = {name: home for home, names in _HOMES.items() for name in names.split()}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'skipinject.store' has no attribute {name!r}")
    module = importlib.import_module(f"skipinject.{home}" if home == "payload" else f"skipinject.store.{home}")
    value = getattr(module, name)
    globals()[name] = value
    return value
