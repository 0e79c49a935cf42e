"""Run the reliability suite and write ``docs/reliability.md`` from what it counted.

    python tests/reliability/report.py                 # run the suite (~3 min on 2 cores), write the doc
    python tests/reliability/report.py --from s.json   # only render an earlier run's summary

The table is filled from the suite's own ledger (see ``conftest.py``), never by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reliability.md"
AREAS = ("crash", "integrity", "concurrency", "disk", "trust", "bad input", "object store")
TITLES = {
    "crash": "Crash safety (SIGKILL)",
    "integrity": "Integrity (damaged or foreign caches)",
    "concurrency": "Concurrency",
    "disk": "Full and read-only disks",
    "trust": "Trust (no code from caches, no path escapes)",
    "bad input": "Bad input",
    "object store": "Object stores (dump_dir=s3://..., a real S3 server)",
}

SUMMARIES = {
    "crash": "a saving process SIGKILLed before every fsync/rename and at random times (1- and 2-part steps)",
    "integrity": "{n} kinds of damaged, forged, hostile or foreign caches; random byte flips; forged meta.json fuzzing",
    "concurrency": "4 writers and 4 readers of one step at once",
    "disk": "disk full (real tmpfs, ENOSPC at a random byte), read-only dump_dir, unlistable cache dir",
    "trust": "planted upstream pickles, hostile names, directories other users control, symlinked steps",
    "bad input": "generated overrides, steps, configs, sample ids, targets, plugin lists; the runner",
    "object store": "uploads SIGKILLed at random times, bit flips on the server, concurrent writers and readers",
}

FOUND = """\
## What the suite found (fixed)

* A long step range (`skip.rollout.steps=0-100000`) made the serialised config ~0.6 MB; it travels
  in an environment variable, so every child process failed to start (`E2BIG`). Steps are now
  serialised as ranges, step numbers are bounded (1,000,000) before `int()` sees them, and a
  5000-digit step is a `ConfigError`, not a `ValueError`.
* A forged meta.json (part not a record, context not a mapping, checksum algorithm missing, a file
  name pointing at a directory) raised `AttributeError`/`TypeError`/`KeyError`/`IsADirectoryError`
  into the training call instead of being a `CorruptCacheError`.
* A cache whose objects file decoded badly (`KeyError` in the codec) escaped the engine; with
  `action=strict`, a `CodecError` stopped the run with the wrong error type.
* A save that failed on a full or read-only disk left empty step directories behind; garbage
  collection after a successful commit could fail the save.
* An unlistable cache directory or a too-long name (`PermissionError`, `ENAMETOOLONG` from
  `Path.is_file`) and a plugin's failing step extractor (e.g. a 6000-digit sample id) broke the
  user's call.
* A damaged cache was reported in two lines (warning + miss); now one line says what is wrong and
  that the step is regenerated, including data files left without meta.json by an interrupted save.
* `role_config_from_mapping` rejected OmegaConf lists and crashed on non-mappings;
  `TargetPath.parse` crashed on non-strings; sample ids accepted a trailing newline and non-ASCII
  digits.

* Hostile files in a shared cache (issue 10): a meta.json of 200,000 nested lists raised
  `RecursionError` into the training call; a sparse 1 TiB meta.json raised `MemoryError`; a meta.json
  that is a named pipe hung the run forever, one linked to `/dev/zero` read without end; a step
  directory named `²` (passes `str.isdigit()`) crashed `action=repeat` with a `ValueError`; forged
  indexes with matching checksums made a few KB allocate 400 MB (`<U50000000`), build 2e8
  NonTensorStacks or 1e9 Python lists (a 0-byte tensor claiming 1e9 rows), and jagged offsets could
  point outside their buffer; an 8 GiB sparse tensor file was hashed in full before its checksum
  failed; a cache in a world-writable or foreign-owned directory was served as "own cache"; a step
  directory that is a symlink was loaded and written through; leftovers of killed saves stayed forever
  unless the same step was saved again.

