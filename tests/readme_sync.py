"""The README's generated blocks: the versions tested and the ``--version`` output.

Each block sits between ``<!-- begin generated: NAME -->`` and ``<!-- end generated: NAME -->`` and is
rendered from the code that decides it, so the README cannot drift from it:
``tests/unit/test_readme_facts.py`` fails when a block differs, and ``python tests/readme_sync.py``
rewrites them.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
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
    """The stack skipinject is tested with: the ranges the runner checks at start and the verls each test
    run covers (``skipinject.verl.stack``), and the versions pinned in the lock the tests run in."""
    from skipinject.verl.stack import TESTED, VERL_IN_CI, VERL_ON_DEMAND

    main, older = verl_versions()
    assert {main, *older} == {*VERL_IN_CI, *VERL_ON_DEMAND}, "requirements/ and skipinject.verl.stack disagree"
    in_ci = [v for v in older if v in VERL_IN_CI]
    lock = pinned(ROOT / "requirements" / "lock.txt")
    lines = ["| package | range checked at start | versions the tests run |", "|---|---|---|"]
    for name, spec in TESTED.items():
        if name == "verl":
            runs = (
                f"{main} (every test); {', '.join(in_ci)} (real trainer runs in every `make test`); "
                f"{', '.join(v for v in older if v in VERL_ON_DEMAND)} (the same runs, on demand: "
                "[docs/verl-versions.md](docs/verl-versions.md))"
            )
        else:
            runs = lock[name]
        lines.append(f"| {name} | `{spec}` | {runs} |")
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


BLOCKS: dict[str, Callable[[], str]] = {
    "tested": tested_table,
    "versions": versions_block,
    "cache-commands": cache_commands,
    "cache-ls": toy_cache_listing,  # checked by tests/unit/test_example.py, which runs the toy example anyway
}


def blocks(text: str) -> dict[str, str]:
    """The generated blocks of a document as it is, by name."""
    return {m["name"]: m["body"] for m in _BLOCK.finditer(text)}


#: Blocks that show a run: rendered anew only when more than times and sizes changed.
RUNS = {"cache-ls"}


def render(text: str) -> str:
    """``text`` with every generated block rendered anew."""

    def block(match: re.Match[str]) -> str:
        name, old = match["name"], match["body"]
        new = BLOCKS[name]()
        if name in RUNS and comparable(new) == comparable(old):
            new = old
        return match[1] + new + match[4]

    return _BLOCK.sub(block, text)


def main() -> int:
    text = README.read_text()
    missing = set(BLOCKS) - set(blocks(text))
    if missing:
        print(f"README.md lacks the generated block(s) {', '.join(sorted(missing))}", file=sys.stderr)
        return 1
    rendered = render(text)
    if rendered != text:
        README.write_text(rendered)
        print("README.md: generated blocks rewritten")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
