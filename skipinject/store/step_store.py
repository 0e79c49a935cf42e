"""One role's steps under one project directory: reading, verifying and loading them."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from skipinject.errors import CorruptCacheError
from skipinject.store.checksums import CHECKSUM_ALGOS, _checksum_algo, _digest_parallel, file_checksum
from skipinject.store.format import _SAFE_NAME, FORMAT, FORMAT_VERSION, META_NAME, _meta_digest
from skipinject.store.garbage import collect
from skipinject.store.payload import Payload, StepEntry
from skipinject.store.tensorfile import map_file, read_tensors
from skipinject.store.writer import StepWriter

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

    def is_committed(self, step: int) -> bool:
        """The step has a valid ``meta.json`` of this role (its data files are not verified)."""
        try:
            self.read_meta(step)
        except (OSError, CorruptCacheError):
            return False
        return True

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

    def collect_garbage(self, step: int, meta: Mapping[str, Any] | None = None) -> tuple[int, int]:
        """Remove abandoned leftovers of this step's saves now (see :mod:`skipinject.store.garbage`)."""
        return collect(self.project_dir, step=step)
