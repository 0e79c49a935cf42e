"""A ratchet on the core's size: its lines of code (not blank, comment or docstring, read from the AST) may
only go down, except where a new feature adds lines; such a commit raises ``CODE_LINES`` and names the
feature in its message."""

from __future__ import annotations

import ast

from tests.conftest import ROOT

#: The core's lines of code today (``skipinject/**/*.py``).
CODE_LINES = 11_807


def code_lines(source: str) -> int:
    """Lines of ``source`` that are neither blank, a comment, nor part of a docstring."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return sum(
        1
        for number, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in docstrings
    )


def test_code_lines_count_neither_blanks_comments_nor_docstrings() -> None:
    source = '"""Doc\nstring."""\n\n# a comment\ndef f():\n    """Doc."""\n    return 1\n'
    assert code_lines(source) == 2


def test_the_core_grows_only_by_a_feature() -> None:
    total = sum(code_lines(path.read_text()) for path in sorted((ROOT / "skipinject").rglob("*.py")))
    assert total <= CODE_LINES, (
        f"skipinject/ has {total} lines of code, over the ratchet's {CODE_LINES}: simplify, or raise CODE_LINES "
        "in tests/unit/test_core_size.py in a commit naming the feature that adds them"
    )


#: The longest a function of the store, the cache tool and the run's report may be, in lines.
MAX_FUNCTION_LINES = 60
#: Functions still longer (each to be split): the hit path's tensor reader.
LONG_FUNCTIONS = {"skipinject/store/tensorfile.py:read_tensors"}


def test_functions_of_the_store_the_cache_tool_and_the_report_stay_short() -> None:
    found = []
    for folder in ("store", "cache_tool", "report"):
        for path in sorted((ROOT / "skipinject" / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    where = f"{path.relative_to(ROOT)}:{node.name}"
                    length = (node.end_lineno or node.lineno) - node.lineno + 1
                    if length > MAX_FUNCTION_LINES and where not in LONG_FUNCTIONS:
                        found.append(f"{where} ({length} lines)")
    assert found == [], found
