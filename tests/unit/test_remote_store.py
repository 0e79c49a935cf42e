"""``dump_dir`` as an fsspec URL: the same format, commit rule and checks, on fsspec's in-memory store.

The real S3 server (moto) runs in ``tests/integration/test_s3_store.py``; these tests use
``memory://`` so every guarantee is checked in the fast tier: a step is complete or absent, sizes
are checked before reading and checksums after, ``meta.json`` is put last, two writers of a step
leave one whole step, leftovers are collected only once abandoned.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any

import pytest

from skipinject import bootstrap
from skipinject.config import Config
from skipinject.config.overrides import apply_overrides
from skipinject.dump_root import DumpRoot, is_remote
from skipinject.errors import ConfigError, CorruptCacheError
from skipinject.store import Payload, RemoteStepStore
from skipinject.store.remote import RemotePath, open_remote
from tests.remote_checks import check_engine_round_trip, generate, start

torch = pytest.importorskip("torch")


@pytest.fixture
def url() -> str:
    return f"memory://skipinject-tests/{uuid.uuid4().hex}"


@pytest.fixture
def store(url: str) -> RemoteStepStore:
    fs, root = open_remote(url)
    return RemoteStepStore(root / "project", "toy", {"run": 1}, fs)


def payload(value: int, rows: int = 4) -> Payload:
    return Payload(tensors={"x": torch.full((rows, 3), value)}, objects={"codec": "toy", "value": value}, rows=rows)


def loaded_value(store: RemoteStepStore, step: int) -> int:
    (part,) = store.load(store.verified(step))
    assert torch.equal(part.tensors["x"], torch.full((4, 3), part.objects["value"]))
    return int(part.objects["value"])


def objects(store: RemoteStepStore, step: int) -> dict[str, int]:
    return {entry["name"].rsplit("/", 1)[1]: entry["size"] for entry in store.backend.fs.ls(store.step_dir(step).path)}


# ---------------------------------------------------------------- locations and config


def test_urls_are_remote_and_file_urls_are_local_paths(tmp_path: Path):
    assert is_remote("s3://bucket/dir") and is_remote("memory://x") and not is_remote("/tmp/a://b")
    assert not is_remote("file:///tmp/x") and not is_remote("LOCAL://x")
    assert DumpRoot.parse("s3://bucket/dir/") == DumpRoot("s3://bucket/dir/", url="s3://bucket/dir")
    assert DumpRoot.parse(f"file://{tmp_path}").path == tmp_path.resolve()
    assert DumpRoot.parse(str(tmp_path)).path == tmp_path.resolve() and DumpRoot.parse(str(tmp_path)).url is None
    location = RemotePath("s3://", "bucket/a") / "b" / "3"
    assert str(location) == "s3://bucket/a/b/3" and location.name == "3" and str(location.parent) == "s3://bucket/a/b"


def test_a_url_no_installed_fsspec_implementation_opens_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^skip\.rollout\.dump_dir=nosuchproto://b/x: fsspec knows no protocol"):
        apply_overrides(Config(), [("skip.rollout.dump_dir", "nosuchproto://b/x")], ["rollout"])
    config = apply_overrides(Config(), [("skip.rollout.dump_dir", "memory://bucket/x")], ["rollout"])
    assert config.roles["rollout"].dump_dir == "memory://bucket/x"


# ---------------------------------------------------------------- commit and read


def test_save_then_verified_load_and_listing(store: RemoteStepStore):
    store.save(3, payload(3))
    store.save(12, payload(12))
    assert store.step_numbers_on_disk() == [3, 12]
    assert loaded_value(store, 3) == 3 and loaded_value(store, 12) == 12
    assert store.is_committed(3) and not store.is_committed(4)
    with pytest.raises(FileNotFoundError):
        store.verified(4)
    meta = store.read_meta(3)
    assert meta["node"]["hostname"] and meta["step"] == 3


def test_meta_json_is_put_last_after_every_data_file(store: RemoteStepStore, monkeypatch):
    order: list[str] = []
    fs = store.backend.fs
    real_open, real_pipe = fs.open, fs.pipe_file

    def spy_open(path: str, mode: str = "rb", **kw: Any) -> Any:
        handle = real_open(path, mode, **kw)
        if "w" in mode:
            real_close = handle.close

            def close() -> None:
                real_close()
                order.append(path.rsplit("/", 1)[1].split("-")[0])

            handle.close = close
        return handle

    def spy_pipe(path: str, value: bytes, **kw: Any) -> Any:
        result = real_pipe(path, value, **kw)
        order.append(path.rsplit("/", 1)[1].split("-")[0])
        return result

    monkeypatch.setattr(fs, "open", spy_open)
    monkeypatch.setattr(fs, "pipe_file", spy_pipe)
    writer = store.begin(5)
    writer.add_part(payload(1), part="0")
    writer.add_part(payload(2), part="1")
    writer.commit({})
    assert order == ["tensors", "objects", "tensors", "objects", "meta.json"]


def test_an_upload_that_fails_leaves_nothing_visible_and_the_step_absent(store: RemoteStepStore, monkeypatch):
    import skipinject.store.writer as writer

    def broken(handle: Any, tensors: Any, algo: str, compression: Any, concats: Any) -> tuple[str, None]:
        handle.write(b"partial bytes")
        raise ConnectionError("network gone")

    monkeypatch.setattr(writer, "tensor_file", broken)
    with pytest.raises(ConnectionError):
        store.save(2, payload(2))
    assert not store.backend.fs.exists(store.step_dir(2).path) or objects(store, 2) == {}
    with pytest.raises(FileNotFoundError):
        store.verified(2)


def test_an_interrupted_save_is_reported_not_loaded_and_saved_again(store: RemoteStepStore):
    writer = store.begin(7)
    writer.add_part(payload(7))  # the process dies here: data uploaded, no meta.json
    assert "holds data files but no meta.json" in (store.interrupted(7) or "")
    assert not store.is_committed(7)
    with pytest.raises(FileNotFoundError):
        store.verified(7)
    store.save(7, payload(70))
    assert store.interrupted(7) is None and loaded_value(store, 7) == 70


def test_two_writers_of_one_step_leave_one_whole_step(store: RemoteStepStore, monkeypatch):
    first, second = store.begin(4), store.begin(4)
    first.add_part(payload(1), part="0")
    second.add_part(payload(2), part="0")
    first.add_part(payload(1), part="1")
    second.add_part(payload(2), part="1")
    second.commit({})
    assert {p.objects["value"] for p in store.load(store.verified(4))} == {2}
    first.commit({})  # the last meta.json wins, naming only its own writer's files
    assert {p.objects["value"] for p in store.load(store.verified(4))} == {1}
    names = json.dumps(store.read_meta(4)["parts"])
    assert first.write_id in names and second.write_id not in names
    # the loser's files are kept while they could belong to a writer still uploading, then collected
    assert any(second.write_id in name for name in objects(store, 4)) or any(
        second.write_id in entry for entry in store.backend.fs.find(store.step_dir(4).path)
    )
    import skipinject.store.garbage as garbage

    monkeypatch.setattr(garbage, "BY_NAME_ABANDONED_AFTER", -1.0)
    removed, freed = store.collect_garbage(4)
    assert removed == 4 and freed > 0
    assert not any(second.write_id in entry for entry in store.backend.fs.find(store.step_dir(4).path))
    assert {p.objects["value"] for p in store.load(store.verified(4))} == {1}


# ---------------------------------------------------------------- hostile objects


def _rewrite(store: RemoteStepStore, step: int, kind: str, change: Any) -> None:
    for entry in store.backend.fs.find(store.step_dir(step).path):
        if entry.rsplit("/", 1)[1].startswith(kind):
            store.backend.fs.pipe_file(entry, change(store.backend.fs.cat_file(entry)))


@pytest.mark.parametrize(
    ("kind", "change", "message"),
    [
        ("tensors", lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum mismatch"),
        ("tensors", lambda b: b + b"x" * 100, "bytes, meta.json records"),
        ("objects", lambda b: b[:-2], "bytes, meta.json records"),
        ("meta.json", lambda b: b.replace(b'"rows": 4', b'"rows": 5'), "edited or damaged"),
        ("meta.json", lambda b: b"{" * 100000, "meta.json"),
        ("meta.json", lambda b: b"\xff\xfe not json", "meta.json"),
    ],
)
def test_damaged_objects_are_reported_never_loaded(store: RemoteStepStore, kind: str, change: Any, message: str):
    store.save(1, payload(1))
    _rewrite(store, 1, kind, change)
    with pytest.raises(CorruptCacheError, match=message):
        store.verified(1)


def test_a_huge_meta_json_is_refused_after_a_bounded_read(store: RemoteStepStore, monkeypatch):
    store.save(1, payload(1))
    store.backend.fs.pipe_file((store.step_dir(1) / "meta.json").path, b" " * (64 << 20) + b"{}")
    fetched: list[int] = []
    fs = store.backend.fs
    real_cat = fs.cat_file
    monkeypatch.setattr(fs, "cat_file", lambda *a, **kw: fetched.append(len(data := real_cat(*a, **kw))) or data)
    with pytest.raises(CorruptCacheError, match=r"far larger than any meta\.json"):
        store.read_meta(1)
    assert fetched == [(16 << 20) + 1], "one request, at most 16 MiB + 1 bytes"


def test_a_data_object_larger_than_recorded_is_refused_before_a_byte_is_read(store: RemoteStepStore, monkeypatch):
    store.save(1, payload(1))
    (tensor_file,) = [p for p in store.backend.fs.find(store.step_dir(1).path) if "/tensors-" in p]
    store.backend.fs.pipe_file(tensor_file, b"x" * (64 << 20))
    opened: list[str] = []
    fs = store.backend.fs
    real_open = fs.open
    monkeypatch.setattr(fs, "open", lambda path, *a, **kw: opened.append(path) or real_open(path, *a, **kw))
    with pytest.raises(CorruptCacheError, match=r"bytes, meta\.json records"):
        store.verified(1)
    assert tensor_file not in opened


@pytest.mark.parametrize("name", ["../../escape.bin", "/etc/passwd", "meta.json", "a/b.bin", ""])
def test_unsafe_file_names_in_meta_json_are_refused(store: RemoteStepStore, name: str):
    store.save(1, payload(1))
    meta = store.read_meta(1)
    meta["parts"][0]["files"]["tensors"]["name"] = name
    from skipinject.store.format import meta_digest

    meta["meta_checksum"] = meta_digest(meta)
    store.backend.fs.pipe_file((store.step_dir(1) / "meta.json").path, json.dumps(meta).encode())
    with pytest.raises(CorruptCacheError, match="unsafe file"):
        store.verified(1)


def test_a_missing_data_file_is_reported(store: RemoteStepStore):
    store.save(1, payload(1))
    for entry in store.backend.fs.find(store.step_dir(1).path):
        if "/objects-" in entry:
            store.backend.fs.rm_file(entry)
    with pytest.raises(CorruptCacheError, match="missing"):
        store.verified(1)


def test_step_listing_ignores_foreign_names(store: RemoteStepStore):
    store.save(2, payload(2))
    for name in ("01/x", "abc/x", "3x/x", "-1/x", "²/x"):
        store.backend.fs.pipe_file(f"{store.location.path}/{name}", b"")
    assert store.step_numbers_on_disk() == [2]


# ---------------------------------------------------------------- through the engine


def test_engine_caches_a_step_in_a_remote_store_then_serves_it(toy: Any, url: str, caplog):
    first = check_engine_round_trip(toy, url, caplog)
    start(url, steps=(5,), action="repeat")
    assert generate(toy, (5,)) == [first[1]], "repeat lists the remote steps and serves the nearest below"


def test_engine_regenerates_a_damaged_remote_step(toy: Any, url: str, caplog):
    start(url, steps=(1,))
    generate(toy, (1,))
    fs, root = open_remote(url)
    (tensor_file,) = [p for p in fs.find(root.path) if "/tensors-" in p]
    fs.pipe_file(tensor_file, fs.cat_file(tensor_file)[:-1] + b"\x00")
    bootstrap.stop()
    start(url, steps=(1,))
    toy.CALLS.clear()
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        generate(toy, (1,))
    assert toy.CALLS == ["generate"]
    assert any(
        "cache unusable, not loaded" in r.getMessage() and "checksum mismatch" in r.getMessage() for r in caplog.records
    )


def test_the_cache_tool_lists_and_verifies_a_remote_store(url: str, capsys):
    from skipinject.cache_tool import main

    fs, root = open_remote(url)
    layout = root / "e_p" / "GBS4_N2_in8_out8"
    RemoteStepStore(layout, "rollout", {"run": 1}, fs).save(1, payload(1))
    RemoteStepStore(layout, "rollout", {"run": 1}, fs).save(2, payload(2))
    RemoteStepStore(layout / "reward", "reward", {"run": 1}, fs).save(1, payload(1))
    RemoteStepStore(layout, "rollout", {"run": 1}, fs).begin(3).add_part(payload(3))  # interrupted
    assert main(["ls", url, "--json", "--steps"]) == 0
    listed = json.loads(capsys.readouterr().out)
    states = {(s["role"], s["step"]): s["state"] for s in listed["steps"]}
    assert states == {
        ("rollout", 1): "complete",
        ("rollout", 2): "complete",
        ("reward", 1): "complete",
        ("-", 3): "partial",
    }
    assert all(s["layout"] == "GBS4_N2_in8_out8" and s["project"] == "e_p" for s in listed["steps"])
    assert main(["verify", url]) == 0  # partial steps are reported, not damage
    out = capsys.readouterr().out
    assert "verified 4 step(s)" in out and "3 ok, 0 damaged, 1 partial" in out
    (tensor_file,) = [p for p in fs.find(layout.path + "/2") if "/tensors-" in p]
    fs.pipe_file(tensor_file, fs.cat_file(tensor_file)[:-1] + b"\x01")
    assert main(["verify", url, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    damaged = [s for s in report["steps"] if s["status"] == "damaged"]
    assert [s["step"] for s in damaged] == [2] and "checksum mismatch" in damaged[0]["problems"][0]


def test_the_cache_tool_reads_urls_only_where_it_can(tmp_path: Path, capsys):
    from skipinject.cache_tool import main

    assert main(["show", "s3://bucket/dump/1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "s3://bucket/dump/1: a remote store's URL; only `skipinject cache ls`, `verify`, `prune` and `rm`" in err
    assert main(["ls", f"file://{tmp_path}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dump_dir"] == str(tmp_path.resolve())


def _encodings(fs: Any, root_path: str) -> set[str]:
    metas = [p for p in fs.find(root_path) if p.endswith("/meta.json")]
    assert metas
    return {
        spec.get("encoding", "none")
        for meta in metas
        for part in json.loads(fs.cat_file(meta))["parts"]
        for spec in part["files"].values()
    }


def test_engine_compresses_by_default_in_a_remote_store_and_not_on_a_local_disk(
    toy: Any, url: str, tmp_path: Path, caplog
):
    """``compression=auto``: zstd for object stores, stored as they are locally; a setting overrides it."""
    import fsspec

    check_engine_round_trip(toy, url, caplog)
    fs, root = open_remote(url)
    assert _encodings(fs, root.path) == {"zstd"}
    local = fsspec.filesystem("file")
    for setting, expected in (("auto", {"none"}), ("zstd-2", {"zstd"})):
        dump = tmp_path / setting
        start(str(dump), steps=(1,), compression=setting)
        generate(toy, (1,))
        bootstrap.stop()
        assert _encodings(local, str(dump)) == expected, setting


def test_new_record_numbers_are_claimed_so_racing_writers_never_share_one(store: RemoteStepStore):
    """No exclusive create in an object store: a writer takes a number only when its claim is the
    only one listed there (``match``'s rows records of two concurrent runs both survive)."""
    first = store.claim("writer-a", first=1)
    second = store.claim("writer-b", first=1)  # a's claim is listed at 1
    assert (first, second) == (1, 2)
    store.save(first, payload(1))
    store.release(first, "writer-a")
    assert store.claim("writer-c", first=1) == 3, "1 is committed, 2 claimed by b"
    store.save(second, payload(2))
    store.release(second, "writer-b")
    assert store.step_numbers_on_disk() == [1, 2, 3]
    assert loaded_value(store, 1) == 1 and loaded_value(store, 2) == 2
    assert not [name for name in store.backend.names(store.step_dir(2)) if name.startswith(".claim-")]


def _remote_steps(url: str, count: int) -> tuple[Any, RemotePath]:
    fs, root = open_remote(url)
    layout = root / "e_p" / "GBS4_N2_in8_out8"
    for step in range(1, count + 1):
        RemoteStepStore(layout, "rollout", {"run": 1}, fs).save(step, payload(step))
    return fs, layout


def test_prune_and_rm_on_an_object_store_that_denies_deletes_report_the_steps_kept(
    url: str, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read-only credentials: every delete is denied. Nothing is counted as removed, each step is reported kept
    with why, as on a read-only local disk (``rm``: exit 1)."""
    from skipinject.cache_tool import main

    fs, layout = _remote_steps(url, 3)
    before = sorted(fs.find(layout.path))

    def deny(path: str, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Access Denied", path)

    monkeypatch.setattr(fs, "rm_file", deny)
    assert main(["prune", url, "--keep-last", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["removed"] == [] and doc["files"] == 0 and len(doc["skipped"]) == 2, doc
    assert all("Access Denied" in kept["reason"] for kept in doc["skipped"]), doc
    assert main(["prune", url, "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert "removed 0 step(s), 0 file(s)" in out and out.count("kept ") == 2, out
    assert main(["rm", str(layout / "3")]) == 1
    out = capsys.readouterr().out
    assert "removed 0 step(s)" in out and "Access Denied" in out, out
    assert sorted(fs.find(layout.path)) == before


def test_prune_of_an_object_store_that_cannot_be_listed_is_an_error(
    url: str, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from skipinject.cache_tool import main

    fs, layout = _remote_steps(url, 2)

    def deny(path: str, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Access Denied", path)

    monkeypatch.setattr(fs, "ls", deny)
    assert main(["prune", url, "--keep-last", "0"]) == 2
    out, err = capsys.readouterr()
    assert "removed" not in out and len(err.splitlines()) == 1 and "Access Denied" in err and "nothing removed" in err
    monkeypatch.undo()
    assert len(fs.find(layout.path)) == 6
