"""Writing a step: fresh data-file names, and meta.json replaced last (complete or absent), on any backend."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import skipinject.store.format as fmt
from skipinject._version import __version__
from skipinject.errors import CacheError
from skipinject.node import node_identity
from skipinject.payload import Payload
from skipinject.store.checksums import _Hasher
from skipinject.store.compression import write_compressed
from skipinject.store.garbage import ACTIVE_WRITE_IDS
from skipinject.store.meta import part_budget
from skipinject.store.tensorfile import tensor_file
from skipinject.text import shown

if TYPE_CHECKING:
    from skipinject.store.step_store import StepStore


class StepWriter:
    """Collects the parts of one step and commits them with one ``meta.json`` replace: data files under
    fresh names first, ``meta.json`` last, leftovers of other saves collected after."""

    def __init__(self, store: StepStore, step: int) -> None:
        self.store = store
        self.step = step
        self.write_id = f"{int(time.time())}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        ACTIVE_WRITE_IDS.add(self.write_id)
        self.parts: dict[str, dict[str, Any]] = {}
        self._written: list[Path] = []
        self._created: list[Path] = []

    @property
    def directory(self) -> Path:
        return self.store.step_dir(self.step)

    def add_part(self, payload: Payload, part: str = "") -> None:
        """Write one part's files, invisible until :meth:`commit` (parts may follow a commit)."""
        if part and not fmt.SAFE_NAME.match(part):
            raise ValueError(f"bad part name {part!r}")
        ACTIVE_WRITE_IDS.add(self.write_id)  # again, after a commit: not collected while being written
        blob = json.dumps(payload.objects, separators=(",", ":"), allow_nan=True).encode()
        tensors = [t for t in payload.tensors.values() if hasattr(t, "element_size")]  # others: refused later
        decoded = len(blob) + sum(t.numel() * t.element_size() for t in tensors)
        budget = part_budget(payload.rows, self.store.context)
        if decoded > budget:  # never write a part no reader would load
            raise CacheError(
                f"{self.directory}: a part of {payload.rows} rows taking {decoded} bytes is more than a reader "
                f"loads ({budget}); not saved"
            )
        backend = self.store.backend
        folder = self.directory / part if part else self.directory
        self._created.extend(backend.prepare(self.directory, folder))
        self.store.check_writable([self.directory, folder])  # never into a tree another user controls
        algo = self.store.checksum_algo
        compression = self.store.compression
        tensors_at = folder / fmt.tensors_name(self.write_id)
        self._written.append(tensors_at)
        size, (checksum, encoded) = backend.write(
            tensors_at, lambda h: tensor_file(h, payload.tensors, algo, compression, payload.concats), self.write_id
        )
        files: dict[str, Any] = {
            "tensors": {"name": tensors_at.name, "size": size, "checksum": checksum, **(encoded or {})}
        }
        objects_at = folder / fmt.objects_name(self.write_id)
        self._written.append(objects_at)
        hasher = _Hasher(algo)

        def objects_file(handle: BinaryIO) -> dict[str, Any]:
            if compression is not None:
                return write_compressed(handle, [blob], compression, hasher)
            handle.write(blob)
            hasher.update(blob)
            return {}

        size, written = backend.write(objects_at, objects_file, self.write_id)
        files["objects"] = {"name": objects_at.name, "size": size, "checksum": hasher.hexdigest(), **written}
        self.parts[part] = {"dir": part, "rows": payload.rows, "files": files}

    def commit(self, meta: Mapping[str, Any], *, over: Mapping[str, Any] | None = None) -> Path:
        """Publish the step: ``meta.json`` written last, in one step. ``over``: the ``meta.json`` this replaces,
        read again first; if the step changed since, nothing is replaced (CacheError)."""
        text = self.meta_record(meta)
        if over is not None:
            try:
                current: object = self.store.read_meta(self.step)
            except (OSError, CacheError) as exc:
                current = exc
            if current != over:
                raise CacheError(f"{self.directory}: recorded anew or removed since it was read; not replaced")
        self.store.backend.replace(self.directory / fmt.META_NAME, text, self.write_id)
        self._written.clear()
        self._created.clear()
        ACTIVE_WRITE_IDS.discard(self.write_id)
        # the step is committed; leftovers of earlier or concurrent saves are collected (never raises)
        self.store.collect_garbage(self.step)
        return self.directory

    def meta_record(self, meta: Mapping[str, Any]) -> bytes:
        """The ``meta.json`` committing the parts written so far, with ``meta`` (role-specific keys)."""
        encoded = any("encoding" in spec for part in self.parts.values() for spec in part["files"].values())
        record = {
            **meta,
            "format": fmt.FORMAT,
            "format_version": fmt.FORMAT_VERSION if encoded else fmt.PLAIN_FORMAT_VERSION,
            "role": self.store.role,
            "step": self.step,
            **dict.fromkeys(self.store.step_aliases, self.step),
            "context": dict(self.store.context),
            "checksum_algo": self.store.checksum_algo,
            "parts": [self.parts[name] for name in sorted(self.parts, key=_part_order)],
            "rows": sum(p["rows"] or 0 for p in self.parts.values()),
            "writer": writer_versions(),
            "node": node_identity(),  # which node wrote the step (multi-node clusters)
            # a step stored anew (``cache compact``) keeps when it was generated
            "created": meta["created"] if "created" in meta else time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **({"plugin": self.store.plugin} if self.store.plugin else {}),
        }
        record["meta_checksum"] = fmt.meta_digest(record)
        text = json.dumps(record, indent=1, sort_keys=True).encode()
        _readable_meta(record, len(text))
        return text

    def abort(self) -> None:
        """Remove what this writer wrote, and the directories it created if empty (best effort)."""
        anchor = self.store.dump_dir if self.store.dump_dir is not None else self.store.project_dir
        for location in [*self._written, *reversed(self._created)]:
            with contextlib.suppress(OSError):
                self.store.backend.remove(location, anchor)
        self._written.clear()
        self._created.clear()
        ACTIVE_WRITE_IDS.discard(self.write_id)


