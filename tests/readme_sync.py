"""The generated blocks of the README and docs/: versions tested, ``--version``, the cache commands, and
every figure, rendered from the results file a script wrote (``benchmarks/results/*.json``,
``tests/reliability/results.json``, ``tests/verl_matrix/results.json``).

Each block sits between ``<!-- begin generated: NAME -->`` and ``<!-- end generated: NAME -->`` and is
rendered from the code or results file that decides it, so no page can drift from it:
``tests/unit/test_readme_facts.py`` fails when a block differs, and ``python tests/readme_sync.py``
rewrites them.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: The pages whose generated blocks are rendered: the README and docs/.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(
    r"(<!-- begin generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated: (?P=name) -->)", re.S
)


def pinned(lock: Path) -> dict[str, str]:
    """``name==version`` lines of a pip lock file, by name."""
    pins = {}
    for line in lock.read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            pins[name.strip().lower()] = version.strip()
    return pins


def verl_versions() -> tuple[str, list[str]]:
    """The verl of the main lock (every test runs on it) and those of the older verls' locks, newest first."""
    from packaging.version import Version

    main = pinned(ROOT / "requirements" / "lock.txt")["verl"]
    older = [pinned(lock)["verl"] for lock in (ROOT / "requirements").glob("verl-*.txt")]
    return main, sorted(older, key=Version, reverse=True)


def tested_table() -> str:
    """The stack skipinject is tested with: the ranges the runner checks at start and where each verl is
    proven (``skipinject.verl.stack``), and the versions pinned in the lock the tests run in."""
    from skipinject.verl.stack import TESTED, VERL_IN_CI, VERL_ON_DEMAND, VERL_READ_FROM_CODE

    main, older = verl_versions()
    assert {main, *older} == {*VERL_IN_CI, *VERL_ON_DEMAND}, "requirements/ and skipinject.verl.stack disagree"
    in_ci = [v for v in older if v in VERL_IN_CI]
    lock = pinned(ROOT / "requirements" / "lock.txt")
    lines = ["| package | range checked at start | versions the tests run |", "|---|---|---|"]
    for name, spec in TESTED.items():
        if name == "verl":
            runs = (
                f"{main}: every test (CI); {', '.join(in_ci)}: one pair in CI, on the project's DAPO test trainer; "
                f"{', '.join(v for v in older if v in VERL_ON_DEMAND)}: on demand"
                + (f"; {', '.join(VERL_READ_FROM_CODE)}: read from code" if VERL_READ_FROM_CODE else "")
                + " ([details](docs/verl-versions.md#version-table))"
            )
        else:
            runs = lock[name]
        lines.append(f"| {name} | `{spec}` | {runs} |")
    return "\n".join(lines) + "\n"


def _pair_trainer(pair: Any) -> str:
    """What a matrix pair runs, in a few words."""
    if pair.variant == "dapo":
        return "the project's DAPO test trainer (`tests/fixtures/recipes/dapo_recipe_wg.py`), not `main_ppo`"
    trainer = "`main_ppo` REMAX" if pair.variant == "remax" else "`main_ppo` GRPO"
    path = "worker group" if pair.sync else "agent loop"
    return f"{trainer}, {path}"


def _last_run(record: dict[str, Any] | None) -> str:
    if record is None:
        return "no run recorded yet"
    return (
        f"last run {record['date'][:10]} at {record['commit']}: {record['outcome']} "
        f"({record['tests']} tests, {record['seconds']} s)"
    )


def verl_proof() -> str:
    """Per verl version, which pairs of real runs CI runs, which run on demand (with their last run, from
    ``tests/verl_matrix/results.json``, which the matrix tests write), and which are only read from code."""
    from packaging.version import Version

    from skipinject.verl.stack import VERL_IN_CI, VERL_ON_DEMAND, VERL_READ_FROM_CODE
    from tests.verl_matrix import ledger
    from tests.verl_matrix.pairs import CALL_PAIRS, DEFAULT_VERSIONS, PAIRS, VERL_BUGS, is_chosen

    main, _ = verl_versions()
    runs = ledger.load()
    lines = [
        "| verl | in CI (`make test`) | on demand (`SKIPINJECT_VERL_MATRIX=<pair>`) | read from code only |",
        "|---|---|---|---|",
    ]
    for version in sorted({*VERL_IN_CI, *VERL_ON_DEMAND, *VERL_READ_FROM_CODE}, key=Version, reverse=True):
        if version in VERL_READ_FROM_CODE:
            lines.append(
                f"| {version} | -- | -- | the roles whose targets' verl ranges include it, as on {main} "
                f"(`python -m skipinject --list` on a {version} install shows which resolve) |"
            )
            continue
        if version == main:
            lines.append(f"| {version} | every test: unit, integration, every end-to-end run | -- | -- |")
            continue
        in_ci, on_demand = [], []
        for pair in (*PAIRS, *CALL_PAIRS):
            if pair.version != version:
                continue
            if pair.id in VERL_BUGS:
                on_demand.append(f"`{pair.id}`: stopped by a verl bug, skipped")
                continue
            entry = f"`{pair.id}` ({_pair_trainer(pair)}; {_last_run(runs.get(pair.id))})"
            (in_ci if is_chosen(pair, DEFAULT_VERSIONS) else on_demand).append(entry)
        lines.append(f"| {version} | {'; '.join(in_ci) or '--'} | {'; '.join(on_demand) or '--'} | -- |")
    return "\n".join(lines) + "\n"


