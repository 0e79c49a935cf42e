"""The same promises with ``dump_dir`` in an object store: a real S3-compatible server (moto, server mode).

* crash: a child saving a step to S3 is SIGKILLed at seeded random times over the measured
  duration of the save (two parts of ~60 MB, each a multipart upload), over an older complete
  version of the step or none; a fresh store then sees nothing, the old step or the new one, whole.
* integrity: random byte flips in any object of a saved step, on the server: never loaded.
* concurrency: writer processes save one step over and over while reader processes load it.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from skipinject.errors import CacheError
from tests.integration.s3_server import create_bucket, s3_environment, s3_server, use_server
from tests.reliability import helpers as h

pytest.importorskip("s3fs")
pytestmark = pytest.mark.integration

BUCKET = "reliability"
SEED = 12
NUMEL_LARGE = 12 << 20  # 48 MB + 12 MB of tensors per part: each part's tensor file is a multipart upload


@pytest.fixture(scope="module")
def s3_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with s3_server(str(tmp_path_factory.mktemp("moto") / "server.log")) as endpoint:
        create_bucket(endpoint, BUCKET)
        yield s3_environment(endpoint)


@pytest.fixture
def url(s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> str:
    use_server(s3_env["AWS_ENDPOINT_URL"], monkeypatch)
    return f"s3://{BUCKET}/{uuid.uuid4().hex}/project"


def _save(project: str, step: int, value: float, env: dict[str, str], conn: Any) -> None:
    store = h.open_store(project, env)
    conn.send("ready")
    writer = store.begin(step)
    for part in ("0", "1"):
        writer.add_part(h.plain_payload(NUMEL_LARGE, value, tag="crash"), part)
    writer.commit({})
    conn.send("done")


def _state(store: Any, step: int) -> float | str:
    """What a fresh reader sees: ``absent``, or the one value every part of the step was made from."""
    try:
        parts = store.load(store.verified(step))
    except FileNotFoundError:
        return "absent"
    values = {h.payload_consistent(p) for p in parts}
    if len(values) != 1 or None in values:
        return "torn"
    return values.pop()  # type: ignore[no-any-return]


def test_a_writer_killed_at_random_times_during_an_upload(url: str, s3_env: dict[str, str], ledger: Any) -> None:
    ctx = mp.get_context("spawn")
    rng = random.Random(SEED)
    outcomes = {"absent": 0, "old": 0, "new": 0}
    lost = trials = 0

    def run(project: str, value: float, kill_after: float | None) -> float:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_save, args=(project, 3, value, s3_env, child))
        proc.start()
        assert parent.poll(120) and parent.recv() == "ready"
        started = time.perf_counter()
        if kill_after is None:
            assert parent.poll(600) and parent.recv() == "done"
        else:
            time.sleep(kill_after)
            proc.kill()
        proc.join(60)
        return time.perf_counter() - started

    duration = run(url + "-timing", 1.0, None)
    for trial in range(6):
        project = f"{url}-{trial}"
        old = trial % 2 == 1
        if old:
            run(project, 100.0 + trial, None)
        run(project, 200.0 + trial, rng.uniform(0.05, duration))
        seen = _state(h.open_store(project), 3)
        trials += 1
        if seen == "absent" and not old:
            outcomes["absent"] += 1
        elif seen == 100.0 + trial and old:
            outcomes["old"] += 1
        elif seen == 200.0 + trial:
            outcomes["new"] += 1
        else:
            lost += 1
    ledger(
        "object store",
        f"a process saving a two-part step (2 x 60 MB multipart uploads) to S3 SIGKILLed at seeded random times "
        f"(save takes {duration:.1f} s), over no step or an older complete one; then a fresh store",
        trials,
        f"absent: {outcomes['absent']}, old: {outcomes['old']}, new: {outcomes['new']}",
        lost,
    )
    assert lost == 0, outcomes


def test_random_byte_flips_in_objects_on_the_server_are_never_loaded(url: str, ledger: Any) -> None:
    store = h.open_store(url)
    store.save(1, h.plain_payload(4096, 7.0))
    fs = store.backend.fs  # type: ignore[attr-defined]
    objects = {path: fs.cat_file(path) for path in fs.find(store.location.path)}  # type: ignore[attr-defined]
    rng = random.Random(SEED)
    outcomes = {"rejected": 0, "harmless": 0}
    lost = 0
    for _ in range(30):
        path = rng.choice(sorted(objects))
        data = bytearray(objects[path])
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        fs.pipe_file(path, bytes(data))
        try:
            seen = _state(store, 1)
        except CacheError:
            outcomes["rejected"] += 1
        except Exception:
            lost += 1  # a raw exception instead of skipinject's error
        else:
            if seen == 7.0:
                outcomes["harmless"] += 1  # a flip JSON does not see (e.g. in indentation whitespace)
            else:
                lost += 1
        fs.pipe_file(path, objects[path])
    ledger(
        "object store",
        "random single-bit flips in any object of a saved step (meta.json, tensor or objects file), on the S3 server",
        30,
        f"rejected {outcomes['rejected']}, harmless (same data) {outcomes['harmless']}",
        lost,
    )
    assert lost == 0


def test_writers_and_readers_of_one_step_in_s3(url: str, s3_env: dict[str, str], ledger: Any) -> None:
    writers, readers, rounds, numel = 3, 3, 10, 20_000
    parts = [1 if w == 0 else 2 for w in range(writers)]
    run = h.writers_and_readers(mp.get_context("spawn"), url, 5, parts, readers, rounds, numel, s3_env, timeout=600)
    totals = run.totals
    final = _state(h.open_store(url), 5)
    final_ok = final in run.last_values
    lost = totals["torn"] + totals["error"] + totals["miss_after_hit"] + run.foreign + int(not final_ok)
    lost += sum(1 for c in run.exit_codes if c != 0)
    ledger(
        "object store",
        f"{writers} processes saving one step {rounds}x each (1- and 2-part) to S3 while {readers} read it",
        writers * rounds + sum(totals.values()),
        f"{writers * rounds} commits; reads: {totals['hit']} complete, {totals['torn']} torn, "
        f"{totals['miss_after_hit']} lost after a hit; final step = one writer's last write: {final_ok}",
        lost,
    )
    assert lost == 0, (totals, run.errors, final)
