"""Save/load a GRPO-sized rollout batch: upstream's pickle vs skipinject's store, in one run.

The reference batch follows ``/work/shared/perf-facts.md``: B=4096 sequences, prompt 1024 +
response 4096 tokens, seven tensors (872 MB) plus per-sample ``uid``, ``data_source``,
``raw_prompt`` (chat messages) and ``reward_model``, built GRPO-style (512 prompts repeated n=8
times, interleaved, with ``DataProto.repeat``). Loads are warm (files in the page cache) and
"usable": every page of every tensor has been touched.

    python benchmarks/bench_store.py            # full reference batch
    python benchmarks/bench_store.py --quick    # small batch (CI smoke test)
"""

from __future__ import annotations

import argparse
import gc
import json
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

from skipinject.codecs import DataProtoCodec  # noqa: E402
from skipinject.store import StepStore  # noqa: E402

PAGE = 4096


def build_batch(rows: int, prompt_len: int, response_len: int, n: int) -> Any:
    """A DataProto shaped like an AgentLoopManager.generate_sequences result."""
    from verl.protocol import DataProto

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
    raw_prompt = [
        [
            {"role": "system", "content": "Please reason step by step, and put your final answer within \\boxed{}."},
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


def tensor_bytes(batch: Any) -> int:
    return sum(t.numel() * t.element_size() for t in batch.batch.values())


def touch(batch: Any) -> int:
    """Read one byte of every page of every tensor: the batch is then really usable."""
    total = 0
    for tensor in batch.batch.values():
        flat = tensor.reshape(-1).view(torch.uint8)
        total += int(flat[::PAGE].sum()) + int(flat[-1])
    return total


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Median wall time in ms over ``repeat`` runs (after one warm-up run), and the last result."""
    times = []
    result = None
    for i in range(repeat + 1):
        result = None
        gc.collect()
        start = time.perf_counter()
        result = fn()
        elapsed = (time.perf_counter() - start) * 1000
        if i:
            times.append(elapsed)
    return statistics.median(times), result


def run(rows: int, prompt_len: int, response_len: int, n: int, repeat: int, workdir: Path) -> dict[str, Any]:
    batch = build_batch(rows, prompt_len, response_len, n)
    codec = DataProtoCodec()
    upstream_path = workdir / "gen_batch.dp"
    store = StepStore(workdir / "store", "rollout", {"bench": True})
    figures: dict[str, Any] = {"rows": rows, "tensor_mb": tensor_bytes(batch) / 1e6}

    figures["upstream_save_ms"], _ = timed(lambda: batch.save_to_disk(upstream_path), repeat)
    figures["ours_encode_ms"], _ = timed(lambda: codec.encode(batch), repeat)
    figures["ours_save_ms"], _ = timed(lambda: store.save(1, codec.encode(batch), {}), repeat)
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

    figures["upstream_load_ms"], loaded_up = timed(upstream_load, repeat)
    del loaded_up
    figures["ours_load_ms"], loaded = timed(ours_load, repeat)
    check_equal(batch, loaded)
    del loaded

    # Where our load time goes: the same steps, timed one by one.
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
    return figures


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


def report(figures: dict[str, Any]) -> str:
    f = figures
    rows = [
        ("save (dump, pickle vs encode+write+fsync+checksum)", f["upstream_save_ms"], f["ours_save_ms"]),
        ("warm load, usable (ours: verify+load+decode+touch)", f["upstream_load_ms"], f["ours_load_ms"]),
    ]
    lines = [
        f"batch: {f['rows']} rows, {f['tensor_mb']:.0f} MB of tensors; files: upstream {f['upstream_file_mb']:.0f} MB, "
        f"ours {f['ours_files_mb']:.0f} MB (objects {f['ours_objects_kb']:.0f} kB)",
        "",
        "| operation | upstream ms | skipinject ms | upstream/skipinject |",
        "|---|---:|---:|---:|",
    ]
    for name, up, ours in rows:
        lines.append(f"| {name} | {up:.1f} | {ours:.1f} | {up / ours:.1f}x |")
    lines += [
        "",
        f"skipinject load breakdown (ms): verify {f['ours_verify_ms']:.1f}, load {f['ours_read_ms']:.1f}, "
        f"decode {f['ours_decode_ms']:.1f}, touch {f['ours_touch_ms']:.1f}; encode alone {f['ours_encode_ms']:.1f}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096, help="sequences in the batch (default 4096)")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--response-len", type=int, default=4096)
    parser.add_argument("-n", type=int, default=8, help="GRPO group size (rows repeat each prompt n times)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per figure (median reported)")
    parser.add_argument("--quick", action="store_true", help="small batch, 1 repeat (smoke test)")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.prompt_len, args.response_len, args.repeat = 64, 32, 64, 1
    if args.rows % args.n:
        parser.error("--rows must be a multiple of -n")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-store-") as tmp:
        figures = run(args.rows, args.prompt_len, args.response_len, args.n, args.repeat, Path(tmp))
    print(report(figures))
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
