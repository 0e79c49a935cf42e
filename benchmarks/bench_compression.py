"""Compression and compact encodings (issue 25) against upstream's pickle, side by side in one run.

The batch is a realistic GRPO rollout (not uniform random tokens): B sequences (default 2048) in
groups of n=8 sharing a prompt; prompts left-padded to 1024 tokens and responses right-padded to
4096, real lengths drawn per prompt / per response, token ids Zipf-distributed over a 151k vocabulary,
``attention_mask`` / ``position_ids`` / ``response_mask`` built as verl builds them, float32
``rollout_log_probs`` (zero on padding), plus GRPO's per-sample non-tensor columns.

Measured in one process, each a median of ``--repeat`` runs after a warm-up run, with the load
average at start and end (the machine is shared):

* upstream: ``DataProto.save_to_disk`` / ``load_from_disk`` (pickle), local disk;
* skipinject ``none`` / ``zstd`` (level 1, the default) / ``zstd-3`` (zstd's own default level):
  save (encode + write + fsync + checksums) and a verified hit (sizes + checksums + decompress +
  load + decode + every page touched), local disk. A compressed hit twice: *cold* (every hit in
  fresh memory, as the first hit of a run) and *steady state* (verl's loop: the previous hit's batch
  still held while the next one loads and dropped after, the memory pool of
  ``skip.<role>.reuse_hit_memory=2``), with the memory the pool keeps;
* a ``zstd`` hit *read ahead* (``skip.<role>.read_ahead``): the step verified in the background while
  the previous one "trains" (a sleep of ``--train-seconds``, which leaves the cores to the reader),
  then the hit as the training thread pays for it (waiting for the read-ahead, re-reading
  ``meta.json``, decoding the parts it loaded), previous batch held as in the steady state; and the
  wait alone;
* the floor of a verified uncompressed hit: mapping the stored bytes and checksumming them (what a
  hit cost while it served views of the file; it now copies them into private memory, so that what
  was verified cannot change after: cold, steady state and read ahead are measured for ``none`` too);
* with ``--s3``, the same save and hit against the local S3 server the tests use (moto).

    python benchmarks/bench_compression.py --s3            # the reference batch
    python benchmarks/bench_compression.py --quick --s3    # small batch (smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT / "benchmarks", ROOT):
    while str(path) in sys.path:
        sys.path.remove(str(path))
    sys.path.insert(0, str(path))

from bench_store import check_equal, grpo_batch, measure, tensor_bytes, touch  # noqa: E402

from benchmarks import results  # noqa: E402
from skipinject.engine.replay import ReadAhead  # noqa: E402
from skipinject.store import StepStore  # noqa: E402
from skipinject.store.checksums import file_checksum  # noqa: E402
from skipinject.store.compression import parse_compression  # noqa: E402
from skipinject.store.hit_memory import HitMemory  # noqa: E402
from skipinject.verl.codecs import DataProtoCodec  # noqa: E402

PAD = 151_643
VOCAB = 151_000


def build_padded_batch(rows: int, prompt_len: int, response_len: int, n: int, seed: int = 0) -> Any:
    """A DataProto like a GRPO rollout's: padded as verl pads, token ids Zipf-distributed."""
    rng = np.random.default_rng(seed)
    groups = rows // n

    def tokens(count: int) -> np.ndarray:
        return np.minimum(rng.zipf(1.2, count), VOCAB - 1)

    prompt_lens = rng.integers(min(64, prompt_len), prompt_len + 1, groups)
    response_lens = rng.integers(min(128, response_len), response_len + 1, rows)
    prompts = np.full((rows, prompt_len), PAD, dtype=np.int64)
    responses = np.full((rows, response_len), PAD, dtype=np.int64)
    prompt_mask = np.zeros((rows, prompt_len), dtype=np.int64)
    response_mask = np.zeros((rows, response_len), dtype=np.int64)
    log_probs = np.zeros((rows, response_len), dtype=np.float32)
    for group in range(groups):
        length = int(prompt_lens[group])
        prompt = tokens(length)
        for row in range(group * n, (group + 1) * n):
            prompts[row, prompt_len - length :] = prompt
            prompt_mask[row, prompt_len - length :] = 1
    for row in range(rows):
        length = int(response_lens[row])
        responses[row, :length] = tokens(length)
        response_mask[row, :length] = 1
        log_probs[row, :length] = -rng.exponential(0.4, length).astype(np.float32)
    prompt_mask_t = torch.from_numpy(prompt_mask)
    prompt_pos = torch.clip(torch.cumsum(prompt_mask_t, dim=-1) - 1, min=0)
    delta = torch.arange(1, response_len + 1).expand(rows, response_len)
    tensors = {
        "prompts": torch.from_numpy(prompts),
        "responses": torch.from_numpy(responses),
        "input_ids": torch.from_numpy(np.concatenate([prompts, responses], axis=1)),
        "attention_mask": torch.from_numpy(np.concatenate([prompt_mask, response_mask], axis=1)),
        "position_ids": torch.cat([prompt_pos, prompt_pos[:, -1:] + delta], dim=1),
        "response_mask": torch.from_numpy(response_mask),
        "rollout_log_probs": torch.from_numpy(log_probs),
    }
    return grpo_batch(tensors, groups, n)


