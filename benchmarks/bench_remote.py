"""Save and hit of the reference rollout batch in an object store (S3) beside the local disk, in one run.

The store is a real S3-compatible server: by default moto in server mode, started on localhost by
this script (it runs in Python on the same CPUs as the client, so these figures are a floor, not
what a real object store over a network gives); ``--endpoint URL --bucket NAME`` measures another
one (e.g. MinIO), with credentials from the usual ``AWS_*`` environment variables.

Each figure is the median of ``--repeat`` runs after a warm-up, with CPU time and the load average;
upstream's way (``DataProto.save_to_disk`` / ``load_from_disk``, a local pickle: verl 0.9.1 has no
object store support) is measured in the same run for scale. A hit is the whole verified hit
(sizes and checksums of every file, load, decode, every page touched).

    python benchmarks/bench_remote.py            # the 4096-row reference batch (872 MB)
    python benchmarks/bench_remote.py --quick    # small batch (smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# First on the path: some installed distributions ship a top-level ``tests`` package of their own.
for path in (ROOT / "benchmarks", ROOT):
    while str(path) in sys.path:
        sys.path.remove(str(path))
    sys.path.insert(0, str(path))

from bench_store import build_batch, check_equal, measure, tensor_bytes, touch  # noqa: E402

from benchmarks import results  # noqa: E402
from skipinject.store import RemoteStepStore, StepStore  # noqa: E402
from skipinject.store.remote import open_remote  # noqa: E402
from skipinject.verl.codecs import DataProtoCodec  # noqa: E402


@contextlib.contextmanager
def object_store(endpoint: str | None, bucket: str | None, workdir: Path) -> Iterator[str]:
    """The URL of an empty prefix in an S3 bucket: a local moto server unless ``endpoint`` is given."""
    if endpoint is not None:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        yield f"s3://{bucket}/skipinject-bench-{uuid.uuid4().hex[:8]}"
        return
    from tests.integration.s3_server import create_bucket, s3_server, use_server

    with s3_server(str(workdir / "moto.log")) as url:
        use_server(url, os.environ)
        create_bucket(url, "bench")
        yield "s3://bench/dump"


def run(rows: int, prompt_len: int, response_len: int, n: int, repeat: int, workdir: Path, url: str) -> dict[str, Any]:
    batch = build_batch(rows, prompt_len, response_len, n)
    codec = DataProtoCodec()
    figures: dict[str, Any] = {"rows": rows, "tensor_mb": tensor_bytes(batch) / 1e6}
    upstream_path = workdir / "gen_batch.dp"
    local = StepStore(workdir / "store", "rollout", {"bench": True})
    fs, root = open_remote(url)
    remote = RemoteStepStore(root / "project", "rollout", {"bench": True}, fs)

    from verl.protocol import DataProto

    def hit(store: StepStore) -> Any:
        [part] = store.load(store.verified(1))
        loaded = codec.decode(part)
        touch(loaded)
        return loaded

    def upstream_load() -> Any:
        loaded = DataProto.load_from_disk(upstream_path)
        touch(loaded)
        return loaded

    measure(figures, "upstream_save", lambda: batch.save_to_disk(upstream_path), repeat)
    measure(figures, "local_save", lambda: local.save(1, codec.encode(batch), {}), repeat)
    measure(figures, "remote_save", lambda: remote.save(1, codec.encode(batch), {}), repeat)
    figures["file_mb"] = remote.read_meta(1).stored_size / 1e6
    for key, load in (("upstream_load", upstream_load), ("local_load", lambda: hit(local))):
        measure(figures, key, load, repeat)
    raw_transfer(figures, fs, remote, root, repeat)
    loaded = measure(figures, "remote_load", lambda: hit(remote), repeat)
    check_equal(batch, loaded)
    del loaded
    with contextlib.suppress(Exception):
        fs.rm(root.path, recursive=True)
    return figures


def raw_transfer(figures: dict[str, Any], fs: Any, store: RemoteStepStore, root: Any, repeat: int) -> None:
    """The server's own speed, for scale: one PUT and one GET of the tensor file's bytes."""
    [tensor_at] = [part.at(store.step_dir(1), f.name) for part, f in store.read_meta(1).files() if f.kind == "tensors"]
    blob = fs.cat_file(tensor_at.path)  # type: ignore[attr-defined]
    target = f"{root.path}/raw.bin"
    measure(figures, "raw_put", lambda: fs.pipe_file(target, blob), repeat)
    measure(figures, "raw_get", lambda: fs.cat_file(target), repeat)
    figures["raw_mb"] = len(blob) / 1e6


def report(f: dict[str, Any]) -> str:
    mb = f["file_mb"]
    lines = [
        f"Reference batch: {f['rows']} rows, {f['tensor_mb']:.0f} MB of tensors ({mb:.0f} MB in the store); "
        f"{f['conditions']}.",
        "",
        "| operation | upstream, local pickle ms | skipinject, local disk ms | skipinject, S3 ms | S3 / local disk "
        "| S3 MB/s | S3 CPU ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, key in (("save (encode + upload/write + checksums)", "save"), ("hit, verified and usable", "load")):
        up, local, remote = f[f"upstream_{key}_ms"], f[f"local_{key}_ms"], f[f"remote_{key}_ms"]
        lines.append(
            f"| {name} | {up:.1f} | {local:.1f} | {remote:.1f} | {remote / local:.1f}x | "
            f"{mb / (remote / 1000):.0f} | {f[f'remote_{key}_cpu_ms']:.0f} |"
        )
    raw = f["raw_mb"]
    lines.append(
        f"\nThe server alone, for scale: one PUT of the {raw:.0f} MB tensor file {f['raw_put_ms']:.0f} ms "
        f"({raw / (f['raw_put_ms'] / 1000):.0f} MB/s), one GET {f['raw_get_ms']:.0f} ms "
        f"({raw / (f['raw_get_ms'] / 1000):.0f} MB/s)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--response-len", type=int, default=4096)
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small batch, 1 repeat (smoke test)")
    parser.add_argument("--endpoint", help="an S3 endpoint URL to measure instead of a local moto server")
    parser.add_argument("--bucket", help="bucket at --endpoint (it must exist)")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    results.add_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.prompt_len, args.response_len, args.repeat = 64, 32, 64, 1
    if (args.endpoint is None) != (args.bucket is None):
        parser.error("--endpoint and --bucket go together")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-remote-") as tmp:
        with object_store(args.endpoint, args.bucket, Path(tmp)) as url:
            figures = run(args.rows, args.prompt_len, args.response_len, args.n, args.repeat, Path(tmp), url)
        gc.collect()
    server = args.endpoint or "moto server on localhost (same CPUs)"
    figures["conditions"] = (
        f"{os.cpu_count()} CPUs, S3: {server}, load average {load_before:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end, median of {args.repeat} runs after a warm-up run"
    )
    print(report(figures))
    if args.json:
        print(json.dumps(figures))
    if args.record:
        results.record("remote", {**figures, "repeat": args.repeat, "server": server}, load_before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