def _readable_meta(record: Mapping[str, Any], size: int) -> None:
    """Refuse (CacheError, one line) a ``meta.json`` every reader would refuse: larger than
    :data:`~skipinject.store.format.MAX_META_BYTES` or nested deeper than ``MAX_META_DEPTH``. Saved, it would
    make the step unusable for every later run; refused, the step is generated again, and the line says why."""
    if size > fmt.MAX_META_BYTES:
        sizes = {str(key): len(json.dumps(value)) for key, value in record.items()}
        largest = max(sizes, key=sizes.__getitem__)
        raise CacheError(
            f"its meta.json would be {size:,} bytes, more than the {fmt.MAX_META_BYTES:,} a reader accepts "
            f"(the largest entry: {shown(largest[:60])!r}, {sizes[largest]:,} bytes)"
        )
    stack: list[tuple[Any, int]] = [(record, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > fmt.MAX_META_DEPTH:
            raise CacheError(f"its meta.json would be nested more than {fmt.MAX_META_DEPTH} levels deep")
        children = item.values() if isinstance(item, Mapping) else item if isinstance(item, (list, tuple)) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (Mapping, list, tuple)))


def _part_order(name: str) -> tuple[int, str]:
    return (int(name), "") if fmt.PART_NAME.fullmatch(name) else (-1, name)


def writer_versions() -> dict[str, str]:
    """Versions of what wrote a cache (skipinject, verl, torch, python)."""
    return dict(_versions())


@functools.cache
def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"skipinject": __version__, "python": platform.python_version()}
    for dist in ("verl", "torch", "tensordict"):
        with contextlib.suppress(PackageNotFoundError):
            found[dist] = version(dist)
    return found
