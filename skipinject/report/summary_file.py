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
    if _through_proc(path):  # a descriptor's file (/dev/stdout -> /proc/self/fd/1 -> the run's log): kept
        _append(path, text)
        return None
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


def _through_proc(path: Path) -> bool:
    """``path`` or a link on the way to its file is under ``/proc`` (``/dev/stdout`` -> ``/proc/self/fd/1``):
    a descriptor's file, which may be deleted, or be the run's own redirected output."""
    current = Path(os.path.abspath(path))
    for _ in range(40):  # the kernel's own bound on links followed
        current = Path(os.path.realpath(current.parent)) / current.name  # its directories' links (/dev/fd) too
        if current.parts[1:2] == ("proc",):
            return True
        if not current.is_symlink():
            return False
        current = Path(os.path.abspath(current.parent / os.readlink(current)))
    return True


def _append(path: Path, text: str) -> None:
    """Write ``text`` at the end of the regular file ``path`` opens (never truncated, never replaced): the
    file an open descriptor writes to, such as the run's own redirected output."""
    handle = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            raise OSError(0, "it is not a regular file")
        data = (text if text.endswith("\n") else text + "\n").encode()
        while data:
            data = data[os.write(handle, data) :]
    finally:
        os.close(handle)
