"""Compressed hits decode into memory kept from earlier hits (issue 25: a compressed local hit fast
enough), never into memory a live tensor still views.

Every hit is compared bit for bit (dtype, shape, values) with what was saved.
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pytest

import skipinject.store.hit_memory as hit_memory
from skipinject.config import role_config
from skipinject.errors import ConfigError
from skipinject.store import Payload, StepStore
from skipinject.store.compression import Compression
from skipinject.store.hit_memory import HitMemory, anonymous
from tests.unit.test_compression import CONCATS, ZSTD, _index, assert_same, padded_batch

torch = pytest.importorskip("torch")
pytest.importorskip("zstandard")


def _saved(tmp_path: Path, memory: HitMemory | None, compression: Compression | None = ZSTD) -> Any:
    tensors = padded_batch(rows=64, prompt=48, response=200)
    store = StepStore(tmp_path / "project", "toy", {"run": 1}, compression=compression, memory=memory)
    store.save(1, Payload(tensors=tensors, objects={"k": 1}, rows=64, concats=CONCATS))
    return store, tensors


def _hit(store: StepStore) -> dict[str, Any]:
    (part,) = store.load(store.verified(1))
    return part.tensors


@pytest.fixture
def fresh_buffers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the fresh mappings hits take (reused memory takes none)."""
    sizes: list[int] = []

    def counted(size: int) -> Any:
        sizes.append(size)
        return anonymous(size)

    monkeypatch.setattr(hit_memory, "anonymous", counted)
    return sizes


def _hits_trained_on(store: StepStore, saved: dict[str, Any], count: int) -> None:
    """``count`` hits, each equal to ``saved``, then written over in place (as training may) and dropped."""
    for _ in range(count):
        hit = _hit(store)
        assert_same(hit, saved)
        for tensor in hit.values():
            tensor.zero_()
        del hit
        gc.collect()


def _spans(tensors: dict[str, Any]) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors.values() if t.numel()]


def _overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return any(lo < other_hi and other_lo < hi for lo, hi in _spans(a) for other_lo, other_hi in _spans(b))


def test_from_the_third_hit_on_a_hit_decodes_into_memory_an_earlier_one_faulted_in(
    tmp_path: Path, fresh_buffers: list[int]
) -> None:
    """verl's loop: step k's batch is still held while step k+1's hit loads, and gone by step k+2's."""
    memory = HitMemory(2)
    store, saved = _saved(tmp_path, memory)
    previous: dict[str, Any] | None = None
    taken = []
    for _ in range(5):
        before = len(fresh_buffers)
        current = _hit(store)
        assert_same(current, saved)
        taken.append(len(fresh_buffers) - before)
        if previous is not None:
            assert not _overlap(current, previous)  # the batch training still holds is left alone
        for tensor in current.values():  # training writes into its batch in place
            tensor.fill_(7) if tensor.dtype != torch.bool else tensor.fill_(True)
        previous = current
        del current
        gc.collect()
    assert taken[:2] == [2, 2]  # the decompressed file and the restored tensors, fresh
    assert taken[2:] == [0, 0, 0]  # then reused: the padding zeros written anew over the 7s
    assert 0 < memory.nbytes <= 2 * 1.1 * sum(fresh_buffers[:2])


def test_a_tensor_kept_from_an_earlier_hit_is_never_overwritten(tmp_path: Path) -> None:
    memory = HitMemory(2)
    store, saved = _saved(tmp_path, memory)
    first = _hit(store)
    kept = {  # a stored view, a widened and a derived tensor, and a slice of one (it holds the memory too)
        "rollout_log_probs": first["rollout_log_probs"],
        "prompts": first["prompts"],
        "attention_mask": first["attention_mask"][1:],
    }
    copies = {name: tensor.clone() for name, tensor in kept.items()}
    del first
    gc.collect()
    _hits_trained_on(store, saved, 4)
    for name, tensor in kept.items():
        assert torch.equal(tensor, copies[name]), name
    assert torch.equal(kept["attention_mask"], saved["attention_mask"][1:])


