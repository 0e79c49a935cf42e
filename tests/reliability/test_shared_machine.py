"""A shared machine and a careless user, around ``dump_dir``: links and directories other users
control, a ``dump_dir`` that is no directory, and a ``repeat`` over many damaged steps.

Each must be one line, once (not a line per step or per candidate), nothing loaded from or saved into
a tree another user controls, and nothing intact reported as damaged.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skipinject.cache_tool import prune as commands
from skipinject.cache_tool.common import CommandError
from skipinject.cache_tool.scan import scan
from tests.reliability import helpers as h
from tests.reliability.test_races import as_other_user

STEP = 1
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (os.setuid)")


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory other users can traverse (pytest's own tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="si-shared-"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in h.regular_files(root)} if root.exists() else {}


def _three_calls(dump: Path | str, caplog: Any) -> tuple[h.ToyTarget, list[str]]:
    """Three calls on two steps through one runtime (one run), with every warning line it logged."""
    rt = h.runtime(dump)
    target = h.ToyTarget()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        for step in (STEP, STEP, STEP + 1):
            h.call(rt, target, step)
        h.end_run(rt)
    return target, h.records(caplog)


@as_root
def test_a_dump_dir_that_is_another_users_link_is_not_followed(base: Path, caplog: Any, ledger: Any) -> None:
    """Another user's link in a sticky shared directory points the victim's dump_dir at a directory
    the victim owns (so every check of the resolved path passes): refused before it is resolved."""
    mine = base / "mine"
    h.call(h.runtime(mine), h.ToyTarget(), STEP)  # the victim's own cache of another experiment
    before = _files(mine)
    shared = base / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    as_other_user(lambda: os.symlink(mine, shared / "dump"))
    target, warnings = _three_calls(shared / "dump", caplog)
    lost = int(target.calls != [STEP, STEP, STEP + 1]) + int(_files(mine) != before) + int(len(warnings) != 1)
    ledger("trust", "dump_dir is a link another user owns (in a 1777 dir), pointing at the user's own cache", 3,
           f"loaded: {target.calls != [STEP, STEP, STEP + 1]}; files changed there: {_files(mine) != before}; "
           f"warnings: {len(warnings)}", lost)  # fmt: skip
    assert lost == 0, warnings


def test_a_dump_dir_under_a_world_writable_parent_is_not_trusted(base: Path, caplog: Any, ledger: Any) -> None:
    open_parent = base / "open"
    open_parent.mkdir()
    dump = open_parent / "dump"
    h.call(h.runtime(dump), h.ToyTarget(), STEP)
    os.chmod(open_parent, 0o777)  # anyone could replace `dump` in it
    before = _files(dump)
    target, warnings = _three_calls(dump, caplog)
    lost = int(target.calls != [STEP, STEP, STEP + 1]) + int(_files(dump) != before) + int(len(warnings) != 1)
    lost += int(not warnings or "writable by others" not in warnings[0])
    ledger("trust", "dump_dir inside a world-writable parent without the sticky bit", 3,
           f"not loaded, nothing saved, warnings: {len(warnings)}", lost)  # fmt: skip
    assert lost == 0, warnings


@as_root
def test_run_one_does_not_save_into_directories_another_user_precreated(base: Path, caplog: Any, ledger: Any) -> None:
    shared = base / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)

    def precreate() -> None:
        os.umask(0)
        os.makedirs(shared / "dump" / "exp_proj", mode=0o777)

    as_other_user(precreate)
    target, warnings = _three_calls(shared / "dump", caplog)
    written = h.regular_files(shared / "dump")
    lost = len(written) + int(target.calls != [STEP, STEP, STEP + 1]) + int(len(warnings) != 1)
    ledger("trust", "run 1 with a dump_dir another user pre-created 0777 (3 calls on 2 steps)", 3,
           f"files saved there: {len(written)}; warnings: {len(warnings)}", lost)  # fmt: skip
    assert lost == 0, (written, warnings)


@pytest.mark.parametrize("kind", ["fifo", "devnull", "file"])
def test_a_dump_dir_that_is_no_directory_gives_one_line_once(
    tmp_path: Path, kind: str, caplog: Any, ledger: Any
) -> None:
    if kind == "fifo":
        dump = tmp_path / "fifo"
        os.mkfifo(dump)
    elif kind == "file":
        dump = tmp_path / "file"
        dump.write_bytes(b"not a directory")
    else:
        dump = Path("/dev/null")
    target, warnings = _three_calls(dump, caplog)
    lost = int(target.calls != [STEP, STEP, STEP + 1]) + int(len(warnings) != 1)
    ledger("disk", f"dump_dir is {dump.name if kind == 'devnull' else 'a ' + kind} (3 calls on 2 steps)", 3,
           f"results returned: {len(target.calls)}/3; warnings: {len(warnings)}", lost)  # fmt: skip
    assert lost == 0, warnings


def test_prune_damaged_leaves_intact_untrusted_steps(tmp_path: Path, ledger: Any) -> None:
    dump = tmp_path / "dump"
    h.call(h.runtime(dump), h.ToyTarget(), STEP)
    project = h.project_dir(h.runtime(dump))
    os.chmod(project, 0o777)
    old = time.time() - 7200  # long written: nothing protects it from prune but its state
    for path in h.regular_files(dump):
        os.utime(path, (old, old))
    before = _files(dump)
    states = {item.state for item in scan(dump)}
    commands.cmd_prune(dump, keep_last=None, older_than=None, partial=False, damaged=True, dry_run=False, as_json=True)
    lost = len(set(before) - set(_files(dump))) + int(states != {"untrusted"})
    ledger("cache tool", "cache prune --damaged on an intact step in a world-writable project dir", 1,
           f"state: {', '.join(sorted(states))}; files removed: {len(set(before) - set(_files(dump)))}",
           lost)  # fmt: skip
    assert lost == 0


def test_import_refuses_a_path_that_is_a_link(tmp_path: Path) -> None:
    from skipinject.cache_tool.importer import cmd_import

    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(CommandError, match="symbolic link"):
        cmd_import([tmp_path / "link"], trust=True, role=None, experiment=None, project=None, as_json=True)


def _damage_above(dump: Path, good: int, count: int) -> None:
    """``count`` steps above ``good`` whose meta.json is valid but whose data files are gone."""
    store = h.store_of(h.runtime(dump))
    meta = h.read_meta_raw(store, good)
    for step in range(good + 1, good + 1 + count):
        store.step_dir(step).mkdir()
        meta = dict(meta, step=step, global_steps=step)
        h.write_meta_raw(store, step, meta)


@pytest.mark.parametrize("usable", [True, False], ids=["a good step below", "none usable"])
def test_repeat_logs_one_line_per_decision(tmp_path: Path, usable: bool, caplog: Any, ledger: Any) -> None:
    dump = tmp_path / "dump"
    h.call(h.runtime(dump), h.ToyTarget(), 0)
    _damage_above(dump, 0, 1000)
    if not usable:
        (h.store_of(h.runtime(dump)).step_dir(0) / "meta.json").unlink()
    rt = h.runtime(dump, action="repeat", steps=range(0, 2000))
    caplog.clear()
    target = h.ToyTarget()
    # with none usable, the first call saves its step, which serves the later ones: one call
    calls = (1500, 1501, 1502) if usable else (1500,)
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        for step in calls:
            h.call(rt, target, step)
    warnings = h.records(caplog)
    longest = max((len(w) for w in warnings), default=0)
    lost = int(len(warnings) != len(calls)) + int(longest > 2500)
    lost += int(not all("1000 cached steps" in w for w in warnings))
    lost += int(target.calls != ([] if usable else [1500]))
    ledger("bad input", f"action=repeat, 1000 damaged steps above {'the good one' if usable else 'none usable'}, "
           f"{len(calls)} call(s)", len(calls), f"warning lines: {len(warnings)}, longest {longest} characters",
           lost)  # fmt: skip
    assert lost == 0, (len(warnings), longest, warnings[:2])


@as_root
def test_the_cache_tool_does_not_follow_another_users_link(base: Path, ledger: Any) -> None:
    """``cache prune`` / ``compact`` / ``import`` through a link another user planted (in a sticky
    shared directory) are refused before anything is resolved; ``ls`` lists the steps as untrusted,
    as a run would not load them. The victim's own cache, where the link points, is untouched."""
    from skipinject.cache_tool.compact import cmd_compact
    from skipinject.cache_tool.importer import cmd_import

    mine = base / "mine"
    h.call(h.runtime(mine), h.ToyTarget(), STEP)
    before = _files(mine)
    shared = base / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    as_other_user(lambda: os.symlink(mine, shared / "dump"))
    link = shared / "dump"
    refused = 0
    for command in (
        lambda: commands.cmd_prune(link, keep_last=0, older_than=None, partial=True, damaged=True, dry_run=False,
                                   as_json=True),
        lambda: cmd_compact(link, compression="zstd", dry_run=False, as_json=True),
        lambda: cmd_import([link], trust=True, role=None, experiment=None, project=None, as_json=True),
    ):  # fmt: skip
        with pytest.raises(CommandError, match="symbolic link") as caught:  # import refuses any link at once
            command()
        refused += int("\n" not in str(caught.value))
    states = {item.state for item in scan(link)}
    lost = int(_files(mine) != before) + (3 - refused) + int(states != {"untrusted"})
    ledger("cache tool", "cache prune/compact/import/ls through another user's link to the user's own cache", 4,
           f"refused: {refused} of 3; ls states: {', '.join(sorted(states))}; files changed: {_files(mine) != before}",
           lost)  # fmt: skip
    assert lost == 0, states


