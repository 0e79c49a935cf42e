"""Save/load a GRPO-sized rollout batch: upstream's pickle vs skipinject's store, in one run.

The reference batch is shaped like a GRPO run's rollout: B=4096 sequences, prompt 1024 +
response 4096 tokens, seven tensors (872 MB) plus per-sample ``uid``, ``data_source``,
``raw_prompt`` (chat messages) and ``reward_model``, built GRPO-style (512 prompts repeated n=8
times, interleaved, with ``DataProto.repeat``). Loads are warm (files in the page cache) and
"usable": every page of every tensor has been touched.

A second table (skip with ``--no-v1``) does the same for verl's V1 TransferQueue path: the
TensorDict that ``tq.kv_batch_get`` returns for a sampled batch (jagged prompts/responses, one
NonTensorStack per per-trajectory field), saved upstream's way (``torch.save`` of
``{"tensordict", "tags", "keys", "global_steps"}``, loaded with ``weights_only=False``).

    python benchmarks/bench_store.py            # full reference batch
    python benchmarks/bench_store.py --quick    # small batch (CI smoke test)
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import results  # noqa: E402
from skipinject.store import StepStore  # noqa: E402
from skipinject.verl.codecs import DataProtoCodec  # noqa: E402

PAGE = 4096
SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."


def build_batch(rows: int, prompt_len: int, response_len: int, n: int) -> Any:
    """A DataProto shaped like an AgentLoopManager.generate_sequences result."""

    prompts = rows // n
    gen = torch.Generator().manual_seed(0)
    seq = prompt_len + response_len
    tensors = {
        "prompts": torch.randint(0, 151_000, (rows, prompt_len), generator=gen),
        "responses": torch.randint(0, 151_000, (rows, response_len), generator=gen),
        "input_ids": torch.randint(0, 151_000, (rows, seq), generator=gen),
        "attention_mask": torch.ones(rows, seq, dtype=torch.int64),
        "position_ids": torch.arange(seq, dtype=torch.int64).expand(rows, seq).contiguous(),
        "response_mask": torch.ones(rows, response_len, dtype=torch.int64),
        "rollout_log_probs": -torch.rand(rows, response_len, generator=gen),
    }
    return grpo_batch(tensors, prompts, n)


def grpo_batch(tensors: dict[str, torch.Tensor], prompts: int, n: int) -> Any:
    """A DataProto of ``tensors`` with GRPO's per-sample columns (``prompts`` prompts repeated ``n`` times)."""
    from verl.protocol import DataProto

    raw_prompt = [
        [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Problem {i}: " + "what is the sum of the first n odd numbers? " * 6},
        ]
        for i in range(prompts)
    ]
    per_prompt = DataProto.from_dict(
        non_tensors={
            "uid": np.array([f"{i:08x}-7f3c-4a1e-9b2d-{i:012x}" for i in range(prompts)], dtype=object),
            "data_source": np.array(["openai/gsm8k"] * prompts, dtype=object),
            "raw_prompt": np.fromiter(raw_prompt, dtype=object, count=prompts),
            "reward_model": np.fromiter(
                ({"style": "rule", "ground_truth": str(i * 7)} for i in range(prompts)), dtype=object, count=prompts
            ),
        }
    )
    repeated = per_prompt.repeat(repeat_times=n, interleave=True)
    return DataProto.from_dict(
        tensors=tensors,
        non_tensors=repeated.non_tensor_batch,
        meta_info={"global_steps": 3, "timing": {"generate_sequences": 12.5}, "temperature": 1.0},
    )


