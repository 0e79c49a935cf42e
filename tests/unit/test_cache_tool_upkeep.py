"""Upkeep: every hit counted in a side record beside the step (never the commit), and ``cache ls``,
``prune --max-size`` / ``--older-than --by served`` and ``rm`` built on it, on a local disk and in an
object store (fsspec's memory store; the same backend as S3)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from skipinject.cache_tool import main
from skipinject.store import Payload, RemoteStepStore, StepStore, step_store
from skipinject.store.remote import open_remote

torch = pytest.importorskip("torch")

LAYOUT = ("e_p", "GBS4_N2_in8_out8")
DAY = 86400.0


def payload(value: int, rows: int = 4, width: int = 3) -> Payload:
    return Payload(tensors={"x": torch.full((rows, width), value)}, objects={"value": value}, rows=rows)


@pytest.fixture(params=["local", "memory"])
def dump(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A dump directory: a local path, or a URL of fsspec's memory store."""
    return str(tmp_path / "dump") if request.param == "local" else f"memory://upkeep/{uuid.uuid4().hex}"


def store_at(dump: str, role: str = "rollout") -> StepStore:
    """The store of ``role`` under the test layout of ``dump`` (local or remote)."""
    if "://" in dump:
        fs, root = open_remote(dump)
        location = root / LAYOUT[0] / LAYOUT[1]
        return RemoteStepStore(location if role == "rollout" else location / role, role, {"run": 1}, fs)
    location = Path(dump, *LAYOUT)
    return StepStore(location if role == "rollout" else location / role, role, {"run": 1})


