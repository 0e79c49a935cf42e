"""What a codec hands the store and the store hands back (:class:`Payload`), the dtypes it may hold and
the compression a role's files are written with: codecs and the settings reader need nothing of the store.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: Tensor dtypes a payload may hold, as the tensor file names them (``torch`` attribute names).
_INTEGERS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
TENSOR_DTYPES = frozenset(("bool", *_INTEGERS, "float16", "bfloat16", "float32", "float64", "complex64", "complex128"))

#: ``zstd`` without a level: after the compact encodings level 3 saves no bytes more than 1, and 1 is
#: faster (``bench_compression.py``).
ZSTD_DEFAULT_LEVEL = 1
ZSTD_MAX_LEVEL = 22


@dataclass
class Payload:
    """One part of a result: plain tensors plus JSON-safe values (see :mod:`skipinject.codecs`)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    rows: int | None = None
    #: ``{name: (left, right)}``: tensor ``name`` may be ``left`` and ``right`` side by side in the last
    #: dimension (a hint: the store keeps only what it checks to rebuild exactly).
    concats: dict[str, tuple[str, str]] = field(default_factory=dict, compare=False)

    def private_copy(self) -> Payload:
        """A copy for a background save: later in-place changes to the result (by training, or a transport
        reusing its buffers) cannot reach it."""
        import json

        tensors = {name: tensor.detach().clone() for name, tensor in self.tensors.items()}
        objects = json.loads(json.dumps(self.objects, separators=(",", ":"), allow_nan=True))
        return Payload(tensors=tensors, objects=objects, rows=self.rows, concats=dict(self.concats))


#: What ``skip.<role>.compression`` accepts: ``auto``, ``none``, ``zstd`` or ``zstd-<level>``.
COMPRESSION_VALUE = re.compile(r"auto|none|zstd(?:-([1-9]|1[0-9]|2[0-2]))?")


@dataclass(frozen=True)
class Compression:
    """How a store compresses the files it writes (``None`` in its place: stored as they are)."""

    level: int = ZSTD_DEFAULT_LEVEL

    @property
    def name(self) -> str:
        return "zstd" if self.level == ZSTD_DEFAULT_LEVEL else f"zstd-{self.level}"


def parse_compression(value: str, *, remote: bool = False, network_fs: bool = False) -> Compression | None:
    """The compression a setting names; ``auto``: zstd for object stores and network file systems,
    none on local disks (where a hit reads at memory speed and decompressing would only cost)."""
    match = COMPRESSION_VALUE.fullmatch(value)
    if match is None:
        raise ValueError(f"unknown compression {value!r} (auto, none, zstd, zstd-1 .. zstd-{ZSTD_MAX_LEVEL})")
    if value == "auto":
        return Compression() if remote or network_fs else None
    if value == "none":
        return None
    return Compression(int(match.group(1) or ZSTD_DEFAULT_LEVEL))