@contextlib.contextmanager
def s3_url(workdir: Path) -> Iterator[str]:
    from tests.integration.s3_server import create_bucket, s3_server, use_server

    with s3_server(str(workdir / "moto.log")) as url:
        use_server(url, os.environ)
        create_bucket(url, "bench")
        yield "s3://bench/dump"


def stored_bytes(store: StepStore, step: int) -> int:
    return store.read_meta(step).stored_size


def measure_store(
    figures: dict[str, Any],
    key: str,
    store: StepStore,
    batch: Any,
    codec: DataProtoCodec,
    repeat: int,
    train_seconds: float = 0.0,
) -> None:
    """Save (each timed save a new step, the previous one removed outside the timing) and verified hit."""
    count = [0]

    def save() -> None:
        count[0] += 1
        store.save(count[0], codec.encode(batch), {})

    def after() -> None:
        if count[0] > 1:
            remove_step(store, count[0] - 1)

    measure(figures, f"{key}_save", save, repeat, after)
    step = count[0]
    figures[f"{key}_mb"] = stored_bytes(store, step) / 1e6

    def hit() -> Any:
        entry = store.verified(step)
        [part] = store.load(entry)
        loaded = codec.decode(part)
        touch(loaded)
        return loaded

    loaded = measure(figures, f"{key}_hit", hit, repeat)
    check_equal(batch, loaded)
    if isinstance(store.step_dir(step), Path):  # local hits (compressed or not) decode into the pool
        measure_steady(figures, key, store, hit, batch, repeat)
    if train_seconds > 0 and (key.endswith("_zstd") or key == "local_none"):
        measure_read_ahead(figures, key, store, step, batch, codec, repeat, train_seconds)


def measure_steady(figures: dict[str, Any], key: str, store: StepStore, hit: Any, batch: Any, repeat: int) -> None:
    """``{key}_steady_hit``: hits as verl's loop makes them, the previous batch held during each hit and
    dropped after, decoding into the memory pool a run uses (two batches); what the pool keeps."""
    store.memory = memory = HitMemory(2)
    held = [hit()]  # the first hit of a run (fresh memory); measure's warm-up is the second

    def steady() -> None:
        loaded = hit()  # held[0], the previous step's batch, is still alive here
        held[0] = loaded  # ... and dropped once this one is

    measure(figures, f"{key}_steady_hit", steady, repeat)
    check_equal(batch, held[0])
    figures[f"{key}_pool_mb"] = memory.nbytes / 1e6
    held.clear()
    store.memory = None
    memory.clear()


