"""One schema: :class:`~skipinject.store.meta.StepMeta` owns every core key of ``meta.json``. Outside
``store/meta.py`` (and ``store/writer.py``, which commits the record) no module reads or writes a core key
raw (a string subscript, or ``.get``/``.pop``/``.setdefault`` with its name) nor builds a path with the
literal ``"meta.json"``: it asks StepMeta's properties and methods, and builds with ``StepMeta.build``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from skipinject.store.meta import CORE_KEYS, StepMeta
from tests.conftest import ROOT

#: Owners of the keys: the schema itself and the writer that commits it.
OWNERS = {"skipinject/store/meta.py", "skipinject/store/writer.py"}
#: Keys no other record of skipinject uses: any raw access of them is one of ``meta.json``.
META_ONLY = {k for k in CORE_KEYS if k not in {"role", "step", "context", "parts", "rows", "writer", "node", "created",
                                               "plugin", "inputs", "calls", "format"}}  # fmt: skip
#: Modules still reading or writing core keys raw, until they switch to StepMeta (each to be emptied):
PENDING = {
    # a phase plugin commits its step's meta through the plugin API (``PhaseContext.commit``), a plain dict:
    # the rollout_tq plugin writes generation_s and its trajectories' row keys there
    "plugins/rollout_tq/skipinject_rollout_tq/phases.py",
}


def sources() -> list[str]:
    """Every module of skipinject/ and every plugin's package (not its tests), relative to the repository."""
    found = [*ROOT.joinpath("skipinject").rglob("*.py"), *ROOT.joinpath("plugins").glob("*/*/**/*.py")]
    return sorted(str(p.relative_to(ROOT)) for p in found if "tests" not in p.relative_to(ROOT).parts)


def raw_accesses(source: str) -> list[str]:
    """Each raw access of a core key of ``meta.json`` in ``source``, and each path built with ``"meta.json"``."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        key, owner = None, None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key, owner = node.slice.value, node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            first = node.args[0]
            if node.func.attr in ("get", "pop", "setdefault") and isinstance(first, ast.Constant):
                key, owner = first.value, node.func.value
        elif isinstance(node, ast.Constant) and node.value == "meta.json":
            parent = parents.get(node)
            joined = isinstance(parent, ast.Call) and ast.unparse(parent.func).split(".")[-1] in ("join", "Path")
            if (isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Div)) or joined:
                found.append(f'{node.lineno}: a path built with "meta.json" (use META_NAME)')
        if key in CORE_KEYS and owner is not None:
            of_meta = "meta" in ast.unparse(owner).lower()
            if key in META_ONLY or of_meta:
                found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_the_check_finds_raw_reads_writes_and_paths() -> None:
    source = (
        'a = meta.get("calls", 1)\nb = entry.meta["role"]\nmeta["generation_s"] = 1\nc = notes.get("row_keys")\n'
        'd = step / "meta.json"\ne = os.path.join(d, "meta.json")\n'
    )
    assert [line.split(":")[0] for line in raw_accesses(source)] == ["1", "2", "3", "4", "5", "6"]
    innocent = 'x = summary["role"]\ny = record.get("step")\nz = "no meta.json here"\nw = meta.role\n'
    assert raw_accesses(innocent) == []


@pytest.mark.parametrize("module", sources())
def test_core_keys_are_read_and_written_only_through_step_meta(module: str) -> None:
    if module in OWNERS:
        return
    found = raw_accesses((ROOT / module).read_text())
    if module in PENDING:
        assert found, f"{module} no longer reads meta.json raw: remove it from PENDING"
        return
    assert found == [], f"{module}: use StepMeta's properties and StepMeta.build: " + "; ".join(found)


def test_step_meta_builds_what_the_recorder_and_match_commit() -> None:
    assert StepMeta.build(inputs=["a"], calls=1, extra={"model": "m"}) == {"model": "m", "inputs": ["a"], "calls": 1}
    two = StepMeta.build(
        inputs=["a"], calls=2, call_inputs=[["a"], ["b"]], generation_s=1.23456789, row_keys=[["k"], None],
        rows_per_input=[2, None],
    )  # fmt: skip
    assert two == {
        "inputs": ["a"], "calls": 2, "generation_s": 1.234568, "call_inputs": [["a"], ["b"]],
        "row_keys": [["k"], None], "rows_per_input": [2, None],
    }  # fmt: skip
    rows = StepMeta.build(inputs=["a"], row_keys=[["k"]], rows_per_input=[1], generated_at=7)
    assert rows == {"inputs": ["a"], "calls": 1, "row_keys": [["k"]], "rows_per_input": [1], "generated_at": 7}
    read = StepMeta(two, Path("meta.json"))
    assert (read.calls, read.inputs_per_call(2), read.input_lists()) == (2, [["a"], ["b"]], [["a"], ["b"]])
    one = StepMeta({"inputs": ["a"]}, Path("meta.json"))
    assert (one.calls, one.inputs_per_call(2), one.input_lists()) == (1, [["a"], None], [["a"]])
    assert set(CORE_KEYS) >= set(two) | set(rows)
