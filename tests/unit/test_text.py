"""Text for people lives in one neutral module, ``skipinject/text.py``: the run's report and the cache tool both
take ``shown`` and ``human_size`` from it, so the report never imports the cache tool nor the command line."""

from __future__ import annotations

import ast

from skipinject.text import human_size, shown
from tests.conftest import ROOT


def imported(path: str) -> set[str]:
    """Every module ``path`` imports (in functions, and under ``TYPE_CHECKING``, too)."""
    found = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_the_report_imports_neither_the_cache_tool_nor_the_command_line() -> None:
    for path in sorted((ROOT / "skipinject" / "report").glob("*.py")):
        names = imported(str(path.relative_to(ROOT)))
        assert not {n for n in names if n.startswith(("skipinject.cache_tool", "skipinject.cli"))}, path.name


def test_text_imports_nothing_of_skipinject() -> None:
    assert not {n for n in imported("skipinject/text.py") if n.startswith("skipinject")}


def test_shown_and_human_size() -> None:
    assert shown("a\nb\x1b") == "a\\nb\\e" and shown("plain") == "plain"
    assert (human_size(None), human_size(1536), human_size(3 << 40)) == ("-", "1.5 KiB", "3.0 TiB")
