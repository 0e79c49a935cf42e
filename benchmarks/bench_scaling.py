"""How save and hit times grow with the batch: DataProto at 4 batch sizes, V1 TensorDicts at 1k-16k rows.

Each size runs ``bench_store``'s measurement (upstream and skipinject in the same process, warm
usable loads, saves with fsync on skipinject's side) and prints time per row and per MB of tensors
and the ratio to upstream, with the load average measured around that size. Time per row (or per
MB) that stays flat across sizes means the cost is linear.

    python benchmarks/bench_scaling.py                      # defaults below
    python benchmarks/bench_scaling.py --v1-rows 1024 2048 --dp-rows 256 512 --repeat 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_store

from benchmarks import results


def measure_sizes(
    kind: str, sizes: list[int], run: Callable[..., dict[str, Any]], lengths: tuple[int, int], args: Any
) -> list[dict[str, Any]]:
    out = []
    for rows in sizes:
        gc.collect()
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-scaling-") as tmp:
            figures = run(rows, lengths[0], lengths[1], args.n, args.repeat, Path(tmp))
        figures["load"] = (load, os.getloadavg()[0])
        figures["kind"] = kind
        out.append(figures)
        print(f"# {kind} {rows} rows done (load average {load:.1f} -> {figures['load'][1]:.1f})", file=sys.stderr)
    return out


def table(title: str, results: list[dict[str, Any]]) -> list[str]:
    lines = [
        title,
        "",
        "| rows | tensor MB | save ms (upstream / skipinject, ratio) | save us/row | save ms/MB "
        "| hit ms (upstream / skipinject, ratio) | hit us/row | hit ms/MB | load avg |",
        "|---:|---:|---|---:|---:|---|---:|---:|---|",
    ]
    fields = any("ours_fields_ms" in f for f in results)
    if fields:  # V1: the hit followed by tu.get of every non-tensor field (rows made on first read)
        column = " | hit + read all fields ms (upstream / skipinject, ratio) | load avg |"
        lines[2] = lines[2].replace(" | load avg |", column)
        lines[3] = "|---:|---:|---|---:|---:|---|---:|---:|---|---|"
    for f in results:
        rows, mb = f["rows"], f["tensor_mb"]
        up_s, us_s = f["upstream_save_ms"], f["ours_save_ms"]
        up_l, us_l = f["upstream_load_ms"], f["ours_load_ms"]
        read = ""
        if fields:
            up_f, us_f = f["upstream_fields_ms"], f["ours_fields_ms"]
            read = f"| {up_f:.0f} / {us_f:.0f}, {up_f / us_f:.1f}x "
        lines.append(
            f"| {rows} | {mb:.0f} | {up_s:.0f} / {us_s:.0f}, {up_s / us_s:.1f}x | {us_s * 1000 / rows:.1f} "
            f"| {us_s / mb:.2f} | {up_l:.0f} / {us_l:.0f}, {up_l / us_l:.1f}x | {us_l * 1000 / rows:.1f} "
            f"| {us_l / mb:.3f} {read}| {f['load'][0]:.1f}-{f['load'][1]:.1f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp-rows", type=int, nargs="*", default=[512, 1024, 2048, 4096])
    parser.add_argument("--dp-lengths", type=int, nargs=2, default=[1024, 4096], metavar=("PROMPT", "RESPONSE"))
    parser.add_argument("--v1-rows", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument(
        "--v1-lengths",
        type=int,
        nargs=2,
        default=[256, 1024],
        metavar=("PROMPT", "RESPONSE"),
        help="max prompt/response lengths of the V1 rows (default 256 1024: 16k rows = 680 MB)",
    )
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--dir", type=Path, default=None)
    results.add_argument(parser)
    args = parser.parse_args(argv)
    load_start = os.getloadavg()[0]
    dp = measure_sizes("dataproto", args.dp_rows, bench_store.run, tuple(args.dp_lengths), args)
    v1 = measure_sizes("v1", args.v1_rows, bench_store.run_v1, tuple(args.v1_lengths), args)
    lines = []
    if dp:
        lines += table(f"DataProto (rollout), prompt {args.dp_lengths[0]} + response {args.dp_lengths[1]}", dp)
        lines.append("")
    if v1:
        lines += table(
            f"V1 TensorDict (rollout_tq), prompt <={args.v1_lengths[0]}, response <={args.v1_lengths[1]}", v1
        )
        lines.append("")
    lines.append(
        f"ratio = upstream/skipinject; hit = verified load + decode + touch (warm); save incl. fsync on skipinject's "
        f"side; medians of {args.repeat} runs after a warm-up; {os.cpu_count()} CPUs"
    )
    print("\n".join(lines))
    if args.json:
        print(json.dumps({"dataproto": dp, "v1": v1}))
    if args.record:
        results.record("scaling", {"dataproto": dp, "v1": v1, "repeat": args.repeat}, load_start)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
