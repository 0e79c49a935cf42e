"""``verify``: every byte of every step checked by the training run's own reader; exit 1 on damage."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from skipinject.cache_tool.common import FOUND, OK, scan_any
from skipinject.cache_tool.plugins import InstalledRoles
from skipinject.cache_tool.progress import Progress
from skipinject.cache_tool.render import emit_json, human_size, say, schema
from skipinject.cache_tool.scan import Item, ItemRecord, open_step, precheck
from skipinject.errors import CorruptCacheError
from skipinject.store.files import read_head, regular_stat


class CheckedRecord(ItemRecord):
    status: str
    plugin: str | None
    notes: list[str]


@dataclass
class Checked:
    item: Item
    status: str  # ok | damaged | partial | foreign | untrusted
    problems: list[str]
    notes: list[str] = field(default_factory=list)
    plugin: str | None = None  # the installed plugin providing the step's role

    def record(self) -> CheckedRecord:
        return {
            **self.item.record(),
            "status": self.status,
            "problems": self.problems,
            "plugin": self.plugin,
            "notes": self.notes,
        }


def cmd_verify(paths: Sequence[Path | str], *, as_json: bool) -> int:
    items: list[Item] = []
    unreadable: list[str] = []
    for path in paths:
        items += scan_any(path, unreadable)  # select
    total = sum(i.size for i in items if i.state == "complete")
    results = []
    roles = InstalledRoles()
    with Progress(total, "verify") as bar:
        for item in items:
            results.append(verify_item(item, roles))  # act
            bar.update(item.size if item.state == "complete" else 0, f"{item.role} {item.step}")
    damaged = [r for r in results if r.status == "damaged"]
    if as_json:
        emit_json(
            {
                "schema": schema("verify"),
                "ok": not damaged and not unreadable,
                "checked": len(results),
                "bytes": total,
                "steps": [r.record() for r in results],
                "problems": unreadable,
            }
        )
    else:
        render(results, unreadable, total)
    return FOUND if damaged or unreadable else OK


# ---------------------------------------------------------------- act

_PICKLE_MAGIC = (b"\x80", b"PK\x03\x04")  # pickle protocol >= 2; torch.save's zip archive


def verify_item(item: Item, roles: InstalledRoles | None = None) -> Checked:
    """Full check of one item: sizes, checksums, tensor index and JSON tree (skipinject's format);
    presence, size and file magic only for verl's pickles (loading them would run code).

    ``roles``: the installed plugins; a step of a role none of them provides is verified all the
    same, with a note naming the plugin that would show it."""
    checked = _verify_item(item)
    if roles is not None and checked.status == "ok" and item.meta is not None:
        checked.plugin = roles.plugin_of(item.role)
        note = roles.missing(item.role, item.meta)
        if note is not None:
            checked.notes.append(f"{item.path}: {note}")
    return checked


def _verify_item(item: Item) -> Checked:
    if item.state == "damaged":
        return Checked(item, "damaged", list(item.problems))
    if item.state in ("partial", "untrusted"):
        return Checked(item, item.state, list(item.problems))
    if item.state == "foreign" and isinstance(item.path, Path):
        return _verify_foreign(item)
    problems = damage(item)
    return Checked(item, "damaged" if problems else "ok", problems)


def damage(item: Item) -> list[str]:
    """What is wrong with a committed step's bytes (``[]``: intact), by the store's own check of every
    byte (:meth:`~skipinject.store.StepStore.check`): the one question ``verify`` and ``prune --damaged``
    ask, so they never disagree. No codec is needed, so every role's steps are checked alike."""
    try:
        if isinstance(item.path, Path):
            store, meta = open_step(item.path)
            precheck(store, int(item.path.name), meta)
        else:  # a step in a remote store
            from skipinject.cache_tool.remote import open_remote_step
            from skipinject.store.remote import open_remote

            store, _ = open_remote_step(open_remote(str(item.path))[0], item.path)
        store.check(int(item.path.name))
    except (CorruptCacheError, OSError) as exc:
        return [str(exc)]
    except Exception as exc:
        return [f"{item.path}: {type(exc).__name__}: {exc}"]
    return []


def _verify_foreign(item: Item) -> Checked:
    problems = []
    for path in item.files:
        try:
            head = read_head(path, 8)
        except OSError as exc:
            problems.append(f"{path}: cannot read it ({exc})")
            continue
        if not head.startswith(_PICKLE_MAGIC):
            problems.append(f"{path}: not a pickle or torch.save file (damaged?)")
    for name in item.upstream.format.required if item.upstream is not None else ():
        if regular_stat(item.path / name) is None:
            problems.append(f"{item.path}: verl's {name} is missing; verl itself will not load this step")
    return Checked(item, "damaged" if problems else "foreign", problems)


# ---------------------------------------------------------------- render


def render(results: Sequence[Checked], unreadable: Sequence[str], total: int) -> None:
    for result in results:
        if result.status in ("damaged", "partial", "untrusted"):
            for problem in result.problems or ["(no detail)"]:
                say(f"{result.status.upper()}: {problem}")
    for problem in unreadable:
        say(f"UNREADABLE: {problem}")
    for result in results:
        for note in result.notes:
            say(f"NOTE: {note}")
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "damaged", "partial", "foreign", "untrusted")}
    foreign = (
        f", {counts['foreign']} foreign (verl's pickles, not loaded: `skipinject cache import --trust` converts)"
        if counts["foreign"]
        else ""
    )
    say(
        f"verified {len(results)} step(s), {human_size(total)}: {counts['ok']} ok, {counts['damaged']} damaged, "
        f"{counts['partial']} partial{foreign}"
        + (f", {counts['untrusted']} untrusted (in directories other users control)" if counts["untrusted"] else "")
    )
