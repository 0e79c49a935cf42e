"""Every figure and version the README states is generated from the code or checked against it here:
the generated blocks (versions tested, ``--version``), the plugin API version, the verl range,
the quickstart's figures (the CPU harness's batch), the warnings it quotes, and every link of the
user documentation (README, docs/, examples/) down to its anchor."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from skipinject import API_VERSION
from tests import readme_sync
from tests.conftest import ROOT

README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*/README.md"))]
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def section(text: str, heading: str) -> str:
    """The text under ``heading`` (a whole heading line) up to the next heading of its level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    body = text.split(heading + "\n", 1)[1]
    end = re.search(rf"^#{{1,{level}}} ", body, re.M)
    return body[: end.start()] if end else body


@pytest.mark.parametrize("name", sorted(set(readme_sync.BLOCKS) - readme_sync.RUNS))
def test_each_generated_block_is_what_the_code_or_its_results_file_renders(name: str) -> None:
    """A figure on a page that is not its results file's (or a table the code no longer decides) fails here."""
    found = readme_sync.page_blocks()
    assert name in found, f"no page holds the generated block {name!r}"
    page, body = found[name]
    assert body == readme_sync.BLOCKS[name](), f"{page.name}'s {name} block drifted: run python tests/readme_sync.py"


def test_every_plugin_api_version_the_docs_state_is_the_current_one() -> None:
    current = f"{API_VERSION[0]}.{API_VERSION[1]}"
    stated = re.findall(r"plugin API (\d+\.\d+)", README.read_text())
    assert stated and set(stated) == {current}, stated
    guide = (ROOT / "docs" / "plugins.md").read_text()
    assert re.findall(r"\*\*plugin API, version (\d+\.\d+)\*\*", guide) == [current]


def test_the_verl_range_is_the_range_of_the_test_locks() -> None:
    from packaging.specifiers import SpecifierSet

    from skipinject.verl.stack import TESTED

    main, older = readme_sync.verl_versions()
    every = [main, *older]
    assert all(SpecifierSet(TESTED["verl"]).contains(v) for v in every)
    ranges = re.findall(r"verl (\d+\.\d+\.\d+)\N{EN DASH}(\d+\.\d+\.\d+)", README.read_text())
    assert ranges and set(ranges) == {(older[-1], main)}, ranges


def test_the_quickstarts_figures_are_the_cpu_harnesss() -> None:
    """The demo's output in the quickstart: layout, rows per step and sequences per run of the harness."""
    sys.path.insert(0, str(ROOT / "examples" / "verl_cpu"))
    try:
        import harness
    finally:
        sys.path.remove(str(ROOT / "examples" / "verl_cpu"))
    quickstart = section(README.read_text(), "## Quickstart")
    rows = harness.TRAIN_BATCH * harness.ROLLOUT_N
    steps = 2  # examples/verl_cpu/demo.py --steps, and the commands' steps=[1,2]
    assert "steps=[1,2]" in quickstart and '--steps", type=int, default=2' in (
        ROOT / "examples" / "verl_cpu" / "demo.py"
    ).read_text().replace("'", '"')
    layouts = set(re.findall(r"GBS\d+_N\d+_in\d+_out\d+", quickstart))
    assert layouts == {harness.cache_dir(Path("d")).name}, layouts
    assert set(re.findall(r"(\d+) sequences generated", quickstart)) == {str(steps * rows), "0"}
    assert set(re.findall(r"saved (\d+) (?:rows|trajectories)", quickstart)) == {str(rows)}
    assert set(re.findall(r"the step drew (\d+) prompts", quickstart)) == {str(harness.TRAIN_BATCH)}
    injected = re.findall(r"injected (\d+) cached trajectories \((\d+) prompts x n=(\d+)\)", quickstart)
    assert injected == [(str(rows), str(harness.TRAIN_BATCH), str(harness.ROLLOUT_N))]


