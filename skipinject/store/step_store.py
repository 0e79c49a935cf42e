"""One role's steps under one project directory: reading, verifying and loading them.

The format's logic lives here once, for every backend (:mod:`skipinject.store.backend`): which
files a step has, the meta.json checks, sizes before reading and checksums before decoding, the
commit rule (through :class:`~skipinject.store.writer.StepWriter`). Where the bytes are is the
backend's business: :class:`~skipinject.store.local.LocalFiles` (regular files only, opened without
following links out of the step directory, directories trusted like ssh's StrictModes unless
``trust_permissions``) or :class:`~skipinject.store.remote.FsspecFiles` (an object store). Every
failure is a :class:`CorruptCacheError` (a missing step stays ``FileNotFoundError``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from skipinject.errors import CacheError, CorruptCacheError
from skipinject.payload import Payload
from skipinject.store.backend import Backend, StepFiles
from skipinject.store.checksums import CHECKSUM_ALGOS, _checksum_algo, _Hasher
from skipinject.store.compression import Compression, FrameDecoder, decompress_into
from skipinject.store.files import parse_json
from skipinject.store.format import (
    CLAIM_PREFIX,
    DATA_NAME,
    FORMAT,
    MAX_CLAIMS,
    MAX_META_DEPTH,
    MAX_ROWS,
    META_NAME,
    PART_NAME,
    READABLE_VERSIONS,
    SAFE_NAME,
    STEP_NAME,
    _meta_digest,
    is_ours,
    step_name,
)
from skipinject.store.garbage import collect, collect_by_name
from skipinject.store.hit_memory import Claim, HitMemory
from skipinject.store.meta import Part, StepMeta, short, step_meta
from skipinject.store.payload import StepEntry
from skipinject.store.tensorfile import read_tensors
from skipinject.store.usage import Usage, is_usage_name, note_hit, read_usage
from skipinject.store.writer import StepWriter

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from skipinject.store.hit_memory import Decoded
    from skipinject.store.remote import RemotePath

__all__ = ["STEP_NAME", "RemoteStepStore", "StepStore"]


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
    ) -> None:
        """``trust_permissions``: load from directories other users could write (the user's opt-in,
        ``skip.<role>.trust_dir_permissions``). ``dump_dir``: the cache root; it and every directory
        from it down to ``project_dir`` are checked too (without it, ``project_dir`` and below).
        ``plugin``: the plugin providing the role, recorded in ``meta.json`` (``skipinject cache``
        names it where it is not installed). ``backend``: where the files are (default: local files,
        see :meth:`~skipinject.dump_root.DumpRoot.backend`). ``compression``: how the files this store
        writes are compressed (None: stored as they are; steps of either kind are read). ``memory``: the
        pool compressed hits decode into (None: fresh memory each hit; see :mod:`~skipinject.store.hit_memory`).
        ``step_aliases``: more ``meta.json`` keys holding the step (the trainer's name for it)."""
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

    @property
    def location(self) -> Path:
        """The project directory (a RemotePath standing in for a Path in a remote store)."""
        return self.project_dir

    def step_dir(self, step: int) -> Path:
        return self.project_dir / step_name(step)

    def at(self, step: int, *names: str) -> Path:
        """A location in step ``step``: ``at(3, "0", "meta.json")``."""
        location = self.step_dir(step)
        for name in names:
            if name:
                location = location / name
        return location

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

    def claim(self, first: int, token: str) -> int:
        """A new step number from ``first`` on that no concurrent writer of this store also takes
        (``match``'s rows records); :meth:`release` it once saved (or not).

        Where there are directories, the number whose step directory this call creates (an exclusive
        ``mkdir``). In an object store (no exclusive create): a claim object ``.claim-<token>`` in the
        step, then a listing; the number is taken only if this claim is the only one there and no
        ``meta.json`` is (strongly consistent listings: of two racing writers at most one sees only
        its own; both may step on)."""
        backend = self.backend
        backend.prepare(self.project_dir, self.project_dir)
        self.check_writable([])
        for number in range(first, first + MAX_CLAIMS):
            step_dir = self.step_dir(number)
            created = backend.make_dir(step_dir)
            if created is not None:
                if created:
                    return number
                continue
            marker = step_dir / f"{CLAIM_PREFIX}{token}"
            backend.write(marker, lambda handle: None)
            try:
                names = backend.names(step_dir)
            except FileNotFoundError:
                names = []
            if [n for n in names if n.startswith(CLAIM_PREFIX) or n == META_NAME] == [marker.name]:
                return number
            backend.remove(marker)
        raise CacheError(f"{self.project_dir}: steps {first} to {first + MAX_CLAIMS - 1} are all taken")

    def release(self, step: int, token: str) -> None:
        """Remove what :meth:`claim` left that the committed record does not need (an object store's
        claim object; a claimed directory is the record's). Never raises."""
        self.backend.remove(self.step_dir(step) / f"{CLAIM_PREFIX}{token}", self.dump_dir or self.project_dir)

    # ------------------------------------------------------------ files beside the steps

    def read_file(self, name: str, limit: int) -> bytes:
        """A file of the project directory beside the steps (``match``'s row index), at most ``limit``
        bytes (more is a CorruptCacheError); FileNotFoundError when there is none."""
        return self.backend.read_bytes(self.project_dir / name, limit)

    def replace_file(self, name: str, data: bytes) -> None:
        """Replace a file beside the steps whole: a reader sees the old bytes or the new ones."""
        self.backend.write(self.project_dir / name, lambda handle: handle.write(data))

    def meta_versions(self, steps: Sequence[int]) -> dict[int, int]:
        """A number per step that changes whenever its ``meta.json`` is replaced (a local file's
        mtime, an object's ETag; steps without one are left out). No ``meta.json`` is read."""
        wanted = {self.step_dir(step) / META_NAME: step for step in steps}
        if not wanted:
            return {}
        return {wanted[at]: version for at, version in self.backend.versions(self.project_dir, list(wanted)).items()}

    def names_above(self, levels: int) -> list[str]:
        """Directory names ``levels`` directories above the project directory (an experiment's
        other layouts); FileNotFoundError when there is none."""
        location = self.project_dir
        for _ in range(levels):
            location = location.parent
        return self.backend.names(location, directories=True)

    # ------------------------------------------------------------ trust

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
        """Refuse (CorruptCacheError, one line with the fix) a dump/project directory other users could
        write or that another user owns. A missing directory is ``FileNotFoundError`` (nothing cached)."""
        if self.trust_permissions:
            return
        self.backend.check_trust(self._trust_chain(), self.role)

    def unusable(self) -> str | None:
        """Why this store's existing directories can be neither loaded from nor saved into, or None:
        a dump or project directory that is not a directory (a FIFO, ``/dev/null``, a file), one other
        users control, a dump directory another user could redirect. Missing directories are fine
        (they are created private to the user). Never raises."""
        try:
            self.backend.check_trust(self._trust_chain(), self.role)
        except FileNotFoundError:
            return None
        except Exception as exc:
            return str(exc)
        return None

    def check_writable(self, directories: list[Path]) -> None:
        """Before a file is written: the chain from the dump directory and ``directories`` (the step and
        part directories just prepared) pass the trust rules; a directory another user pre-created
        (0777, or theirs) is refused with the fix, a CorruptCacheError."""
        chain = self._trust_chain()
        self.backend.check_trust(chain + [d for d in directories if d not in chain], self.role)

    def _open_step(self, step: int) -> StepFiles:
        """The step directory opened for reading (never through a symlink), trust-checked."""
        self.check_trust()
        return self.backend.open_step(self.step_dir(step), self.role)

    # ------------------------------------------------------------ listing

    def step_numbers_on_disk(self) -> list[int]:
        """Step numbers of the project's step directories, sorted: names only (one directory listing,
        no ``stat`` or read per step), so ``repeat`` over thousands of cached steps stays cheap.
        Names that are not plain ASCII numbers and symlinks are skipped; an untrusted or missing
        project gives ``[]``. Whether a step is usable is for :meth:`verified` to say."""
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
        return sorted({int(name) for name in names if STEP_NAME.fullmatch(name)})

    def is_committed(self, step: int) -> bool:
        """The step has a valid ``meta.json`` of this role (its data files are not verified)."""
        try:
            self.read_meta(step)
        except (OSError, CorruptCacheError):
            return False
        return True

    def interrupted(self, step: int) -> str | None:
        """One line if the step holds our data files (directly or in a part directory) but no
        ``meta.json`` (a save there was interrupted), else None. Never raises."""

        def holds_data(names: list[str]) -> bool:
            return any(DATA_NAME.fullmatch(name) for name in names)

        def part_holds_data(sub: str) -> bool:
            try:
                return holds_data(self.backend.names(self.step_dir(step) / sub))
            except Exception:
                return False

        try:
            names = self.backend.names(self.step_dir(step))
        except Exception:
            return None
        if META_NAME in names:
            return None
        if not holds_data(names) and not any(PART_NAME.fullmatch(sub) and part_holds_data(sub) for sub in names):
            return None
        return f"{self.step_dir(step)} holds data files but no meta.json (an earlier save was interrupted)"

    def upstream_file(self, step: int, name: str, directory_name: str | None = None) -> Path | None:
        """verl's own cache file ``name`` of a step (e.g. ``gen_batch.dp``) if it is a regular file in a
        real, trusted step directory; None otherwise (a link, a pipe, an untrusted directory, a remote
        store). Never raises.

        ``directory_name``: the step's directory when it is not ``{step}`` (verl < 0.9: ``genstep_000003``)."""
        pieces = name.split("/")
        if len(pieces) > 2 or not all(SAFE_NAME.match(p) and ".." not in p for p in pieces):
            return None
        if directory_name is not None and (not SAFE_NAME.match(directory_name) or ".." in directory_name):
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

    # ------------------------------------------------------------ reading

    def read_meta(self, step: int) -> StepMeta:
        """Read and check a step's ``meta.json`` (format, version, role, context, self-checksum)."""
        files = self._open_step(step)
        try:
            return self._read_meta(files, step)
        finally:
            files.close()

    def _read_meta(self, files: StepFiles, step: int) -> StepMeta:
        path = self.step_dir(step) / META_NAME
        data = files.read_meta()
        meta = parse_json(data, path, what="meta.json", max_depth=MAX_META_DEPTH)
        try:
            return self._check_meta(meta, path, step)
        except CacheError:
            raise
        except Exception as exc:
            raise CorruptCacheError(f"{path}: meta.json is malformed ({type(exc).__name__}: {exc})") from exc

    def _check_meta(self, meta: object, path: Path, step: int) -> StepMeta:
        """``meta`` (parsed JSON) once checked to be this role's and step's ``meta.json``."""
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CorruptCacheError(f"{path}: not a skipinject cache (no format marker)")
        if meta.get("format_version") not in READABLE_VERSIONS:
            raise CorruptCacheError(
                f"{path}: written in format version {short(meta.get('format_version'))}, "
                f"this skipinject reads versions {', '.join(map(str, READABLE_VERSIONS))}"
            )
        if meta.get("meta_checksum") != _meta_digest(meta):
            raise CorruptCacheError(f"{path}: meta.json was edited or damaged (its checksum does not match)")
        if meta.get("role") != self.role:
            raise CorruptCacheError(f"{path}: written by role {short(meta.get('role'))}, not {self.role!r}")
        if meta.get("step") != step:
            raise CorruptCacheError(f"{path}: records step {short(meta.get('step'))}, but lies in step {step}")
        context = meta.get("context", {})
        if not isinstance(context, dict):
            raise CorruptCacheError(f"{path}: meta.json is malformed (context {short(context)} is not a mapping)")
        if context != self.context:
            raise CorruptCacheError(
                f"{path}: written for other trainer metadata {short(context)}, this run is {self.context!r}"
            )
        rows = meta.get("rows")
        if rows is not None and (type(rows) is not int or not 0 <= rows <= MAX_ROWS):
            raise CorruptCacheError(f"{path}: meta.json is malformed (rows {short(rows)} is no row count)")
        if meta.get("checksum_algo") not in CHECKSUM_ALGOS:
            raise CorruptCacheError(
                f"{path}: meta.json is malformed (unknown checksum algorithm {short(meta.get('checksum_algo'))})"
            )
        return StepMeta(meta, path)

    def verified(self, step: int) -> StepEntry:
        """The step's entry after checking every file it names; raises CorruptCacheError.

        ``FileNotFoundError``: no step directory or no ``meta.json`` (nothing cached). Local tensor files
        are checksummed through the copy-on-write mapping that :meth:`load` then uses, other files are
        read once and kept: the bytes are read once and cannot change between the check and the load.
        """
        files = self._open_step(step)
        try:
            meta = self._read_meta(files, step)
            entry = StepEntry(step, self.step_dir(step), meta, memory=Claim(self.memory))
            try:
                for part in meta.parts:
                    self._verify_part(entry, files, part)
            except BaseException:
                entry.release()
                raise
            return entry
        finally:
            files.close()

    def _verify_part(self, entry: StepEntry, files: StepFiles, part: Part) -> None:
        algo = entry.meta["checksum_algo"]
        for file in part.files:
            kind, name, spec = file.kind, file.name, file.spec
            path = part.at(entry.directory, name)
            make = entry.memory.buffer if kind == "tensors" else bytearray
            if file.encoded and files.streams:  # decoded as it downloads, kept only if intact
                data, checksum = _decode_streamed(files, part.dir, name, spec, algo, make, path)
            else:
                data, checksum = files.read(part.dir, name, spec.get("size"), algo, mapped=kind == "tensors")
                if file.encoded:  # compressed: decoded once its stored bytes are checked
                    stored = data
                    try:
                        if checksum != spec.get("checksum"):
                            raise CorruptCacheError(f"{path}: checksum mismatch (the file was damaged or changed)")
                        data = decompress_into(stored, spec, path, make)
                    finally:
                        _close(stored)  # the stored bytes' mapping is done with
            if kind == "tensors":
                if not isinstance(data, bytes) and len(data):
                    entry.mapped[path] = data  # tensors are views of it
            else:
                entry.blobs[path] = bytes(data)
            if checksum != spec.get("checksum"):
                raise CorruptCacheError(f"{path}: checksum mismatch (the file was damaged or changed)")

    def check(self, step: int) -> None:
        """Read and check every byte of a step as a hit would (sizes, checksums, tensor index, JSON
        tree), then let it go: the one question ``cache verify`` and ``cache prune --damaged`` both
        ask. CorruptCacheError when damaged; FileNotFoundError when nothing is committed."""
        entry = self.verified(step)
        try:
            self.load(entry)
        finally:
            entry.release()

    def load(self, entry: StepEntry) -> list[Payload]:
        """Load every part of a verified entry. Tensors are views of a copy-on-write file mapping.

        Raises only CorruptCacheError (any failure of any type while parsing or decoding the files).
        Parts loaded ahead (``entry.loaded``) are handed out once, as they are.
        """
        if entry.loaded:
            loaded = list(entry.loaded)
            entry.loaded.clear()
            return loaded
        if not entry.mapped and not entry.blobs:
            entry = self.verified(entry.step)  # not read by verified(): read it now, under the same rules
        payloads = []
        for part in step_meta(entry.meta, entry.directory).parts:
            paths = {file.kind: part.at(entry.directory, file.name) for file in part.files}
            try:
                tensors = read_tensors(entry.mapped.get(paths["tensors"]), paths["tensors"], entry.memory)
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
            payloads.append(Payload(tensors=tensors, objects=objects, rows=part.rows))
        return payloads

    def named_files(self, step: int, meta: Mapping[str, Any]) -> list[tuple[Path, dict[str, Any]]]:
        """Every data file a step's ``meta.json`` names, with its record (``kind``, ``size``, ``checksum``);
        every name checked to be safe (CorruptCacheError otherwise). No file is opened."""
        directory = self.step_dir(step)
        return [
            (part.at(directory, file.name), {**file.spec, "kind": file.kind})
            for part, file in step_meta(meta, directory).files()
        ]

    def precheck(self, step: int, meta: Mapping[str, Any]) -> list[tuple[Path, int]]:
        """Every named file is a regular file (no link, FIFO) of its recorded size, and no part
        directory is a link: checked by name, before the step is opened (the cache tool's listing)."""
        out = []
        for path, spec in self.named_files(step, meta):
            holder = self.backend.stat(path.parent) if path.parent != self.step_dir(step) else None
            if holder is not None and holder[0] == "link":
                raise CorruptCacheError(f"{path.parent}: part directory is a symbolic link")
            kind = self.backend.stat(path)
            if kind is None:
                raise CorruptCacheError(f"{path}: missing (named by meta.json)")
            if kind[0] != "file":
                raise CorruptCacheError(f"{path}: not a regular file (link, FIFO or device)")
            if kind[1] != spec.get("size"):
                raise CorruptCacheError(f"{path}: {kind[1]} bytes, meta.json says {spec.get('size')} (truncated?)")
            out.append((path, kind[1]))
        return out

    # ------------------------------------------------------------ upkeep

    def note_hit(self, step: int, now: float | None = None) -> None:
        """Record that ``step`` was served (now, or at unix time ``now``; :mod:`~skipinject.store.usage`).
        Never raises: a failure costs the statistics, never the hit."""
        note_hit(self, step, now)

    def usage(self, step: int) -> Usage | None:
        """When ``step`` was last served and how often, or None (never, or a record not to be trusted)."""
        return read_usage(self, step)

    def files(self, step: int) -> list[StoredFile]:
        """Every name in the step's directory and part directories (what ``cache prune`` weighs before
        removing it), never through a link; FileNotFoundError, CorruptCacheError for a link."""
        return list_step(self.backend, self.step_dir(step))

    def remove(self, step: int, only: Collection[str] | None = None, anchor: Path | None = None) -> tuple[int, int]:
        """Remove a step: ``meta.json`` first (the step is absent at once), then its data files, usage
        record and empty directories, never verl's own files; ``only``: just these ``part/name`` files
        (an interrupted save's). Locally everything is reached from ``anchor`` (default: the dump or
        project directory) by descriptors opened once without following a link
        (:func:`~skipinject.store.files.remove_step`). Returns (files, bytes) removed."""

        def wanted(part: str, name: str) -> bool:
            if only is not None:
                return f"{part}/{name}" in only
            return is_ours(name) or (not part and (name == META_NAME or is_usage_name(name)))

        root = anchor if anchor is not None else self.dump_dir if self.dump_dir is not None else self.project_dir
        step_dir = self.step_dir(step)
        if self.backend.checks_owners:  # a directory tree: removed relative to directory descriptors
            from skipinject.store.files import remove_step

            return remove_step(root, step_dir, wanted)
        try:
            listed = self.files(step)
        except FileNotFoundError:
            return 0, 0
        chosen = sorted((f for f in listed if f.kind == "file" and wanted(f.part, f.name)), key=_meta_first)
        for found in chosen:
            self.backend.remove(step_dir / found.part / found.name if found.part else step_dir / found.name)
        return len(chosen), sum(found.size for found in chosen)

    def collect_garbage(self, step: int, meta: Mapping[str, Any] | None = None) -> tuple[int, int]:
        """Remove abandoned leftovers of this step's saves now (see :mod:`skipinject.store.garbage`):
        on a local disk by its descriptor-walking rule, elsewhere by name. Never raises."""
        if isinstance(self.project_dir, Path):
            return collect(self.project_dir, step=step)
        try:
            named: set[str] | None = {
                str(path) for path, _ in self.named_files(step, meta if meta is not None else self.read_meta(step))
            }
        except Exception:
            named = None
        return collect_by_name(self.backend, self.step_dir(step), named)


@dataclass(frozen=True)
class StoredFile:
    """A name in a step directory (``part``: ``""``) or one of its part directories, as listed:
    ``kind`` is file, directory, link or other (never followed); ``mtime`` in unix seconds (0: unknown)."""

    part: str
    name: str
    kind: str
    size: int
    mtime: float


def list_step(backend: Backend, step_dir: Path) -> list[StoredFile]:
    """Every name in a step directory (any name: verl's ``genstep_*`` too) and its part directories,
    by the backend's listing and ``stat`` (never through a link); FileNotFoundError when there is no
    such directory, CorruptCacheError when it is a link or no directory."""
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
        if info.kind == "directory" and PART_NAME.fullmatch(name):
            for leaf in backend.names(step_dir / name):
                inner = backend.stat(step_dir / name / leaf)
                if inner is not None:
                    out.append(StoredFile(name, leaf, inner.kind, inner.size, inner.modified or 0.0))
    return out


def _meta_first(found: StoredFile) -> bool:
    return bool(found.part) or found.name != META_NAME


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
    files: StepFiles,
    sub: str,
    name: str,
    spec: Mapping[str, Any],
    algo: str,
    make: Callable[[int], Decoded],
    path: Path,
) -> tuple[Decoded, str]:
    """A compressed data file decoded while it arrives, and the checksum of its stored bytes: each
    complete frame decompressed in a thread while the next piece comes; the whole stored file is
    never held. Same size and frame checks as a read; a file whose stored bytes do not match
    ``spec["checksum"]`` is reported as such, whatever its frames did."""
    size = spec.get("size")
    if type(size) is not int or size < 0:
        raise CorruptCacheError(f"{path}: meta.json records no size")
    with files.stream(sub, name, size) as pieces:
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
            decoded = decoder.finish()
        except BaseException:
            decoder.abandon()
            raise
    return decoded, hasher.hexdigest()


def _close(buffer: object) -> None:
    close = getattr(buffer, "close", None)
    if close is not None:
        close()