def measure_read_ahead(
    figures: dict[str, Any],
    key: str,
    store: StepStore,
    step: int,
    batch: Any,
    codec: DataProtoCodec,
    repeat: int,
    train_seconds: float,
) -> None:
    """``{key}_ahead_hit``: a hit of a step read ahead (:class:`ReadAhead`, as the engine uses it) while
    the previous step trained for ``train_seconds``, in the pool of a run (previous batch held);
    ``{key}_ahead_wait``: the part of it spent waiting for the read-ahead and re-reading ``meta.json``."""
    store.memory = memory = HitMemory(2)
    reader = ReadAhead("rollout")
    held: list[Any] = [None]
    waits: list[float] = []

    def train() -> None:  # the read-ahead starts once the step's call returned; the step trains
        reader.start(store, step - 1, lambda candidate: candidate == step)
        time.sleep(train_seconds)

    def hit() -> None:
        taken = reader.take(store, step)
        if taken is None:
            raise RuntimeError(f"step {step} was not read ahead in {train_seconds} s")
        entry, waited = taken
        waits.append(waited)
        [part] = store.load(entry)
        loaded = codec.decode(part)
        touch(loaded)
        held[0] = loaded  # the previous step's batch is dropped once this one is loaded

    train()
    measure(figures, f"{key}_ahead_hit", hit, repeat, train)
    figures[f"{key}_ahead_wait_ms"] = statistics.median(waits[1:]) * 1000
    figures["train_seconds"] = train_seconds
    check_equal(batch, held[0])
    reader.close()
    held.clear()
    store.memory = None
    memory.clear()


def remove_step(store: StepStore, step: int) -> None:
    location = store.step_dir(step)
    if isinstance(location, Path):
        shutil.rmtree(location)
    else:
        with contextlib.suppress(Exception):
            store.backend.fs.rm(location.path, recursive=True)  # type: ignore[attr-defined]


def run(args: argparse.Namespace, workdir: Path, url: str | None) -> dict[str, Any]:
    batch = build_padded_batch(args.rows, args.prompt_len, args.response_len, args.n)
    codec = DataProtoCodec()
    figures: dict[str, Any] = {"rows": args.rows, "tensor_mb": tensor_bytes(batch) / 1e6}
    from verl.protocol import DataProto

    upstream_path = workdir / "gen_batch.dp"
    measure(figures, "upstream_save", lambda: batch.save_to_disk(upstream_path), args.repeat)
    figures["upstream_mb"] = upstream_path.stat().st_size / 1e6

    def upstream_load() -> Any:
        loaded = DataProto.load_from_disk(upstream_path)
        touch(loaded)
        return loaded

    measure(figures, "upstream_hit", upstream_load, args.repeat)
    fresh_floor(figures, tensor_bytes(batch), args.repeat)
    for name in args.local:
        store = StepStore(workdir / f"local-{name}", "rollout", {"bench": True}, compression=parse_compression(name))
        measure_store(figures, f"local_{name}", store, batch, codec, args.repeat, args.train_seconds)
        if name == "none":
            floor(figures, store, args.repeat)
        shutil.rmtree(workdir / f"local-{name}")
    if url is not None:
        from skipinject.store import RemoteStepStore
        from skipinject.store.remote import open_remote

        fs, root = open_remote(url)
        for name in args.remote:
            compression = parse_compression(name)
            store = RemoteStepStore(root / name, "rollout", {"bench": True}, fs, compression=compression)
            measure_store(figures, f"s3_{name}", store, batch, codec, args.repeat, args.train_seconds)
    return figures


def floor(figures: dict[str, Any], store: StepStore, repeat: int) -> None:
    """Reading and checksumming the stored bytes of the last saved step, nothing else (mapped, as the hit does)."""
    step = max(store.step_numbers_on_disk())
    meta = store.read_meta(step)
    named = [part.at(store.step_dir(step), file.name) for part, file in meta.files()]
    algo = meta["checksum_algo"]
    measure(figures, "floor", lambda: [file_checksum(path, algo) for path in named], repeat)


def fresh_floor(figures: dict[str, Any], nbytes: int, repeat: int) -> None:
    """Allocating and filling as many bytes of fresh memory as the batch's tensors: what any load that
    builds the tensors anew in fresh memory (pickle's, a cold compressed hit's) pays at least, whatever
    it decodes; and filling memory already faulted in (what a steady-state hit's writes cost at least)."""

    def fill() -> Any:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        buffer.fill_(1)
        return buffer

    measure(figures, "fresh_floor", fill, repeat)
    warm = torch.empty(nbytes, dtype=torch.uint8)
    warm.fill_(0)
    measure(figures, "warm_floor", lambda: warm.fill_(1), repeat)


