"""``skipinject cache ...``: see, verify, show, compare, import and prune what is cached."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    """Entry point of ``skipinject cache``; returns the exit status."""
    print("skipinject: error: `skipinject cache` is not implemented yet", file=sys.stderr)
    return 2
