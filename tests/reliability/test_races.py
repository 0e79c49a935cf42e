"""Removal through links and races: another user of a shared (1777) dump directory swaps a step for a
symbolic link to a victim's private step between a remover's check and its removal.

The other user is a forked child under another uid (``os.setuid``; tests run as root, otherwise
they skip). The race is made deterministic: the swap happens right after the remover's own check
(``cache prune``'s ``_unsafe``, garbage collection's scan), or right before its first unlink. The
victim's files must stay byte-identical; every file the remover took from them counts as lost.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skipinject.cache_tool import prune as commands
from skipinject.store import StepStore, garbage
from tests.reliability import helpers as h

OTHER_UID = 65534
LAYOUT = ("exp_proj", "GBS4_N2_in8_out8")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (os.setuid)")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A base directory others can traverse, holding ``shared/`` (1777, like /tmp) and ``victim/``."""
    base = Path(tempfile.mkdtemp(prefix="si-race-"))
    os.chmod(base, 0o755)
    (base / "shared").mkdir()
    os.chmod(base / "shared", 0o1777)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def as_other_user(action: Any) -> None:
    """Run ``action()`` in a forked child under another uid; fails the test if the child failed."""
    pid = os.fork()
    if pid == 0:  # the child: another user of the machine
        code = 1
        try:
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            action()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the other user's swap failed"


def swap_for_link(step_dir: Path, target: Path) -> None:
    def swap() -> None:
        os.rename(step_dir, step_dir.with_name(step_dir.name + ".moved"))
        os.symlink(target, step_dir)

    as_other_user(swap)


def chown_tree(root: Path, uid: int) -> None:
    for path in [root, *root.rglob("*")]:
        os.lchown(path, uid, uid)


def _write_id(age: float) -> str:
    return f"{int(time.time() - age)}-{DEAD_PID}-deadbeef"


OLD = garbage.ABANDONED_AFTER + 3600
#: No process has this pid (above the kernel's pid_max default).
DEAD_PID = 4_999_999


