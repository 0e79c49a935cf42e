"""The documentation's benchmark figures, rendered from the results files (``benchmarks/results/*.json``).

Each function renders one generated block of a page (``tests/readme_sync.py`` names them): the line that
says when, where, under what load and at which commit the figures were measured, then the figures, in the
benchmark's own table where it prints one.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

from benchmarks.results import RESULTS, load

BENCHMARKS = Path(__file__).resolve().parent


def _script(name: str) -> Any:
    """A benchmark script as a module (its table functions), without running it."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def measured(results: dict[str, Any]) -> str:
    """When, where, under what load and at which commit a results file's figures were measured."""
    m, load_average = results["machine"], results["load_average"]
    return (
        f"Measured {results['date']} at commit {results['commit']}: `{results['command']}` on {m['cores']} CPUs "
        f"({m['cpu']}, {m['memory_gib']} GiB), Python {m['python']}, load average {load_average['start']:.1f} at "
        f"start and {load_average['end']:.1f} at end (a shared machine: the figures hold at that load; "
        f"`benchmarks/results/{results['benchmark']}.json`)."
    )


def _block(results: dict[str, Any], *lines: str) -> str:
    return "\n".join([measured(results), "", *lines]) + "\n"


def store() -> str:
    """DataProto and V1 TensorDict save, miss and hit against upstream's pickle, same run."""
    results = load("store")
    bench_store = _script("bench_store")
    f, v1 = results["figures"]["dataproto"], results["figures"]["v1"]
    lines = bench_store.table("DataProto (rollout)", "DataProto.save_to_disk, pickle", f)
    lines += ["", *bench_store.hits_table(f), bench_store.breakdown(f)]
    if v1 is not None:
        lines += ["", *bench_store.table("V1 TensorDict (rollout_tq)", "torch.save, pickle", v1), ""]
        lines += [*bench_store.hits_table(v1), bench_store.breakdown(v1)]
    lines += ["", f"ratio = upstream/skipinject (higher is better); median of {results['figures']['repeat']} runs"]
    return _block(results, *lines)


def store_hits() -> str:
    """Each hit not read ahead against the copy floor and pickle's load, and what the hit-memory pool saves."""
    results = load("store")
    bench_store = _script("bench_store")
    lines = []
    for title, key in (("DataProto (rollout)", "dataproto"), ("V1 TensorDict (rollout_tq)", "v1")):
        f = results["figures"][key]
        if f is None or "ours_zstd_load_x_floor" not in f:
            continue
        lines += [f"{title}, {f['rows']} rows, {f['tensor_mb']:.0f} MB of tensors:", "", *bench_store.hits_table(f)]
        lines.append(
            "The hit-memory pool against fresh memory: "
            + "; ".join(
                f"`{name}` {f[f'{fresh}_ms']:.0f} ms against {f[f'{fresh}_pool_ms']:.0f} ms "
                f"({f[f'{fresh}_ms'] / f[f'{fresh}_pool_ms']:.1f}x)"
                for name, fresh in (("none", "ours_load"), ("zstd", "ours_zstd_load"))
            )
            + "."
        )
        lines.append("")
    return _block(results, *lines[:-1])


def store_zstd_hits() -> str:
    """The same hits for compression.md (a block is rendered on one page)."""
    return store_hits()