Not covered here: power loss (only SIGKILL: data files are fsynced before they are renamed and named
by meta.json, and every file is checked against meta.json on load, so a lost directory entry
shows up as a missing file, i.e. a regenerated step); a file truncated *while* it is mapped by a
reader (SIGBUS; only someone who can write the step directory can do that, and trusted directories
are writable by their owner only); writers on other hosts of a shared file system are protected from
garbage collection by the 10-minute age rule only.

## Bounds on a load

Every file of a cache is read under one discipline (`skipinject/store/files.py`): opened relative to
its step directory's descriptor with `O_NOFOLLOW|O_NONBLOCK` (step and part directories with
`O_DIRECTORY|O_NOFOLLOW`, so nothing is reached through a link), the opened descriptor `fstat`-ed
and required to be a regular file, its size compared with meta.json's record before a byte is read
or hashed. meta.json is at most 16 MiB and 32 levels deep; a tensor file's index at most 64 MiB;
JSON deeper than the interpreter's recursion limit is a parse error; a file of 64 MiB or more must
occupy at least 1/64 of its size on disk (a sparse forgery is refused before it is hashed). Every
failure of any type is one `CorruptCacheError` line (strict: it stops the run).

With that, a verified load does one pass over the files' bytes, and the memory it allocates is at
most **the tensor file's copy-on-write mapping + 64 times the objects file's size + 64 KiB per
fixed-width string array**: every container a column builds is backed by a row on disk (its leading
shape products may not exceed its rows), a tensor without elements may not claim more rows than its
file has bytes, a string array may take at most 64 bytes per byte of its JSON, and jagged offsets
must lie inside their values.

## Directory trust and leftovers

Like ssh's `StrictModes`, an existing dump, project, step or part directory that is group- or
world-writable without the sticky bit, or owned by another user (not root), is refused for loading
in one warning line naming the directory and the fix (`chmod go-w`, or
`skip.<role>.trust_dir_permissions=true` to opt in); step and part directories that are symlinks are
neither loaded nor written through.

Leftovers of killed or concurrent saves (`skipinject/store/garbage.py`) are collected after any
successful commit in the same project (the saved step every time, the whole project at most once per
10 minutes per process) and by the cache tooling. A file is collected only when it matches our own
names, no committed meta.json of its step names it, it was last modified 10 minutes ago or more, and
its writer (the pid in its write id `{unix_time}-{pid}-{uuid8}`) is gone from this host, or is this
process with no open writer of that id, or the file is over a day old (pids are reused). Each file
is checked again right before it is unlinked; a step whose meta.json cannot be read is left alone.
"""

INTRO = """\
# Reliability

skipinject promises: **nothing half-written is ever loaded, nothing unsafe is ever loaded, every bad
input is a clear error, and training never stops because of the cache** (except with
`action=strict`, which stops by design). `tests/reliability/` tries to break each promise; this page
is generated from a real run of it (`python tests/reliability/report.py`), and the *lost* column
counts every time a promise was broken: it must be 0.

How the faults are made:

* **crash**: a child process saving a step is SIGKILLed right before each of its fsync/rename
  operations (one- and two-part steps, with and without an older complete version on disk), and at
  seeded random times during dumps of a 33 MB DataProto payload (most kills land mid-file). A new
  store then must see nothing or a complete step, and the engine serves or regenerates it.
* **integrity**: files of a saved step are truncated, emptied, bit-flipped, deleted or forged
  (forged edits recompute meta.json's own checksum and the data files' sizes/checksums, so the
  checks behind the checksum are tested too); caches of another format version, role or run. Each
  must give exactly one WARNING line and a regenerated step; `action=strict` must stop with
  `CacheMissError`/`CorruptCacheError` without loading or deleting anything.
* **concurrency**: 4 processes save the same step while 4 read it (forkserver: fresh interpreters).
* **disk**: `dump_dir` on a 1 MiB tmpfs (disk really full), ENOSPC injected at a random byte of any
  file of a save, a tmpfs remounted read-only and a directory made immutable (`chattr +i`); root
  ignores `chmod 0o500`, so that variant only runs as a non-root user.
* **trust**: pickles planted as verl's own caches (`{step}/gen_batch.dp`, `{step}/0/tq_batch.pt`)
  whose unpickling creates a marker file; hostile names in the run config and in meta.json.