def build_tq_batch(rows: int, prompt_len: int, response_len: int, n: int) -> dict[str, Any]:
    """Upstream's V1 dump payload around a TensorDict shaped like a ``tq.kv_batch_get`` result."""
    from tensordict import NonTensorStack, TensorDict

    from skipinject.verl.tensordicts import non_tensor_items

    gen = torch.Generator().manual_seed(0)
    prompt_lens = torch.randint(prompt_len // 2, prompt_len + 1, (rows,), generator=gen)
    response_lens = torch.randint(response_len // 2, response_len + 1, (rows,), generator=gen)

    def jagged(lengths: torch.Tensor, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
        offsets = torch.zeros(rows + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return torch.nested.nested_tensor_from_jagged(make(int(offsets[-1])), offsets=offsets)

    def ids(total: int) -> torch.Tensor:
        return torch.randint(0, 151_000, (total,), generator=gen)

    def ones(total: int) -> torch.Tensor:
        return torch.ones(total, dtype=torch.int64)

    seq_lens = prompt_lens + response_lens
    fields: dict[str, Any] = {
        "prompts": jagged(prompt_lens, ids),
        "responses": jagged(response_lens, ids),
        "response_mask": jagged(response_lens, ones),
        "loss_mask": jagged(response_lens, ones),
        "input_ids": jagged(seq_lens, ids),
        "position_ids": jagged(seq_lens, lambda t: torch.arange(t, dtype=torch.int64)),
        "rollout_log_probs": jagged(response_lens, lambda t: -torch.rand(t, generator=gen)),
        "rm_scores": jagged(response_lens, lambda t: torch.zeros(t)),
    }
    prompt_of = [i // n for i in range(rows)]
    uids = [f"{p:08x}7f3c4a1e9b2d{p:012x}" for p in prompt_of]
    columns: dict[str, list[Any]] = {
        "num_turns": [2] * rows,
        "metrics": [{"generate_sequences": 1.5, "tool_calls": 0.0, "num_preempted": -1} for _ in range(rows)],
        "extra_fields": [{"turn_scores": [], "min_global_steps": 3, "max_global_steps": 3} for _ in range(rows)],
        "raw_prompt": [
            [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"Problem {p}: " + "what is the sum of the first n odd numbers? " * 6},
            ]
            for p in prompt_of
        ],
        "data_source": ["openai/gsm8k"] * rows,
        "reward_model": [{"style": "rule", "ground_truth": str(p * 7)} for p in prompt_of],
        "extra_info": [{"index": p, "split": "train"} for p in prompt_of],
        "index": prompt_of,
        "uid": uids,
        "tools_kwargs": [{} for _ in range(rows)],
        "agent_name": ["single_turn_agent"] * rows,
        "global_steps": [3] * rows,
        "session_id": [i % n for i in range(rows)],
        "multi_modal_inputs": [{} for _ in range(rows)],
    }
    for name, values in columns.items():
        fields[name] = NonTensorStack(*non_tensor_items(values))
    keys = [f"{uid}_{i % n}_0" for i, uid in enumerate(uids)]
    tags = [
        {"status": "success", "prompt_len": int(p), "response_len": int(r), "global_steps": 3}
        for p, r in zip(prompt_lens.tolist(), response_lens.tolist(), strict=True)
    ]
    return {"tensordict": TensorDict(fields, batch_size=rows), "tags": tags, "keys": keys, "global_steps": 3}


def tensors_of(batch: Any) -> list[torch.Tensor]:
    """The tensors holding a result's bytes (a DataProto's batch, a V1 payload's jagged values)."""
    if isinstance(batch, dict):
        out = []
        for value in batch["tensordict"].values():
            if isinstance(value, torch.Tensor):
                out.append(value.values() if value.is_nested else value)
        return out
    return list(batch.batch.values())


def tensor_bytes(batch: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(batch))


def touch(batch: Any) -> int:
    """Read one byte of every page of every tensor: the batch is then really usable."""
    total = 0
    for tensor in tensors_of(batch):
        flat = tensor.reshape(-1).view(torch.uint8)
        total += int(flat[::PAGE].sum()) + int(flat[-1])
    return total


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads (less disturbed by other load than wall time)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(
    figures: dict[str, Any], key: str, fn: Callable[[], Any], repeat: int, after: Callable[[], Any] | None = None
) -> Any:
    """Median wall and CPU ms over ``repeat`` runs (after one warm-up run) into ``figures``; the last result.
    ``after`` runs after each run, outside the timing."""
    walls, cpus = [], []
    result = None
    for i in range(repeat + 1):
        result = None
        gc.collect()
        wall, cpu = time.perf_counter(), cpu_seconds()
        result = fn()
        if i:
            walls.append((time.perf_counter() - wall) * 1000)
            cpus.append((cpu_seconds() - cpu) * 1000)
        if after is not None:
            after()
    figures[f"{key}_ms"] = statistics.median(walls)
    figures[f"{key}_min_ms"] = min(walls)
    figures[f"{key}_cpu_ms"] = statistics.median(cpus)
    return result


class NewFiles:
    """Saves as a training run makes them: each to a new file (upstream) or step (skipinject), the
    previous one deleted after the timed save. (Saving over one path would time writes into the page
    cache pages the truncated file just freed, which only the side that truncates gets.)"""

    def __init__(self, workdir: Path, name: str, store: StepStore) -> None:
        self.workdir, self.name, self.store, self.count = workdir, name, store, 0

    @property
    def path(self) -> Path:
        return self.workdir / f"{self.count}-{self.name}"

    def upstream(self, save: Callable[[Path], Any]) -> tuple[Callable[[], Any], Callable[[], Any]]:
        def run() -> Any:
            self.count += 1
            return save(self.path)

        def after() -> None:
            for old in self.workdir.glob(f"*-{self.name}"):
                if old != self.path:
                    old.unlink()

        return run, after

    def ours(self, save: Callable[[int], Any]) -> tuple[Callable[[], Any], Callable[[], Any]]:
        def run() -> Any:
            self.count += 1
            return save(self.count)

        def after() -> None:
            if self.count > 1:
                shutil.rmtree(self.store.step_dir(self.count - 1))

        return run, after


def measure_our_saves(figures: dict[str, Any], store: StepStore, workdir: Path, encode: Any, repeat: int) -> None:
    """``ours_save``: encode + save, each timed run to a new step; leaves exactly step 1 saved."""
    steps = NewFiles(workdir, "", store)
    save, after = steps.ours(lambda step: store.save(step, encode(), {}))
    measure(figures, "ours_save", save, repeat, after)
    store.save(1, encode(), {})
    if steps.count != 1:
        shutil.rmtree(store.step_dir(steps.count))


def run(rows: int, prompt_len: int, response_len: int, n: int, repeat: int, workdir: Path) -> dict[str, Any]:
    batch = build_batch(rows, prompt_len, response_len, n)
    codec = DataProtoCodec()
    store = StepStore(workdir / "store", "rollout", {"bench": True})
    figures: dict[str, Any] = {"rows": rows, "tensor_mb": tensor_bytes(batch) / 1e6}

    upstream_files = NewFiles(workdir, "gen_batch.dp", store)
    save, after = upstream_files.upstream(batch.save_to_disk)
    measure(figures, "upstream_save", save, repeat, after)
    upstream_path = upstream_files.path
    measure(figures, "ours_encode", lambda: codec.encode(batch), repeat)
    measure_our_saves(figures, store, workdir, lambda: codec.encode(batch), repeat)
    # What a miss costs the training call: encode and a private copy; the write runs in the background.
    measure(figures, "ours_miss_call", lambda: codec.encode(batch).private_copy(), repeat)
    figures["upstream_file_mb"] = upstream_path.stat().st_size / 1e6
    files = store.read_meta(1)["parts"][0]["files"]
    figures["ours_files_mb"] = sum(spec["size"] for spec in files.values()) / 1e6
    figures["ours_objects_kb"] = files["objects"]["size"] / 1e3

    from verl.protocol import DataProto

    def upstream_load() -> Any:
        loaded = DataProto.load_from_disk(upstream_path)
        touch(loaded)
        return loaded

    def ours_load() -> Any:
        entry = store.verified(1)
        [part] = store.load(entry)
        loaded = codec.decode(part)
        touch(loaded)
        return loaded

    zstd = compressed_copy(store, workdir / "store_zstd", codec.encode(batch))
    check_equal(batch, ours_load())
    check_equal(batch, codec.decode(zstd.load(zstd.verified(1))[0]))
    measure_hits(figures, store, zstd, codec, upstream_load, repeat)
    hit_stages(figures, store, codec, repeat)
    return figures


def compressed_copy(store: StepStore, project: Path, payload: Any) -> StepStore:
    """The same step saved ``zstd``-compressed (compact encodings, zstd level 1) in a store of its own."""
    from skipinject.store.compression import parse_compression

    zstd = StepStore(project, store.role, store.context, compression=parse_compression("zstd"))
    zstd.save(1, payload, {})
    return zstd


#: The hits timed beside the copy floor, in each round: (figure key, what it is).
HITS = (
    ("ours_load", "`none`, fresh memory (`reuse_hit_memory=0`)"),
    ("ours_load_pool", "`none`, hit-memory pool (`reuse_hit_memory=2`, previous batch held)"),
    ("ours_zstd_load", "`zstd`, fresh memory (`reuse_hit_memory=0`)"),
    ("ours_zstd_load_pool", "`zstd`, hit-memory pool (`reuse_hit_memory=2`, previous batch held)"),
)


def measure_hits(
    figures: dict[str, Any], store: StepStore, zstd: StepStore, codec: Any, upstream: Callable[[], Any], repeat: int
) -> None:
    """Every hit not read ahead (uncompressed and ``zstd``, fresh memory and the hit-memory pool), upstream's
    load and the copy floor, interleaved round by round in this process (a shared machine's load moves; a
    ratio is taken within each round, its median reported), each round starting one run later (what fresh
    memory costs depends on what ran before: a VM that gives freed memory back to its host charges for it
    again). Each hit verifies, loads, decodes and touches every page; with the pool, the previous hit's batch
    is held while the next loads (verl's loop)."""
    from skipinject.store.hit_memory import HitMemory

    floor = CopyFloor(store, 1)
    figures["copy_floor_threads"] = floor.threads

    def hit(source: StepStore, keep: list[Any] | None = None) -> Callable[[], Any]:
        def run() -> Any:
            [part] = source.load(source.verified(1))
            loaded = codec.decode(part)
            touch(loaded)
            if keep is not None:  # the previous batch goes once the next one is loaded
                keep[:] = [loaded]
            return loaded

        return run

    def pooled(source: StepStore) -> StepStore:
        return StepStore(source.project_dir, source.role, source.context, memory=HitMemory(2))

    held: dict[str, list[Any]] = {"ours_load_pool": [], "ours_zstd_load_pool": []}
    runs: dict[str, Callable[[], Any]] = {
        "copy_floor": floor,
        "copy_floor_huge": CopyFloor(store, 1, huge=True),
        "upstream_load": upstream,
        "ours_load": hit(store),
        "ours_load_pool": hit(pooled(store), held["ours_load_pool"]),
        "ours_zstd_load": hit(zstd),
        "ours_zstd_load_pool": hit(pooled(zstd), held["ours_zstd_load_pool"]),
    }
    walls: dict[str, list[float]] = {key: [] for key in runs}
    cpus: dict[str, list[float]] = {key: [] for key in runs}
    order = list(runs)
    for i in range(repeat + 1):
        for key in order[i % len(order) :] + order[: i % len(order)]:  # each run first in some round
            fn = runs[key]
            gc.collect()
            wall, cpu = time.perf_counter(), cpu_seconds()
            result = fn()
            if i:
                walls[key].append((time.perf_counter() - wall) * 1000)
                cpus[key].append((cpu_seconds() - cpu) * 1000)
            del result
    for key in runs:
        figures[f"{key}_ms"] = statistics.median(walls[key])
        figures[f"{key}_min_ms"] = min(walls[key])
        figures[f"{key}_cpu_ms"] = statistics.median(cpus[key])
    floors, pickles = walls["copy_floor"], walls["upstream_load"]
    for key, _ in HITS:
        figures[f"{key}_x_floor"] = statistics.median(h / f for h, f in zip(walls[key], floors, strict=True))
        figures[f"{key}_x_pickle"] = statistics.median(p / h for h, p in zip(walls[key], pickles, strict=True))
        figures[f"{key}_x_floor_fastest"] = min(walls[key]) / min(floors)
    figures["upstream_load_x_floor"] = statistics.median(p / f for p, f in zip(pickles, floors, strict=True))
    figures["copy_floor_huge_x_floor"] = statistics.median(
        h / f for h, f in zip(walls["copy_floor_huge"], floors, strict=True)
    )
    figures["hit_rounds"] = repeat


class CopyFloor:
    """What no verified private hit can beat: every byte of the step's data files read into fresh private
    memory (an anonymous mapping in 4 KiB pages, as a hit's; ``huge``: transparent huge pages asked for,
    as numpy asks for its large arrays) and checksummed as each 32 MiB chunk lands, the chunks spread over
    every core's thread."""

    def __init__(self, store: StepStore, step: int, huge: bool = False) -> None:
        self.huge = huge
        from concurrent.futures import ThreadPoolExecutor

        from skipinject.store.checksums import workers

        meta = store.read_meta(step)
        directory = store.step_dir(step)
        self.files = [directory / spec["name"] for part in meta["parts"] for spec in part["files"].values()]
        self.threads = workers()
        self.pool = ThreadPoolExecutor(self.threads)

    def __call__(self) -> list[mmap.mmap]:
        import xxhash

        from skipinject.store.format import TREE_CHUNK

        memories, jobs, handles = [], [], []
        try:
            for path in self.files:
                handle = os.open(path, os.O_RDONLY)
                handles.append(handle)
                size = os.fstat(handle).st_size
                memory = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                if self.huge:
                    memory.madvise(mmap.MADV_HUGEPAGE)
                memories.append(memory)  # fresh pages: each faults in as the read lands
                view = memoryview(memory)
                jobs += [(handle, view[at : at + TREE_CHUNK], at) for at in range(0, size, TREE_CHUNK)]

            def read(job: tuple[int, memoryview, int]) -> int:
                handle, view, at = job
                done = 0
                while done < len(view):
                    got = os.preadv(handle, [view[done:]], at + done)
                    if got <= 0:
                        raise OSError(f"short read at {at + done}")
                    done += got
                return int(xxhash.xxh3_64_intdigest(view))

            list(self.pool.map(read, jobs))
        finally:
            for handle in handles:
                os.close(handle)
        return memories


def hit_stages(figures: dict[str, Any], store: StepStore, codec: Any, repeat: int) -> None:
    """Where our load time goes: the same steps, timed one by one."""
    stages: dict[str, list[float]] = {"verify": [], "read": [], "decode": [], "touch": []}
    for _ in range(repeat):
        gc.collect()
        marks = [time.perf_counter()]
        entry = store.verified(1)
        marks.append(time.perf_counter())
        parts = store.load(entry)
        marks.append(time.perf_counter())
        decoded = codec.decode(parts[0])
        marks.append(time.perf_counter())
        touch(decoded)
        marks.append(time.perf_counter())
        for name, start, end in zip(stages, marks, marks[1:], strict=False):
            stages[name].append((end - start) * 1000)
        del entry, parts, decoded
    for name, values in stages.items():
        figures[f"ours_{name}_ms"] = statistics.median(values)


def run_v1(rows: int, prompt_len: int, response_len: int, n: int, repeat: int, workdir: Path) -> dict[str, Any]:
    from skipinject.verl.codecs import TensorDictCodec

    batch = build_tq_batch(rows, prompt_len, response_len, n)
    codec = TensorDictCodec()
    store = StepStore(workdir / "store_v1", "rollout_tq", {"bench": True})
    figures: dict[str, Any] = {"rows": rows, "tensor_mb": tensor_bytes(batch) / 1e6}
    upstream_files = NewFiles(workdir, "tq_batch.pt", store)
    save, after = upstream_files.upstream(lambda path: torch.save(batch, path))
    measure(figures, "upstream_save", save, repeat, after)
    save, after = upstream_files.upstream(lambda path: save_fsynced(batch, path))
    measure(figures, "upstream_save_fsync", save, repeat, after)
    upstream_path = upstream_files.path
    measure(figures, "ours_encode", lambda: codec.encode(batch), repeat)
    measure_our_saves(figures, store, workdir, lambda: codec.encode(batch), repeat)
    # What a miss costs the sample call besides the TransferQueue read both sides make: encode and a
    # private copy; the write runs in the background (rollout_tq's sample phase).
    measure(figures, "ours_miss_call", lambda: codec.encode(batch).private_copy(), repeat)
    figures["upstream_file_mb"] = upstream_path.stat().st_size / 1e6
    files = store.read_meta(1)["parts"][0]["files"]
    figures["ours_files_mb"] = sum(spec["size"] for spec in files.values()) / 1e6
    figures["ours_objects_kb"] = files["objects"]["size"] / 1e3

    def upstream_load() -> Any:
        loaded = torch.load(upstream_path, weights_only=False)
        touch(loaded)
        return loaded

    def ours_load() -> Any:
        [part] = store.load(store.verified(1))
        loaded = codec.decode(part)
        touch(loaded)
        return loaded

    zstd = compressed_copy(store, workdir / "store_v1_zstd", codec.encode(batch))
    measure_hits(figures, store, zstd, codec, upstream_load, repeat)
    # What reading the rows then costs: verl's tu.get of every non-tensor field (NonTensorStack.tolist()).
    # skipinject's hit makes a field's row objects the first time it is read; torch.load made them all.
    loaded = measure(figures, "upstream_fields", lambda: read_fields(upstream_load()), repeat)
    del loaded
    loaded = measure(figures, "ours_fields", lambda: read_fields(ours_load()), repeat)
    from verl.utils.tensordict_utils import assert_tensordict_eq

    assert_tensordict_eq(batch["tensordict"], loaded["tensordict"])
    if loaded["keys"] != batch["keys"] or loaded["tags"] != batch["tags"]:
        raise AssertionError("keys or tags differ")
    del loaded
    hit_stages(figures, store, codec, repeat)
    return figures


def save_fsynced(batch: Any, path: Path) -> None:
    """``torch.save`` made durable as skipinject's save is (the file fsynced)."""
    with open(path, "wb") as handle:
        torch.save(batch, handle)
        handle.flush()
        os.fsync(handle.fileno())


def read_fields(loaded: dict[str, Any]) -> dict[str, Any]:
    """Every non-tensor field's rows read as training code reads them (verl's ``tu.get``)."""
    from verl.utils import tensordict_utils as tu

    td = loaded["tensordict"]
    for key in list(td.keys()):
        if not isinstance(td.get(key), torch.Tensor):
            tu.get(td, key)
    return loaded


def check_equal(a: Any, b: Any) -> None:
    if set(a.batch.keys()) != set(b.batch.keys()):
        raise AssertionError("tensor keys differ")
    for key in sorted(a.batch.keys()):
        if a.batch[key].dtype != b.batch[key].dtype or not torch.equal(a.batch[key], b.batch[key]):
            raise AssertionError(f"tensor {key} differs")
    for key, value in a.non_tensor_batch.items():
        other = b.non_tensor_batch[key]
        if other.shape != value.shape or list(other) != list(value):
            raise AssertionError(f"non-tensor {key} differs")
    if a.meta_info != b.meta_info:
        raise AssertionError("meta_info differs")


def table(title: str, upstream: str, f: dict[str, Any]) -> list[str]:
    rows = [
        (f"save ({upstream} vs encode + write + fsync + checksum)", "upstream_save", "ours_save"),
        ("warm load, usable (ours: verify + load + decode + touch)", "upstream_load", "ours_load"),
    ]
    if "upstream_save_fsync_ms" in f:
        rows.insert(1, ("save, upstream's file fsynced too (`torch.save` + fsync)", "upstream_save_fsync", "ours_save"))
    if "ours_fields_ms" in f:
        rows.append(("warm load, usable, then every non-tensor field read (tu.get)", "upstream_fields", "ours_fields"))
    if "ours_miss_call_ms" in f:
        rows.insert(
            len(rows) - (2 if "ours_fields_ms" in f else 1),
            ("miss: what the training call waits for (ours: encode + private copy)", "upstream_save", "ours_miss_call"),
        )
    lines = [
        f"{title}: {f['rows']} rows, {f['tensor_mb']:.0f} MB of tensors; files: upstream "
        f"{f['upstream_file_mb']:.0f} MB, skipinject {f['ours_files_mb']:.0f} MB "
        f"(objects {f['ours_objects_kb']:.0f} kB)",
        "",
        "| operation | upstream ms | skipinject ms | ratio | upstream CPU ms | skipinject CPU ms | CPU ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, up, ours in rows:
        wall_up, wall_ours = f[f"{up}_ms"], f[f"{ours}_ms"]
        cpu_up, cpu_ours = f[f"{up}_cpu_ms"], f[f"{ours}_cpu_ms"]
        lines.append(
            f"| {name} | {wall_up:.1f} | {wall_ours:.1f} | {wall_up / wall_ours:.1f}x "
            f"| {cpu_up:.1f} | {cpu_ours:.1f} | {cpu_up / max(cpu_ours, 1e-3):.1f}x |"
        )
    best_up, best_ours = f["upstream_load_min_ms"], f["ours_load_min_ms"]
    lines += [
        "",
        f"fastest warm load: upstream {best_up:.1f} ms, skipinject {best_ours:.1f} ms ({best_up / best_ours:.1f}x)",
    ]
    if "copy_floor_ms" in f:  # results recorded before the floor was measured have none
        lines.append(
            f"copy floor (every byte read into fresh private memory, checksummed per 32 MiB chunk as it lands, "
            f"{f['copy_floor_threads']} threads): {f['copy_floor_ms']:.1f} ms (CPU {f['copy_floor_cpu_ms']:.1f}); "
            f"skipinject's warm load is {f['ours_load_ms'] / f['copy_floor_ms']:.2f}x the floor, "
            f"upstream's {f['upstream_load_ms'] / f['copy_floor_ms']:.2f}x"
        )
    return lines


def hits_table(f: dict[str, Any]) -> list[str]:
    """Every hit not read ahead beside the copy floor and upstream's load of the same rounds."""
    if "ours_zstd_load_x_floor" not in f:  # results recorded before the hits were interleaved
        return []
    lines = [
        f"Hits not read ahead, {f['hit_rounds']} interleaved rounds (each: the copy floor, upstream's load and "
        f"every hit, each round starting one later); copy floor {f['copy_floor_ms']:.0f} ms (fastest "
        f"{f['copy_floor_min_ms']:.0f}), upstream's load {f['upstream_load_ms']:.0f} ms "
        f"({f['upstream_load_x_floor']:.2f}x the floor); the copy floor into transparent huge pages "
        f"{f['copy_floor_huge_ms']:.0f} ms (fastest {f['copy_floor_huge_min_ms']:.0f}, "
        f"{f['copy_floor_huge_x_floor']:.2f}x the floor). x floor and x pickle are medians of the rounds' ratios; "
        "fastest: the fastest hit over the fastest floor:",
        "",
        "| hit (verify + load + decode + touch) | ms | fastest ms | CPU ms | x copy floor | fastest x floor "
        "| pickle's load / hit |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, what in HITS:
        lines.append(
            f"| {what} | {f[f'{key}_ms']:.0f} | {f[f'{key}_min_ms']:.0f} | {f[f'{key}_cpu_ms']:.0f} "
            f"| {f[f'{key}_x_floor']:.2f}x | {f[f'{key}_x_floor_fastest']:.2f}x | {f[f'{key}_x_pickle']:.1f}x |"
        )
    return [*lines, ""]


def breakdown(f: dict[str, Any]) -> str:
    return (
        f"skipinject load breakdown (ms): verify {f['ours_verify_ms']:.1f}, load {f['ours_read_ms']:.1f}, "
        f"decode {f['ours_decode_ms']:.1f}, touch {f['ours_touch_ms']:.1f}; encode alone {f['ours_encode_ms']:.1f}"
    )


def report(figures: dict[str, Any], v1: dict[str, Any] | None) -> str:
    f = figures
    lines = table("DataProto (rollout)", "DataProto.save_to_disk, pickle", f)
    lines += ["", *hits_table(f), breakdown(f)]
    if v1 is not None:
        lines += ["", *table("V1 TensorDict (rollout_tq)", "torch.save, pickle", v1)]
        lines += ["", *hits_table(v1), breakdown(v1)]
    lines += ["", f"ratio = upstream/skipinject (higher is better); {f['conditions']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096, help="sequences in the batch (default 4096)")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--response-len", type=int, default=4096)
    parser.add_argument("-n", type=int, default=8, help="GRPO group size (rows repeat each prompt n times)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per figure (median reported)")
    parser.add_argument("--quick", action="store_true", help="small batch, 1 repeat (smoke test)")
    parser.add_argument("--no-v1", action="store_true", help="skip the V1 TransferQueue TensorDict table")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    results.add_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.prompt_len, args.response_len, args.repeat = 64, 32, 64, 1
    if args.rows % args.n:
        parser.error("--rows must be a multiple of -n")
    shape = (args.rows, args.prompt_len, args.response_len, args.n, args.repeat)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-store-") as tmp:
        figures = run(*shape, Path(tmp))
    v1 = None
    if not args.no_v1:
        gc.collect()
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-store-") as tmp:
            v1 = run_v1(*shape, Path(tmp))
    figures["conditions"] = (
        f"{os.cpu_count()} CPUs, load average {load_before:.1f} at start, {os.getloadavg()[0]:.1f} at end, "
        f"median of {args.repeat} runs after a warm-up run"
    )
    print(report(figures, v1))
    if args.json:
        print(json.dumps({"dataproto": figures, "v1": v1}))
    if args.record:
        results.record("store", {"dataproto": figures, "v1": v1, "repeat": args.repeat}, load_before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
