"""The store has one door: outside ``skipinject/store/`` (and in every plugin) code imports only the names
``skipinject.store`` itself exports, never one of its modules; the cache tool's removals and the miss
explainer go through :class:`~skipinject.store.StepStore`."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

import skipinject.store as store_package
from skipinject.cache_tool import main
from skipinject.store import Payload, StepStore
from tests.conftest import ROOT

STORE = ROOT / "skipinject" / "store"
SUBMODULES = {path.stem for path in STORE.glob("*.py") if path.stem != "__init__"}


def sources() -> list[Path]:
    """Every module of skipinject/ outside the store, and every file of the plugins (their tests too)."""
    core = [path for path in (ROOT / "skipinject").rglob("*.py") if STORE not in path.parents]
    return sorted(core + list((ROOT / "plugins").glob("*/**/*.py")))


def store_module_imports(source: str) -> list[str]:
    """Each import of a module of ``skipinject.store`` in ``source`` (under ``TYPE_CHECKING`` too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("skipinject.store.")]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module.startswith("skipinject.store."):
                found.append(node.module)
            elif node.module == "skipinject.store":
                found += [f"skipinject.store.{a.name}" for a in node.names if a.name in SUBMODULES]
    return found


def test_the_check_finds_every_form_of_a_store_module_import() -> None:
    source = (
        "import skipinject.store.files\nfrom skipinject.store.format import META_NAME\n"
        "from skipinject.store import format, StepStore\n"
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from skipinject.store.meta import StepMeta\n"
    )
    assert store_module_imports(source) == [
        "skipinject.store.files",
        "skipinject.store.format",
        "skipinject.store.format",
        "skipinject.store.meta",
    ]
    assert store_module_imports("from skipinject.store import StepStore, META_NAME\n") == []


def test_outside_the_store_only_its_own_names_are_imported() -> None:
    found = [
        f"{path.relative_to(ROOT)}: {name}" for path in sources() for name in store_module_imports(path.read_text())
    ]
    assert found == [], "import these from skipinject.store (add the name to its lazy table): " + "; ".join(found)


def test_every_exported_name_resolves_lazily_from_its_own_module() -> None:
    for name, home in store_package._HOME.items():
        value = getattr(store_package, name)
        assert value is getattr(__import__(f"skipinject.store.{home}" if home != "payload" else "skipinject.payload",
                                           fromlist=[name]), name)  # fmt: skip
    with pytest.raises(AttributeError):
        store_package.nothing_of_that_name  # noqa: B018


# ---------------------------------------------------------------- removals and the miss explainer


def _step(dump: Path, step: int) -> StepStore:
    store = StepStore(dump / "e_p" / "GBS4_N2_in8_out8", "rollout", {"run": 1})
    store.save(step, Payload(tensors={}, objects={"value": step}, rows=1))
    return store


def test_prune_dry_run_counts_what_the_store_would_remove(tmp_path: Path, monkeypatch, capsys) -> None:
    store = _step(tmp_path / "dump", 1)
    asked: list[tuple[int, Any]] = []
    removal = StepStore.removal

    def counted(self: StepStore, step: int, only: Any = None) -> Any:
        asked.append((step, only))
        return removal(self, step, only)

    monkeypatch.setattr(StepStore, "removal", counted)
    assert main(["rm", str(store.step_dir(1)), "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert asked and {step for step, _ in asked} == {1}
    assert doc["files"] == len(removal(store, 1)) == 3  # meta.json, the tensors and the objects file
    assert store.step_numbers_on_disk() == [1]


def test_the_miss_explainer_lists_and_looks_through_the_store(tmp_path: Path, monkeypatch) -> None:
    from skipinject.report import misses

    _step(tmp_path / "dump", 3)
    context = {"experiment_name": "e", "project_name": "p", "gbs": 4, "n": 2, "prompt_length": 8}
    here = StepStore(tmp_path / "dump" / "e_p" / "GBS4_N2_in8_out16", "rollout", {**context, "response_length": 16})
    calls: list[str] = []
    for name in ("neighbours", "holds_step"):
        real = getattr(StepStore, name)
        monkeypatch.setattr(StepStore, name, lambda self, *a, _r=real, _n=name: calls.append(_n) or _r(self, *a))
    found = misses.nearest_cache(here, 3)
    assert found is not None and "GBS4_N2_in8_out8/3" in found and "data.max_response_length is 8 there" in found
    assert {"neighbours", "holds_step"} <= set(calls)
    tree = ast.parse(Path(misses.__file__).read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "backend"]


def test_the_cache_tool_listing_reads_each_meta_json_once(tmp_path: Path, monkeypatch) -> None:
    from skipinject.cache_tool.scan import scan
    from skipinject.store.local import LocalFiles

    for step in (1, 2):
        _step(tmp_path / "dump", step)
    reads: list[Path] = []
    real = LocalFiles.read_bytes

    def counted(self: LocalFiles, location: Path, limit: int) -> bytes:
        reads.append(location)
        return real(self, location, limit)

    monkeypatch.setattr(LocalFiles, "read_bytes", counted)
    items = scan(tmp_path / "dump")
    assert [(i.step, i.state, i.role) for i in items] == [(1, "complete", "rollout"), (2, "complete", "rollout")]
    assert sorted(p.parent.name for p in reads if p.name == "meta.json") == ["1", "2"]
