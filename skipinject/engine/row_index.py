"""Where each row of a project's cached results was recorded, by its key (``action=match``), in memory and in
``row-index.npz`` (docs/cache-format.md; numpy arrays, no pickle, bounded and checked). A hint, never trusted: a
row is served only once its step verified and records the key there."""

from __future__ import annotations

import io
import logging
import re
import struct
import threading
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from skipinject.errors import CorruptCacheError
from skipinject.store import MAX_INDEXED_ROWS, MAX_ROW_INDEX_BYTES, ROW_INDEX_NAME

if TYPE_CHECKING:
    from skipinject.store import StepMeta, StepStore

logger = logging.getLogger("skipinject")

#: A row key in ``meta.json``: 16 hex digits (8 bytes of blake2b).
ROW_KEY = re.compile(r"[0-9a-f]{16}")
#: Sources of rows: the role's steps, and the rows records of ``match`` (``{project}/rows/{n}``).
STEPS, ROWS = 0, 1
#: The index's arrays and their dtypes: the entries ``key -> (source, number, call, row)`` sorted by key (the
#: latest copy first), then the records read.
_ENTRY_DTYPES = {"keys": "uint64", "source": "uint8", "number": "int64", "call": "uint32", "row": "uint32"}
_DTYPES = {**_ENTRY_DTYPES, "seen_source": "uint8", "seen_number": "int64", "seen_mtime": "int64"}
_ARRAYS = tuple(_DTYPES)
_ENTRIES, _SEEN = _ARRAYS[:5], _ARRAYS[5:]


@dataclass(frozen=True)
class RowSource:
    """Where one row was recorded: input row ``row`` of call ``call`` of step (or rows record) ``number``."""

    source: int
    number: int
    call: int
    row: int


