"""Every name, pattern and bound of the on-disk format, in one place, so no two readers disagree;
:func:`reference_table` renders the table docs/cache-format.md holds (``python -m skipinject.store.format``)."""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Mapping
from typing import Any

from skipinject.payload import TENSOR_DTYPES as TENSOR_DTYPES  # part of the format, as the codecs know it
from skipinject.payload import ZSTD_DEFAULT_LEVEL as ZSTD_DEFAULT_LEVEL
from skipinject.payload import ZSTD_MAX_LEVEL as ZSTD_MAX_LEVEL

FORMAT = "skipinject"
#: Written when a step holds a compressed file; plain steps keep version 2, which older readers read.
FORMAT_VERSION = 3
PLAIN_FORMAT_VERSION = 2
READABLE_VERSIONS = (2, 3)
#: The commit record of a step (and of nothing else): written last, replaced atomically.
META_NAME = "meta.json"

#: A step directory: the decimal step number, no sign, no leading zeros (``007`` is no step), 12 digits at most.
STEP_NAME = re.compile(r"0|[1-9][0-9]{0,11}")
#: A part directory of a step (the same rule, 6 digits at most); part ``""`` is the step directory itself.
PART_NAME = re.compile(r"0|[1-9][0-9]{0,5}")
#: A step's usage record beside ``meta.json`` (never named by it), and its local replacement's temporary files.
USAGE_NAME = "usage.json"
#: A writer's id ``{unix_time}-{pid}-{8 hex}``: fresh per save, in every data and temporary file name.
WRITE_ID = re.compile(r"([0-9]{9,12})-([0-9]{1,10})-([0-9a-f]{8})")
#: A data file of a part: the tensor file or the objects file of one write.
DATA_NAME = re.compile(r"(?:tensors-[0-9A-Za-z_.-]+\.bin|objects-[0-9A-Za-z_.-]+\.json)")
#: A temporary file of a local save (``.{name}.tmp-{8 hex or the write id}``), renamed into place.
TMP_NAME = re.compile(r"\.(?:tensors-|objects-|meta\.json)[0-9A-Za-z_.-]*\.tmp-[0-9A-Za-z_-]+")
#: What a name read from meta.json (a part directory, a data file) must look like before it is used.
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

#: ``action=match``: new rows of an already committed step (``{project}/rows/{n}/``, ordinary step records
#: numbered from 1), and the project's row-key index (a hint, rebuilt from the steps).
ROWS_DIR = "rows"
ROW_INDEX_NAME = "row-index.npz"
#: An object store's claim of a rows record's number (``rows/{n}/.claim-{token}``; locally: an exclusive mkdir).
CLAIM_PREFIX = ".claim-"
#: Numbers one claim tries before it gives up (each taken by another writer).
MAX_CLAIMS = 1000
#: Rows one index holds (about 30 bytes each), and the largest index file read.
MAX_INDEXED_ROWS = 1 << 25
MAX_ROW_INDEX_BYTES = 40 * MAX_INDEXED_ROWS + (1 << 20)

#: meta.json is a few KB (plus one short fingerprint per row); anything larger is not ours.
MAX_META_BYTES = 16 << 20
#: Parts of one step: a role writes one per call (a few for multi-call steps), far fewer than this.
MAX_PARTS = 4096
#: meta.json nests 4 levels deep (parts -> files -> spec); some room for role-specific keys.
MAX_META_DEPTH = 32
#: Rows of a step or a part (``rows`` in meta.json): more than any batch holds; a larger count is forged.
MAX_ROWS = 1 << 48
#: The largest size meta.json may record for a data file, stored or decoded (1 PiB).
MAX_FILE_BYTES = 1 << 50
#: The JSON index at the head of a tensor file (~100 bytes per tensor).
MAX_INDEX_BYTES = 64 << 20
#: A file this large must occupy at least 1/SPARSE_FACTOR of its size on disk (not a sparse forgery).
SPARSE_MIN_SIZE = 64 << 20
SPARSE_FACTOR = 64
#: The tensor file's magic and the alignment of its data.
TENSORS_MAGIC = b"SKIPTNS1"
TENSOR_ALIGN = 64
#: Chunk of the ``xxh3_64-tree`` checksum.
TREE_CHUNK = 32 << 20
#: Decoded bytes per zstd frame of a compressed data file (the last frame holds the rest).
FRAME_BYTES = 4 << 20
#: No zstd data expands more than this (a 128 KiB block in 4 bytes): a compressed file claiming more is forged.
MAX_EXPANSION = 1 << 15
#: What one part may take decoded and rebuilt (:func:`skipinject.store.meta.part_budget`): per row, bytes
#: per token of the declared width (at least ``MIN_ROW_BYTES``; ``MAX_ROW_BYTES`` with no width), plus slack.
MAX_BYTES_PER_TOKEN = 4096
MIN_ROW_BYTES = 1 << 20
MAX_ROW_BYTES = 256 << 20
PART_SLACK = 16 << 20
#: The widest row of tokens a ``context`` may declare, and a compact mask or ramp may rebuild.
MAX_WIDTH = 1 << 20


