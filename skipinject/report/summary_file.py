"""``SKIPINJECT_SUMMARY``'s file: named at the command's start, written at the run's end to what the path
names (through a link to its target), never replacing a link, a device, a FIFO or a directory."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from skipinject.config.environment import ENV_SUMMARY
from skipinject.dump_root import anchored

#: What a file that is no regular file is, in the refusal's words.
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def summary_target() -> str | None:
    """``SKIPINJECT_SUMMARY`` as the command meant it: a relative path joined to the directory the command
    starts in (as ``dump_dir`` is), not to wherever the program moves later (Hydra's ``chdir``)."""
    raw = os.environ.get(ENV_SUMMARY)
    return anchored(raw) if raw else None


def refusal(path: Path) -> str | None:
    """Why the summary is not written at ``path`` (what it names, links followed, is no regular file), else
    ``None`` (a regular file, or nothing yet)."""
    try:
        link = path.lstat()
        if stat.S_ISLNK(link.st_mode) and link.st_uid not in (os.geteuid(), 0):
            return f"it is a symbolic link of another user (uid {link.st_uid}): the summary is not written through it"
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "no regular file")
    return f"it is {kind}, not a regular file: the summary is not written there"


def write_summary(target: str, text: str) -> str | None:
    """Write ``text`` whole to the regular file ``target`` names: a link's target is replaced (the link
    kept); a directory, device, FIFO or socket is left alone. Why it was not written, else ``None``;
    raises :class:`OSError` when writing fails (nothing is left beside the target)."""
    path = Path(target).expanduser()
    why = refusal(path)
    if why is not None:
        return why
    real = Path(os.path.realpath(path))  # through links, to the file they name
    fd, name = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        again = refusal(real)  # swapped for something else meanwhile: still never replaced
        if again is None and real.is_symlink():
            again = "it became a link while the summary was written: the summary is not written there"
        if again is not None:
            os.unlink(name)
            return again
        os.replace(name, real)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise
    return None
