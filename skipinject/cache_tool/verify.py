"""``verify``: every byte of every step checked by the training run's own reader; exit 1 on damage."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skipinject.cache_tool.common import FOUND, OK, CommandError, Progress, default_dump_dir, human_size, output, say
from skipinject.cache_tool.plugins import InstalledRoles
from skipinject.cache_tool.scan import Item, scan
from skipinject.errors import CorruptCacheError
from skipinject.store import StepStore, read_head

_PICKLE_MAGIC = (b"\x80", b"PK\x03\x04")  # pickle protocol >= 2; torch.save's zip archive


@dataclass
class Checked:
    item: Item
    status: str  # ok | damaged | partial | foreign | untrusted
    problems: list[str]
    notes: list[str] = field(default_factory=list)
    plugin: str | None = None  # the installed plugin providing the step's role

    def record(self) -> dict[str, Any]:
        extra = {"status": self.status, "problems": self.problems, "plugin": self.plugin, "notes": self.notes}
        return {**self.item.record(), **extra}


def cmd_verify(paths: Sequence[Path | str], *, as_json: bool) -> int:
    items: list[Item] = []
    unreadable: list[str] = []
    for path in paths or [default_dump_dir()]:
        before = len(unreadable)
        found = scan(path, unreadable)
        if not found and len(unreadable) == before:  # a wrong path must not look like a pass
            raise CommandError(f"{path}: no cache found there (no step of skipinject or verl below it)")
        items += found
    total = sum(i.size for i in items if i.state == "complete")
    results = []
    roles = InstalledRoles()
    with Progress(total, "verify") as bar:
        for item in items:
            results.append(verify_item(item, roles))
            bar.update(item.size if item.state == "complete" else 0, f"{item.role} {item.step}")
    damaged = [r for r in results if r.status == "damaged"]
    counts = {"ok": not damaged and not unreadable, "checked": len(results), "bytes": total}
    document = {**counts, "steps": [r.record() for r in results], "problems": unreadable}
    output("verify", as_json, document, lambda: render(results, unreadable, total))
    return FOUND if damaged or unreadable else OK


def verify_item(item: Item, roles: InstalledRoles | None = None) -> Checked:
    """Every byte of skipinject's steps (``roles``: a note where no installed plugin provides the role);
    presence, size and file magic only of verl's pickles (loading them would run code)."""
    if item.state in ("damaged", "partial", "untrusted"):
        return Checked(item, item.state, list(item.problems))
    if item.state == "foreign":
        problems = []
        for path in item.files:
            try:
                if not read_head(path, 8).startswith(_PICKLE_MAGIC):
                    problems.append(f"{path}: not a pickle or torch.save file (damaged?)")
            except OSError as exc:
                problems.append(f"{path}: cannot read it ({exc})")
        backend = item.backend
        for name in item.upstream.format.required if item.upstream is not None else ():
            if getattr(backend.stat(item.path / name), "kind", None) != "file":
                problems.append(f"{item.path}: verl's {name} is missing; verl itself will not load this step")
        return Checked(item, "damaged" if problems else "foreign", problems)
    problems = damage(item)
    if problems or roles is None or item.meta is None:
        return Checked(item, "damaged" if problems else "ok", problems)
    note = roles.missing(item.role, item.meta)
    return Checked(item, "ok", [], [] if note is None else [f"{item.path}: {note}"], roles.plugin_of(item.role))


def damage(item: Item) -> list[str]:
    """What is wrong with a committed step's bytes (``[]``: intact) by :meth:`~skipinject.store.StepStore.check`:
    the one question ``verify`` and ``prune --damaged`` ask, so they never disagree. It needs no codec."""
    try:
        store, meta = StepStore.at(item.path, item.backend)
        store.precheck(int(item.path.name), meta)
        store.check(int(item.path.name))
    except (CorruptCacheError, OSError) as exc:
        return [str(exc)]
    except Exception as exc:
        return [f"{item.path}: {type(exc).__name__}: {exc}"]
    return []


def render(results: Sequence[Checked], unreadable: Sequence[str], total: int) -> None:
    for result in (r for r in results if r.status in ("damaged", "partial", "untrusted")):
        for problem in result.problems or ["(no detail)"]:
            say(f"{result.status.upper()}: {problem}")
    for problem in unreadable:
        say(f"UNREADABLE: {problem}")
    for note in (note for result in results for note in result.notes):
        say(f"NOTE: {note}")
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "damaged", "partial", "foreign", "untrusted")}
    foreign = f", {counts['foreign']} foreign (verl's pickles, not loaded: `skipinject cache import --trust` converts)"
    untrusted = f", {counts['untrusted']} untrusted (in directories other users control)"
    say(
        f"verified {len(results)} step(s), {human_size(total)}: {counts['ok']} ok, {counts['damaged']} damaged, "
        f"{counts['partial']} partial{foreign if counts['foreign'] else ''}{untrusted if counts['untrusted'] else ''}"
    )