def step_name(step: int) -> str:
    """The directory name of ``step``."""
    return str(int(step))


def is_ours(name: str) -> bool:
    """A data file or a temporary file of our own saves (what garbage collection and prune may touch)."""
    return DATA_NAME.fullmatch(name) is not None or TMP_NAME.fullmatch(name) is not None


def is_usage_name(name: str) -> bool:
    """The usage record or a temporary file of its local replacement (removed with the step)."""
    return name == USAGE_NAME or name.startswith(f".{USAGE_NAME}.tmp-")


def tensors_name(write_id: str) -> str:
    return f"tensors-{write_id}.bin"


def objects_name(write_id: str) -> str:
    return f"objects-{write_id}.json"


def tmp_name(name: str, token: str) -> str:
    return f".{name}.tmp-{token}"


def meta_digest(meta: Mapping[str, Any]) -> str:
    """``meta_checksum``: crc32 of the canonical JSON of every other key."""
    body = {k: v for k, v in meta.items() if k != "meta_checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return f"{zlib.crc32(text) & 0xFFFFFFFF:08x}"


def _code(pattern: str) -> str:
    """A pattern as a markdown table cell (``|`` escaped)."""
    return "`" + pattern.replace("|", "\\|") + "`"


def _mib(size: int) -> str:
    return f"{size >> 20} MiB"


def reference_table() -> str:
    """The markdown table of names, patterns and bounds docs/cache-format.md holds."""
    rows = [
        f"step directory | {_code(STEP_NAME.pattern)} | decimal step number, no sign, no leading zeros",
        f'part directory | {_code(PART_NAME.pattern)} | part `""` is the step directory itself',
        f"parts of a step | `parts` in `meta.json` | 1 to {MAX_PARTS}, each directory and data file named once; "
        "no two data files of a step the same file (hard links)",
        f"commit record | `{META_NAME}` | at most {_mib(MAX_META_BYTES)}, {MAX_META_DEPTH} levels deep",
        f"row count | `rows` in `meta.json` | an integer from 0 to 2^{MAX_ROWS.bit_length() - 1}, or null",
        f"tensor file | `{tensors_name('{write_id}')}` | index at most {_mib(MAX_INDEX_BYTES)}",
        f"objects file | `{objects_name('{write_id}')}` | tagged JSON",
        f"data file | {_code(DATA_NAME.pattern)} | what no `meta.json` names is a leftover",
        f"temporary file | {_code(TMP_NAME.pattern)} | a local save's file before its rename",
        f"write id | {_code(WRITE_ID.pattern)} | `{{unix_time}}-{{pid}}-{{8 hex}}`",
        f"name from meta.json | {_code(SAFE_NAME.pattern)} | and not `..`, not `meta.json`",
        f"sparse files | {_mib(SPARSE_MIN_SIZE)} or more | "
        f"must occupy at least 1/{SPARSE_FACTOR} of their size on disk",
        f"tensor file magic | `{TENSORS_MAGIC.decode()}` | data {TENSOR_ALIGN}-byte aligned",
        f"tree checksum chunk | {_mib(TREE_CHUNK)} | `xxh3_64-tree`",
        f"zstd frame | {_mib(FRAME_BYTES)} decoded | expanding at most {MAX_EXPANSION}x, levels 1-{ZSTD_MAX_LEVEL}",
        f"decoded part | rows x max(width x {MAX_BYTES_PER_TOKEN} B, {_mib(MIN_ROW_BYTES)}) + {_mib(PART_SLACK)} | "
        f"data files decoded and compact tensors rebuilt; {_mib(MAX_ROW_BYTES)} a row without a declared width; "
        "a step at most half the memory the process may use",
        f"rows records (`match`) | `{ROWS_DIR}/{{n}}/` | ordinary committed steps, numbered from 1",
        f"rows record claim | `{ROWS_DIR}/{{n}}/{CLAIM_PREFIX}{{token}}` | object stores: `n` is a writer's only "
        f"while its claim is the only one there; {MAX_CLAIMS} tries",
        f"row index (`match`) | `{ROW_INDEX_NAME}` | at most {MAX_INDEXED_ROWS} rows, {_mib(MAX_ROW_INDEX_BYTES)}; "
        "a hint, rebuilt when it does not check out",
    ]
    lines = ["| what | name or pattern | bound or rule |", "|---|---|---|", *(f"| {row} |" for row in rows)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference_table(), end="")
