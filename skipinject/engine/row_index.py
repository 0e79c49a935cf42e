"""Where each row of a project's cached results was recorded, found by its key (``action=match``).

A committed step (or rows record, see :data:`~skipinject.store.format.ROWS_DIR`) whose ``meta.json``
holds ``row_keys`` contributes one entry per input row: ``key -> (source, number, call, row)``. The
index of a project directory is kept in memory and in :data:`~skipinject.store.format.ROW_INDEX_NAME`
beside its steps (numpy arrays, loaded without pickle; a local file is written to a temporary file
and renamed, an object store's is put whole).

It is a hint, never trusted: the file is bounded and checked, and is rebuilt when it does not load;
a refresh compares the committed step names with the indexed ones and reads only the ``meta.json``
of new ones (and drops the removed ones; a loaded index also re-reads records whose ``meta.json``
changed since it was written: locally by its mtime, in an object store by its ETag, from one
listing); every row it names is served only after the store
verified that step's files and its verified ``meta.json`` records that key at that row. A forged or
stale index can only cause a miss. Lookup is a binary search over the sorted keys: a 4096-row call
among 10,000 cached steps reads no step but the ones its rows are in. Every copy of a key is kept
(the latest first), so a copy that does not serve falls back to an older one.
"""

from __future__ import annotations

import io
import logging
import re
import threading
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from skipinject.errors import CorruptCacheError
from skipinject.store.format import MAX_INDEXED_ROWS, MAX_ROW_INDEX_BYTES, ROW_INDEX_NAME

if TYPE_CHECKING:
    from skipinject.store import StepStore

logger = logging.getLogger("skipinject")

#: A row key in ``meta.json``: 16 hex digits (8 bytes of blake2b).
ROW_KEY = re.compile(r"[0-9a-f]{16}")
#: Sources of rows: the role's steps, and the rows records of ``match`` (``{project}/rows/{n}``).
STEPS, ROWS = 0, 1
_ARRAYS = ("keys", "source", "number", "call", "row", "seen_source", "seen_number", "seen_mtime")


@dataclass(frozen=True)
class RowSource:
    """Where one row was recorded: input row ``row`` of call ``call`` of step (or rows record) ``number``."""

    source: int
    number: int
    call: int
    row: int


def match_records(meta: Mapping[str, Any]) -> list[tuple[list[str], int] | None]:
    """Per recorded call, its row keys and output rows per input row (``None`` where not recorded).

    Raises :class:`CorruptCacheError` when ``row_keys`` is there but malformed."""
    keys = meta.get("row_keys")
    per_input = meta.get("rows_per_input")
    if keys is None:
        return []
    if not isinstance(keys, list) or not isinstance(per_input, list) or len(keys) != len(per_input):
        raise CorruptCacheError("meta.json is malformed (row_keys and rows_per_input do not match)")
    out: list[tuple[list[str], int] | None] = []
    for call_keys, ratio in zip(keys, per_input, strict=True):
        if call_keys is None:
            out.append(None)
            continue
        if (
            not isinstance(call_keys, list)
            or len(call_keys) > MAX_INDEXED_ROWS
            or type(ratio) is not int
            or not 1 <= ratio <= 1 << 16
            or not all(isinstance(k, str) and ROW_KEY.fullmatch(k) for k in call_keys)
        ):
            raise CorruptCacheError("meta.json is malformed (row_keys is no list of row keys)")
        out.append((call_keys, ratio))
    return out


