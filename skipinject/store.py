"""The on-disk cache: upstream's directory layout, a format that never runs code when loaded.

Layout (upstream's names, so users find caches where verl put them)::

    {dump_dir}/{experiment}_{project}/GBS{gbs}_N{n}_in{prompt_len}_out{response_len}/{step}/
        meta.json                      # the commit record, written last (atomic replace)
        tensors-<write id>.bin         # plain tensors: raw bytes + a JSON index (see below)
        objects-<write id>.json        # non-tensor values as tagged JSON
        0/ 1/ ...                      # the same per part, for roles saving several parts a step

A step is valid only when ``meta.json`` is ours, names every part, and every file it names has
the recorded size and checksum. Data files get a fresh name per write, so a reader never sees a
file change under it and an interrupted writer leaves only files no ``meta.json`` names.

The tensor file is ``MAGIC``, a little-endian u64 index length, the JSON index (name, dtype, shape,
offset, nbytes per tensor) padded to 64 bytes, then each tensor's bytes at a 64-byte aligned offset.
Loading it runs no code: the file is mapped copy-on-write once, checksummed through that mapping
(which also pulls it into this process), and tensors are views of it (``torch.frombuffer``), so a
verified hit costs one pass over the bytes, and in-place writes to a loaded tensor stay private.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import mmap
import os
import platform
import re
import struct
import time
import uuid
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skipinject._version import __version__
from skipinject.cluster import node_identity
from skipinject.errors import CorruptCacheError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("skipinject")

FORMAT = "skipinject"
FORMAT_VERSION = 2
META_NAME = "meta.json"
TENSORS_MAGIC = b"SKIPTNS1"
_ALIGN = 64
#: Tensor dtypes the tensor file holds (by ``torch`` attribute name).
TENSOR_DTYPES = frozenset(
    {
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    }
)
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_STALE_SECONDS = 600.0


@dataclass
class Payload:
    """One part of a result: plain tensors plus JSON-safe values (see :mod:`skipinject.codecs`)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    rows: int | None = None


@dataclass(frozen=True)
class StepEntry:
    """A verified, loadable cache entry."""

    step: int
    directory: Path
    meta: Mapping[str, Any]
    #: Tensor files mapped (and checksummed) by :meth:`StepStore.verified`, reused by ``load``.
    mapped: dict[Path, mmap.mmap] = field(default_factory=dict, compare=False, repr=False)


# ---------------------------------------------------------------- checksums


#: Checksum algorithms a cache may name. ``xxh3_64-tree`` (the default with xxhash installed) is the
#: xxh3_64 of the concatenated 8-byte xxh3_64 digests of the file's 32 MiB chunks: the chunks can
#: be hashed on several cores, which halves a verified hit of a large batch on two.
CHECKSUM_ALGOS = ("xxh3_64-tree", "xxh3_64", "crc32")
_TREE_CHUNK = 32 << 20


def _checksum_algo() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "crc32"
    return "xxh3_64-tree"


