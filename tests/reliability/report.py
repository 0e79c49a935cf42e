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
AREAS = ("crash", "integrity", "concurrency", "disk", "trust", "cache tool", "bad input", "object store")
TITLES = {
    "crash": "Crash safety (SIGKILL)",
    "integrity": "Integrity (damaged or foreign caches)",
    "concurrency": "Concurrency",
    "disk": "Full and read-only disks",
    "trust": "Trust (no code from caches, no path escapes)",
    "cache tool": "Removal (cache tool, garbage collection, clean-up): links and races",
    "bad input": "Bad input",
    "object store": "Object stores (dump_dir=s3://..., a real S3 server)",
}

SUMMARIES = {
    "crash": "a saving process SIGKILLed before every fsync/rename and at random times (1- and 2-part steps)",
    "integrity": "{n} kinds of damaged, forged, hostile or foreign caches; random byte flips; forged meta.json fuzzing",
    "concurrency": "4 writers and 4 readers of one step at once",
    "disk": "disk full (real tmpfs, ENOSPC at a random byte), read-only dump_dir, unlistable cache dir",
    "trust": "planted upstream pickles, hostile names, directories other users control, symlinked steps",
    "cache tool": "steps swapped for links by another uid mid-removal; untrusted steps under prune --damaged",
    "bad input": "generated overrides, steps, configs, sample ids, targets, plugin lists; YAML bombs; the runner",
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

* Hostile input, round 3 (issue 23): in a shared 1777 dump directory, another user swapping a
  step for a link between `cache prune`'s check and its removal emptied the victim's step through
  the link (garbage collection opened the part directory by a path through the swapped step too); a
  305-byte `--skip-config` of nested YAML aliases ran for more than 90 s, a 202-character
  command-line value for 76 s and 440 MB; a steps list of 130k items took 25 s to refuse; a 5 kB
  `SKIPINJECT_CONFIG` decompressing to 4 MB cost a child 8 s and 200 MB; a `dump_dir` that is
  another user's link, or lies in a directory others can write, was resolved before it was checked;
  run 1 saved into directories another user pre-created 0777; a `dump_dir` that is a FIFO,
  `/dev/null` or a file gave two warnings per step; `prune --damaged` took intact steps that were
  merely untrusted for damaged; `action=repeat` logged a line per unusable candidate (3000 lines for
  3 calls over 1000 damaged steps).

* Hostile input, round 4 (issue 37): real zstd frames of zeros (~29,000x, within zstd's ratio) made
  a tensor file of a few KB decode to gigabytes, and a compact index of a few hundred bytes rebuild a
  gigabyte mask (the only bounds were ratios of the file's size); compact recipes with runs outside
  their row, ramps a dtype cannot hold or a "narrowed" dtype wider than its tensor's were served; a
  declared decoded size beyond memory ended a run with a bare `MemoryError` (strict too) and `cache
  show` with an internal error, a 4000-digit size `cache ls` with an `OverflowError`; memory a refused
  step took stayed in hit memory; an uncompressed hit served views of the file's mapping, so a file
  rewritten in place after it was verified changed the served tensors and one truncated killed the
  process (SIGBUS); ending a run joined a read-ahead stuck in a store read forever; a row index zip of
  100,000 members cost its parse before it was refused, a forged one a warning per record it named;
  an empty `rows/999999999999/` made the next rows record 13 digits long (a name no reader lists),
  and thousands of empty claims were re-read on every call and never removed; a run going 1 -> 2 -> 1
  was served at the second step 1 what it had recorded at the first.

* Hostile input against re-scoring, the summary file and the cache tool's upkeep commands: a
  tokenizer directory named by a cache (or `--tokenizer`) with code of its own made `cache show` ask
  on stdin whether to run it, and a "y" ran it; the reward's identity left out a `reward_kwargs`
  mapping under a name that is tuning elsewhere, a class-based reward's code (its `repr` stayed), the
  modules the reward file imports and every byte past 64 MiB, digested an unreadable file as `''`,
  and differed in every process for a `lambda` or `partial`, so `auto` trained on stale scores or
  re-scored for nothing; `SKIPINJECT_SUMMARY` replaced a symlink, a FIFO or a device (as root,
  `/dev/stdout`) with a regular file, and a relative one followed the program's `chdir`; a recorded
  reward path or settings key with escape codes or a megabyte of text went raw into the run's log;
  a 20 MB `reward_kwargs` was saved into a `meta.json` every later run refused; `cache rm A B` with B
  missing removed A, `rm 2 2` counted the step twice, `rm /` walked the whole file system, `prune
  --max-size` with 400 digits and a NUL in the recorded model path were internal errors; a forged row
  index's entries naming no record it had read stayed in the file after the run said it rebuilt it.

Not covered here: power loss (only SIGKILL: data files are fsynced before they are renamed and named
by meta.json, and every file is checked against meta.json on load, so a lost directory entry
shows up as a missing file, i.e. a regenerated step); writers on other hosts of a shared file system
are protected from garbage collection by the 10-minute age rule only.

## Bounds on a load

Every file of a cache is read under one discipline (`skipinject/store/files.py`): opened relative to
its step directory's descriptor with `O_NOFOLLOW|O_NONBLOCK` (step and part directories with
`O_DIRECTORY|O_NOFOLLOW`, so nothing is reached through a link), the opened descriptor `fstat`-ed
and required to be a regular file, its size compared with meta.json's record before a byte is read
or hashed. meta.json is at most 16 MiB and 32 levels deep; a tensor file's index at most 64 MiB;
JSON deeper than the interpreter's recursion limit is a parse error; a file of 64 MiB or more must
occupy at least 1/64 of its size on disk (a sparse forgery is refused before it is hashed). Every
failure of any type is one `CorruptCacheError` line (strict: it stops the run).

With that, a verified load reads each file once into the process's own memory and checksums it there
(never a mapping of the file: what was verified is what is served, whatever another process does to
the file afterwards, and nothing faults), and the memory it allocates is bounded absolutely, from
what the writer could have written, before a frame is decompressed or a tensor rebuilt: a part's
data files decoded plus the tensors its compact tensor file rebuilds take at most **its declared rows
x max(the layout's width (`prompt_length + response_length`) x 4096 bytes, 1 MiB) + 16 MiB** (256 MiB
a row where no width is declared; rows at most 2^48, widths 2^20), and a step at most **half the memory the
process may use** (physical, cgroup limit, `RLIMIT_AS`); the writer refuses to save what a reader
would refuse. Every compact recipe is checked whole against its shape and dtype (runs inside their
row, ramps of a signed dtype that holds their top, starting where the writer finds them, one entry
per row, a narrowed dtype smaller than its tensor's). Objects files: 64 times their size + 64 KiB
per fixed-width string array: every container a column builds is backed by a row on disk (its
leading shape products may not exceed its rows), a tensor without elements may not claim more rows
than its file has bytes, a string array may take at most 64 bytes per byte of its JSON, and jagged
offsets must lie inside their values. Memory a refused step took is released (hit memory does not
keep it), and any failure while a step is read, `MemoryError` included, is a `CorruptCacheError`.

**A cache that rebuilds more than the process may hold.** Before a byte of a step is decompressed
or a compact encoding rebuilt, what the step declares it decodes and rebuilds to is checked against
the budget: half the memory the process may use, the smallest of the physical memory, `RLIMIT_AS`
and the memory limits of the process's own cgroup and its ancestors (cgroup v2 `memory.max`, v1
`memory.limit_in_bytes`, as `/proc/self/cgroup` names them), read once per process. A step beyond
it is not read and nothing is allocated for it: one line (`declares N decoded bytes, more than this
process may spend on a step (B); not read`), and the step is generated again (`action=strict`: the
run stops with that `CorruptCacheError`). A limit applied from outside the process is invisible to
it: a supervisor or scheduler that kills at a resident-set size, Ray's memory monitor (which kills
workers above `RAY_memory_usage_threshold` of the node's memory), a container runtime's OOM policy
without a cgroup limit. A step within the budget may still be more than such a supervisor allows,
and the process is killed while it rebuilds. Set the limit where the process can read it: run the
job in a cgroup with a memory limit (systemd's `MemoryMax=`, `docker run --memory`, Kubernetes'
`resources.limits.memory`) or with `ulimit -v` (`RLIMIT_AS`, which also counts address space
reserved and never touched — CUDA and PyTorch reserve much of it, so on GPU nodes prefer the
cgroup), and keep any outside kill threshold above that limit.

`action=match`'s row index and rows records are bounded too: the index is a zip of exactly its 8
arrays (its end record is read first), an entry only the file vouches for that does not serve drops
the whole file in one line per run (it is rebuilt from the `meta.json`s), a refresh looks at most at
256 records without a readable `meta.json` (newest first; not again for 60 s), a rows record's number
follows the records in use from 1 (a stray or forged number more than 1000 past them is never
followed), and empty record directories (claims never written) are collected after 10 minutes. A
run that comes back to a step it recorded (1 -> 2 -> 1) generates it again; ending a run never waits
for a read-ahead.

## Directory trust and leftovers

Like ssh's `StrictModes`, an existing dump, project, step or part directory that is group- or
world-writable without the sticky bit, or owned by another user (not root), is refused for loading
in one warning line naming the directory and the fix (`chmod go-w`, or
`skip.<role>.trust_dir_permissions=true` to opt in); step and part directories that are symlinks are
neither loaded nor written through.

The dump directory is also checked *as given*, before any link in it is resolved: a name in it that
is a symbolic link another user owns, or a directory holding one of its names that others can write
without the sticky bit (they could replace the name), refuses it. A tree that fails any of these
rules is neither loaded from nor saved into (checked again after a save creates its directories, so
a directory another user pre-created, e.g. 0777, is never written into); this is said in one line
when the run first opens the store, not once per step. A `dump_dir` that is a FIFO, `/dev/null` or a
regular file is one such line too. `skipinject cache` lists such steps as `untrusted`, a state of
their own (`prune --damaged` leaves them), and checks the path it is given the same way: `ls` and
`verify` list every step under a redirectable path as `untrusted`, and `prune`, `compact` and
`import` refuse such a path in one line (exit 2) before anything is resolved or changed.

## Links, races, names and bounds

* **Removal** (`skipinject/store/files.py`, the one primitive of `cache prune`, `cache import`'s
  writer, garbage collection and a failed save's clean-up): a directory is reached from the dump or
  project directory one name at a time with `O_DIRECTORY|O_NOFOLLOW` and held by its descriptor;
  files are `fstat`-ed and unlinked relative to the descriptor they were listed in (`unlinkat`),
  directories removed with `rmdir(name, dir_fd=)`. Never a second look-up of a checked path: a step
  swapped for a link before it is opened removes nothing; one swapped after it was opened is still
  the directory that was checked. `cache import PATH` refuses a `PATH` that is a link.
* **Names**: step and part names are ASCII decimal numbers (the format's patterns), data files our
  own patterns; names read from meta.json must be plain names (no `/`, `..`).
* **Settings** (`skipinject/config/overrides.py`): YAML from `--skip-config` and command-line
  values in flow syntax is first read as an event stream (nothing composed or expanded) and refused
  in one line naming the key at the first anchor or alias, past 16 levels of nesting or past 10,000
  values; a settings file is a regular file of at most 1 MiB (a FIFO or directory is named as such).
  `--skip-config` given twice is an error.
* **The configuration handed to children** (`SKIPINJECT_CONFIG`): the runner refuses to write more
  than 64 KiB compressed or 512 KiB expanded, and a child refuses a variable that is longer or
  expands further, after decompressing at most that much.
* **Log lines**: one per decision; `repeat` over many unusable candidates gives their count and
  three examples of at most 600 characters each.

Leftovers of killed or concurrent saves (`skipinject/store/garbage.py`) are collected after any
successful commit in the same project (the saved step every time, the whole project at most once per
10 minutes per process) and by the cache tooling. A file is collected only when it matches our own
names, no committed meta.json of its step names it, it was last modified 10 minutes ago or more, and
its writer (the pid in its write id `{unix_time}-{pid}-{uuid8}`) is gone from this host, or is this
process with no open writer of that id, or the file is over a day old (pids are reused). Each file
is checked again right before it is unlinked (relative to the descriptor of its directory, reached
from the project directory without following a link); a step whose meta.json cannot be read is left
alone.
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
  seeded random times during dumps of a 33 MB rollout batch (most kills land mid-file). A new
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
* **links and races** (`test_races.py`, rows in *cache tool*): a forked child under another uid
  swaps a step of a shared 1777 dump directory for a link to a victim's private step right after
  `cache prune`'s check, right before its first unlink, and between garbage collection's scan and
  its removal; the victim's files must stay byte-identical (each file taken counts as lost).
* **a shared machine** (`test_shared_machine.py`, `test_bounds.py`): a `dump_dir` that is another
  user's link or lies in a world-writable directory, directories another user pre-created 0777, a
  `dump_dir` that is a FIFO, `/dev/null` or a file, `repeat` over 1000 damaged steps; YAML alias
  bombs, a 130k-item steps list, a decompression bomb in `SKIPINJECT_CONFIG` (the runner in
  subprocesses with a generous timeout: a bomb must not hang).
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
        "failed, a file left behind by a failed save, a file the cache tool (or garbage collection) removed "
        "that was not its to remove, or a decision logged in more than one line.\n"
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