ROWS = (("save", "save (encode + write/upload + fsync + checksums)"), ("hit", "verified hit, usable"))


def report(f: dict[str, Any], local: list[str], remote: list[str]) -> str:
    up = f["upstream_mb"]
    lines = [
        f"Padded GRPO batch: {f['rows']} rows, {f['tensor_mb']:.0f} MB of tensors; {f['conditions']}.",
        "",
        "| store | stored MB | size vs pickle | save ms | save vs pickle | hit ms | hit vs pickle |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| upstream pickle, local disk | {up:.0f} | 1.00x | {f['upstream_save_ms']:.0f} | 1.0x "
        f"| {f['upstream_hit_ms']:.0f} | 1.0x |",
    ]
    for where, names in (("local disk", local), ("S3", remote)):
        for name in names:
            key = f"{'local' if where == 'local disk' else 's3'}_{name}"
            if f"{key}_mb" not in f:
                continue
            cold = ", hit cold (fresh memory)" if f"{key}_steady_hit_ms" in f else ""
            lines.append(
                f"| skipinject `{name}`, {where}{cold} | {f[f'{key}_mb']:.1f} | {f[f'{key}_mb'] / up:.3f}x "
                f"| {f[f'{key}_save_ms']:.0f} | {f['upstream_save_ms'] / f[f'{key}_save_ms']:.1f}x "
                f"| {f[f'{key}_hit_ms']:.0f} | {f['upstream_hit_ms'] / f[f'{key}_hit_ms']:.1f}x |"
            )
            if cold:
                lines.append(
                    f"| skipinject `{name}`, {where}, hit steady state (previous batch held, pool "
                    f"{f[f'{key}_pool_mb']:.0f} MB) | | | | | {f[f'{key}_steady_hit_ms']:.0f} "
                    f"| {f['upstream_hit_ms'] / f[f'{key}_steady_hit_ms']:.1f}x |"
                )
            if f"{key}_ahead_hit_ms" in f:
                lines.append(
                    f"| skipinject `{name}`, {where}, hit read ahead (while the previous step trained "
                    f"{f['train_seconds']:g} s; waited {f[f'{key}_ahead_wait_ms']:.1f} ms of it) | | | | "
                    f"| {f[f'{key}_ahead_hit_ms']:.0f} | {f['upstream_hit_ms'] / f[f'{key}_ahead_hit_ms']:.1f}x |"
                )
    if "floor_ms" in f and "local_none_hit_ms" in f:
        lines.append(
            f"\nFloor of a verified uncompressed hit (map + checksum the stored bytes): {f['floor_ms']:.0f} ms; "
            f"the `none` hit (copied into private memory) is {f['local_none_hit_ms'] / f['floor_ms']:.2f}x it cold, "
            f"{f.get('local_none_steady_hit_ms', 0) / f['floor_ms']:.2f}x in the steady state"
            + (
                f", and the hit a run waits for (read ahead) {f['local_none_ahead_hit_ms'] / f['floor_ms']:.2f}x."
                if "local_none_ahead_hit_ms" in f
                else "."
            )
        )
    if "fresh_floor_ms" in f and "local_zstd_hit_ms" in f:
        lines.append(
            f"Floor of any hit that builds the tensors anew (allocate and fill {f['tensor_mb']:.0f} MB of fresh "
            f"memory): {f['fresh_floor_ms']:.0f} ms, CPU {f['fresh_floor_cpu_ms']:.0f} ms; the `zstd` hit is "
            f"{f['local_zstd_hit_ms'] / f['fresh_floor_ms']:.2f}x it (CPU {f['local_zstd_hit_cpu_ms']:.0f} ms), "
            f"pickle's load {f['upstream_hit_ms'] / f['fresh_floor_ms']:.2f}x (CPU {f['upstream_hit_cpu_ms']:.0f} ms)."
        )
    if "warm_floor_ms" in f and "local_zstd_steady_hit_ms" in f:
        lines.append(
            f"Filling {f['tensor_mb']:.0f} MB of memory already faulted in: {f['warm_floor_ms']:.0f} ms; the "
            f"steady-state `zstd` hit (CPU {f['local_zstd_steady_hit_cpu_ms']:.0f} ms) keeps "
            f"{f['local_zstd_pool_mb']:.0f} MB allocated between hits (two batches' decoded size)."
        )
    for name in remote:
        if name != "none" and "s3_none_save_ms" in f and f"s3_{name}_save_ms" in f:
            lines.append(
                f"S3 `{name}` against S3 `none`: save {f['s3_none_save_ms'] / f[f's3_{name}_save_ms']:.1f}x, "
                f"hit {f['s3_none_hit_ms'] / f[f's3_{name}_hit_ms']:.1f}x faster."
            )
    lines.append("\nratio columns: upstream / skipinject for times (higher is better), skipinject / upstream for size.")
    return "\n".join(lines)