def file_checksum(path: Path, algo: str) -> str:
    """Checksum of a whole file, read through mmap (the pages are then warm for the load)."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            view: Any = b""
            return _digest(view, algo)
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return _digest_parallel(mapped, algo)


def _digest(data: Any, algo: str) -> str:
    hasher = _Hasher(algo)
    hasher.update(data)
    return hasher.hexdigest()


def _digest_parallel(data: Any, algo: str) -> str:
    """:func:`_digest`, with the chunks of a tree checksum hashed in threads (xxhash releases the GIL)."""
    workers = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if algo != "xxh3_64-tree" or len(data) <= _TREE_CHUNK or workers < 2:
        return _digest(data, algo)
    from concurrent.futures import ThreadPoolExecutor

    view = memoryview(data)
    chunks = [view[start : start + _TREE_CHUNK] for start in range(0, len(view), _TREE_CHUNK)]
    try:
        with ThreadPoolExecutor(min(workers, len(chunks)), thread_name_prefix="skipinject-hash") as pool:
            digests = list(pool.map(lambda chunk: _Leaf("xxh3_64", chunk).digest(), chunks))
    finally:
        for chunk in chunks:
            chunk.release()
        view.release()
    return _Leaf("xxh3_64", b"".join(digests)).hexdigest()


class _Leaf:
    """A plain (non-tree) checksum being computed."""

    def __init__(self, algo: str, data: Any = b"") -> None:
        self.algo = algo
        if algo == "xxh3_64":
            try:
                import xxhash
            except ImportError as exc:
                raise CorruptCacheError("cache was checksummed with xxh3_64 but xxhash is not installed") from exc
            self._xxh = xxhash.xxh3_64(data)
        elif algo == "crc32":
            self._crc = zlib.crc32(data)
        else:
            raise CorruptCacheError(f"unknown checksum algorithm {algo!r}")

    def update(self, data: Any) -> None:
        if self.algo == "xxh3_64":
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def digest(self) -> bytes:
        if self.algo == "xxh3_64":
            return self._xxh.digest()
        return struct.pack(">I", self._crc & 0xFFFFFFFF)

    def hexdigest(self) -> str:
        return self.digest().hex()


class _Hasher:
    """Incremental checksum, so a writer checksums what it writes instead of reading it back."""

    def __init__(self, algo: str) -> None:
        if algo not in CHECKSUM_ALGOS:
            raise CorruptCacheError(f"unknown checksum algorithm {algo!r}")
        self.algo = algo
        self.tree = algo == "xxh3_64-tree"
        self._leaf = _Leaf(algo.removesuffix("-tree"))
        self._filled = 0
        self._digests: list[bytes] = []

    def update(self, data: Any) -> None:
        if not self.tree:
            self._leaf.update(data)
            return
        with memoryview(data) as whole, whole.cast("B") as view:
            start = 0
            while start < len(view):
                take = min(len(view) - start, _TREE_CHUNK - self._filled)
                with view[start : start + take] as piece:
                    self._leaf.update(piece)
                start += take
                self._filled += take
                if self._filled == _TREE_CHUNK:
                    self._digests.append(self._leaf.digest())
                    self._leaf = _Leaf("xxh3_64")
                    self._filled = 0

    def hexdigest(self) -> str:
        if not self.tree:
            return self._leaf.hexdigest()
        digests = self._digests
        if self._filled or not digests:
            digests = [*digests, self._leaf.digest()]
        return _Leaf("xxh3_64", b"".join(digests)).hexdigest()


# ---------------------------------------------------------------- the tensor file


def _padding(size: int) -> int:
    return -size % _ALIGN


def write_tensors(handle: Any, tensors: Mapping[str, torch.Tensor], algo: str) -> str:
    """Write the tensor file to ``handle``; returns its checksum. Contiguous CPU tensors are not copied."""
    import torch

    views = []
    index = []
    offset = 0
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"payload tensors must map str to torch.Tensor, got {name!r}: {type(tensor).__name__}")
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in TENSOR_DTYPES or tensor.is_nested or tensor.layout != torch.strided:
            raise TypeError(f"payload tensor {name!r}: {tensor.dtype} {tensor.layout} tensors are not supported")
        value = tensor.detach().cpu().contiguous()
        nbytes = value.numel() * value.element_size()
        index.append({"name": name, "dtype": dtype, "shape": list(value.shape), "offset": offset, "nbytes": nbytes})
        views.append(value.reshape(-1).view(torch.uint8).numpy() if nbytes else None)
        offset += nbytes + _padding(nbytes)
    header = json.dumps({"tensors": index}, separators=(",", ":")).encode()
    header += b" " * _padding(len(TENSORS_MAGIC) + 8 + len(header))
    hasher = _Hasher(algo)
    for chunk in (TENSORS_MAGIC, struct.pack("<Q", len(header)), header):
        handle.write(chunk)
        hasher.update(chunk)
    for view, entry in zip(views, index, strict=True):
        if view is None:
            continue
        handle.write(view)
        hasher.update(view)
        pad = bytes(_padding(entry["nbytes"]))
        if pad:
            handle.write(pad)
            hasher.update(pad)
    return hasher.hexdigest()


def map_file(path: Path) -> mmap.mmap | None:
    """Map a whole file copy-on-write (writes through the mapping never reach the file)."""
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return None
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)


def read_tensors(mapped: mmap.mmap | None, path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a mapped tensor file, as views of the mapping. Runs no code from the file."""
    import torch

    size = 0 if mapped is None else len(mapped)
    if mapped is None or size < len(TENSORS_MAGIC) + 8 or mapped[: len(TENSORS_MAGIC)] != TENSORS_MAGIC:
        raise CorruptCacheError(f"{path}: not a skipinject tensor file")
    (header_len,) = struct.unpack_from("<Q", mapped, len(TENSORS_MAGIC))
    data_start = len(TENSORS_MAGIC) + 8 + header_len
    if data_start > size or data_start % _ALIGN:
        raise CorruptCacheError(f"{path}: tensor file index is damaged")
    try:
        index = json.loads(mapped[len(TENSORS_MAGIC) + 8 : data_start])["tensors"]
        tensors = {}
        for entry in index:
            name, dtype_name, shape = entry["name"], entry["dtype"], entry["shape"]
            offset, nbytes = entry["offset"], entry["nbytes"]
            if dtype_name not in TENSOR_DTYPES or not all(type(d) is int and d >= 0 for d in shape):
                raise ValueError(f"bad dtype or shape for {name!r}")
            dtype = getattr(torch, dtype_name)
            count = math.prod(shape)
            itemsize = torch.empty((), dtype=dtype).element_size()
            if type(offset) is not int or offset < 0 or offset % _ALIGN or nbytes != count * itemsize:
                raise ValueError(f"bad extent for {name!r}")
            if data_start + offset + nbytes > size:
                raise ValueError(f"{name!r} runs past the end of the file")
            if count == 0:
                tensors[name] = torch.empty(shape, dtype=dtype)
            else:
                tensors[name] = torch.frombuffer(mapped, dtype=dtype, count=count, offset=data_start + offset).view(
                    shape
                )
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCacheError(f"{path}: tensor file index is damaged ({exc})") from exc
    return tensors


