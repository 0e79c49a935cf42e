"""What marks a step directory as ours: names, format version, the meta.json self-checksum."""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Mapping
from typing import Any

FORMAT = "skipinject"
FORMAT_VERSION = 2
META_NAME = "meta.json"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _meta_digest(meta: Mapping[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "meta_checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return f"{zlib.crc32(text) & 0xFFFFFFFF:08x}"