def test_an_entry_verified_but_not_loaded_holds_its_memory_until_it_is_gone(tmp_path: Path) -> None:
    memory = HitMemory(1)
    store, saved = _saved(tmp_path, memory)
    entry = store.verified(1)
    second = _hit(store)  # the one slot is the entry's: fresh memory
    (part,) = store.load(entry)
    assert_same(part.tensors, saved)
    assert not _overlap(part.tensors, second)
    del entry, part, second
    gc.collect()
    assert_same(_hit(store), saved)


def test_the_pool_keeps_at_most_its_slots_and_its_bytes(tmp_path: Path, fresh_buffers: list[int]) -> None:
    memory = HitMemory(2)
    store, saved = _saved(tmp_path, memory)
    held = [_hit(store) for _ in range(4)]  # all alive: two slots, then fresh memory freed with its tensors
    for hit in held:
        assert_same(hit, saved)
    one_hit = sum(fresh_buffers[:2])
    assert len(fresh_buffers) == 8
    assert memory.nbytes <= 2 * 1.1 * one_hit
    del held, hit
    gc.collect()

    small = HitMemory(2, max_bytes=one_hit // 2)  # room for the decompressed file, not the restored tensors
    store.memory = small
    for _ in range(3):
        assert_same(_hit(store), saved)
        assert small.nbytes <= one_hit // 2
    small.clear()
    assert small.nbytes == 0


def test_reuse_hit_memory_0_gives_every_hit_fresh_memory(tmp_path: Path, fresh_buffers: list[int]) -> None:
    memory = HitMemory(role_config("rollout", {"reuse_hit_memory": 0}).reuse_hit_memory)
    store, saved = _saved(tmp_path, memory)
    for _ in range(3):
        assert_same(_hit(store), saved)
        gc.collect()
    assert len(fresh_buffers) == 6 and memory.nbytes == 0


def test_the_setting_takes_a_number_of_batches() -> None:
    assert role_config("rollout", {}).reuse_hit_memory == 2
    assert role_config("rollout", {"reuse_hit_memory": "4"}).reuse_hit_memory == 4
    for bad in (-1, 17, "two", 1.5):
        with pytest.raises(ConfigError, match=r"skip\.rollout\.reuse_hit_memory=.*0 \.\. 16"):
            role_config("rollout", {"reuse_hit_memory": bad})


def test_a_role_runtime_gives_its_stores_one_pool_sized_by_the_setting(tmp_path: Path) -> None:
    from skipinject import Role, StepSource, Target
    from skipinject.engine.runtime import RoleRuntime

    settings = role_config("toy", {"enable": True, "dump_dir": str(tmp_path), "reuse_hit_memory": 3})
    role = Role(name="toy", targets=[Target("json:dumps")], step=StepSource.argument("step"))
    runtime = RoleRuntime(role, settings, "tests")
    stores = [runtime.open(tmp_path / name, {}) for name in ("a", "b")]
    assert all(store.memory is runtime.hit_memory for store in stores)
    assert runtime.hit_memory.slots == 3


def test_hits_from_many_threads_never_share_memory(tmp_path: Path) -> None:
    memory = HitMemory(2)
    store, saved = _saved(tmp_path, memory)
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def hit() -> None:
        try:
            start.wait()
            for _ in range(3):
                got = _hit(store)
                assert_same(got, saved)
                with lock:
                    results.append(got)
        except BaseException as exc:  # reported below
            errors.append(exc)

    lock = threading.Lock()
    threads = [threading.Thread(target=hit) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(results) == 12
    for i, a in enumerate(results):  # all alive at the end: no two share a byte
        for b in results[i + 1 :]:
            assert not _overlap(a, b)
        assert_same(a, saved)


def test_an_uncompressed_hit_is_copied_into_the_pools_memory(tmp_path: Path) -> None:
    """Never a view of the file (what was verified cannot change after): its bytes are read into the
    pool's memory, two slots of it, reused from the third hit on."""
    memory = HitMemory(2)
    store, saved = _saved(tmp_path, memory, compression=None)
    held = []
    for _ in range(4):
        held = [*held[-1:], _hit(store)]
        assert_same(held[-1], saved)
    (tensors,) = store.step_dir(1).glob("tensors-*.bin")
    assert tensors.stat().st_size <= memory.nbytes <= 3 * tensors.stat().st_size


@pytest.mark.parametrize("dtype", ["int64", "int32", "int16", "uint8", "float32", "bool"])
def test_a_run_or_ramp_written_over_an_earlier_batch_is_written_in_full(dtype: str) -> None:
    """The rows written whole (reused memory) equal the rows written over zeros (fresh memory), for
    runs and ramps anywhere a writer records them (empty, whole, at either end, ramps starting before the row)."""
    from skipinject.store.tensorfile import Recipe

    kind_dtype = getattr(torch, dtype)
    rows, width = 9, 37
    starts = [0, 0, 3, 30, 37, 5, 0, 10, 36]
    ends = [3, 0, 3, 37, 37, 20, 20, 37, 36]
    specs = [("run", "end", starts, ends)]
    if dtype in ("int64", "int32", "int16"):
        ramp_starts = [-3, 0, 3, 30, 36, -9, -40, 10, 36]
        specs.append(("ramp", "top", ramp_starts, [3, 0, 2, 7, 5, 9, 100, 26, 1]))
    for key, other, first, second in specs:
        entry = {"derive": {key: first, other: second}, "shape": [rows, width]}
        recipe = Recipe.of(entry, {}, kind_dtype)
        fresh = torch.zeros(rows, width, dtype=kind_dtype)
        reused = torch.ones(rows, width, dtype=kind_dtype) * (1 if dtype == "bool" else 7)
        for block in recipe.blocks():
            recipe.write(fresh, block, zeroed=True)
            recipe.write(reused, block, zeroed=False)
        assert torch.equal(fresh, reused), key


def test_concatenations_and_widened_tensors_of_every_dtype_keep_every_bit(tmp_path: Path) -> None:
    """The restore copies through numpy where a dtype has one and through torch where not (bfloat16),
    into fresh and into reused memory alike."""
    gen = torch.Generator().manual_seed(3)
    tensors: dict[str, Any] = {}
    concats: dict[str, tuple[str, str]] = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int16, torch.int64, torch.bool):
        name = str(dtype).removeprefix("torch.")
        left = (torch.randn(6, 5, generator=gen) * 100).to(dtype)
        right = (torch.randn(6, 7, generator=gen) * 100).to(dtype)
        tensors |= {f"{name}_l": left, f"{name}_r": right, f"{name}_lr": torch.cat([left, right], dim=1)}
        concats[f"{name}_lr"] = (f"{name}_l", f"{name}_r")
    tensors["narrowed"] = torch.randint(-(1 << 14), 1 << 14, (6, 9), generator=gen, dtype=torch.int64)
    store = StepStore(tmp_path / "project", "toy", {"run": 1}, compression=ZSTD, memory=HitMemory(1))
    store.save(1, Payload(tensors=tensors, objects={}, rows=6, concats=concats))
    assert len(concats) == 6 and all("derive" in entry for entry in _index(store, 1) if entry["name"] in concats)
    _hits_trained_on(store, tensors, 3)


_RELEASE_THEN_READ = """
import sys
from pathlib import Path
from skipinject.store import Payload, StepStore
from tests.unit.test_compression import CONCATS, ZSTD, padded_batch

compression = None if sys.argv[2] == "none" else ZSTD
saved = padded_batch(rows=64, prompt=48, response=200)
store = StepStore(Path(sys.argv[1]) / "project", "toy", {"run": 1}, compression=compression, memory=None)
store.save(1, Payload(tensors=saved, objects={"k": 1}, rows=64, concats=CONCATS))
entry = store.verified(1)
(part,) = store.load(entry)
entry.release()
for name, tensor in part.tensors.items():
    assert tensor.sum().item() == saved[name].sum().item(), name
print("read after release")
"""


@pytest.mark.parametrize("stored", ["none", "zstd"])
def test_tensors_loaded_from_an_entry_stay_readable_after_it_is_released(tmp_path: Path, stored: str) -> None:
    """``StepEntry.release`` lets go of its mappings; it never unmaps memory a loaded tensor views
    (``torch.frombuffer`` holds no buffer export, so ``mmap.close`` would succeed under it: a crash)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _RELEASE_THEN_READ, str(tmp_path), stored],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "read after release" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