def store_v1_hit() -> str:
    """The V1 hit beside the DataProto hit of the same run, per tensor byte."""
    results = load("store")
    f, v1 = results["figures"]["dataproto"], results["figures"]["v1"]
    per_byte = (v1["ours_load_ms"] / v1["tensor_mb"]) / (f["ours_load_ms"] / f["tensor_mb"])
    return _block(
        results,
        "| V1 figure | upstream ms | skipinject ms | ratio |",
        "|---|---:|---:|---:|",
        f"| save (`torch.save` / encode + write + fsync + checksum + commit) | {v1['upstream_save_ms']:.0f} "
        f"| {v1['ours_save_ms']:.0f} | {v1['upstream_save_ms'] / v1['ours_save_ms']:.1f}x |",
        f"| save, both fsynced | {v1['upstream_save_fsync_ms']:.0f} | {v1['ours_save_ms']:.0f} "
        f"| {v1['upstream_save_fsync_ms'] / v1['ours_save_ms']:.1f}x |",
        f"| miss: what the sample call waits for (encode + private copy) | {v1['upstream_save_ms']:.0f} "
        f"| {v1['ours_miss_call_ms']:.0f} | {v1['upstream_save_ms'] / v1['ours_miss_call_ms']:.1f}x |",
        f"| verified hit, not read ahead | {v1['upstream_load_ms']:.0f} | {v1['ours_load_ms']:.0f} "
        f"| {v1['upstream_load_ms'] / v1['ours_load_ms']:.1f}x |",
        "",
        f"The V1 hit costs {per_byte:.1f}x the DataProto hit of the same run per tensor byte "
        f"({v1['ours_load_ms']:.0f} ms for {v1['tensor_mb']:.0f} MB, {f['ours_load_ms']:.0f} ms for "
        f"{f['tensor_mb']:.0f} MB).",
    )


def remote() -> str:
    """Save and hit in an S3 store beside the local disk and upstream's local pickle, same run."""
    results = load("remote")
    return _block(results, _script("bench_remote").report(results["figures"]))


def compression() -> str:
    """Stored sizes, saves and hits of each compression against upstream's pickle, same run."""
    results = load("compression")
    f = results["figures"]
    return _block(results, _script("bench_compression").report(f, f["local"], f["remote"]))