def run(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, Any, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, json.loads(out) if "--json" in argv else out, err


def step_files(store: StepStore, step: int) -> dict[str, bytes]:
    return {f"{f.part}/{f.name}": store.backend.read_bytes(store.step_dir(step) / f.part / f.name, 1 << 20)
            for f in store.files(step) if f.kind == "file"}  # fmt: skip


# ---------------------------------------------------------------- the side record


def test_hits_are_counted_beside_the_step_which_is_never_rewritten(dump: str):
    store = store_at(dump)
    store.save(1, payload(1))
    before = step_files(store, 1)
    assert store.usage(1) is None
    for _ in range(3):
        store.note_hit(1)
    after = step_files(store, 1)
    record = store.usage(1)
    assert record is not None and record.hits == 3 and abs(record.last_served - time.time()) < 60
    assert set(after) - set(before) == {"/usage.json"} and len(after["/usage.json"]) < 100
    assert {k: v for k, v in after.items() if k != "/usage.json"} == before, "the commit is never rewritten"
    store.check(1)  # the step verifies and loads as before


HOSTILE = {
    "not json": b"\x00\xffgarbage",
    "too large": b'{"hits": 1, "last_served": 1, "pad": "' + b"x" * 2000 + b'"}',
    "negative count": b'{"hits": -1, "last_served": 1}',
    "count past 2^53": b'{"hits": 36028797018963968, "last_served": 1}',
    "a time in the future": b'{"hits": 5, "last_served": 1e20}',
    "no mapping": b"[1, 2]",
    "nested": b'{"hits": {"a": {"b": 1}}, "last_served": 1}',
}


def test_a_garbled_or_hostile_record_costs_only_the_statistics_with_one_line(
    dump: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(step_store, "_first_warning", threading.Lock())
    store = store_at(dump)
    for step, data in enumerate(HOSTILE.values()):
        store.save(step, payload(step))
        store.backend.write(store.step_dir(step) / "usage.json", lambda handle, data=data: handle.write(data))
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        for step in range(len(HOSTILE)):
            assert store.usage(step) is None, list(HOSTILE)[step]
            store.note_hit(step)
            record = store.usage(step)
            assert record is not None and record.hits == 1, "counting starts again"
            store.check(step)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "usage statistics start again" in lines[0], lines


def test_a_record_that_is_a_link_or_a_fifo_is_never_followed_nor_blocks(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(step_store, "_first_warning", threading.Lock())
    store = store_at(str(tmp_path / "dump"))
    secret = tmp_path / "secret.json"
    secret.write_text('{"hits": 7, "last_served": 1}')
    store.save(1, payload(1))
    store.save(2, payload(2))
    (store.step_dir(1) / "usage.json").symlink_to(secret)
    os.mkfifo(store.step_dir(2) / "usage.json")
    assert store.usage(1) is None and store.usage(2) is None
    store.note_hit(1)
    store.note_hit(2)
    assert store.usage(1).hits == 1 and store.usage(2).hits == 1  # type: ignore[union-attr]
    assert secret.read_text() == '{"hits": 7, "last_served": 1}', "the link is replaced, never written through"


def test_concurrent_hits_may_lose_increments_never_the_record(tmp_path: Path):
    store = store_at(str(tmp_path / "dump"))
    store.save(1, payload(1))
    seen: list[Any] = []

    def hits() -> None:
        for _ in range(20):
            store.note_hit(1)
            seen.append(store.usage(1))

    threads = [threading.Thread(target=hits) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    final = store.usage(1)
    assert final is not None and 1 <= final.hits <= 120
    assert all(record is not None for record in seen), "every read found a whole record"
    assert sorted(p.name for p in store.step_dir(1).iterdir() if p.name.startswith(".")) == []


def test_a_hit_of_a_step_removed_meanwhile_leaves_nothing(dump: str):
    store = store_at(dump)
    store.save(1, payload(1))
    assert store.remove(1)[0] == 3
    store.note_hit(1)
    assert store.usage(1) is None and store.step_numbers_on_disk() == []


# ---------------------------------------------------------------- the cache tool


def served_dump(dump: str) -> dict[int, float]:
    """Steps 1-4 of rollout (served 3 days, never, 1 hour and 2 days ago) and step 1 of reward (never)."""
    rollout, reward = store_at(dump), store_at(dump, "reward")
    now = time.time()
    served = {1: now - 3 * DAY, 3: now - 3600, 4: now - 2 * DAY}
    for step in (1, 2, 3, 4):
        rollout.save(step, payload(step, rows=4 * step))
    reward.save(1, payload(9))
    for step, when in served.items():
        for _ in range(step):
            rollout.note_hit(step, now=when)
    return served


def test_ls_shows_last_served_and_hits_sorts_and_filters(dump: str, capsys):
    served_dump(dump)
    code, out, _ = run(capsys, "ls", dump, "-l")
    lines = out.splitlines()
    assert code == 0 and "LAST SERVED" in lines[0] and "HITS" in lines[0]
    assert lines[-1].startswith("5 step(s), ") and ", 8 hit(s) in " in lines[-1], "a total line"
    never = [line for line in lines if " never " in line]
    assert len(never) == 2, "step 2 and reward's step 1 were never served"

    code, doc, _ = run(capsys, "ls", dump, "--json", "--steps", "--sort", "served")
    order = [(s["role"], s["step"], s["hits"]) for s in doc["steps"]]
    assert order[2:] == [("rollout", 1, 1), ("rollout", 4, 4), ("rollout", 3, 3)], order
    assert {o[:2] for o in order[:2]} == {("rollout", 2), ("reward", 1)}, "never served comes first"
    assert doc["steps"][-1]["last_served"] is not None and doc["steps"][0]["last_served"] is None

    code, doc, _ = run(capsys, "ls", dump, "--json", "--sort", "size", "--role", "rollout")
    sizes = [s["size"] for s in doc["steps"]]
    assert [s["step"] for s in doc["steps"]] == [4, 3, 2, 1] and sizes == sorted(sizes, reverse=True)
    assert {g["role"] for g in doc["groups"]} == {"rollout"} and doc["groups"][0]["hits"] == 8

    store_at(dump).begin(5).add_part(payload(5))  # an interrupted save
    code, doc, _ = run(capsys, "ls", dump, "--json", "--state", "partial")
    assert [(s["step"], s["state"]) for s in doc["steps"]] == [(5, "partial")]
    code, _, err = run(capsys, "ls", dump, "--sort", "age")
    assert code == 2 and "invalid choice: 'age'" in err


def test_prune_max_size_removes_the_least_recently_served_first(dump: str, capsys):
    served_dump(dump)
    code, doc, _ = run(capsys, "ls", dump, "--json", "--steps")
    size = {(s["role"], s["step"]): s["size"] for s in doc["steps"]}
    # last use: rollout 1 (3 days ago), 4 (2 days), 3 (an hour); rollout 2 and reward 1 never served, created now
    keep = size[("rollout", 2)] + size[("reward", 1)] + size[("rollout", 3)] - 1
    code, doc, _ = run(capsys, "prune", dump, "--max-size", str(keep), "--dry-run", "--json")
    assert code == 0 and len(doc["removed"]) == 3 and store_at(dump).step_numbers_on_disk() == [1, 2, 3, 4]
    code, doc, _ = run(capsys, "prune", dump, "--max-size", str(keep), "--json")
    gone = [(Path(str(r["path"])).name, r["reason"]) for r in doc["removed"]]
    assert [name for name, _ in gone] == ["1", "4", "3"] and all("--max-size" in why for _, why in gone)
    assert doc["bytes"] >= size[("rollout", 1)] + size[("rollout", 4)] + size[("rollout", 3)]
    assert store_at(dump).step_numbers_on_disk() == [2] and store_at(dump, "reward").step_numbers_on_disk() == [1]
    code, doc, _ = run(capsys, "prune", dump, "--max-size", "0.1G", "--json")
    assert doc["removed"] == [], "what fits is kept"
    code, _, err = run(capsys, "prune", dump, "--max-size", "lots")
    assert code == 2 and "bad size 'lots'" in err


def test_prune_older_than_goes_by_last_use_with_by_served(dump: str, capsys):
    served_dump(dump)
    code, doc, _ = run(capsys, "prune", dump, "--older-than", "1d", "--json")
    assert doc["removed"] == [], "every step was created just now"
    code, out, _ = run(capsys, "prune", dump, "--older-than", "1d", "--by", "served")
    assert code == 0 and "unused for longer than --older-than" in out
    assert out.splitlines()[-1].startswith("removed 2 step(s), ")
    assert store_at(dump).step_numbers_on_disk() == [2, 3], "1 and 4 were last served days ago"


def test_rm_removes_named_steps_through_the_same_checks(dump: str, capsys):
    served_dump(dump)
    rollout = store_at(dump)
    code, out, _ = run(capsys, "rm", rollout.step_dir(1), rollout.step_dir(4), "--dry-run")
    assert code == 0 and out.count("would remove ") == 3 and rollout.step_numbers_on_disk() == [1, 2, 3, 4]
    code, doc, _ = run(capsys, "rm", rollout.step_dir(1), rollout.step_dir(4), "--json")
    assert code == 0 and [Path(str(r["path"])).name for r in doc["removed"]] == ["1", "4"]
    assert doc["files"] == 8, "meta.json, two data files and the usage record each"
    assert rollout.step_numbers_on_disk() == [2, 3] and store_at(dump, "reward").step_numbers_on_disk() == [1]
    code, _, err = run(capsys, "rm", rollout.step_dir(1))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "no skipinject step there" in err or "no such directory" in err


def test_rm_keeps_a_step_a_save_is_writing_and_never_removes_verls_pickles(tmp_path: Path, capsys):
    rollout = store_at(str(tmp_path / "dump"))
    rollout.save(1, payload(1))
    rollout.begin(1).add_part(payload(2))  # a second save of step 1 in progress
    code, out, _ = run(capsys, "rm", rollout.step_dir(1))
    assert code == 1 and "a save may still be writing it" in out and rollout.is_committed(1)
    pickle_dir = rollout.project_dir / "7"
    pickle_dir.mkdir()
    (pickle_dir / "gen_batch.dp").write_bytes(b"\x80\x04N.")
    code, _, err = run(capsys, "rm", pickle_dir)
    assert code == 2 and "skipinject never removes it" in err and (pickle_dir / "gen_batch.dp").exists()


def test_rm_of_a_step_that_is_a_link_neither_follows_nor_walks_it(tmp_path: Path, capsys):
    """A step directory that is a link (to a whole other tree): refused in one line, its target never walked."""
    rollout = store_at(str(tmp_path / "dump"))
    rollout.save(1, payload(1))
    elsewhere = store_at(str(tmp_path / "elsewhere"))
    elsewhere.save(1, payload(2))
    (rollout.project_dir / "2").symlink_to(tmp_path / "elsewhere")
    before = step_files(elsewhere, 1)
    code, out, err = run(capsys, "rm", rollout.project_dir / "2")
    assert code == 2 and "a symbolic link" in err and len(err.splitlines()) == 1, out + err
    assert step_files(elsewhere, 1) == before and rollout.is_committed(1)


def test_every_hit_through_the_engine_is_counted(toy: Any, dump: str, capsys):
    from skipinject import bootstrap
    from tests.remote_checks import generate, start

    for _ in range(3):  # one run records steps 1 and 2, two runs serve them
        start(dump, steps=(1, 2))
        generate(toy, (1, 2))
        bootstrap.stop()
    assert len(toy.CALLS) == 2, "only the first run called the target"
    code, doc, _ = run(capsys, "ls", dump, "--json", "--steps")
    assert code == 0 and [(s["step"], s["hits"]) for s in doc["steps"]] == [(1, 2), (2, 2)]
    assert all(s["last_served"] is not None for s in doc["steps"])


def test_the_cache_tool_touches_a_cache_only_through_the_store():
    """No module of ``skipinject/cache_tool/`` opens, lists, stats, renames or removes a file itself: the
    store (``StepStore``, its backends, ``skipinject.store.files``) does, with its link and bound rules."""
    import ast

    import skipinject.cache_tool as package

    forbidden_os = {"open", "scandir", "listdir", "walk", "unlink", "remove", "rename", "replace", "rmdir",
                    "mkdir", "makedirs", "fdopen", "stat", "lstat", "access", "readlink", "chmod", "chown",
                    "exists", "lexists", "isdir", "isfile", "islink", "realpath", "getsize", "getmtime"}  # fmt: skip
    forbidden_path = {"open", "iterdir", "glob", "rglob", "unlink", "rename", "rmdir", "mkdir",
                      "read_bytes", "read_text", "write_bytes", "write_text", "touch", "exists", "is_dir",
                      "is_file", "is_symlink", "stat", "lstat", "resolve", "readlink", "samefile", "owner"}  # fmt: skip
    stores = ("files", "store", "backend", "fs", "LocalFiles", "FsspecFiles", "StepStore")
    found = []
    for path in sorted(Path(package.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id == "open":
                found.append(f"{path.name}:{node.lineno} open()")
            elif isinstance(func, ast.Attribute):
                value = func.value.func if isinstance(func.value, ast.Call) else func.value  # LocalFiles().stat
                owner = ast.unparse(value) if isinstance(value, (ast.Name, ast.Attribute)) else None
                if owner in ("os", "os.path", "shutil") and (owner == "shutil" or func.attr in forbidden_os):
                    found.append(f"{path.name}:{node.lineno} {owner}.{func.attr}")
                elif owner not in ("os", "os.path", *stores) and func.attr in forbidden_path:
                    found.append(f"{path.name}:{node.lineno} .{func.attr}()")
    assert found == [], found