def _meta_digest(meta: Mapping[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "meta_checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return f"{zlib.crc32(text) & 0xFFFFFFFF:08x}"


# ---------------------------------------------------------------- writing


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_file_atomic(path: Path, write: Any) -> None:
    """Write through a temporary name, fsync, then rename: the name holds all or nothing."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def make_private_dirs(path: Path) -> list[Path]:
    """Create ``path`` and missing parents readable by the owner only; returns those it created."""
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    created = []
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            continue
        created.append(directory)
    return created


class StepWriter:
    """Collects the parts of one step and commits them with one ``meta.json`` replace."""

    def __init__(self, store: StepStore, step: int) -> None:
        self.store = store
        self.step = step
        self.write_id = f"{int(time.time())}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.parts: dict[str, dict[str, Any]] = {}
        self._written: list[Path] = []
        self._created: list[Path] = []

    @property
    def directory(self) -> Path:
        return self.store.step_dir(self.step)

    def add_part(self, payload: Payload, part: str = "") -> None:
        """Write one part's files (invisible to readers until :meth:`commit`)."""
        if part and not _SAFE_NAME.match(part):
            raise ValueError(f"bad part name {part!r}")
        part_dir = self.directory / part if part else self.directory
        self._created.extend(make_private_dirs(part_dir))
        algo = self.store.checksum_algo
        checksums: dict[str, str] = {}
        tensors_path = part_dir / f"tensors-{self.write_id}.bin"
        self._written.append(tensors_path)
        _write_file_atomic(
            tensors_path, lambda h: checksums.__setitem__("tensors", write_tensors(h, payload.tensors, algo))
        )
        objects_path = part_dir / f"objects-{self.write_id}.json"
        self._written.append(objects_path)
        blob = json.dumps(payload.objects, separators=(",", ":"), allow_nan=True).encode()
        _write_file_atomic(objects_path, lambda h: h.write(blob))
        checksums["objects"] = _digest(blob, algo)
        files: dict[str, Any] = {}
        for kind, path in (("tensors", tensors_path), ("objects", objects_path)):
            files[kind] = {"name": path.name, "size": path.stat().st_size, "checksum": checksums[kind]}
        self.parts[part] = {"dir": part, "rows": payload.rows, "files": files}

    def commit(self, meta: Mapping[str, Any]) -> Path:
        """Publish the step: write ``meta.json`` last, atomically. Returns the step directory."""
        record = dict(meta)
        record.update(
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "role": self.store.role,
                "step": self.step,
                "global_steps": self.step,
                "context": dict(self.store.context),
                "checksum_algo": self.store.checksum_algo,
                "parts": [self.parts[name] for name in sorted(self.parts, key=_part_order)],
                "rows": sum(p["rows"] or 0 for p in self.parts.values()),
                "writer": writer_versions(),
                "node": node_identity(),  # which node wrote the step (multi-node clusters, issue 12)
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
        )
        record["meta_checksum"] = _meta_digest(record)
        text = json.dumps(record, indent=1, sort_keys=True).encode()
        _write_file_atomic(self.directory / META_NAME, lambda h: h.write(text))
        _fsync_dir(self.directory)
        self._written.clear()
        self._created.clear()
        with contextlib.suppress(OSError):  # the step is committed; garbage is someone else's problem now
            self.store.collect_garbage(self.step, record)
        return self.directory

    def abort(self) -> None:
        """Remove what this writer wrote, and the directories it created if empty (best effort)."""
        for path in self._written:
            with contextlib.suppress(OSError):
                path.unlink()
        for directory in reversed(self._created):
            with contextlib.suppress(OSError):
                directory.rmdir()
        self._written.clear()
        self._created.clear()


def _part_order(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (-1, name)


_VERSIONS: dict[str, str] = {}


def writer_versions() -> dict[str, str]:
    """Versions of what wrote a cache (skipinject, verl, torch, python)."""
    if not _VERSIONS:
        from importlib.metadata import PackageNotFoundError, version

        _VERSIONS["skipinject"] = __version__
        _VERSIONS["python"] = platform.python_version()
        for dist in ("verl", "torch", "tensordict"):
            try:
                _VERSIONS[dist] = version(dist)
            except PackageNotFoundError:
                pass
    return dict(_VERSIONS)


# ---------------------------------------------------------------- reading


class StepStore:
    """The cache of one role under one project directory."""

    def __init__(self, project_dir: Path, role: str, context: Mapping[str, Any]) -> None:
        self.project_dir = project_dir
        self.role = role
        self.context = dict(context)
        self.checksum_algo = _checksum_algo()

    def step_dir(self, step: int) -> Path:
        return self.project_dir / str(int(step))

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

    def steps_on_disk(self) -> list[int]:
        """Steps that have a skipinject ``meta.json`` (cheap: no data is verified)."""
        if not self.project_dir.is_dir():
            return []
        found = []
        for child in self.project_dir.iterdir():
            if child.name.isdigit() and (child / META_NAME).is_file():
                try:
                    meta = self.read_meta(int(child.name))
                except CorruptCacheError:
                    continue
                if meta.get("role") == self.role:
                    found.append(int(child.name))
        return sorted(found)

    def read_meta(self, step: int) -> dict[str, Any]:
        """Read and check a step's ``meta.json`` (format, version, role, context, self-checksum)."""
        path = self.step_dir(step) / META_NAME
        try:
            meta = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise
        except (OSError, ValueError) as exc:
            raise CorruptCacheError(f"{path}: unreadable meta.json ({exc})") from exc
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CorruptCacheError(f"{path}: not a skipinject cache (no format marker)")
        if meta.get("format_version") != FORMAT_VERSION:
            raise CorruptCacheError(
                f"{path}: written in format version {meta.get('format_version')!r}, "
                f"this skipinject reads version {FORMAT_VERSION}"
            )
        if meta.get("meta_checksum") != _meta_digest(meta):
            raise CorruptCacheError(f"{path}: meta.json was edited or damaged (its checksum does not match)")
        if meta.get("role") != self.role:
            raise CorruptCacheError(f"{path}: written by role {meta.get('role')!r}, not {self.role!r}")
        if meta.get("step") != step:
            raise CorruptCacheError(f"{path}: records step {meta.get('step')!r}, but lies in step {step}")
        context = meta.get("context", {})
        if not isinstance(context, dict):
            raise CorruptCacheError(f"{path}: meta.json is malformed (context {context!r} is not a mapping)")
        if context != self.context:
            raise CorruptCacheError(
                f"{path}: written for other trainer metadata {meta.get('context')!r}, this run is {self.context!r}"
            )
        if meta.get("checksum_algo") not in CHECKSUM_ALGOS:
            raise CorruptCacheError(
                f"{path}: meta.json is malformed (unknown checksum algorithm {meta.get('checksum_algo')!r})"
            )
        return meta

    def verified(self, step: int) -> StepEntry:
        """The step's entry after checking every file it names; raises CorruptCacheError.

        Tensor files are checksummed through the copy-on-write mapping that :meth:`load` then uses,
        so the bytes are read once and a file cannot change between the check and the load.
        """
        meta = self.read_meta(step)
        directory = self.step_dir(step)
        parts = meta.get("parts")
        if not isinstance(parts, list) or not parts:
            raise CorruptCacheError(f"{directory}: meta.json names no parts")
        entry = StepEntry(step, directory, meta)
        for part in parts:
            for path, spec in self._part_files(directory, part):
                try:
                    size = path.stat().st_size
                except FileNotFoundError as exc:
                    raise CorruptCacheError(f"{path}: missing (named by meta.json)") from exc
                if size != spec.get("size"):
                    raise CorruptCacheError(f"{path}: {size} bytes, meta.json says {spec.get('size')} (truncated?)")
                try:
                    if spec["kind"] == "tensors":
                        mapped = map_file(path)
                        checksum = _digest_parallel(b"" if mapped is None else mapped, meta["checksum_algo"])
                        if mapped is not None:
                            entry.mapped[path] = mapped
                    else:
                        checksum = file_checksum(path, meta["checksum_algo"])
                except OSError as exc:
                    entry.mapped.clear()
                    raise CorruptCacheError(f"{path}: cannot read it ({type(exc).__name__}: {exc})") from exc
                if checksum != spec.get("checksum"):
                    entry.mapped.clear()
                    raise CorruptCacheError(f"{path}: checksum mismatch (the file was damaged or changed)")
        return entry

    def load(self, entry: StepEntry) -> list[Payload]:
        """Load every part of a verified entry. Tensors are views of a copy-on-write file mapping."""
        payloads = []
        for part in entry.meta["parts"]:
            paths = {spec["kind"]: path for path, spec in self._part_files(entry.directory, part)}
            try:
                mapped = entry.mapped.get(paths["tensors"])
                if mapped is None:
                    mapped = map_file(paths["tensors"])
                tensors = read_tensors(mapped, paths["tensors"])
                objects = json.loads(paths["objects"].read_bytes())
            except (FileNotFoundError, CorruptCacheError):
                raise
            except Exception as exc:
                raise CorruptCacheError(f"{entry.directory}: cannot load part {part.get('dir')!r}: {exc}") from exc
            if not isinstance(tensors, dict) or not isinstance(objects, dict):
                raise CorruptCacheError(f"{entry.directory}: part {part.get('dir')!r} has an unexpected structure")
            payloads.append(Payload(tensors=tensors, objects=objects, rows=part.get("rows")))
        return payloads

    def _part_files(self, directory: Path, part: Mapping[str, Any]) -> Iterator[tuple[Path, dict[str, Any]]]:
        if not isinstance(part, Mapping):
            raise CorruptCacheError(f"{directory}: meta.json is malformed (part {part!r} is not a record)")
        sub = part.get("dir", "")
        if not isinstance(sub, str) or (sub and not _SAFE_NAME.match(sub)) or sub in (".", ".."):
            raise CorruptCacheError(f"{directory}: meta.json names an unsafe part directory {sub!r}")
        files = part.get("files")
        if not isinstance(files, dict) or set(files) != {"tensors", "objects"}:
            raise CorruptCacheError(f"{directory}: meta.json part {sub!r} does not name its files")
        for kind, spec in files.items():
            name = spec.get("name") if isinstance(spec, dict) else None
            if not isinstance(name, str) or not _SAFE_NAME.match(name) or ".." in name:
                raise CorruptCacheError(f"{directory}: meta.json names an unsafe file {name!r}")
            yield (directory / sub / name if sub else directory / name), {**spec, "kind": kind}

    def collect_garbage(self, step: int, meta: Mapping[str, Any]) -> None:
        """Delete our data files that the current ``meta.json`` does not name and that are stale."""
        directory = self.step_dir(step)
        keep = {path for part in meta["parts"] for path, _ in self._part_files(directory, part)}
        now = time.time()
        dirs = [directory] + [p for p in directory.iterdir() if p.is_dir() and p.name.isdigit()]
        for folder in dirs:
            for path in folder.iterdir():
                ours = path.name.startswith(("tensors-", "objects-", ".tensors-", ".objects-", ".meta.json.tmp"))
                if not ours or path in keep:
                    continue
                with contextlib.suppress(OSError):
                    if now - path.stat().st_mtime > _STALE_SECONDS:
                        path.unlink()