def match_records(meta: StepMeta) -> list[tuple[list[str], int] | None]:
    """Per recorded call, its row keys and output rows per input row (``None``: not recorded); raises
    :class:`CorruptCacheError` when they are malformed."""
    keys, per_input = meta.row_keys, meta.rows_per_input
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
    """The row keys of one project directory's steps and rows records; ``saves``: kept in its file too."""

    def __init__(self, steps: StepStore, rows: StepStore, *, saves: bool = True) -> None:
        import numpy as np

        self.saves = saves
        self.stores = (steps, rows)
        self.lock = threading.Lock()
        self.path = steps.project_dir / ROW_INDEX_NAME
        self._np = np
        self._arrays: dict[str, Any] = {name: np.zeros(0, dtype=_DTYPES[name]) for name in _ARRAYS}
        self._loaded = False
        #: Records whose ``meta.json`` this process read (what came from the file only is a hint).
        self._read_here: set[tuple[int, int]] = set()
        #: Records looked at without a readable ``meta.json`` (a claim, a save under way), and when.
        self._unreadable: dict[tuple[int, int], float] = {}
        self._distrusted = False

    def lookup(self, keys: Sequence[str], copies: int = 1) -> list[list[RowSource]]:
        """Where each key was recorded, after a refresh: at most ``copies`` places per key, the latest first."""
        np = self._np
        with self.lock:
            self._refresh()
            wanted = np.array([int(k, 16) for k in keys], dtype=np.uint64)
            a = self._arrays
            starts = np.searchsorted(a["keys"], wanted, side="left").tolist()
            ends = np.searchsorted(a["keys"], wanted, side="right").tolist()
            return [
                [
                    RowSource(*(int(a[name][at]) for name in _ENTRIES[1:]))
                    for at in range(start, min(end, start + copies))
                ]
                for start, end in zip(starts, ends, strict=True)
            ]

    def forget(self, source: int, number: int) -> bool:
        """A source did not serve what the index said: drop it (read again at the next refresh). True when
        only the index file vouched for it: then nothing only the file vouches for is trusted (one line)."""
        with self.lock:
            hint = (source, number) not in self._read_here
            if hint:  # the file lied: what it alone vouches for goes, entries of records it never listed too
                self._keep_only(self._read_here)
            else:
                self._drop({(source, number)})
            if hint and not self._distrusted:
                self._distrusted = True
                logger.warning(
                    f"row index {self.path} names rows its steps do not hold (damaged or forged); {_REBUILD}"
                )
            self._save()
            return hint

    def _seen(self) -> set[tuple[int, int]]:
        return set(zip(self._arrays["seen_source"].tolist(), self._arrays["seen_number"].tolist(), strict=True))

    def _refresh(self) -> None:
        np = self._np
        if not self._loaded:
            self._loaded = True
            self._load()
        a = self._arrays
        on_disk = {(kind, n) for kind, store in enumerate(self.stores) for n in store.step_numbers_on_disk()}
        seen = self._seen()
        gone, new = seen - on_disk, on_disk - seen
        if not gone and not new:
            return
        if gone:
            self._drop(gone)
            self._read_here -= gone
        added: dict[str, list[Any]] = {name: [] for name in _ARRAYS}
        now = time.monotonic()
        failures = 0
        for kind, number in sorted(new, key=lambda record: (-record[1], record[0])):  # the newest first
            looked = self._unreadable.get((kind, number))
            if looked is not None and now - looked < RECHECK_SECONDS:
                continue
            if failures >= MAX_UNREADABLE_LOOKS:
                break  # a directory of empty claims costs a bounded look per refresh (the collector removes them)
            mtime = self.stores[kind].meta_versions([number]).get(number, -1)  # before reading: a change is seen
            try:
                rows = list(enumerate(match_records(self.stores[kind].read_meta(number, siblings=True))))
            except (OSError, CorruptCacheError):
                failures += 1
                self._unreadable[(kind, number)] = now  # not committed (yet) or not ours: looked at again later
                continue
            self._unreadable.pop((kind, number), None)
            self._read_here.add((kind, number))
            for name, value in zip(_SEEN, (kind, number, mtime), strict=True):
                added[name].append(np.array([value], dtype=_DTYPES[name]))
            for call, record in rows:
                if record is not None:
                    count = len(record[0])
                    values = ([int(k, 16) for k in record[0]], [kind] * count, [number] * count, [call] * count)
                    for name, column in zip(_ENTRIES, (*values, range(count)), strict=True):
                        added[name].append(np.array(column, dtype=_DTYPES[name]))
        if added["seen_source"]:
            merged = {name: np.concatenate([a[name], *added[name]]) for name in _ARRAYS}
            # sorted by key, and among equal keys the latest step first (searchsorted finds the first)
            order = np.lexsort((-merged["number"], merged["keys"]))
            for name in _ENTRIES:
                merged[name] = merged[name][order]
            if len(merged["keys"]) > MAX_INDEXED_ROWS:
                logger.warning(
                    f"row index of {self.path.parent} holds more than {MAX_INDEXED_ROWS} rows; not indexing more"
                )
                return
            self._arrays = merged
        self._save()

    def _drop(self, records: set[tuple[int, int]]) -> None:
        """Forget the entries of ``records`` (source, number) and that they were read."""
        np = self._np
        a = self._arrays
        gone = np.array([_record_code(s, n) for s, n in records], dtype=np.int64)
        keep = ~np.isin(_record_code(a["source"].astype(np.int64), a["number"]), gone)
        for name in _ENTRIES:
            a[name] = a[name][keep]
        keep = ~np.isin(_record_code(a["seen_source"].astype(np.int64), a["seen_number"]), gone)
        for name in _SEEN:
            a[name] = a[name][keep]

    def _keep_only(self, records: set[tuple[int, int]]) -> None:
        """Keep the entries and records of ``records`` alone (a rebuild starts from what this process read)."""
        np = self._np
        a = self._arrays
        kept = np.array([_record_code(s, n) for s, n in records], dtype=np.int64)
        keep = np.isin(_record_code(a["source"].astype(np.int64), a["number"]), kept)
        for name in _ENTRIES:
            a[name] = a[name][keep]
        keep = np.isin(_record_code(a["seen_source"].astype(np.int64), a["seen_number"]), kept)
        for name in _SEEN:
            a[name] = a[name][keep]

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
            logger.info(f"row index {self.path} not used ({type(exc).__name__}: {exc}); {_REBUILD}")
            return
        if _valid(arrays, np):
            self._arrays = arrays
            seen_codes = _record_code(arrays["seen_source"].astype(np.int64), arrays["seen_number"])
            orphans = ~np.isin(_record_code(arrays["source"].astype(np.int64), arrays["number"]), seen_codes)
            if bool(orphans.any()):  # entries of a record the index never read: none was written by us
                for name in _ENTRIES:
                    arrays[name] = arrays[name][~orphans]
                logger.info(f"row index {self.path} names records it never read (damaged or forged); dropped them")
                self._save()  # the file no longer holds them either
            # records committed anew since the index was written (same number, other meta.json): read again
            seen = list(zip(*(arrays[name].tolist() for name in _SEEN), strict=True))
            versions = {
                (kind, number): version
                for kind, store in enumerate(self.stores)
                for number, version in store.meta_versions([n for k, n, _ in seen if k == kind]).items()
            }
            changed = {(kind, number) for kind, number, mtime in seen if versions.get((kind, number), -1) != mtime}
            if changed:
                self._drop(changed)
        else:
            logger.info(f"row index {self.path} not used (malformed); {_REBUILD}")

    def _save(self) -> None:
        if not self.saves:
            return
        buffer = io.BytesIO()
        self._np.savez(buffer, **self._arrays)
        try:
            self.stores[STEPS].replace_file(ROW_INDEX_NAME, buffer.getvalue())
        except Exception as exc:
            logger.debug(f"row index {self.path} not saved ({type(exc).__name__}: {exc})")


