"""One role's steps under one project directory: reading, verifying and loading them.

Every file is read under one discipline (:mod:`skipinject.store.files`): regular files only, opened
without following links out of the step directory, sizes checked against meta.json before a byte is
read or hashed, bounded JSON; every failure is a :class:`CorruptCacheError` (a missing step stays
``FileNotFoundError``). Directories are trusted like ssh's StrictModes unless ``trust_permissions``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from skipinject.errors import CacheError, CorruptCacheError
from skipinject.store.checksums import CHECKSUM_ALGOS, _checksum_algo, _digest, _digest_parallel
from skipinject.store.files import (
    MAX_META_BYTES,
    MAX_META_DEPTH,
    map_fd,
    open_dir,
    open_regular,
    parse_json,
    read_fd,
    trust_problem,
    untrusted_reason,
)
from skipinject.store.format import _SAFE_NAME, FORMAT, FORMAT_VERSION, META_NAME, _meta_digest
from skipinject.store.garbage import collect
from skipinject.store.payload import Payload, StepEntry
from skipinject.store.tensorfile import read_tensors
from skipinject.store.writer import StepWriter

#: A step directory's name: ASCII digits, no leading zero (``str.isdigit`` also accepts "²").
STEP_NAME = re.compile(r"0|[1-9][0-9]{0,11}")
_DATA_NAME = re.compile(r"(?:tensors-[0-9A-Za-z_.-]+\.bin|objects-[0-9A-Za-z_.-]+\.json)")
_PART_NAME = re.compile(r"[0-9]{1,6}")


# ---------------------------------------------------------------- reading


class StepStore:
    """The cache of one role under one project directory."""

    def __init__(
        self,
        project_dir: Path,
        role: str,
        context: Mapping[str, Any],
        *,
        trust_permissions: bool = False,
        dump_dir: Path | None = None,
        plugin: str | None = None,
    ) -> None:
        """``trust_permissions``: load from directories other users could write (the user's opt-in,
        ``skip.<role>.trust_dir_permissions``). ``dump_dir``: the cache root; it and every directory
        from it down to ``project_dir`` are checked too (without it, ``project_dir`` and below).
        ``plugin``: the plugin providing the role, recorded in ``meta.json`` (``skipinject cache``
        names it where it is not installed)."""
        self.plugin = plugin
        self.project_dir = project_dir
        self.role = role
        self.context = dict(context)
        self.checksum_algo = _checksum_algo()
        self.trust_permissions = trust_permissions
        self.dump_dir = dump_dir

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
        for directory in self._trust_chain():
            try:
                info = os.stat(directory)
            except FileNotFoundError:
                raise
            except OSError as exc:
                raise CorruptCacheError(
                    f"{directory}: cannot check the directory ({type(exc).__name__}: {exc})"
                ) from exc
            if untrusted_reason(info) is not None:
                raise CorruptCacheError(trust_problem(directory, info, self.role))

    def _check_fd(self, fd: int, path: Path) -> None:
        if self.trust_permissions:
            return
        info = os.fstat(fd)
        if untrusted_reason(info) is not None:
            raise CorruptCacheError(trust_problem(path, info, self.role))

    def _open_step(self, step: int, directory_name: str | None = None) -> int:
        """The step directory's descriptor (never through a symlink), trust-checked.

        ``directory_name``: another directory of the project holding the step (verl < 0.9's
        ``genstep_000003``)."""
        self.check_trust()
        directory = self.step_dir(step) if directory_name is None else self.project_dir / directory_name
        fd = open_dir(directory)
        try:
            self._check_fd(fd, directory)
        except BaseException:
            os.close(fd)
            raise
        return fd

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
            with os.scandir(self.project_dir) as entries:
                return sorted(
                    int(entry.name)
                    for entry in entries
                    if STEP_NAME.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)
                )
        except FileNotFoundError:
            return []

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

        def holds_data(sub: str = "") -> bool:
            try:
                return any(_DATA_NAME.fullmatch(name) for name in self._names_in(step, sub))
            except Exception:
                return False

        try:
            names = self._names_in(step)
        except Exception:
            return None
        if META_NAME in names:
            return None
        if not holds_data() and not any(_PART_NAME.fullmatch(sub) and holds_data(sub) for sub in names):
            return None
        return f"{self.step_dir(step)} holds data files but no meta.json (an earlier save was interrupted)"

    def _names_in(self, step: int, sub: str = "") -> list[str]:
        """Names in the step directory, or in its part directory ``sub``; follows no links."""
        fd = open_dir(self.step_dir(step))
        try:
            if not sub:
                return os.listdir(fd)
            part_fd = open_dir(sub, fd)
            try:
                return os.listdir(part_fd)
            finally:
                os.close(part_fd)
        finally:
            os.close(fd)

    def upstream_file(self, step: int, name: str, directory_name: str | None = None) -> Path | None:
        """verl's own cache file ``name`` of a step (e.g. ``gen_batch.dp``) if it is a regular file in a
        real, trusted step directory; None otherwise (a link, a pipe, an untrusted directory). Never raises.

        ``directory_name``: the step's directory when it is not ``{step}`` (verl < 0.9: ``genstep_000003``)."""
        pieces = name.split("/")
        if len(pieces) > 2 or not all(_SAFE_NAME.match(p) and ".." not in p for p in pieces):
            return None
        if directory_name is not None and (not _SAFE_NAME.match(directory_name) or ".." in directory_name):
            return None
        base = self.step_dir(step) if directory_name is None else self.project_dir / directory_name
        try:
            fd = self._open_step(step, directory_name)
        except Exception:
            return None
        try:
            parent_fd, leaf = fd, name
            sub, _, rest = name.partition("/")
            if rest:  # one part directory level, e.g. "0/tq_batch.pt"
                parent_fd, leaf = open_dir(sub, fd), rest
            try:
                fd2, _ = open_regular(leaf, parent_fd, base / name)
                os.close(fd2)
            finally:
                if parent_fd != fd:
                    os.close(parent_fd)
        except Exception:
            return None
        finally:
            os.close(fd)
        return base / name

    # ------------------------------------------------------------ reading

    def read_meta(self, step: int) -> dict[str, Any]:
        """Read and check a step's ``meta.json`` (format, version, role, context, self-checksum)."""
        fd = self._open_step(step)
        try:
            return self._read_meta(fd, step)
        finally:
            os.close(fd)

    def _read_meta(self, step_fd: int, step: int) -> dict[str, Any]:
        path = self.step_dir(step) / META_NAME
        fd, info = open_regular(META_NAME, step_fd, path)
        try:
            if info.st_size > MAX_META_BYTES:
                raise CorruptCacheError(f"{path}: {info.st_size} bytes, far larger than any meta.json; not read")
            data = read_fd(fd, info.st_size, path)
        except OSError as exc:
            raise CorruptCacheError(f"{path}: unreadable meta.json ({type(exc).__name__}: {exc})") from exc
        finally:
            os.close(fd)
        meta = parse_json(data, path, what="meta.json", max_depth=MAX_META_DEPTH)
        try:
            return self._check_meta(meta, path, step)
        except CacheError:
            raise
        except Exception as exc:
            raise CorruptCacheError(f"{path}: meta.json is malformed ({type(exc).__name__}: {exc})") from exc

    def _check_meta(self, meta: object, path: Path, step: int) -> dict[str, Any]:
        """``meta`` (parsed JSON) once checked to be this role's and step's ``meta.json``."""
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
            raise CorruptCacheError(f"{path}: written by role {_short(meta.get('role'))}, not {self.role!r}")
        if meta.get("step") != step:
            raise CorruptCacheError(f"{path}: records step {_short(meta.get('step'))}, but lies in step {step}")
        context = meta.get("context", {})
        if not isinstance(context, dict):
            raise CorruptCacheError(f"{path}: meta.json is malformed (context {_short(context)} is not a mapping)")
        if context != self.context:
            raise CorruptCacheError(
                f"{path}: written for other trainer metadata {_short(context)}, this run is {self.context!r}"
            )
        if meta.get("checksum_algo") not in CHECKSUM_ALGOS:
            raise CorruptCacheError(
                f"{path}: meta.json is malformed (unknown checksum algorithm {_short(meta.get('checksum_algo'))})"
            )
        return meta

    def verified(self, step: int) -> StepEntry:
        """The step's entry after checking every file it names; raises CorruptCacheError.

        ``FileNotFoundError``: no step directory or no ``meta.json`` (nothing cached). Tensor files are
        checksummed through the copy-on-write mapping that :meth:`load` then uses, other files are read
        once and kept: the bytes are read once and cannot change between the check and the load.
        """
        step_fd = self._open_step(step)
        try:
            meta = self._read_meta(step_fd, step)
            directory = self.step_dir(step)
            parts = meta.get("parts")
            if not isinstance(parts, list) or not parts:
                raise CorruptCacheError(f"{directory}: meta.json names no parts")
            entry = StepEntry(step, directory, meta)
            try:
                for part in parts:
                    self._verify_part(entry, step_fd, part)
            except BaseException:
                entry.release()
                raise
            return entry
        finally:
            os.close(step_fd)

    def _verify_part(self, entry: StepEntry, step_fd: int, part: Any) -> None:
        sub, files = self._part_files(entry.directory, part)
        algo = entry.meta["checksum_algo"]
        part_fd = step_fd
        if sub:
            try:
                part_fd = open_dir(sub, step_fd, shown=entry.directory / sub)
            except FileNotFoundError as exc:
                raise CorruptCacheError(f"{entry.directory / sub}: missing (named by meta.json)") from exc
        try:
            if sub:
                self._check_fd(part_fd, entry.directory / sub)
            for kind, name, spec in files:
                path = entry.directory / sub / name if sub else entry.directory / name
                try:
                    fd, info = open_regular(name, part_fd, path, spec.get("size"))
                except FileNotFoundError as exc:
                    raise CorruptCacheError(f"{path}: missing (named by meta.json)") from exc
                try:
                    if kind == "tensors":
                        mapped = map_fd(fd, info.st_size)
                        if mapped is not None:
                            entry.mapped[path] = mapped
                        checksum = _digest_parallel(b"" if mapped is None else mapped, algo)
                    else:
                        blob = read_fd(fd, info.st_size, path)
                        entry.blobs[path] = blob
                        checksum = _digest(blob, algo)
                except CacheError:
                    raise
                except Exception as exc:  # OSError, MemoryError, ValueError from mmap: not a cache we use
                    raise CorruptCacheError(f"{path}: cannot read it ({type(exc).__name__}: {exc})") from exc
                finally:
                    os.close(fd)
                if checksum != spec.get("checksum"):
                    raise CorruptCacheError(f"{path}: checksum mismatch (the file was damaged or changed)")
        finally:
            if part_fd != step_fd:
                os.close(part_fd)

    def load(self, entry: StepEntry) -> list[Payload]:
        """Load every part of a verified entry. Tensors are views of a copy-on-write file mapping.

        Raises only CorruptCacheError (any failure of any type while parsing or decoding the files).
        """
        if not entry.mapped and not entry.blobs:
            entry = self.verified(entry.step)  # not read by verified(): read it now, under the same rules
        payloads = []
        for part in entry.meta["parts"]:
            sub, files = self._part_files(entry.directory, part)
            paths = {kind: (entry.directory / sub / name if sub else entry.directory / name) for kind, name, _ in files}
            try:
                tensors = read_tensors(entry.mapped.get(paths["tensors"]), paths["tensors"])
                blob = entry.blobs.get(paths["objects"])
                if blob is None:
                    raise CorruptCacheError(f"{paths['objects']}: was not verified")
                objects = parse_json(blob, paths["objects"], what="objects file")
            except CacheError:
                raise
            except Exception as exc:
                raise CorruptCacheError(
                    f"{entry.directory}: cannot load part {sub!r}: {type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(tensors, dict) or not isinstance(objects, dict):
                raise CorruptCacheError(f"{entry.directory}: part {sub!r} has an unexpected structure")
            rows = part.get("rows")
            payloads.append(Payload(tensors=tensors, objects=objects, rows=rows if type(rows) is int else None))
        return payloads

    def named_files(self, step: int, meta: Mapping[str, Any]) -> list[tuple[Path, dict[str, Any]]]:
        """Every data file a step's ``meta.json`` names, with its record (``kind``, ``size``, ``checksum``);
        every name checked to be safe (CorruptCacheError otherwise). No file is opened."""
        directory = self.step_dir(step)
        parts = meta.get("parts")
        if not isinstance(parts, list) or not parts:
            raise CorruptCacheError(f"{directory}: meta.json names no parts")
        out = []
        for part in parts:
            sub, files = self._part_files(directory, part)
            for kind, name, spec in files:
                out.append(((directory / sub / name) if sub else directory / name, {**spec, "kind": kind}))
        return out

    def _part_files(self, directory: Path, part: Any) -> tuple[str, list[tuple[str, str, dict[str, Any]]]]:
        """A part's sub-directory and its files ``(kind, name, spec)``, every name checked to be safe."""
        if not isinstance(part, Mapping):
            raise CorruptCacheError(f"{directory}: meta.json is malformed (part {_short(part)} is not a record)")
        sub = part.get("dir", "")
        if not isinstance(sub, str) or (sub and not _SAFE_NAME.match(sub)) or sub in (".", ".."):
            raise CorruptCacheError(f"{directory}: meta.json names an unsafe part directory {_short(sub)}")
        files = part.get("files")
        if not isinstance(files, dict) or set(files) != {"tensors", "objects"}:
            raise CorruptCacheError(f"{directory}: meta.json part {sub!r} does not name its files")
        out = []
        for kind, spec in files.items():
            name = spec.get("name") if isinstance(spec, dict) else None
            if not isinstance(name, str) or not _SAFE_NAME.match(name) or ".." in name or name == META_NAME:
                raise CorruptCacheError(f"{directory}: meta.json names an unsafe file {_short(name)}")
            out.append((kind, name, spec))
        return sub, out

    def collect_garbage(self, step: int, meta: Mapping[str, Any] | None = None) -> tuple[int, int]:
        """Remove abandoned leftovers of this step's saves now (see :mod:`skipinject.store.garbage`)."""
        return collect(self.project_dir, step=step)


def _short(value: Any, limit: int = 200) -> str:
    """``repr`` of a value from a cache, cut to one short line (a forged meta.json may hold megabytes)."""
    try:
        text = repr(value)
    except Exception:  # a RecursionError on a value nested past the limit
        return f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."