def passthrough() -> str:
    """A patched call at a step not chosen against verl's own ``SkipManager.annotate``, same run."""
    results = load("passthrough")
    ns = results["figures"]["ns_per_call"]
    lines = [
        f"ns per call, best of 7 x {results['figures']['calls']:,}:",
        "",
        "| convention | bare method | upstream `annotate` | skipinject | upstream overhead | skipinject overhead "
        "| ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind in ("sync", "async"):
        bare, up, ours = ns[f"bare {kind}"], ns[f"upstream {kind}"], ns[f"skipinject {kind}"]
        lines.append(
            f"| {kind} | {bare:.0f} | {up:.0f} | {ours:.0f} | {up - bare:.0f} | {ours - bare:.0f} "
            f"| {(up - bare) / max(ours - bare, 1e-9):.1f}x |"
        )
    return _block(results, *lines)


def repeat() -> str:
    """``action=repeat``'s decision over many cached steps against reading every step's ``meta.json``."""
    results = load("repeat")
    f = results["figures"]
    return _block(
        results,
        f"{f['steps']:,} cached steps: the decision {f['decision_ms']:.1f} ms ({f['meta_reads']} `meta.json` "
        f"read); reading every step's `meta.json` instead {f['every_ms']:.0f} ms "
        f"({f['every_ms'] / f['decision_ms']:.0f}x), in the same run.",
    )


def match_index() -> str:
    """``action=match``'s lookup of a call's rows among many cached steps."""
    results = load("match_index")
    f = results["figures"]
    lines = [
        f"A {f['call_rows']}-row call, half of its rows cached, among {f['steps']:,} cached steps:",
        "",
        "| cached rows | first lookup, no index ms (`meta.json` reads) | lookup, new run ms (reads) | same run ms "
        "| one new step ms (reads) | index MB |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for s in f["sizes"]:
        lines.append(
            f"| {s['rows']:,} | {s['build_ms']:.0f} ({s['build_meta_reads']:,}) | {s['lookup_ms']:.0f} "
            f"({s['lookup_meta_reads']}) | {s['same_run_ms']:.0f} | {s['new_step_ms']:.0f} "
            f"({s['new_step_meta_reads']}) | {s['index_mb']} |"
        )
    return _block(results, *lines)


def rescore() -> str:
    """A served hit, the reward alone and a re-scored hit, same run."""
    results = load("rescore")
    f = results["figures"]
    lines = [
        f"{f['rows']} rows, responses of {f['response']} tokens, medians of {f['repeat']}:",
        "",
        "| clock | served hit ms | reward alone ms | re-scored hit ms | re-scored - (served + reward) ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for clock, name in (("cpu", "CPU time"), ("wall", "wall-clock")):
        c = f[clock]
        extra = c["rescored_ms"] - c["served_ms"] - c["reward_ms"]
        lines.append(
            f"| {name} | {c['served_ms']:.1f} | {c['reward_ms']:.1f} | {c['rescored_ms']:.1f} | {extra:+.1f} |"
        )
    return _block(results, *lines)


def startup() -> str:
    """CPU time skipinject adds to each kind of process of a run (not measured against upstream)."""
    results = load("startup")
    f = results["figures"]
    lines = [
        f"CPU ms per process, medians of {f['runs']}:",
        "",
        "| process | plain Python | with skipinject | added |",
        "|---|---:|---:|---:|",
    ]
    for label, c in f["processes"].items():
        added = c.get("added_ms", c["skipinject_ms"] - c["plain_ms"])  # the median of interleaved pairs
        lines.append(f"| {label} | {c['plain_ms']:.0f} | {c['skipinject_ms']:.0f} | {added:+.0f} |")
    lines.append(
        f"| skipinject's own start in a process that imported verl (measured inside it) | | | +{f['inside_ms']:.0f} |"
    )
    return _block(results, *lines)


def scaling() -> str:
    """Save and hit at several batch sizes against upstream, same run."""
    results = load("scaling")
    bench_scaling = _script("bench_scaling")
    f = results["figures"]
    lines: list[str] = []
    if f["dataproto"]:
        lines += [*bench_scaling.table("DataProto (rollout)", f["dataproto"]), ""]
    if f["v1"]:
        lines += [*bench_scaling.table("V1 TensorDict (rollout_tq)", f["v1"]), ""]
    lines.append(f"ratio = upstream/skipinject; medians of {f['repeat']} runs after a warm-up")
    return _block(results, *lines)


def pagecache() -> str:
    """Writing a new file into fresh or just-freed page-cache pages."""
    results = load("pagecache")
    f = results["figures"]
    fresh = ", ".join(f"{w:.0f} + fsync {s:.0f} ms" for w, s in f["fresh"])
    recycled = ", ".join(f"{w:.0f} + fsync {s:.0f} ms" for w, s in f["recycled"])
    return _block(
        results,
        f"{f['mb']} MB already in memory written to a new file: into fresh page-cache pages {fresh}; into "
        f"pages another file has just freed {recycled}. First touch of as much anonymous memory "
        f"{f['first_touch_ms']:.0f} ms, {f['second_touch_ms']:.0f} ms again after freeing it.",
    )


def available() -> list[str]:
    """The benchmarks that have a results file."""
    return sorted(path.stem for path in RESULTS.glob("*.json"))


def first_run() -> str:
    """How long a newcomer waits: set-up, the demo and (when timed) the whole suite, from a fresh clone."""
    results = load("first_run")
    f, m, load_average = results["figures"], results["machine"], results["load_average"]

    def took(seconds: float) -> str:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"

    times = [f"`make setup` {took(f['setup_s'])}", f"then `make demo` {took(f['demo_s'])}"]
    if "test_s" in f:
        times.append(f"then `make test` {took(f['test_s'])}")
    return (
        f"Timed from a fresh clone ({results['date'][:10]}, {m['cores']} CPUs, {m['memory_gib']:.0f} GiB, pip's "
        f"download cache warm, load average {load_average['start']:.1f} at start and {load_average['end']:.1f} at "
        f"end; `benchmarks/bench_first_run.py`): " + ", ".join(times) + ".\n"
    )
