"""One role's steps under one project directory: the only code that reads, verifies, writes or removes them,
for every backend (``meta.json`` checks, sizes before reading, checksums before decoding, the commit rule).
Every failure is a :class:`CorruptCacheError`; a missing step stays ``FileNotFoundError``."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import skipinject.store.format as fmt
from skipinject.errors import CacheError, CorruptCacheError
from skipinject.payload import Payload
from skipinject.store.backend import Backend, StepFiles
from skipinject.store.checksums import _checksum_algo, _Hasher
from skipinject.store.compression import Compression, FrameDecoder
from skipinject.store.files import parse_json, remove_step
from skipinject.store.garbage import Leftover, collect, find_leftovers
from skipinject.store.hit_memory import FRESH, Claim, HitMemory
from skipinject.store.meta import DataFile, Part, StepMeta, checked, part_budget
from skipinject.store.tensorfile import read_tensors
from skipinject.store.tree import read_json
from skipinject.store.writer import StepWriter

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from skipinject.store.hit_memory import Decoded
    from skipinject.store.remote import RemotePath

__all__ = ["RemoteStepStore", "StepEntry", "StepStore"]

logger = logging.getLogger("skipinject")

#: A usage record larger than this is not ours (a real one is under 100 bytes).
MAX_USAGE_BYTES = 1024
#: Hit counts past this are forged (JSON's exact integers end here).
MAX_HITS = 1 << 53
#: A last use further in the future than this (clock skew between nodes) is forged.
FUTURE_SLACK = 86400.0
#: Taken by the first untrusted usage record reported (later ones are logged at debug level only).
_first_warning = threading.Lock()


@dataclass(frozen=True)
class Usage:
    """``{step}/usage.json``: how often a step was served, and when last (unix time); never named by
    ``meta.json``, replaced whole (two runs counting at once may lose an increment, never the file)."""

    hits: int
    last_served: float

    def encoded(self) -> bytes:
        return json.dumps({"hits": self.hits, "last_served": round(self.last_served, 3)}).encode()

    @classmethod
    def parse(cls, data: bytes, shown: object, now: float) -> Usage:
        """A record's bytes checked (CacheError: hostile input)."""
        if len(data) > MAX_USAGE_BYTES:
            raise CacheError(f"{shown}: {len(data)} bytes, larger than any usage record")
        raw = parse_json(data, shown, what="usage record", max_depth=1)  # type: ignore[arg-type]
        hits, served = (raw.get("hits"), raw.get("last_served")) if isinstance(raw, dict) else (None, None)
        if type(hits) is not int or not 0 <= hits <= MAX_HITS:
            raise CacheError(f"{shown}: no hit count in the usage record")
        if not isinstance(served, (int, float)) or type(served) is bool or not math.isfinite(served):
            raise CacheError(f"{shown}: no last-served time in the usage record")
        if not 0 <= served <= now + FUTURE_SLACK:
            raise CacheError(f"{shown}: no plausible last-served time in the usage record")
        return cls(hits, float(served))


@dataclass(frozen=True)
class StoredFile:
    """A listed name in a step directory (``part``: ``""``) or a part directory, never followed."""

    part: str
    name: str
    kind: str
    size: int
    mtime: float

    @property
    def usage(self) -> bool:
        """The step's usage record (a hit's, not a save's)."""
        return not self.part and fmt.is_usage_name(self.name)


@dataclass(frozen=True)
class StepEntry:
    """A verified, loadable step: what :meth:`StepStore.verified` read (and checksummed), kept for ``load``."""

    step: int
    directory: Path
    meta: StepMeta
    mapped: dict[Path, Decoded] = field(default_factory=dict, compare=False, repr=False)  # tensor files
    blobs: dict[Path, bytes] = field(default_factory=dict, compare=False, repr=False)  # objects files
    #: Where a compressed step's decoded tensors go (:mod:`~skipinject.store.hit_memory`).
    memory: Claim = field(default=FRESH, compare=False, repr=False)
    #: Its parts already loaded (a step read ahead): the next :meth:`StepStore.load` hands them out.
    loaded: list[Payload] = field(default_factory=list, compare=False, repr=False)

    def release(self) -> None:
        """Drop what was read. Mappings are let go, never closed: a tensor viewing one holds no buffer
        export, so closing it would leave the tensor reading unmapped memory."""
        self.mapped.clear()
        self.blobs.clear()
        self.loaded.clear()


