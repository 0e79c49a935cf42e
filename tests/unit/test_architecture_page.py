"""docs/architecture.md draws the layers ``tests/unit/test_import_graph.py`` checks, in the same order, and
gives every module of skipinject (each top-level module and package, each module of the engine and the
store) its place, so the page cannot fall behind the code it describes."""

from __future__ import annotations

import re

from tests.conftest import ROOT
from tests.unit.test_import_graph import LAYERS

PAGE = (ROOT / "docs" / "architecture.md").read_text()
DRAWING = PAGE.split("```")[1]


def test_the_drawing_has_the_layers_of_the_import_test_in_their_order() -> None:
    labels = [re.sub(r" \(.*", "", name) for name, _ in LAYERS]
    starts = [line.strip().split("  ")[0] for line in DRAWING.splitlines() if line[1:2].strip()]
    drawn = [label for label in starts if not label.startswith(("(", "│", "▼"))]
    assert drawn == labels, f"docs/architecture.md draws {drawn}; test_import_graph.LAYERS is {labels}"


def test_every_module_of_a_layer_is_on_the_page() -> None:
    for _, members in LAYERS:
        for member in members:
            path = member.lstrip("=").removeprefix("skipinject").lstrip(".").replace(".", "/")
            if path:
                assert f"{path}.py" in PAGE or f"{path}/" in PAGE, f"{member} has no place in docs/architecture.md"


def test_every_module_of_the_package_the_engine_and_the_store_is_on_the_page() -> None:
    package = ROOT / "skipinject"
    names = [p.name + "/" for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    names += [p.name for p in package.glob("*.py")]
    names += [p.name for folder in ("engine", "store") for p in (package / folder).glob("*.py")]
    missing = sorted(name for name in names if name not in PAGE)
    assert missing == [], f"not on docs/architecture.md: {missing}"