class RowIndex:
    """The row keys of one project directory's steps and rows records (see the module)."""

    def __init__(self, steps: StepStore, rows: StepStore, *, saves: bool = True) -> None:
        """``saves``: keep the index in its file too (``False``: a read-only run, ``save=false``)."""
        import numpy as np

        self.saves = saves
        self.stores = (steps, rows)
        self.lock = threading.Lock()
        self.path = steps.project_dir / ROW_INDEX_NAME
        self._np = np
        self._arrays: dict[str, Any] = {name: np.zeros(0, dtype=_dtype(name)) for name in _ARRAYS}
        self._loaded = False

    # ------------------------------------------------------------ lookup

    def lookup(self, keys: Sequence[str], copies: int = 1) -> list[list[RowSource]]:
        """Where each key was recorded, after a refresh: at most ``copies`` places per key, the latest
        step first (an older copy is the fallback when a later one does not serve)."""
        np = self._np
        with self.lock:
            self._refresh()
            wanted = np.array([int(k, 16) for k in keys], dtype=np.uint64)
            a = self._arrays
            starts = np.searchsorted(a["keys"], wanted, side="left").tolist()
            ends = np.searchsorted(a["keys"], wanted, side="right").tolist()
            found: list[list[RowSource]] = []
            for start, end in zip(starts, ends, strict=True):
                found.append(
                    [
                        RowSource(
                            int(a["source"][position]),
                            int(a["number"][position]),
                            int(a["call"][position]),
                            int(a["row"][position]),
                        )
                        for position in range(start, min(end, start + copies))
                    ]
                )
            return found

    def forget(self, source: int, number: int) -> None:
        """A source did not serve what the index said: drop it (it is read again at the next refresh)."""
        with self.lock:
            self._drop({(source, number)})
            self._save()

    @property
    def rows(self) -> int:
        return len(self._arrays["keys"])

    # ------------------------------------------------------------ refreshing

    def _refresh(self) -> None:
        np = self._np
        if not self._loaded:
            self._loaded = True
            self._load()
        a = self._arrays
        on_disk = {(kind, n) for kind, store in enumerate(self.stores) for n in store.step_numbers_on_disk()}
        seen = set(zip(a["seen_source"].tolist(), a["seen_number"].tolist(), strict=True))
        gone, new = seen - on_disk, on_disk - seen
        if not gone and not new:
            return
        if gone:
            self._drop(gone)
        added: dict[str, list[Any]] = {name: [] for name in _ARRAYS}
        for kind, number in sorted(new):
            mtime = self._mtime(kind, number)  # before reading: a later change is seen as one
            rows = self._read(kind, number)
            if rows is None:
                continue  # not committed (yet) or not ours: looked at again next time
            added["seen_source"].append(np.array([kind], dtype=np.uint8))
            added["seen_number"].append(np.array([number], dtype=np.int64))
            added["seen_mtime"].append(np.array([mtime], dtype=np.int64))
            for call, (keys, _) in rows:
                count = len(keys)
                added["keys"].append(np.array([int(k, 16) for k in keys], dtype=np.uint64))
                added["source"].append(np.full(count, kind, dtype=np.uint8))
                added["number"].append(np.full(count, number, dtype=np.int64))
                added["call"].append(np.full(count, call, dtype=np.uint32))
                added["row"].append(np.arange(count, dtype=np.uint32))
        if added["seen_source"]:
            merged = {name: np.concatenate([a[name], *added[name]]) for name in _ARRAYS}
            # sorted by key, and among equal keys the latest step first (searchsorted finds the first)
            order = np.lexsort((-merged["number"], merged["keys"]))
            for name in ("keys", "source", "number", "call", "row"):
                merged[name] = merged[name][order]
            if len(merged["keys"]) > MAX_INDEXED_ROWS:
                logger.warning(
                    "row index of %s holds more than %d rows; not indexing more", self.path.parent, MAX_INDEXED_ROWS
                )
                return
            self._arrays = merged
        self._save()

    def _read(self, kind: int, number: int) -> list[tuple[int, tuple[list[str], int]]] | None:
        try:
            meta = self.stores[kind].read_meta(number)
            records = match_records(meta)
        except (OSError, CorruptCacheError):
            return None
        return [(call, record) for call, record in enumerate(records) if record is not None]

    def _drop(self, records: set[tuple[int, int]]) -> None:
        """Forget every entry of ``records`` (source, number) and that they were read."""
        np = self._np
        a = self._arrays
        gone = np.array([_record_code(s, n) for s, n in records], dtype=np.int64)
        keep = ~np.isin(_record_code(a["source"].astype(np.int64), a["number"]), gone)
        for name in ("keys", "source", "number", "call", "row"):
            a[name] = a[name][keep]
        keep = ~np.isin(_record_code(a["seen_source"].astype(np.int64), a["seen_number"]), gone)
        for name in ("seen_source", "seen_number", "seen_mtime"):
            a[name] = a[name][keep]

    def _mtime(self, kind: int, number: int) -> int:
        """The version of the record's ``meta.json`` (:meth:`StepStore.meta_versions`; -1: unknown)."""
        return self.stores[kind].meta_versions([number]).get(number, -1)

    # ------------------------------------------------------------ the file

    def _load(self) -> None:
        """The saved index if it loads and checks out; else an empty one (rebuilt by the refresh)."""
        np = self._np
        try:
            data = self.stores[STEPS].read_file(ROW_INDEX_NAME, MAX_ROW_INDEX_BYTES)
            _check_members(data)
            with np.load(io.BytesIO(data), allow_pickle=False) as saved:
                arrays = {name: saved[name] for name in _ARRAYS}
        except FileNotFoundError:
            return
        except Exception as exc:  # anything wrong with the file: rebuilt from the steps
            logger.info(
                "row index %s not used (%s: %s); rebuilding it from the steps", self.path, type(exc).__name__, exc
            )
            return
        if _valid(arrays, np):
            self._arrays = arrays
            # records committed anew since the index was written (same number, other meta.json): read again
            seen = list(
                zip(
                    arrays["seen_source"].tolist(),
                    arrays["seen_number"].tolist(),
                    arrays["seen_mtime"].tolist(),
                    strict=True,
                )
            )
            versions = {
                (kind, number): version
                for kind, store in enumerate(self.stores)
                for number, version in store.meta_versions([n for k, n, _ in seen if k == kind]).items()
            }
            changed = {(kind, number) for kind, number, mtime in seen if versions.get((kind, number), -1) != mtime}
            if changed:
                self._drop(changed)
        else:
            logger.info("row index %s not used (malformed); rebuilding it from the steps", self.path)

    def _save(self) -> None:
        if not self.saves:
            return
        buffer = io.BytesIO()
        self._np.savez(buffer, **self._arrays)
        try:
            self.stores[STEPS].replace_file(ROW_INDEX_NAME, buffer.getvalue())
        except Exception as exc:
            logger.debug("row index %s not saved (%s: %s)", self.path, type(exc).__name__, exc)