* **bad input**: hypothesis-generated overrides, step lists, serialised configs, sample ids,
  target paths and `VERL_SKIP_PLUGINS` values; the runner in subprocesses.
* **hostile caches** (`test_hostile.py`, rows in *integrity*, *trust*, *crash*, *bad input*): files
  that are not what they claim (nested or huge JSON, pipes, links to devices or out of the step,
  sparse files), forged indexes with matching checksums whose claims are out of proportion to the
  bytes, step names that are not ASCII numbers, directories other users control, symlinked steps,
  leftovers of killed saves. Each must be decided in under 5 s with under 64 MiB allocated (checked
  with `tracemalloc`), in one warning line.
* **object store** (`test_object_store.py`): `dump_dir` in a real S3-compatible server (moto in
  server mode, through s3fs): a process uploading a two-part step (multipart uploads) SIGKILLed at
  seeded random times, random bit flips in objects on the server, writers and readers of one step
  in separate processes at once.
"""


def run_suite(summary: Path) -> tuple[int, dict[str, float]]:
    """Run the suite; returns its exit code and its wall time, CPU time and the machine's load."""
    env = dict(os.environ, SKIPINJECT_RELIABILITY_SUMMARY=str(summary))
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    code = subprocess.call(
        [sys.executable, "-m", "pytest", "tests/reliability", "-q", "-p", "no:cacheprovider"], cwd=ROOT, env=env
    )
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return code, {
        "wall": time.perf_counter() - started,
        "cpu": usage.ru_utime + usage.ru_stime,
        "load": max(load_before, os.getloadavg()[0]),
    }


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(data: dict[str, Any], timing: dict[str, float] | None) -> str:
    rows = data["rows"]
    by_area: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_area[row["area"]].append(row)
    total_trials = sum(r["trials"] for r in rows)
    total_lost = sum(r["lost"] for r in rows)
    lines = [INTRO]
    when = time.strftime("%Y-%m-%d")
    took = ""
    if timing is not None:
        took = f", {timing['wall']:.0f} s wall ({timing['cpu']:.0f} s CPU, load average up to {timing['load']:.0f})"
    lines.append(
        f"Last run: {when}, {os.cpu_count()} CPUs, Python {platform.python_version()}{took}; "
        f"{data['tests_collected']} tests, {data['tests_failed']} failed. "
        f"**{total_trials} trials, {total_lost} lost.**\n"
    )
    lines.append("## Summary\n")
    lines.append("| area | what was tried | how often | what was lost |")
    lines.append("|---|---|---:|---:|")
    for area in AREAS:
        group = by_area.get(area, [])
        if not group:
            continue
        tried = SUMMARIES[area].format(n=sum(1 for r in group if r["trials"] == 2))
        lines.append(f"| {area} | {tried} | {sum(r['trials'] for r in group)} | {sum(r['lost'] for r in group)} |")
    for area in AREAS:
        group = by_area.get(area, [])
        if not group:
            continue
        lines.append(f"\n## {TITLES[area]}\n")
        lines.append("| what was tried | how often | outcome | lost |")
        lines.append("|---|---:|---|---:|")
        for row in group:
            lines.append(f"| {_cell(row['tried'])} | {row['trials']} | {_cell(row['outcome'])} | {row['lost']} |")
    lines.append(
        "\n*how often*: trials of that fault (for the property tests: generated examples). "
        "*lost*: a partial, damaged, foreign or untrusted cache loaded, a torn read, code from a cache run, "
        "a path outside `dump_dir`, a raw Python exception instead of skipinject's error, a training call that "
        "failed or a file left behind by a failed save.\n"
    )
    lines.append(FOUND)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", type=Path, help="render this summary JSON instead of running")
    parser.add_argument("--out", type=Path, default=DOC)
    args = parser.parse_args()
    timing = None
    code = 0
    if args.source is None:
        with tempfile.TemporaryDirectory() as tmp:
            summary = Path(tmp) / "summary.json"
            code, timing = run_suite(summary)
            if not summary.exists():
                print("the suite recorded nothing", file=sys.stderr)
                return code or 1
            data = json.loads(summary.read_text())
    else:
        data = json.loads(args.source.read_text())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(data, timing))
    print(f"wrote {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
