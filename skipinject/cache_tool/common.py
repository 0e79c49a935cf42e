"""What every command shares: exit statuses, the one-line usage error, and how a path is selected."""

from __future__ import annotations

from pathlib import Path

from skipinject.cache_tool.scan import Item, scan
from skipinject.store import StepStore
from skipinject.store.files import unresolved_problem

OK, FOUND, USAGE = 0, 1, 2


class CommandError(Exception):
    """A one-line error for the user (bad path, bad option); exit status 2."""


def existing_dir(path: Path) -> Path:
    if not path.exists():
        raise CommandError(f"{path}: no such directory")
    if not path.is_dir():
        raise CommandError(f"{path}: not a directory")
    return path


def mutable_root(path: Path, command: str) -> Path:
    """``path`` as given, for a command that removes or rewrites files under it: refused (one line,
    exit 2) when another user could redirect it (their link in it, or a parent they can write
    without the sticky bit), as a run refuses such a ``dump_dir``; the check runs before the path is
    resolved, which is where a swapped link would lead the removal."""
    problem = unresolved_problem(path)
    if problem is not None:
        raise CommandError(
            f"{problem}: another user could redirect `cache {command}`; nothing changed. "
            "Give a path only you control (e.g. the resolved directory, if you trust it)"
        )
    return existing_dir(path)


def writer_text(writer: dict[str, str]) -> str:
    parts = [f"{name} {writer[name]}" for name in ("skipinject", "verl", "torch") if name in writer]
    return ", ".join(parts) or "-"


def scan_any(root: Path | str, problems: list[str]) -> list[Item]:
    """Items of a local directory (which must exist) or of a remote store's URL."""
    if isinstance(root, str):
        from skipinject.cache_tool.remote import scan_remote

        return scan_remote(root, problems)
    existing_dir(root)
    return scan(root, problems)


def item_store(item: Item, root: Path | None = None) -> StepStore:
    """The store holding ``item``'s step (local, or the object store of its URL), for upkeep that
    needs no role context (its usage record, its files, its removal): ``root`` anchors local removals."""
    if isinstance(item.path, Path):
        return StepStore(item.path.parent, item.role, {}, dump_dir=root)
    from skipinject.store.remote import FsspecFiles, open_remote

    return StepStore(item.path.parent, item.role, {}, backend=FsspecFiles(open_remote(str(item.path))[0]))
