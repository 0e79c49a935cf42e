"""``dump_dir=s3://...`` against a real S3-compatible server (moto in server mode) through s3fs.

Writers run in their own processes, and are killed with SIGKILL mid-upload or before the commit:
what a reader then sees is a whole step or none. Two writers of one step leave one whole step.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skipinject.errors import CorruptCacheError
from skipinject.store import RemoteStepStore
from skipinject.store.remote import open_remote
from tests.integration.s3_server import create_bucket, s3_environment, s3_server, use_server
from tests.remote_checks import check_engine_round_trip

pytest.importorskip("s3fs")
pytest.importorskip("moto")

WRITER = Path(__file__).parents[1] / "fixtures" / "s3_writer.py"
BUCKET = "skipinject-tests"


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with s3_server(str(log)) as url:
        create_bucket(url, BUCKET)
        yield url


@pytest.fixture
def s3_env(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    use_server(endpoint, monkeypatch)
    return s3_environment(endpoint)


@pytest.fixture
def url(s3_env: dict[str, str]) -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"


def store_at(url: str) -> RemoteStepStore:
    fs, root = open_remote(url)
    return RemoteStepStore(root / "project", "toy", {"run": 1}, fs)


def write(
    url: str, step: int, value: int, mode: str, *extra: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(WRITER), url, str(step), str(value), mode, *extra],
        capture_output=True,
        text=True,
        timeout=600,
        check=check,
    )


def values(store: RemoteStepStore, step: int) -> list[int]:
    return [int(part.objects["value"]) for part in store.load(store.verified(step))]


def test_a_step_saved_by_one_process_is_verified_and_loaded_by_another(url: str):
    write(url, 3, 30, "ok")
    store = store_at(url)
    assert store.step_numbers_on_disk() == [3] and values(store, 3) == [30]
    assert store.read_meta(3)["node"]["hostname"]


def test_a_writer_killed_mid_upload_leaves_no_object_and_no_step(url: str):
    killed = write(url, 5, 50, "kill-mid-upload", check=False)
    assert killed.returncode == -9, killed.stderr
    store = store_at(url)
    with pytest.raises(FileNotFoundError):
        store.verified(5)
    visible = [p for p in store.backend.fs.find(store.location.path) if "/tensors-" in p]
    assert visible == [], "an interrupted multipart upload publishes nothing"
    write(url, 5, 51, "ok")
    assert values(store, 5) == [51]


def test_a_writer_killed_before_the_commit_leaves_no_step_and_is_reported(url: str):
    killed = write(url, 6, 60, "kill-before-meta", check=False)
    assert killed.returncode == -9, killed.stderr
    store = store_at(url)
    assert not store.is_committed(6)
    with pytest.raises(FileNotFoundError):
        store.verified(6)
    assert "no meta.json (an earlier save was interrupted)" in (store.interrupted(6) or "")
    write(url, 6, 61, "ok")
    assert values(store, 6) == [61] and store.interrupted(6) is None


def test_two_writers_of_one_step_leave_one_whole_step(url: str, tmp_path: Path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    writers = [
        subprocess.Popen(
            [sys.executable, str(WRITER), url, "9", str(value), "barrier", str(barrier)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for value in (1, 2)
    ]
    outputs = [w.communicate(timeout=600) for w in writers]
    assert all(w.returncode == 0 for w in writers), outputs
    store = store_at(url)
    loaded = values(store, 9)
    assert loaded in ([1, 1], [2, 2]), "both parts come from one writer"
    winner = store.read_meta(9)
    named = json.dumps(winner["parts"])
    ids = [out.split()[-1] for out, _ in outputs]
    assert sum(write_id in named for write_id in ids) == 1


def test_an_object_changed_on_the_server_is_reported_never_loaded(url: str):
    write(url, 2, 20, "ok")
    store = store_at(url)
    (tensor_file,) = [p for p in store.backend.fs.find(store.location.path) if "/tensors-" in p]
    data = store.backend.fs.cat_file(tensor_file)
    store.backend.fs.pipe_file(tensor_file, data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(CorruptCacheError, match="checksum mismatch"):
        store.verified(2)
    store.backend.fs.pipe_file(tensor_file, data + b"trailing")
    with pytest.raises(CorruptCacheError, match=r"bytes, meta\.json records"):
        store.verified(2)


def test_a_real_dataproto_round_trips_through_s3_unchanged(url: str):
    import numpy as np
    import torch
    from tensordict import TensorDict
    from verl import DataProto

    from skipinject.verl.codecs import DataProtoCodec

    batch = DataProto(
        batch=TensorDict({"responses": torch.arange(24).view(4, 6), "mask": torch.ones(4, 6)}, batch_size=[4]),
        non_tensor_batch={"uid": np.array(["a", "a", "b", "b"], dtype=object)},
        meta_info={"temperature": 1.0},
    )
    codec = DataProtoCodec()
    store = store_at(url)
    store.save(1, codec.encode(batch))
    (payload,) = store.load(store.verified(1))
    back = codec.decode(payload)
    assert torch.equal(back.batch["responses"], batch.batch["responses"])
    assert list(back.non_tensor_batch["uid"]) == ["a", "a", "b", "b"] and back.meta_info == batch.meta_info


def test_the_engine_saves_then_serves_steps_from_s3(toy: Any, url: str, caplog):
    check_engine_round_trip(toy, url, caplog)


def test_the_cache_tool_lists_and_verifies_steps_in_s3(url: str, s3_env: dict[str, str]):
    import os

    write(url, 1, 10, "ok")
    write(url, 2, 20, "kill-before-meta", check=False)
    env = {**os.environ, **s3_env}
    listed = subprocess.run(
        [sys.executable, "-m", "skipinject", "cache", "ls", url, "--steps", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    states = {s["step"]: s["state"] for s in json.loads(listed.stdout)["steps"]}
    assert states == {1: "complete", 2: "partial"}
    verified = subprocess.run(
        [sys.executable, "-m", "skipinject", "cache", "verify", url],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert verified.returncode == 0 and "1 ok, 0 damaged, 1 partial" in verified.stdout, verified.stdout


def test_prune_damaged_selects_the_steps_verify_calls_damaged_in_s3(url: str):
    """In an object store too, ``prune``'s choice of damaged steps is ``verify``'s: the bytes checked."""
    from skipinject.cache_tool.prune import select
    from skipinject.cache_tool.scan import scan
    from skipinject.cache_tool.verify import verify_item

    write(url, 1, 10, "ok")
    write(url, 2, 20, "ok")
    store = store_at(url)
    (tensor_file,) = [p for p in store.backend.fs.find(store.location.path) if "/2/tensors-" in p]
    data = store.backend.fs.cat_file(tensor_file)
    store.backend.fs.pipe_file(tensor_file, data[:-1] + bytes([data[-1] ^ 0xFF]))
    items = scan(url, [])
    assert [verify_item(item).status for item in items] == ["ok", "damaged"]
    chosen = select(items, keep_last=None, older_than=None, partial=False, damaged=True, now=0.0)
    assert [(item.step, reason) for item, reason in chosen] == [(2, "damaged")]
    assert "checksum mismatch" in chosen[0][0].problems[0]


def test_the_match_row_index_is_kept_in_the_store_and_refreshed_from_new_steps_only(url: str, monkeypatch):
    """``action=match``'s row index in S3: built once (every ``meta.json`` read), put as an object;
    a later run loads it and reads only the ``meta.json`` of steps new or recorded anew since (found
    by one listing); a damaged index object is only rebuilt."""
    import torch

    from skipinject.engine.row_index import RowIndex
    from skipinject.store import Payload
    from skipinject.store.format import ROW_INDEX_NAME

    fs, root = open_remote(url)
    steps = RemoteStepStore(root / "project", "toy", {"run": 1}, fs)
    rows = RemoteStepStore(root / "project" / "rows", "toy", {"run": 1}, fs)

    def keys(step: int, generation: int = 0) -> list[str]:
        return [f"{generation:04x}{step:06x}{row:06x}" for row in range(4)]

    def save(step: int, generation: int = 0) -> None:
        payload = Payload(tensors={"x": torch.zeros(4, 2)}, objects={"value": step}, rows=4)
        steps.save(step, payload, {"row_keys": [keys(step, generation)], "rows_per_input": [1]})

    for step in (1, 2, 3):
        save(step)
    meta_reads: list[str] = []
    cat_file = fs.cat_file

    def counting(path: str, *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith("/meta.json"):
            meta_reads.append(str(path))
        return cat_file(path, *args, **kwargs)

    monkeypatch.setattr(fs, "cat_file", counting)
    found = RowIndex(steps, rows).lookup(keys(2))
    assert [place[0].number for place in found] == [2, 2, 2, 2]
    assert len(meta_reads) == 3 and fs.exists(f"{root.path}/project/{ROW_INDEX_NAME}"), "built, then stored"

    save(4)
    save(1, generation=1)  # step 1 recorded anew, with other rows
    meta_reads.clear()
    index = RowIndex(steps, rows)  # a later run
    found = index.lookup(keys(2) + keys(1) + keys(1, generation=1) + keys(4))
    assert sorted(path.rsplit("/", 2)[1] for path in meta_reads) == ["1", "4"], meta_reads
    assert [bool(place) for place in found] == [True] * 4 + [False] * 4 + [True] * 8, "step 1's old rows left"
    meta_reads.clear()
    assert index.lookup(keys(3))[0][0].number == 3 and meta_reads == [], "nothing new: no meta.json read"

    fs.pipe_file(f"{root.path}/project/{ROW_INDEX_NAME}", b"PK\x03\x04 not an index")
    meta_reads.clear()
    found = RowIndex(steps, rows).lookup(keys(3))
    assert [place[0].number for place in found] == [3] * 4 and len(meta_reads) == 4, "damaged: rebuilt from the steps"


def test_the_next_step_is_read_ahead_from_s3_and_its_hit_downloads_no_data_file(
    url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    """``skip.<role>.read_ahead`` against a real S3 server (where a hit's download costs most): the step
    read ahead is served after its data objects were deleted, bit for bit as recorded."""
    import logging

    from tests.read_ahead_checks import (
        GENERATED,
        assert_same,
        hit_line,
        install_targets,
        read_ahead_lines,
        remove_data_files,
        run,
    )

    targets = install_targets(monkeypatch)
    recorded, _ = run(targets, url, (1, 2, 3))  # compression auto: zstd in an object store
    caplog.set_level(logging.DEBUG, logger="skipinject")
    caplog.clear()

    def train(step: int, runtime: Any) -> None:
        runtime.replay.read_ahead.wait()
        if step < 3:
            assert remove_data_files(url, step + 1)

    served, _ = run(targets, url, (1, 2, 3), between=train)
    assert GENERATED == []
    assert read_ahead_lines(caplog) == ["0 -> 1", "1 -> 2", "2 -> 3"]  # the first while the trainer starts
    for step in (1, 2, 3):
        assert_same(served[step], recorded[step])
    for step in (1, 2, 3):
        assert "read ahead, waited" in hit_line(caplog, step) and url.split("://", 1)[1] in hit_line(caplog, step)
