"""A ratchet on the core's size: its lines of code (not blank, comment or docstring, read from the AST) may
only go down, except where a new feature adds lines; such a commit raises ``CODE_LINES`` and names the
feature in its message."""

from __future__ import annotations

import ast

from tests.conftest import ROOT

#: The core's lines of code today (``skipinject/**/*.py``).
CODE_LINES = 11_913


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


#: A function's most lines (its ``def`` to its last line); longer ones are split into named steps.
MAX_FUNCTION_LINES = 60
#: Functions over :data:`MAX_FUNCTION_LINES` not split yet (this set only shrinks).
LONG_FUNCTIONS = {
    "skipinject/store/tensorfile.py:read_tensors",
}


def long_functions(source: str) -> dict[str, int]:
    """``{qualified name: lines}`` of the functions of ``source`` over :data:`MAX_FUNCTION_LINES`."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and lines > MAX_FUNCTION_LINES:
                    found[name] = lines
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_long_functions_are_found() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    nested = "class C:\n" + "".join(f"    {line}\n" for line in ("def f(self):\n" + body).splitlines())
    assert long_functions(nested) == {"C.f": MAX_FUNCTION_LINES + 1}
    assert long_functions("def f():\n" + body.split("\n", 1)[1]) == {}


def test_no_function_is_over_sixty_lines() -> None:
    found = {
        f"{path.relative_to(ROOT)}:{name}": lines
        for path in sorted((ROOT / "skipinject").rglob("*.py"))
        for name, lines in long_functions(path.read_text()).items()
    }
    over = {name: lines for name, lines in found.items() if name not in LONG_FUNCTIONS}
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {over}"
    assert set(found) >= LONG_FUNCTIONS, f"split already, drop from LONG_FUNCTIONS: {LONG_FUNCTIONS - set(found)}"