def sizes_report(args: argparse.Namespace) -> str:
    """Stored bytes of one save of the batch: upstream's pickle and each local compression (no timing)."""
    batch = build_padded_batch(args.rows, args.prompt_len, args.response_len, args.n)
    codec = DataProtoCodec()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-compression-") as tmp:
        upstream = Path(tmp) / "gen_batch.dp"
        batch.save_to_disk(upstream)
        pickle_mb = upstream.stat().st_size / 1e6
        lines = [
            f"Padded GRPO batch: {args.rows} rows, {tensor_bytes(batch) / 1e6:.0f} MB of tensors; "
            f"upstream pickle {pickle_mb:.1f} MB",
            "",
            "| store | stored MB | vs pickle |",
            "|---|---:|---:|",
        ]
        for name in args.local:
            store = StepStore(Path(tmp) / name, "rollout", {"bench": True}, compression=parse_compression(name))
            store.save(1, codec.encode(batch), {})
            loaded = codec.decode(store.load(store.verified(1))[0])
            check_equal(batch, loaded)
            mb = stored_bytes(store, 1) / 1e6
            lines.append(f"| skipinject `{name}` | {mb:.1f} | {mb / pickle_mb:.3f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--response-len", type=int, default=4096)
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--local", nargs="*", default=["none", "zstd", "zstd-3"])
    parser.add_argument("--remote", nargs="*", default=["none", "zstd"])
    parser.add_argument(
        "--train-seconds",
        type=float,
        default=2.0,
        help="how long a step 'trains' between two hits read ahead (zstd and local none rows; 0: none)",
    )
    parser.add_argument("--s3", action="store_true", help="also measure against a local S3 server (moto)")
    parser.add_argument("--quick", action="store_true", help="small batch, 1 repeat (smoke test)")
    parser.add_argument("--sizes", action="store_true", help="stored sizes only (one save each, nothing timed)")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    results.add_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.prompt_len, args.response_len, args.repeat = 64, 32, 64, 1
        args.train_seconds = min(args.train_seconds, 0.2)
    for name in [*args.local, *args.remote]:
        parse_compression(name)
    if args.sizes:
        print(sizes_report(args))
        return 0
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-compression-") as tmp:
        with s3_url(Path(tmp)) if args.s3 else contextlib.nullcontext() as url:  # type: ignore[attr-defined]
            figures = run(args, Path(tmp), url)
        gc.collect()
    load_after = os.getloadavg()
    figures["conditions"] = (
        f"{os.cpu_count()} CPUs, load average {load_before[0]:.1f} at start, {load_after[0]:.1f} at end, "
        f"median of {args.repeat} runs after a warm-up run"
        + (", S3: moto server on localhost (same CPUs)" if args.s3 else "")
    )
    print(report(figures, args.local, args.remote if args.s3 else []))
    if args.json:
        print(json.dumps(figures))
    if args.record:
        remote = args.remote if args.s3 else []
        results.record(
            "compression", {**figures, "repeat": args.repeat, "local": args.local, "remote": remote}, load_before[0]
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
