"""Helpers plugins share (plugin API 1.1; docs/plugins.md), public like :mod:`skipinject`. Nothing here
imports torch or verl at import time."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from skipinject.errors import CodecError
from skipinject.verl.compat import attended_tokens, installed_verl_matches

__all__ = [
    "DIGEST_BYTES",
    "CodecHeader",
    "attended_tokens",
    "installed_verl_matches",
    "row_digest",
    "row_text",
    "tensor_bytes",
]

#: Size of a row digest (blake2b), in bytes: 16 hex characters in ``meta.json`` per row.
DIGEST_BYTES = 8


@dataclass(frozen=True)
class CodecHeader:
    """A codec's name and format version, written into each payload's objects and checked on decode."""

    name: str
    version: int = 1

    def fields(self) -> dict[str, Any]:
        """Put first into the payload's objects."""
        return {"codec": self.name, "codec_version": self.version}

    def check(self, objects: Mapping[str, Any]) -> None:
        """Raise :class:`CodecError` unless ``objects`` were written by this codec and version."""
        if objects.get("codec") != self.name or objects.get("codec_version") != self.version:
            raise CodecError(
                f"cache was written by codec {objects.get('codec')!r} version {objects.get('codec_version')!r}, "
                f"expected {self.name!r} version {self.version}"
            )


def tensor_bytes(tensor: Any) -> bytes:
    """A tensor's raw bytes in row-major order, whatever its dtype (``bfloat16`` included) or device."""
    import torch

    data: bytes = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return data


def row_text(value: Any) -> str:
    """A row's non-tensor value as stable text (sorted JSON; numpy values through ``tolist``)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    return json.dumps(value, sort_keys=True, default=str)


def row_digest(*pieces: Any) -> str:
    """One row's digest over ``pieces`` in order: bytes as they are, text as UTF-8, tensors by their
    bytes (:func:`tensor_bytes`), anything else by :func:`row_text` (pass ``row_text(value)`` for a
    value that may itself be a string, so that ``"a"`` and ``["a"]`` differ)."""
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for piece in pieces:
        if isinstance(piece, (bytes, bytearray, memoryview)):
            digest.update(piece)
        elif isinstance(piece, str):
            digest.update(piece.encode())
        elif hasattr(piece, "detach") and hasattr(piece, "dtype"):
            digest.update(tensor_bytes(piece))
        else:
            digest.update(row_text(piece).encode())
    return digest.hexdigest()