def _check_members(data: bytes) -> None:
    """The archive holds exactly our arrays, stored (not compressed: no member expands beyond the file)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        members = archive.infolist()
    names = sorted(member.filename for member in members)
    if names != sorted(f"{name}.npy" for name in _ARRAYS):
        raise CorruptCacheError(f"unexpected members {names[:10]}")
    if any(member.compress_type != zipfile.ZIP_STORED or member.file_size > len(data) for member in members):
        raise CorruptCacheError("a member is compressed or larger than the file")


def _record_code(source: Any, number: Any) -> Any:
    """One integer per record (source, number): step numbers stay below 2^40."""
    return source * (1 << 40) + number


def _dtype(name: str) -> Any:
    import numpy as np

    return {
        "keys": np.uint64,
        "source": np.uint8,
        "number": np.int64,
        "call": np.uint32,
        "row": np.uint32,
        "seen_source": np.uint8,
        "seen_number": np.int64,
        "seen_mtime": np.int64,
    }[name]


def _valid(arrays: Mapping[str, Any], np: Any) -> bool:
    """Right dtypes, one dimension, equal lengths, keys sorted, sources known, within the bounds."""
    if any(arrays[name].dtype != np.dtype(_dtype(name)) or arrays[name].ndim != 1 for name in _ARRAYS):
        return False
    rows = len(arrays["keys"])
    if rows > MAX_INDEXED_ROWS or any(len(arrays[name]) != rows for name in ("source", "number", "call", "row")):
        return False
    if not len(arrays["seen_source"]) == len(arrays["seen_number"]) == len(arrays["seen_mtime"]):
        return False
    if rows and bool(np.any(arrays["keys"][1:] < arrays["keys"][:-1])):
        return False
    return not bool(np.any(arrays["source"] > ROWS)) and not bool(np.any(arrays["seen_source"] > ROWS))
