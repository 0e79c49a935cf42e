"""Hostile caches and hostile environments: every failure bounded, typed and one line.

A user of a shared cache directory plants files that are not what they claim (absurdly nested or
huge JSON, pipes, devices, links out of the step directory, sparse files), forges indexes whose
checksums match but whose claims are out of proportion to the bytes on disk, or makes directories
that other users can write. Each must give one warning line and a regenerated step (strict: a
CacheError), within a few seconds and a bounded amount of memory; nothing may be written through
a link or deleted outside the project.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from skipinject.errors import CacheError, CacheMissError, CorruptCacheError
from skipinject.store import StepStore, garbage
from skipinject.store.checksums import _digest
from tests.reliability import helpers as h

STEP = 1
#: Every hostile case must be decided within this (the honest cache of this size loads in ~10 ms).
SECONDS = 5.0
#: Peak Python/numpy/torch allocation allowed while deciding a hostile case of a few KB on disk.
PEAK_BYTES = 64 << 20


class Hung(BaseException):
    """Raised by the alarm: not an Exception, so nothing in skipinject swallows it."""


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    def fire(*_: Any) -> None:
        raise Hung(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _expected(step: int = STEP) -> Any:
    return h.make_batch(4, 8, seed=1000 + step, step=step)


def _store(dump: Path) -> StepStore:
    return h.store_of(h.runtime(dump))


def _forge_file(store: StepStore, kind: str, data: bytes) -> None:
    path = h.data_files(store, STEP)[kind]
    path.write_bytes(data)
    meta = h.read_meta_raw(store, STEP)
    spec = meta["parts"][0]["files"][kind]
    spec["size"], spec["checksum"] = len(data), _digest(data, meta["checksum_algo"])
    h.write_meta_raw(store, STEP, meta)


def _forge_objects(store: StepStore, edit: Callable[[dict[str, Any]], None]) -> None:
    objects = json.loads(h.data_files(store, STEP)["objects"].read_bytes())
    edit(objects)
    _forge_file(store, "objects", json.dumps(objects).encode())


def _replace(path: Path, make: Callable[[Path], None]) -> None:
    path.unlink()
    make(path)


# ---------------------------------------------------------------- the cases


def nested_meta(store: StepStore) -> None:
    h.meta_path(store, STEP).write_bytes(b"[" * 200_000 + b"]" * 200_000)


def nested_meta_forged(store: StepStore) -> None:
    meta = h.read_meta_raw(store, STEP)
    deep: Any = 0
    for _ in range(200):
        deep = [deep]
    meta["extra"] = deep
    h.write_meta_raw(store, STEP, meta)


def huge_meta(store: StepStore) -> None:
    with open(h.meta_path(store, STEP), "r+b") as handle:
        handle.truncate(1 << 40)  # a sparse TiB: read_bytes() would ask for it all


def _fifo(path: Path) -> None:
    """A named pipe, plus a thread that opens its writing end every few seconds: a reader blocked on
    it is released (and then takes longer than allowed) instead of hanging the suite forever."""
    os.mkfifo(path)

    def unblock() -> None:
        end = time.monotonic() + 180
        while time.monotonic() < end and os.path.lexists(path):
            time.sleep(SECONDS + 1)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO unless a reader is waiting
            except OSError:
                continue
            os.close(fd)

    threading.Thread(target=unblock, daemon=True).start()


def fifo_meta(store: StepStore) -> None:
    _replace(h.meta_path(store, STEP), _fifo)


def meta_links_to_device(store: StepStore) -> None:
    _replace(h.meta_path(store, STEP), lambda p: p.symlink_to("/dev/zero"))


def meta_links_out(store: StepStore) -> None:
    path = h.meta_path(store, STEP)
    outside = store.project_dir.parent / "planted-meta.json"
    path.rename(outside)
    path.symlink_to(outside)


def fifo_tensors(store: StepStore) -> None:
    path = h.data_files(store, STEP)["tensors"]
    meta = h.read_meta_raw(store, STEP)
    meta["parts"][0]["files"]["tensors"]["size"] = 0
    h.write_meta_raw(store, STEP, meta)
    _replace(path, _fifo)


def tensors_link_out(store: StepStore) -> None:
    path = h.data_files(store, STEP)["tensors"]
    outside = store.project_dir.parent / "planted.bin"
    path.rename(outside)
    path.symlink_to(outside)  # same bytes, same checksum: only the link is wrong


def objects_is_device(store: StepStore) -> None:
    _replace(h.data_files(store, STEP)["objects"], lambda p: p.symlink_to("/dev/urandom"))


def sparse_tensors(store: StepStore) -> None:
    path = h.data_files(store, STEP)["tensors"]
    size = 8 << 30
    with open(path, "r+b") as handle:
        handle.truncate(size)
    meta = h.read_meta_raw(store, STEP)
    meta["parts"][0]["files"]["tensors"]["size"] = size  # forged size; the checksum is wrong
    meta["parts"][0]["rows"] = meta["rows"] = 1 << 20  # rows that may take 8 GiB (else refused from meta.json)
    h.write_meta_raw(store, STEP, meta)


def _compressed_tensors(entries: list[dict[str, Any]], zeros: int = 0) -> tuple[bytes, dict[str, Any]]:
    """A genuine compressed tensor file (real zstd frames): the index of ``entries``, then ``zeros``
    bytes of zeros (about 29,000x smaller stored: within zstd's ratio); its bytes and record."""
    import struct

    import zstandard

    from skipinject.store.format import FRAME_BYTES, TENSORS_MAGIC

    header = json.dumps({"tensors": entries}).encode()
    header += b" " * (-(16 + len(header)) % 64)
    head = TENSORS_MAGIC + struct.pack("<Q", len(header)) + header
    compressor = zstandard.ZstdCompressor(level=19, write_content_size=True)
    total = len(head) + zeros
    first = min(total, FRAME_BYTES)
    frames = [compressor.compress(head + bytes(first - len(head)))]
    whole, rest = divmod(total - first, FRAME_BYTES)
    frames += [compressor.compress(bytes(FRAME_BYTES))] * whole + ([compressor.compress(bytes(rest))] if rest else [])
    record = {"encoding": "zstd", "decoded_size": total, "frames": [len(frame) for frame in frames]}
    return b"".join(frames), record


def _forge_compressed(store: StepStore, data: bytes, record: dict[str, Any]) -> None:
    _forge_file(store, "tensors", data)
    meta = h.read_meta_raw(store, STEP)
    meta["parts"][0]["files"]["tensors"].update(record)
    h.write_meta_raw(store, STEP, meta)


def zstd_bomb(store: StepStore) -> None:
    size = 256 << 20
    entry = {"name": "input_ids", "dtype": "uint8", "shape": [4, size // 4], "offset": 0, "nbytes": size}
    _forge_compressed(store, *_compressed_tensors([entry], size))


def compact_rebuild_bomb(store: StepStore) -> None:
    width = 1 << 20
    mask = {"name": "attention_mask", "dtype": "int64", "shape": [4, width]}
    _forge_compressed(store, *_compressed_tensors([{**mask, "derive": {"run": [0] * 4, "end": [width] * 4}}]))


def compact_run_past_its_row(store: StepStore) -> None:
    mask = {"name": "attention_mask", "dtype": "int64", "shape": [4, 16]}
    _forge_compressed(store, *_compressed_tensors([{**mask, "derive": {"run": [0, 0, 20, -3], "end": [16, 99, 2, 4]}}]))


def nested_objects(store: StepStore) -> None:
    _forge_file(store, "objects", b'{"codec":' + b"[" * 100_000 + b"]" * 100_000 + b"}")


def huge_column(store: StepStore) -> None:
    def edit(objects: dict[str, Any]) -> None:
        column = {"__si__": "column", "n": 0, "u": [], "plain": True}
        fields = objects["mapping"]["batch"]["td"]["fields"]
        fields["planted"] = {"k": "nts", "shape": [200_000_000, 0], "column": column}

    _forge_objects(store, edit)


def huge_string_dtype(store: StepStore) -> None:
    def edit(objects: dict[str, Any]) -> None:
        meta_info = objects["mapping"]["meta_info"]["v"]
        meta_info["planted"] = {"__si__": "nd", "dtype": "<U50000000", "shape": [2], "v": ["a", "b"]}

    _forge_objects(store, edit)


def empty_tensor_huge_rows(store: StepStore) -> None:
    """A tensor of 0 bytes claiming 10**9 rows, decoded as a nested tensor's sizes (a list per row)."""
    dump_payload = store.load(store.verified(STEP))[0]
    tensors = dict(dump_payload.tensors)
    tensors["planted"] = torch.empty((1_000_000_000, 0), dtype=torch.int64)
    objects = dump_payload.objects
    objects["mapping"]["meta_info"]["v"]["planted"] = {
        "__si__": "tensorref",
        "spec": {"k": "nested", "buffer": "planted", "sizes": "planted"},
    }
    from skipinject.store import Payload

    store.save(STEP, Payload(tensors=tensors, objects=objects, rows=dump_payload.rows), {"inputs": None})


def jagged_out_of_bounds(store: StepStore) -> None:
    """Offsets pointing far past a jagged tensor's values (torch does not check them)."""
    payload = store.load(store.verified(STEP))[0]
    tensors = dict(payload.tensors)
    tensors["v"] = torch.zeros(4, dtype=torch.float32)
    tensors["o"] = torch.tensor([0, 2, 1 << 40], dtype=torch.int64)
    payload.objects["mapping"]["meta_info"]["v"]["planted"] = {
        "__si__": "tensorref",
        "spec": {"k": "jagged", "values": "v", "offsets": "o", "lengths": None, "ragged_idx": 1},
    }
    from skipinject.store import Payload

    store.save(STEP, Payload(tensors=tensors, objects=payload.objects, rows=payload.rows), {"inputs": None})


CASES: list[tuple[str, str, Callable[[StepStore], None], tuple[str, ...]]] = [
    ("nested-meta", "meta.json of 200,000 nested lists", nested_meta, ("nested",)),
    ("nested-meta-forged", "meta.json nesting 200 lists deep (checksum recomputed)", nested_meta_forged, ("nested",)),
    ("huge-meta", "meta.json of 1 TiB (sparse)", huge_meta, ("larger than any meta.json", "sparse")),
    ("fifo-meta", "meta.json is a named pipe", fifo_meta, ("a pipe",)),
    ("meta-device", "meta.json is a link to /dev/zero", meta_links_to_device, ("symbolic link",)),
    ("meta-link-out", "meta.json is a link to a valid meta.json outside the step", meta_links_out, ("symbolic link",)),
    ("fifo-tensors", "the tensor file is a named pipe (size forged to 0)", fifo_tensors, ("a pipe",)),
    ("tensors-link-out", "the tensor file is a link to the same bytes outside the step", tensors_link_out, ("link",)),
    ("objects-device", "the objects file is a link to /dev/urandom", objects_is_device, ("link",)),
    ("sparse-tensors", "the tensor file is an 8 GiB sparse file (size and rows forged)", sparse_tensors, ("sparse",)),
    ("nested-objects", "objects file of 100,000 nested lists (forged checksum)", nested_objects, ("nested",)),
    (
        "zstd-bomb",
        "a tensor file of real zstd frames (~10 KB) decoding to 256 MiB of zeros for 4 rows (checksums match)",
        zstd_bomb,
        ("rows may take",),
    ),
    (
        "compact-rebuild-bomb",
        "a compact index rebuilding a [4, 2^20] int64 mask for 4 rows (checksums match)",
        compact_rebuild_bomb,
        ("rows may take",),
    ),
    (
        "compact-run-past-its-row",
        "a compact mask whose runs start before, end past or cross their row (checksums match)",
        compact_run_past_its_row,
        ("outside its row",),
    ),
]

#: Forged caches whose checksums match: the claims inside are out of proportion to the bytes.
FORGED: list[tuple[str, str, Callable[[StepStore], None]]] = [
    ("huge-column", "a NonTensorStack column of 0 rows claiming shape [2e8, 0]", huge_column),
    ("huge-string-dtype", "a 2-item string array claiming dtype <U50000000 (400 MB)", huge_string_dtype),
    ("empty-tensor-rows", "a 0-byte tensor claiming 1e9 rows, decoded row by row", empty_tensor_huge_rows),
    ("jagged-out-of-bounds", "jagged offsets 2**40 past a 4-element buffer", jagged_out_of_bounds),
]


def _one_run(dump: Path, caplog: pytest.LogCaptureFixture, **kw: Any) -> tuple[Any, list[int], list[str], float, int]:
    target = h.ToyTarget()
    caplog.clear()
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with deadline(60), caplog.at_level(logging.INFO, logger="skipinject"):
            result = h.call(h.runtime(dump, **kw), target, STEP)
    finally:
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return result, target.calls, h.records(caplog), elapsed, peak


def _check_case(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mutate: Callable[[StepStore], None], fragments: tuple[str, ...]
) -> tuple[int, list[str], str]:
    dump = tmp_path / "dump"
    h.call(h.runtime(dump), h.ToyTarget(), STEP)
    store = _store(dump)
    mutate(store)
    lost, problems = 0, []
    try:
        result, calls, warnings, elapsed, peak = _one_run(dump, caplog)
    except BaseException as exc:  # anything from the cache reaching the training call is lost
        return 1, [f"raised {type(exc).__name__}: {str(exc)[:200]}"], "raised"
    if calls != [STEP] or not h.same_batch(result, _expected()):
        lost += 1
        problems.append(f"not regenerated: calls={calls}")
    if len(warnings) != 1 or not any(f in warnings[0] for f in fragments):
        lost += 1
        problems.append(f"warnings={[w[:300] for w in warnings]}")
    if elapsed > SECONDS or peak > PEAK_BYTES:
        lost += 1
        problems.append(f"took {elapsed:.1f} s, peak {peak >> 20} MiB")
    # strict: the run stops with a CacheError, nothing else
    mutate(store) if not h.meta_path(store, STEP).is_symlink() else None
    try:
        with deadline(60):
            h.call(h.runtime(dump, action="strict"), h.ToyTarget(), STEP)
        lost += 1
        problems.append("strict run did not stop")
        stopped = "none"
    except (CacheMissError, CorruptCacheError) as exc:
        stopped = type(exc).__name__
    except BaseException as exc:
        lost += 1
        problems.append(f"strict raised {type(exc).__name__}: {str(exc)[:200]}")
        stopped = type(exc).__name__
    return lost, problems, f"1 warning line, regenerated in {elapsed:.2f} s (peak {peak >> 20} MiB); strict: {stopped}"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_files_are_refused_in_one_line(
    tmp_path: Path, case: tuple[str, str, Callable[[StepStore], None], tuple[str, ...]], caplog: Any, ledger: Any
) -> None:
    _, tried, mutate, fragments = case
    lost, problems, outcome = _check_case(tmp_path, caplog, mutate, fragments)
    ledger("integrity", tried, 2, outcome if not lost else f"lost: {problems}", lost)
    assert lost == 0, problems


@pytest.mark.parametrize("case", FORGED, ids=[c[0] for c in FORGED])
def test_forged_claims_cost_no_more_than_the_bytes_on_disk(
    tmp_path: Path, case: tuple[str, str, Callable[[StepStore], None]], caplog: Any, ledger: Any
) -> None:
    _, tried, mutate = case
    lost, problems, outcome = _check_case(tmp_path, caplog, mutate, ("cannot load", "damaged", "out of proportion"))
    ledger("integrity", f"{tried} (checksums match)", 2, outcome if not lost else f"lost: {problems}", lost)
    assert lost == 0, problems


def test_step_names_that_are_not_ascii_numbers(tmp_path: Path, caplog: Any, ledger: Any) -> None:
    dump = tmp_path / "dump"
    h.call(h.runtime(dump), h.ToyTarget(), 3)
    project = _store(dump).project_dir
    for name in ("²", "١٢", "0003", "3\n", "٣"):
        (project / name).mkdir()
        (project / name / "meta.json").write_bytes((project / "3" / "meta.json").read_bytes())
    caplog.clear()
    target = h.ToyTarget()
    lost = 0
    try:
        with caplog.at_level(logging.INFO, logger="skipinject"):
            result = h.call(h.runtime(dump, action="repeat"), target, 5)
        ok = target.calls == [] and h.same_batch(result, _expected(3))
    except Exception as exc:
        ok = False
        caplog.records.append(logging.makeLogRecord({"msg": repr(exc)}))
    lost += int(not ok)
    ledger("bad input", "step directories named ², ١٢, 0003, '3\\n', ٣ beside a cached step (action=repeat)", 5,
           f"served the cached step 3: {ok}", lost)  # fmt: skip
    assert lost == 0


# ---------------------------------------------------------------- directory trust


def _trust_case(dump: Path, caplog: Any, make_hostile: Callable[[StepStore], Path]) -> tuple[bool, bool, list[str]]:
    h.call(h.runtime(dump), h.ToyTarget(), STEP)
    store = _store(dump)
    make_hostile(store)
    target = h.ToyTarget()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        h.call(h.runtime(dump), target, STEP)
    refused = target.calls == [STEP]
    warnings = h.records(caplog)
    opted_in = StepStore(store.project_dir, store.role, store.context, trust_permissions=True)
    loads = bool(opted_in.load(opted_in.verified(STEP)))
    return refused, loads, warnings


TRUST: list[tuple[str, str, Callable[[StepStore], Any], bool]] = [
    ("world-writable project dir", "0o777", lambda s: os.chmod(s.project_dir, 0o777), True),
    ("group-writable step dir", "0o770", lambda s: os.chmod(s.step_dir(STEP), 0o770), True),
    ("step dir owned by another user", "uid 65534", lambda s: os.chown(s.step_dir(STEP), 65534, -1), True),
    ("project dir owned by another user", "uid 65534", lambda s: os.chown(s.project_dir, 65534, -1), True),
    ("world-writable project dir with the sticky bit (like /tmp)", "0o1777", lambda s: os.chmod(s.project_dir, 0o1777),
     False),
]  # fmt: skip


@pytest.mark.parametrize("case", TRUST, ids=[c[1] + "-" + c[0].split()[0] for c in TRUST])
def test_directories_other_users_control_are_not_loaded(tmp_path: Path, case: Any, caplog: Any, ledger: Any) -> None:
    tried, _, hostile, refuse = case
    refused, opted_in_loads, warnings = _trust_case(tmp_path / "dump", caplog, hostile)
    lost = 0
    if refuse:
        lost += int(not refused or len(warnings) != 1 or "trust_dir_permissions" not in warnings[0])
    else:
        lost += int(refused or warnings != [])
    lost += int(not opted_in_loads)
    outcome = "refused, 1 warning naming the fix" if refuse else "loaded (sticky bit)"
    ledger("trust", f"cache in a {tried}", 2, f"{outcome}; with trust_permissions loaded: {opted_in_loads}", lost)
    assert lost == 0, warnings


def test_a_writable_dump_dir_is_refused_at_the_store(tmp_path: Path, ledger: Any) -> None:
    dump = tmp_path / "dump"
    project = dump / "exp_proj" / "GBS4"
    store = StepStore(project, "toy", h.CONTEXT, dump_dir=dump)
    store.save(STEP, h.plain_payload(64, 1.0))
    assert store.load(store.verified(STEP))
    os.chmod(dump, 0o777)
    lost = 0
    with pytest.raises(CorruptCacheError, match="chmod go-w"):
        store.verified(STEP)
    lost += int(store.step_numbers_on_disk() != [])
    trusting = StepStore(project, "toy", h.CONTEXT, dump_dir=dump, trust_permissions=True)
    lost += int(not trusting.load(trusting.verified(STEP)))
    ledger("trust", "dump_dir writable by others (StepStore(dump_dir=...))", 1, "refused, fix named", lost)
    assert lost == 0


def test_a_symlinked_step_is_neither_loaded_nor_written_through(tmp_path: Path, caplog: Any, ledger: Any) -> None:
    dump = tmp_path / "dump"
    h.call(h.runtime(dump), h.ToyTarget(), STEP)
    store = _store(dump)
    elsewhere = tmp_path / "victim"
    store.step_dir(STEP).rename(elsewhere)
    before = {p: p.read_bytes() for p in elsewhere.iterdir()}
    for p in elsewhere.iterdir():  # old enough for any garbage collection
        os.utime(p, (time.time() - 7200, time.time() - 7200))
    (elsewhere / "tensors-1-1-deadbeef.bin").write_bytes(b"victim's file")
    before[elsewhere / "tensors-1-1-deadbeef.bin"] = b"victim's file"
    store.step_dir(STEP).symlink_to(elsewhere)
    garbage._LAST_SCAN.clear()
    target = h.ToyTarget()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        h.call(h.runtime(dump), target, STEP)  # not loaded; the save must not write into the victim
        h.call(h.runtime(dump), h.ToyTarget(), STEP + 1)  # another save: collects garbage
    after = {p: p.read_bytes() for p in elsewhere.iterdir()}
    lost = int(target.calls != [STEP]) + int(before != after)
    ledger("trust", "a step directory that is a symlink to another directory", 2,
           f"not loaded: {target.calls == [STEP]}; files written or deleted there: {len(set(before) ^ set(after))}",
           lost)  # fmt: skip
    assert lost == 0, (target.calls, set(before) ^ set(after))


def test_strict_untrusted_is_a_cache_error(tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    h.call(h.runtime(dump), h.ToyTarget(), STEP)
    os.chmod(_store(dump).project_dir, 0o777)
    with pytest.raises(CacheError, match="trust_dir_permissions"):
        h.call(h.runtime(dump, action="strict"), h.ToyTarget(), STEP)


# ---------------------------------------------------------------- leftovers


def test_leftovers_of_killed_saves_are_collected_by_a_later_save(tmp_path: Path, ledger: Any) -> None:
    """SIGKILLed saves of several steps leave files; once abandoned, a save of another step removes them."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    project = tmp_path / "proj"
    payload = h.plain_payload(1 << 16, 1.0)
    killed = 0
    for step, kill_at in ((1, 1), (2, 2), (3, 3), (4, 5)):
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=h.dump_child, args=(str(project), step, [payload, payload], ("0", "1"), kill_at, child)
        )
        proc.start()
        child.close()
        parent.recv()
        proc.join(30)
        killed += int(proc.exitcode == -signal.SIGKILL)
    left = [p for p in project.rglob("*") if p.is_file()]
    old = time.time() - garbage.ABANDONED_AFTER - 60
    for p in left:
        os.utime(p, (old, old))
    garbage._LAST_SCAN.clear()  # a new run
    store = StepStore(project, "toy", h.CONTEXT)
    store.save(9, h.plain_payload(64, 2.0))
    remaining = [p for p in project.rglob("*") if p.is_file() and p.parent.name != "9"]
    lost = int(remaining != []) + int(killed != 4) + int(not left)
    ledger("crash", "4 saves SIGKILLed mid-write (2 parts each); files aged 11 min; a later save of another step",
           4, f"left behind: {len(left)} files; after the later save: {len(remaining)}", lost)  # fmt: skip
    assert lost == 0, (killed, left, remaining)


# ---------------------------------------------------------------- a data file changed after it was verified

_CHANGED_AFTER_VERIFY = """
import os, sys, torch
from pathlib import Path
from skipinject.store import Payload, StepStore

store = StepStore(Path(sys.argv[1]), "toy", {"run": 1})
store.save(1, Payload(tensors={"x": torch.arange(1 << 20, dtype=torch.int64)}, objects={}, rows=1))
entry = store.verified(1)  # what a read-ahead holds while the step before it trains
(path,) = store.step_dir(1).glob("tensors-*.bin")
size = path.stat().st_size
with open(path, "r+b") as handle:  # another process rewrites the file in place, then truncates it
    handle.seek(size // 2)
    handle.write(bytes(size // 2))
(part,) = store.load(entry)
with open(path, "r+b") as handle:
    handle.truncate(64)
x = part.tensors["x"]
print(bool(torch.equal(x, torch.arange(1 << 20, dtype=torch.int64))), int(x.sum()))
"""


def test_a_served_tensor_never_changes_nor_faults_after_it_was_verified(tmp_path: Path, ledger: Any) -> None:
    """An uncompressed local step verified (as a read-ahead does), then its tensor file rewritten in
    place and truncated by another process: what is served is what was verified, and the process
    does not die of SIGBUS (a child process, so that a fault cannot take the suite with it)."""
    import subprocess
    import sys

    child = subprocess.run(
        [sys.executable, "-c", _CHANGED_AFTER_VERIFY, str(tmp_path / "project")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    expected = f"True {sum(range(1 << 20))}"
    lost = int(child.returncode != 0 or child.stdout.strip() != expected)
    outcome = "served as verified, no fault" if not lost else f"exit {child.returncode}: {child.stdout.strip()!r}"
    ledger(
        "integrity", "a verified tensor file rewritten in place, then truncated, before it is served", 1, outcome, lost
    )
    assert not lost, (child.returncode, child.stdout, child.stderr[-500:])