def _check_members(data: bytes) -> None:
    """The archive holds exactly our arrays, stored (no member expands beyond the file). Its end record
    is read first: any other number of members, or a comment, is refused before the directory is parsed
    (a few MB of members would cost gigabytes)."""
    end = data[-_END_RECORD.size :]
    if len(data) < _END_RECORD.size or end[:4] != b"PK\x05\x06":
        raise CorruptCacheError("not a zip archive of its arrays (or one with a comment)")
    _, disk, first_disk, here, total, directory_size, _, comment = _END_RECORD.unpack(end)
    if (disk, first_disk, comment) != (0, 0, 0) or here != total or total != len(_ARRAYS):
        raise CorruptCacheError(f"{total} members, not {len(_ARRAYS)}")
    if directory_size > 1024 * len(_ARRAYS):
        raise CorruptCacheError(f"a member directory of {directory_size} bytes")
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        members = archive.infolist()
    names = sorted(member.filename for member in members)
    if names != sorted(f"{name}.npy" for name in _ARRAYS):
        raise CorruptCacheError(f"unexpected members {names[:10]}")
    if any(member.compress_type != zipfile.ZIP_STORED or member.file_size > len(data) for member in members):
        raise CorruptCacheError("a member is compressed or larger than the file")


_REBUILD = "rebuilding it from the steps"
#: A zip archive's end record (no comment: numpy writes none).
_END_RECORD = struct.Struct("<4s4H2LH")
#: Records without a readable ``meta.json`` one refresh looks at, at most, and seconds before another look.
MAX_UNREADABLE_LOOKS = 256
RECHECK_SECONDS = 60.0


def _record_code(source: Any, number: Any) -> Any:
    """One integer per record (source, number): step numbers stay below 2^40."""
    return source * (1 << 40) + number


def _valid(arrays: Mapping[str, Any], np: Any) -> bool:
    """Right dtypes, one dimension, equal lengths, keys sorted, sources and record numbers possible, within the
    bounds."""
    if any(arrays[name].dtype != np.dtype(_DTYPES[name]) or arrays[name].ndim != 1 for name in _ARRAYS):
        return False
    rows = len(arrays["keys"])
    if rows > MAX_INDEXED_ROWS or any(len({len(arrays[name]) for name in names}) != 1 for names in (_ENTRIES, _SEEN)):
        return False
    if rows and bool(np.any(arrays["keys"][1:] < arrays["keys"][:-1])):
        return False
    if any(bool(np.any((arrays[name] < 0) | (arrays[name] >= 1 << 40))) for name in ("number", "seen_number")):
        return False  # no step directory has such a number (and _record_code needs it below 2^40)
    return not bool(np.any(arrays["source"] > ROWS)) and not bool(np.any(arrays["seen_source"] > ROWS))