def _plant(folder: Path, names: list[str], data: bytes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.time() - OLD
    for name in names:
        (folder / name).write_bytes(data)
        os.utime(folder / name, (stamp, stamp))


def step_files() -> list[str]:
    wid = _write_id(OLD)
    return [f"tensors-{wid}.bin", f"objects-{wid}.json"]


def victim_step(base: Path, step: int, names: list[str]) -> tuple[Path, dict[Path, bytes]]:
    """The victim's private step elsewhere (root's, mode 0700): a complete step, plus files under the
    names the other user's step uses (what a removal through a link would take)."""
    store = StepStore(base / "victim" / "proj", "toy", h.CONTEXT)
    store.save(step, h.plain_payload(256, 7.0))
    _plant(store.step_dir(step), names, b"the victim's data")
    return store.step_dir(step), {p: p.read_bytes() for p in h.regular_files(store.step_dir(step))}


def attacker_step(base: Path, step: int, names: list[str]) -> Path:
    """The other user's step in the shared dump directory: an interrupted save (data files, no
    meta.json), abandoned long ago, which ``prune --partial`` removes; owned by them."""
    step_dir = base / "shared" / Path(*LAYOUT) / str(step)
    _plant(step_dir, names, b"the other user's leftover")
    chown_tree(base / "shared" / LAYOUT[0], OTHER_UID)
    return step_dir


def prune_partial(base: Path) -> None:
    commands.cmd_prune(
        base / "shared", keep_last=None, older_than=None, partial=True, damaged=False, dry_run=False, as_json=True
    )


def taken(before: dict[Path, bytes]) -> int:
    return sum(1 for p, data in before.items() if not p.is_file() or p.read_bytes() != data)


def test_prune_does_not_remove_through_a_step_swapped_after_its_check(
    shared: Path, monkeypatch: pytest.MonkeyPatch, ledger: Any
) -> None:
    names = step_files()
    victim, before = victim_step(shared, 3, names)
    step_dir = attacker_step(shared, 3, names)
    checked = commands._unsafe
    seen: list[bool] = []

    def check_then_swap(item: Any, root_real: Path, now: float) -> str | None:
        problem = checked(item, root_real, now)
        if item.path == step_dir and problem is None:
            seen.append(True)
            swap_for_link(step_dir, victim)
        return problem

    monkeypatch.setattr(commands, "_unsafe", check_then_swap)
    prune_partial(shared)
    lost = taken(before) + int(not seen)
    ledger("cache tool", "cache prune --partial: another uid swaps its abandoned step in the shared 1777 dump "
           "dir for a link to a victim's step right after prune's check", 1,
           f"victim's files removed or changed: {lost} of {len(before)}", lost)  # fmt: skip
    assert lost == 0


def test_prune_does_not_remove_through_a_step_swapped_before_its_first_unlink(
    shared: Path, monkeypatch: pytest.MonkeyPatch, ledger: Any
) -> None:
    """Once the step is open, a swap of its name cannot redirect the removal: the opened directory
    is the one that was checked (its own files go, the victim's stay)."""
    from skipinject.store import files as removal

    names = step_files()
    victim, before = victim_step(shared, 4, names)
    step_dir = attacker_step(shared, 4, names)
    swapped: list[bool] = []

    def swap_once(_dir_fd: int, _name: str) -> None:
        if not swapped:
            swapped.append(True)
            swap_for_link(step_dir, victim)

    monkeypatch.setattr(removal, "BEFORE_UNLINK", swap_once, raising=False)
    prune_partial(shared)
    moved = step_dir.with_name(step_dir.name + ".moved")
    lost = taken(before) + int(not swapped)
    left = [p.name for p in h.regular_files(moved)] if moved.exists() else []
    ledger("cache tool", "cache prune --partial: the step swapped for a link after prune opened it, before "
           "its first unlink", 1,
           f"victim's files removed: {taken(before)}; the opened (moved) step's own files left: {len(left)}",
           lost)  # fmt: skip
    assert lost == 0 and left == [], left


def test_garbage_collection_does_not_remove_through_a_swapped_step(shared: Path, ledger: Any) -> None:
    """A leftover found in the other user's step; the step swapped for a link to a victim's step that
    holds a file of the same name; the collector must not unlink the victim's file."""
    name = step_files()[0]
    project = shared / "shared" / Path(*LAYOUT)
    _plant(project / "5" / "0", [name], b"the other user's leftover")
    victim = shared / "victim" / "proj" / "5"
    _plant(victim / "0", [name], b"the victim's file")
    before = {victim / "0" / name: b"the victim's file"}
    chown_tree(shared / "shared" / LAYOUT[0], OTHER_UID)
    found = garbage.find_leftovers(project)
    assert [f.path.name for f in found] == [name]
    swap_for_link(project / "5", victim)
    garbage.remove_leftovers(found)
    lost = taken(before)
    ledger("cache tool", "garbage collection: a leftover found, then its step swapped (another uid) for a link to "
           "a victim's step holding a file of the same name", 1,
           f"victim's files removed: {lost}", lost)  # fmt: skip
    assert lost == 0


def test_a_failed_save_cleans_up_without_following_a_link(tmp_path: Path, ledger: Any) -> None:
    """A writer's clean-up (abort) removes what it wrote relative to the store's root: its step
    directory replaced meanwhile by a link to a directory holding files of the same names leads
    nowhere."""
    dump = tmp_path / "dump"
    store = StepStore(dump / "proj", "toy", h.CONTEXT, dump_dir=dump)
    writer = store.begin(3)
    writer.add_part(h.plain_payload(64, 1.0))
    victim = tmp_path / "victim"
    store.step_dir(3).rename(victim)  # the same names, now someone else's
    store.step_dir(3).symlink_to(victim)
    before = {p: p.read_bytes() for p in h.regular_files(victim)}
    writer.abort()
    lost = taken(before)
    ledger("cache tool", "a failed save's clean-up after its step directory became a link to files of the same "
           "names", 1, f"files removed through the link: {lost}", lost)  # fmt: skip
    assert lost == 0