def _source_texts() -> str:
    """Every string literal of skipinject and the built-in roles (adjacent literals joined; each
    f-string's literal pieces), one per line: what a warning the README quotes must be made of."""
    texts = []
    for path in [*(ROOT / "skipinject").rglob("*.py"), *(ROOT / "plugins").glob("*/skipinject_*/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.append(node.value)
    return "\n".join(texts)


#: For each warning row of the troubleshooting section, the pieces of its text that the code writes
#: as they are (the rest is values: role, step, path).
WARNINGS = {
    "cannot act": ["is enabled but cannot act in this run: ", "trainer.use_v1=True runs the V1 TransferQueue trainer"],
    "no target": ["is enabled but has no target for the installed verl "],
    "upstream": ["found verl's own cache ", " but did not load it: it is a pickle, which runs code "],
    "permissions": [
        "is writable by ",
        "(mode ",
        "no sticky bit",
        ": another user could plant or replace a cache there; not loaded or saved",
    ],
    "run directory": [".dump_dir=", " holds ", ", a cache layout: it is a run's directory", "; give skip."],
    "unusable": [": cache unusable, not loaded: ", "; running the target and ", "saving its result"],
    "mismatch": [": the cache served (step ", " was generated from ", "other inputs in "],
    "never called": [" was never called: ", " calls "],
    "strict": [": skip.", ".action=strict and ", "no cache at "],
    "cluster": ["the Ray cluster has ", " nodes, but the cache of ", " is on a node-local file system"],
    "untested": ["this environment has ", ": outside the versions skipinject is tested with ("],
}


def test_every_warning_the_troubleshooting_quotes_is_one_the_code_writes() -> None:
    troubleshooting = section(README.read_text(), "## Troubleshooting")
    table = troubleshooting.split("what it could not do is one line:", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == len(WARNINGS), "a warning row was added or removed: list its pieces in WARNINGS"
    sources = _source_texts()
    for row, (name, pieces) in zip(rows, WARNINGS.items(), strict=True):
        quoted = row.split("`")[1]
        for piece in pieces:
            assert piece in quoted, f"{name}: the README's line lacks {piece!r}: {quoted}"
            assert piece in sources, f"{name}: no code writes {piece!r} any more"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {_slug(m[1]) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_of_the_user_documentation_resolves(doc: Path) -> None:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        where = (doc.parent / file).resolve() if file else doc
        assert where.exists(), f"{doc.name}: link to {target}: no such file"
        if anchor:
            assert anchor in _anchors(where), f"{doc.name}: link to {target}: no such heading"


def test_the_python_and_json_schema_versions_are_the_packages() -> None:
    import tomllib

    from skipinject.cache_tool.common import SCHEMA_VERSION

    readme = README.read_text()
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.10" and "Python 3.10 or newer" in readme
    assert re.findall(r"skipinject\.cache\.<command>/(\d+)", readme) == [str(SCHEMA_VERSION)]


def test_the_readmes_rescore_section_names_every_value_and_leaves_figures_to_docs_rescore() -> None:
    """The table of ``rescore`` values and its cost figures live in docs/rescore.md (the figures rendered from
    the benchmark's results file); the README's section names each value and points there, quoting no figure."""
    from skipinject.config.schema import choices

    quoted = section(README.read_text(), "### A served step is scored by this run's reward (`skip.<role>.rescore`)")
    assert all(f"`{value}`" in quoted for value in choices("rescore")), quoted
    assert "(docs/rescore.md" in quoted
    assert not re.search(r"\d ms\b", quoted), "a figure belongs in docs/rescore.md's generated block"
    page = (ROOT / "docs" / "rescore.md").read_text()
    assert "| value | a served step whose recorded reward" in page


def test_the_runners_page_names_every_environment_variable_skipinject_reads_or_sets() -> None:
    from skipinject.config.environment import VARIABLES

    listed = section((ROOT / "docs" / "runner.md").read_text(), "## Environment variables")
    assert [name for name in VARIABLES if f"`{name}`" not in listed] == []


def test_the_plugin_guides_role_table_has_a_row_for_every_field_of_role() -> None:
    import dataclasses

    from skipinject import Role

    table = section((ROOT / "docs" / "plugins.md").read_text(), "## What a `Role` declares")
    rows = {
        name
        for line in table.splitlines()
        if line.startswith("| `")
        for name in re.findall(r"`(\w+)`", line.split(" | ")[0])
    }
    assert [f.name for f in dataclasses.fields(Role) if f.name not in rows] == []