def test_the_cache_tool_refuses_to_prune_under_a_world_writable_parent(base: Path) -> None:
    open_parent = base / "open"
    open_parent.mkdir()
    dump = open_parent / "dump"
    h.call(h.runtime(dump), h.ToyTarget(), STEP)
    os.chmod(open_parent, 0o777)
    before = _files(dump)
    with pytest.raises(CommandError, match="writable by others"):
        commands.cmd_prune(dump, keep_last=0, older_than=None, partial=False, damaged=False, dry_run=False,
                           as_json=True)  # fmt: skip
    assert _files(dump) == before
    assert {item.state for item in scan(dump)} == {"untrusted"}


@as_root
def test_the_cache_tool_lists_a_shared_dump_dir_past_another_users_private_project(base: Path, ledger: Any) -> None:
    """In a sticky shared dump directory another user's project is private (0700): ``ls``, ``verify`` and
    ``prune`` of the directory say so in one line and go on with the rest, never stop at it."""
    import contextlib
    import importlib
    import io
    import json

    from skipinject.cache_tool import main
    from tests.reliability.test_races import OTHER_UID, chown_tree

    shared = base / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    h.call(h.runtime(shared / "theirs"), h.ToyTarget(), STEP)  # root's, private
    os.chmod(shared / "theirs", 0o700)
    h.call(h.runtime(shared / "mine"), h.ToyTarget(), STEP)
    chown_tree(shared / "mine", OTHER_UID)
    commands = {"ls": ["ls", "--json"], "verify": ["verify", "--json"], "prune": ["prune", "--keep-last", "0"]}
    for argv in commands.values():  # every module the commands import, loaded before the child drops root
        with contextlib.redirect_stdout(io.StringIO()):
            main([*argv, "--dry-run", str(shared / "mine")] if argv[0] == "prune" else [*argv, str(shared / "mine")])
    importlib.import_module("_strptime")  # datetime.strptime's, imported at its first call

    def run_all() -> None:
        results = {}
        for name, argv in commands.items():
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main([*argv, str(shared)])
            results[name] = [code, out.getvalue(), err.getvalue()]
        (shared / "mine" / "results.json").write_text(json.dumps(results))

    as_other_user(run_all)
    results = json.loads((shared / "mine" / "results.json").read_text())
    (ls_code, ls_out, ls_err), (verify_code, verify_out, _), (prune_code, prune_out, prune_err) = results.values()
    listed = [(s["project"], s["state"]) for s in json.loads(ls_out)["steps"]]
    problems = json.loads(verify_out)["problems"]
    lost = int(listed != [("exp_proj", "complete")]) + int(prune_code != 0 or "removed 1 step(s)" not in prune_out)
    lost += int(len(problems) != 1 or "theirs" not in problems[0]) + int(ls_code != 0)
    ledger("trust", "cache ls, verify, prune of a 1777 dump dir holding another user's private (0700) project", 3,
           f"own steps listed: {len(listed)}; unreadable lines: {len(problems)}; exit statuses "
           f"{ls_code}, {verify_code}, {prune_code}", lost)  # fmt: skip
    assert ls_code == 0 and listed == [("exp_proj", "complete")], (ls_out, ls_err)
    assert verify_code == 1 and len(problems) == 1 and "theirs: cannot" in problems[0], verify_out
    assert prune_code == 0 and "removed 1 step(s)" in prune_out, (prune_out, prune_err)
    assert (shared / "theirs").is_dir() and not list((shared / "mine").rglob("meta.json"))
