"""What every command shares: exit statuses, the one-line usage error, and how a path is selected."""

from __future__ import annotations

from pathlib import Path

from skipinject.cache_tool.scan import Item, scan

OK, FOUND, USAGE = 0, 1, 2


class CommandError(Exception):
    """A one-line error for the user (bad path, bad option); exit status 2."""


def existing_dir(path: Path) -> Path:
    if not path.exists():
        raise CommandError(f"{path}: no such directory")
    if not path.is_dir():
        raise CommandError(f"{path}: not a directory")
    return path


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