class StepStore:
    """The cache of one role under one project directory, in a local tree or a remote store."""

    def __init__(
        self,
        project_dir: Path,
        role: str,
        context: Mapping[str, Any],
        *,
        trust_permissions: bool = False,
        dump_dir: Path | None = None,
        plugin: str | None = None,
        backend: Backend | None = None,
        compression: Compression | None = None,
        memory: HitMemory | None = None,
        step_aliases: Sequence[str] = (),
        siblings: Sequence[str] = (),
    ) -> None:
        """``dump_dir``: the cache root (trust checked down to ``project_dir``); ``memory``: the pool compressed
        hits decode into; ``step_aliases``: more ``meta.json`` keys holding the step; ``siblings``: other roles
        whose steps are read when asked (``action=match``), never overwritten."""
        if backend is None:
            from skipinject.store.local import LocalFiles

            backend = LocalFiles(trust_permissions=trust_permissions)
        self.backend = backend
        self.project_dir = project_dir
        self.role = role
        self.context = dict(context)
        self.checksum_algo = _checksum_algo()
        self.trust_permissions = trust_permissions or not backend.checks_owners
        self.dump_dir = dump_dir
        self.plugin = plugin
        self.compression = compression
        self.memory = memory
        self.step_aliases = tuple(step_aliases)
        self.siblings = frozenset(siblings)

    @classmethod
    def at(
        cls, step_dir: Path, backend: Backend | None = None, root: Path | None = None, record: StepMeta | None = None
    ) -> tuple[StepStore, StepMeta]:
        """The store holding ``step_dir`` (role and context from its ``meta.json``, checked whole before they are
        trusted; its directories trusted from ``root`` down, as a run checks its dump directory's) and its checked
        meta, from one read of ``meta.json`` (none given its ``record``)."""
        if not fmt.STEP_NAME.fullmatch(step_dir.name):
            raise CorruptCacheError(f"{step_dir}: not a step directory (its name is not a step number)")
        record = read_record(step_dir, backend) if record is None else record
        if record is None:
            raise CorruptCacheError(f"{step_dir}/meta.json: not a skipinject commit record (no format marker)")
        role, context = record.written("role"), record.written("context", {})
        if not isinstance(role, str) or not isinstance(context, dict):
            raise CorruptCacheError(
                f"{step_dir}/meta.json: malformed (role {role!r:.80}, context {type(context).__name__})"
            )
        store = cls(step_dir.parent, role, context, backend=backend, dump_dir=root)
        step = int(step_dir.name)
        store._open_step(step).close()  # the trust rules and the step directory, as read_meta applies them
        return store, store._checked(dict(record), step)

    @property
    def location(self) -> Path:
        return self.project_dir

    def step_dir(self, step: int) -> Path:
        return self.project_dir / fmt.step_name(step)

    def begin(self, step: int) -> StepWriter:
        return StepWriter(self, step)

    def save(self, step: int, payload: Payload, meta: Mapping[str, Any] | None = None) -> Path:
        """Save a one-part step atomically."""
        writer = self.begin(step)
        try:
            writer.add_part(payload)
            return writer.commit(meta or {})
        except BaseException:
            writer.abort()
            raise

    def claim(self, token: str, first: int | None = None) -> int:
        """A new record number from ``first`` on (default: after those in use) no concurrent writer also takes
        (docs/cache-format.md: an exclusive ``mkdir``, or a lone ``.claim-<token>`` object). :meth:`release` it."""
        backend = self.backend
        backend.prepare(self.project_dir, self.project_dir)
        self.check_writable([])
        if first is None:
            first = next_number(self.step_numbers_on_disk())
        for number in range(first, first + fmt.MAX_CLAIMS):
            step_dir = self.step_dir(number)
            created = backend.make_dir(step_dir)
            if created is not None:
                if created:
                    return number
                continue
            marker = step_dir / f"{fmt.CLAIM_PREFIX}{token}"
            backend.write(marker, lambda handle: None)
            try:
                names = backend.names(step_dir)
            except FileNotFoundError:
                names = []
            if [n for n in names if n.startswith(fmt.CLAIM_PREFIX) or n == fmt.META_NAME] == [marker.name]:
                return number
            with contextlib.suppress(OSError):
                backend.remove(marker)
        raise CacheError(f"{self.project_dir}: steps {first} to {first + fmt.MAX_CLAIMS - 1} are all taken")

    def release(self, step: int, token: str) -> None:
        """Remove an object store's claim object (a claimed directory is the record's). Never raises."""
        with contextlib.suppress(OSError):
            self.backend.remove(self.step_dir(step) / f"{fmt.CLAIM_PREFIX}{token}", self.dump_dir or self.project_dir)

    def read_file(self, name: str, limit: int) -> bytes:
        """A file beside the steps (the row index), at most ``limit`` bytes; FileNotFoundError."""
        return self.backend.read_bytes(self.project_dir / name, limit)

    def replace_file(self, name: str, data: bytes) -> None:
        self.backend.write(self.project_dir / name, lambda handle: handle.write(data))

    def meta_versions(self, steps: Sequence[int]) -> dict[int, int]:
        """A number per step that changes whenever its ``meta.json`` is replaced (no ``meta.json`` read)."""
        wanted = {self.step_dir(step) / fmt.META_NAME: step for step in steps}
        if not wanted:
            return {}
        return {wanted[at]: version for at, version in self.backend.versions(self.project_dir, list(wanted)).items()}

    def names_above(self, levels: int) -> list[str]:
        """Directory names ``levels`` above the project directory (an experiment's other layouts)."""
        location = self.project_dir
        for _ in range(levels):
            location = location.parent
        return self.backend.names(location, directories=True)

    def _trust_chain(self) -> list[Path]:
        chain = [self.project_dir]
        if self.dump_dir is not None:
            try:
                relative = self.project_dir.relative_to(self.dump_dir)
            except ValueError:
                return chain
            chain = [self.dump_dir]
            for part in relative.parts:
                chain.append(chain[-1] / part)
        return chain

    def check_trust(self) -> None:
        """Refuse (CorruptCacheError with the fix) a dump/project directory other users could write."""
        if not self.trust_permissions:
            self.backend.check_trust(self._trust_chain(), self.role)

    def unusable(self) -> str | None:
        """Why this store's existing directories can be neither loaded from nor saved into, or None. Never raises."""
        try:
            self.backend.check_trust(self._trust_chain(), self.role)
        except FileNotFoundError:
            return None
        except Exception as exc:
            return str(exc)
        return None

    def check_writable(self, directories: list[Path]) -> None:
        """Before a file is written: the trust chain and ``directories`` just prepared pass the trust rules."""
        chain = self._trust_chain()
        self.backend.check_trust(chain + [d for d in directories if d not in chain], self.role)

    def _open_step(self, step: int) -> StepFiles:
        self.check_trust()
        return self.backend.open_step(self.step_dir(step), self.role)

    def step_numbers_on_disk(self) -> list[int]:
        """The step directories' numbers, sorted, from one listing; ``[]`` for an untrusted or missing project."""
        try:
            self.check_trust()
        except (FileNotFoundError, CacheError):
            return []
        try:
            names = self.backend.names(self.project_dir, directories=True)
        except FileNotFoundError:
            return []
        except Exception:
            if self.backend.checks_owners:
                raise
            return []  # a remote store that cannot be listed holds nothing this run can use
        return sorted({int(name) for name in names if fmt.STEP_NAME.fullmatch(name)})

    def is_committed(self, step: int, *, siblings: bool = False) -> bool:
        """The step has a valid ``meta.json`` of this role (or a sibling's); its data files are not verified."""
        try:
            self.read_meta(step, siblings=siblings)
        except (OSError, CorruptCacheError):
            return False
        return True

    def interrupted(self, step: int) -> str | None:
        """One line if the step holds our data files but no ``meta.json`` (an interrupted save). Never raises."""

        def names(location: Path) -> list[str]:
            try:
                return self.backend.names(location)
            except Exception:
                return []

        step_dir = self.step_dir(step)
        top = names(step_dir)
        found = top + [name for sub in top if fmt.PART_NAME.fullmatch(sub) for name in names(step_dir / sub)]
        if fmt.META_NAME in top or not any(fmt.DATA_NAME.fullmatch(name) for name in found):
            return None
        return f"{step_dir} holds data files but no meta.json (an earlier save was interrupted)"

    def upstream_file(self, step: int, name: str, directory_name: str | None = None) -> Path | None:
        """verl's own file ``name`` of a step if it is a regular file in a real, trusted, local step directory
        (``directory_name``: when not ``{step}``); None otherwise. Never raises."""
        pieces = name.split("/")
        names = pieces if directory_name is None else [*pieces, directory_name]
        if len(pieces) > 2 or not all(fmt.SAFE_NAME.match(p) and ".." not in p for p in names):
            return None
        base = self.step_dir(step) if directory_name is None else self.project_dir / directory_name
        if not isinstance(base, Path):  # verl's own caches are pickles on local disks, loaded by path
            return None
        sub, leaf = pieces if len(pieces) == 2 else ("", name)
        try:
            self.check_trust()
            files = self.backend.open_step(base, self.role)
            try:
                with files.stream(sub, leaf, None):  # opened as a regular file, no link followed
                    pass
            finally:
                files.close()
        except Exception:
            return None
        return base / name

    def read_meta(self, step: int, *, siblings: bool = False) -> StepMeta:
        """A step's checked ``meta.json`` (``siblings``: a sibling role's too)."""
        files = self._open_step(step)
        try:
            return self._read_meta(files, step, siblings)
        finally:
            files.close()

    def _read_meta(self, files: StepFiles, step: int, siblings: bool = False) -> StepMeta:
        path = self.step_dir(step) / fmt.META_NAME
        meta = parse_json(files.read_meta(), path, what="meta.json", max_depth=fmt.MAX_META_DEPTH)
        return self._checked(meta, step, siblings)

    def _checked(self, meta: Any, step: int, siblings: bool = False) -> StepMeta:
        path = self.step_dir(step) / fmt.META_NAME
        return checked(meta, path, step, self.role, self.context, self.siblings if siblings else frozenset())

    def verified(self, step: int, *, siblings: bool = False) -> StepEntry:
        """The step's entry after checking every file it names, each read once into private memory and kept for
        :meth:`load` (CorruptCacheError; FileNotFoundError: nothing cached; ``siblings``: a sibling's step too)."""
        files = self._open_step(step)
        try:
            meta = self._read_meta(files, step, siblings)
            meta.check_budget()
            entry = StepEntry(step, self.step_dir(step), meta, memory=Claim(self.memory))
            try:
                for part, file in meta.files():
                    self._verify_file(entry, files, part, file)
            except BaseException as exc:
                entry.release()
                entry.memory.refuse()
                if isinstance(exc, Exception) and not isinstance(exc, CacheError):  # MemoryError, OSError...
                    raise CorruptCacheError(f"{entry.directory}: cannot read it ({type(exc).__name__}: {exc})") from exc
                raise
            return entry
        finally:
            files.close()

    def _verify_file(self, entry: StepEntry, files: StepFiles, part: Part, file: DataFile) -> None:
        path = part.at(entry.directory, file.name)
        algo = entry.meta.checksum_algo
        make = entry.memory.buffer if file.kind == "tensors" else bytearray
        if file.encoded:  # decoded as its stored bytes arrive, kept only if they check out
            data = _decode_streamed(files, part.dir, file, algo, make, path)
        else:  # tensors into private memory (never served from a mapping of the file)
            into = make if file.kind == "tensors" else None
            data, checksum = files.read(part.dir, file.name, file.spec.get("size"), algo, into=into)
            if checksum != file.spec.get("checksum"):
                raise CorruptCacheError(f"{path}: checksum mismatch (the file was damaged or changed)")
        if file.kind != "tensors":
            entry.blobs[path] = bytes(data)
        elif not isinstance(data, bytes) and len(data):
            entry.mapped[path] = data  # tensors are views of it

    def check(self, step: int) -> None:
        """Read and check every byte of a step as a hit would, then let it go (``cache verify``, ``--damaged``)."""
        entry = self.verified(step)
        try:
            self.load(entry)
        finally:
            entry.release()

    def load(self, entry: StepEntry) -> list[Payload]:
        """Every part of a verified entry (parts read ahead are handed out once). Raises only CorruptCacheError."""
        if entry.loaded:
            loaded = list(entry.loaded)
            entry.loaded.clear()
            return loaded
        if not entry.mapped and not entry.blobs:
            entry = self.verified(entry.step, siblings=entry.meta.role != self.role)  # under the same rules
        try:
            return [self._load_part(entry, part) for part in entry.meta.parts]
        except BaseException:
            entry.memory.refuse()  # what a refused step took is not kept for later hits
            raise

    def _load_part(self, entry: StepEntry, part: Part) -> Payload:
        paths = {file.kind: part.at(entry.directory, file.name) for file in part.files}
        budget = part_budget(part.rows, self.context)  # the step's context: it equals this store's
        budget -= sum(file.decoded for file in part.files if file.kind != "tensors")
        try:
            tensors = read_tensors(entry.mapped.get(paths["tensors"]), paths["tensors"], entry.memory, budget)
            blob = entry.blobs.get(paths["objects"])
            if blob is None:
                raise CorruptCacheError(f"{paths['objects']}: was not verified")
            objects = parse_json(blob, paths["objects"], what="objects file")
        except CacheError:
            raise
        except Exception as exc:
            raise CorruptCacheError(
                f"{entry.directory}: cannot load part {part.dir!r}: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(tensors, dict) or not isinstance(objects, dict):
            raise CorruptCacheError(f"{entry.directory}: part {part.dir!r} has an unexpected structure")
        return Payload(tensors=tensors, objects=objects, rows=part.rows)

    def precheck(self, step: int, meta: StepMeta) -> list[tuple[Path, int]]:
        """Every named file is a regular file of its recorded size, checked by name (the cache tool's listing)."""
        out = []
        for part, file in meta.files():
            path = part.at(self.step_dir(step), file.name)
            holder = self.backend.stat(path.parent) if part.dir else None
            if holder is not None and holder.kind == "link":
                raise CorruptCacheError(f"{path.parent}: part directory is a symbolic link")
            found = self.backend.stat(path)
            if found is None:
                raise CorruptCacheError(f"{path}: missing (named by meta.json)")
            if found.kind != "file":
                raise CorruptCacheError(f"{path}: not a regular file (link, FIFO or device)")
            if found.size != (size := file.spec.get("size")):
                raise CorruptCacheError(f"{path}: {found.size} bytes, meta.json says {size} (truncated?)")
            out.append((path, found.size))
        return out

    def note_hit(self, step: int, now: float | None = None) -> None:
        """Count a hit in a committed step's :class:`Usage` record, in a trusted directory. Never raises."""
        now = time.time() if now is None else now
        try:
            step_dir = self.step_dir(step)
            found, meta = self.backend.stat(step_dir), self.backend.stat(step_dir / fmt.META_NAME)
            linked = self.backend.checks_owners and (found is None or found.kind != "directory")
            if linked or meta is None or meta.kind != "file":
                return  # removed meanwhile (or a link): nothing to count in
            self.check_writable([step_dir])
            before = self.usage(step, now)
            record = Usage(min(MAX_HITS, (before.hits if before is not None else 0) + 1), now).encoded()
            self.backend.write(step_dir / fmt.USAGE_NAME, lambda handle: handle.write(record))
        except Exception as exc:
            logger.debug("%s step %d: usage not recorded (%s: %s)", self.role, step, type(exc).__name__, exc)

    def usage(self, step: int, now: float | None = None) -> Usage | None:
        """The step's usage record, or None (none, or one not to trust: said once per process). Never raises."""
        location = self.step_dir(step) / fmt.USAGE_NAME
        try:
            data = self.backend.read_bytes(location, MAX_USAGE_BYTES)
            return Usage.parse(data, location, time.time() if now is None else now)
        except FileNotFoundError:
            return None
        except Exception as exc:
            problem = str(exc) if isinstance(exc, CacheError) else f"{location}: {type(exc).__name__}: {exc}"
            if _first_warning.acquire(blocking=False):
                logger.warning(
                    "%s; its step's usage statistics start again (further such records: not reported)", problem
                )
            else:
                logger.debug("%s", problem)
            return None

    def files(self, step: int) -> list[StoredFile]:
        return list_step(self.backend, self.step_dir(step))

    def removal(self, step: int, only: Collection[str] | None = None) -> list[StoredFile]:
        """The files :meth:`remove` would delete, as listed (FileNotFoundError; CorruptCacheError for a link)."""
        return [found for found in self.files(step) if found.kind == "file" and _ours(found.part, found.name, only)]

    def leftovers(self, now: float | None = None) -> list[Leftover]:
        """Abandoned files of this project's interrupted saves, by the store's rule (local trees only)."""
        return find_leftovers(self.project_dir, now=now)

    def neighbours(self, levels: int, limit: int) -> list[str]:
        """At most ``limit`` directory names, sorted, ``levels`` above the project directory; ``[]`` when they cannot
        be listed. Never raises."""
        try:
            return sorted(self.names_above(levels))[:limit]
        except Exception:
            return []

    def holds_step(self, step_dir: Path) -> bool:
        """Whether ``step_dir`` (anywhere in this store's backend) has a ``meta.json`` file: one ``stat``."""
        found = self.backend.stat(step_dir / fmt.META_NAME)
        return found is not None and found.kind == "file"

    def remove(self, step: int, only: Collection[str] | None = None, anchor: Path | None = None) -> tuple[int, int]:
        """Remove a step, ``meta.json`` first, then its data files, usage record and empty directories (never
        verl's files; ``only``: just these ``part/name`` files); (files, bytes)."""

        def wanted(part: str, name: str, info: object = None) -> bool:
            return _ours(part, name, only)

        root = anchor if anchor is not None else self.dump_dir if self.dump_dir is not None else self.project_dir
        step_dir = self.step_dir(step)
        if self.backend.checks_owners:  # a directory tree: removed relative to directory descriptors
            return remove_step(root, step_dir, wanted)
        try:
            chosen = self.removal(step, only)
        except FileNotFoundError:
            return 0, 0
        chosen.sort(key=lambda found: bool(found.part) or found.name != fmt.META_NAME)
        for found in chosen:  # a denied delete raises: the step is reported kept, never counted as removed
            self.backend.remove(step_dir / found.part / found.name if found.part else step_dir / found.name)
        return len(chosen), sum(found.size for found in chosen)

    def collect_garbage(self, step: int) -> tuple[int, int]:
        """Remove abandoned leftovers of this step's saves (:mod:`skipinject.store.garbage`). Never raises."""
        return collect(self.project_dir, step=step, backend=self.backend)


def _ours(part: str, name: str, only: Collection[str] | None) -> bool:
    """Whether removing a step removes ``part/name``: its data files, ``meta.json`` and usage record (never
    verl's files); ``only``: just these ``part/name`` files."""
    if only is not None:
        return f"{part}/{name}" in only
    return fmt.is_ours(name) or (not part and (name == fmt.META_NAME or fmt.is_usage_name(name)))


def read_record(step_dir: Path, backend: Backend | None = None) -> StepMeta | None:
    """A step's ``meta.json`` as its writer claims it (nothing checked but its JSON and its format marker: the
    cache tool's listing); None: not skipinject's (verl's own, beside its pickles). CorruptCacheError."""
    path = step_dir / fmt.META_NAME
    raw = read_json(path, backend)
    meta = StepMeta(raw, path) if isinstance(raw, dict) else None
    return meta if meta is not None and meta.ours else None


def list_step(backend: Backend, step_dir: Path) -> list[StoredFile]:
    """Every name in a step directory and its part directories, never through a link (FileNotFoundError;
    CorruptCacheError for a link)."""
    found = backend.stat(step_dir)
    if found is None:
        raise FileNotFoundError(str(step_dir))
    if found.kind != "directory":
        raise CorruptCacheError(f"{step_dir} is {found.kind}, not a step directory; not read")
    out = []
    for name in backend.names(step_dir):
        info = backend.stat(step_dir / name)
        if info is None:
            continue
        out.append(StoredFile("", name, info.kind, info.size, info.modified or 0.0))
        if info.kind == "directory" and fmt.PART_NAME.fullmatch(name):
            for leaf in backend.names(step_dir / name):
                inner = backend.stat(step_dir / name / leaf)
                if inner is not None:
                    out.append(StoredFile(name, leaf, inner.kind, inner.size, inner.modified or 0.0))
    return out


def next_number(numbers: Sequence[int]) -> int:
    """The number after the run of numbers in use from 1; a gap larger than
    :data:`~skipinject.store.format.MAX_CLAIMS` ends the run (a stray directory never makes records jump)."""
    last = 0
    for number in numbers:
        if number - last > fmt.MAX_CLAIMS:
            break
        last = number
    return last + 1


def RemoteStepStore(
    project_dir: RemotePath,
    role: str,
    context: Mapping[str, Any],
    fs: AbstractFileSystem,
    plugin: str | None = None,
    compression: Compression | None = None,
) -> StepStore:
    """The :class:`StepStore` of ``project_dir`` in the fsspec filesystem ``fs``."""
    from skipinject.store.remote import FsspecFiles

    return StepStore(
        cast(Path, project_dir), role, context, backend=FsspecFiles(fs), plugin=plugin, compression=compression
    )


def _decode_streamed(
    files: StepFiles, sub: str, file: DataFile, algo: str, make: Callable[[int], Decoded], path: Path
) -> Decoded:
    """A compressed file decoded frame by frame while it arrives, its stored bytes checksummed first (a damaged
    or changed file is reported as such, whatever its frames did)."""
    spec, size = file.spec, file.spec.get("size")
    if size is None:  # else a bounded int: meta.json's parts are checked when parsed
        raise CorruptCacheError(f"{path}: meta.json records no size")
    with files.stream(sub, file.name, size) as pieces:
        decoder = FrameDecoder(spec, size, path, make)
        try:
            hasher = _Hasher(algo)
            got = 0
            failure: CorruptCacheError | None = None
            for piece in pieces:
                hasher.update(piece)
                got += len(piece)
                if failure is None:
                    try:
                        decoder.feed(piece)
                    except CorruptCacheError as exc:  # read on: a changed file is reported as such
                        failure = exc
            if got != size:
                raise CorruptCacheError(f"{path}: {got} bytes read, meta.json records {size}")
            if hasher.hexdigest() != spec.get("checksum"):
                raise CorruptCacheError(f"{path}: checksum mismatch (the file was damaged or changed)")
            if failure is not None:
                raise failure
            return decoder.finish()
        except BaseException:
            decoder.abandon()
            raise