def versions_block() -> str:
    """What ``python -m skipinject --version`` prints in this environment (the lock's)."""
    from skipinject.listing import render_versions

    return "```\n$ python -m skipinject --version\n" + render_versions() + "```\n"


def cache_commands() -> str:
    """Every ``skipinject cache`` command: its usage (as ``--help`` prints it, unwrapped) and what it does."""
    import argparse

    from skipinject.cache_tool import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines = ["```"]
    for choice in commands._choices_actions:
        command = commands.choices[choice.dest]
        formatter = argparse.HelpFormatter(prog=f"skipinject cache {choice.dest}", width=10_000)
        formatter.add_usage(command.usage, command._actions, command._mutually_exclusive_groups, prefix="")
        usage = formatter.format_help().strip().replace(" [-h]", "")
        lines += [usage, f"    {choice.help}"]
    return "\n".join([*lines, "```"]) + "\n"


TOY_CACHE = "examples/toy/cache"


def cache_listing(dump: Path) -> str:
    """``skipinject cache ls`` of the toy example's cache at ``dump``, shown as if it were in ``TOY_CACHE``."""
    import subprocess

    listed = subprocess.run(
        [sys.executable, "-m", "skipinject", "cache", "ls", str(dump)], capture_output=True, text=True, check=True
    )
    return (
        f"```\n$ make example        # the toy trainer, twice: its cache stays in {TOY_CACHE}\n"
        f"$ .venv/bin/skipinject cache ls {TOY_CACHE}   # make setup's console script (or activate .venv)\n"
        + listed.stdout.replace(str(dump), TOY_CACHE)
        + "```\n"
    )


def toy_cache_listing() -> str:
    """Run the toy example into a fresh directory and list its cache (about 20 s)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        dump = Path(scratch) / "cache"
        example = ROOT / "examples" / "toy" / "run_example.py"
        subprocess.run([sys.executable, str(example), "--dump-dir", str(dump)], capture_output=True, check=True)
        return cache_listing(dump)


def comparable(listing: str) -> str:
    """A listing without what changes from run to run: creation times, sizes and the columns' widths."""
    time = r"\d{4}-\d\d-\d\d \d\d:\d\d"
    listing = re.sub(rf"{time}( \.\. (\d{{4}}-\d\d-\d\d )?\d\d:\d\d)?", "TIME", listing)  # a span: saves a minute apart
    listing = re.sub(r"\d+(\.\d+)? (B|KiB|MiB|GiB)\b", "SIZE", listing)
    return re.sub(r"[ \t]+", " ", listing)


def reliability_headline() -> str:
    from tests.reliability import report

    return report.headline(report.load_results())


def reliability_tables() -> str:
    from tests.reliability import report

    return report.tables(report.load_results())


def _benchmark(name: str) -> Callable[[], str]:
    """The renderer of a benchmark's block (``benchmarks/render.py``), imported when rendered."""

    def render_block() -> str:
        from benchmarks import render

        block: Callable[[], str] = getattr(render, name)
        return block()

    return render_block


BLOCKS: dict[str, Callable[[], str]] = {
    "tested": tested_table,
    "versions": versions_block,
    "cache-commands": cache_commands,
    "cache-ls": toy_cache_listing,  # checked by tests/unit/test_example.py, which runs the toy example anyway
    "verl-proof": verl_proof,
    "reliability-headline": reliability_headline,
    "reliability-tables": reliability_tables,
    **{
        f"bench-{name.replace('_', '-')}": _benchmark(name)
        for name in (
            "store",
            "store_hits",
            "store_zstd_hits",
            "store_v1_hit",
            "remote",
            "passthrough",
            "repeat",
            "match_index",
            "rescore",
            "startup",
            "scaling",
            "pagecache",
            "compression",
            "first_run",
        )
    },
}


def blocks(text: str) -> dict[str, str]:
    """The generated blocks of a document as it is, by name."""
    return {m["name"]: m["body"] for m in _BLOCK.finditer(text)}


#: Blocks left as they were by the last ``render`` because their results file is missing.
UNRENDERED: list[str] = []

#: Blocks that show a run: rendered anew only when more than times and sizes changed.
RUNS = {"cache-ls"}


def render(text: str) -> str:
    """``text`` with every generated block rendered anew."""

    def block(match: re.Match[str]) -> str:
        name, old = match["name"], match["body"]
        try:
            new = BLOCKS[name]()
        except FileNotFoundError as missing:
            print(f"block {name}: no results file ({missing.filename}); left as it is", file=sys.stderr)
            UNRENDERED.append(name)
            return match[0]
        if name in RUNS and comparable(new) == comparable(old):
            new = old
        return match[1] + new + match[4]

    return _BLOCK.sub(block, text)


def page_blocks() -> dict[str, tuple[Path, str]]:
    """Every generated block of every page, by name: the page it is on and its body as it is."""
    found: dict[str, tuple[Path, str]] = {}
    for page in PAGES:
        for name, body in blocks(page.read_text()).items():
            if name in found:
                raise ValueError(f"generated block {name!r} is on both {found[name][0].name} and {page.name}")
            found[name] = (page, body)
    return found


def main() -> int:
    missing = set(BLOCKS) - set(page_blocks())
    if missing:
        print(f"no page holds the generated block(s) {', '.join(sorted(missing))}", file=sys.stderr)
        return 1
    for page in PAGES:
        text = page.read_text()
        rendered = render(text)
        if rendered != text:
            page.write_text(rendered)
            print(f"{page.relative_to(ROOT)}: generated blocks rewritten")
    return 1 if UNRENDERED else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
