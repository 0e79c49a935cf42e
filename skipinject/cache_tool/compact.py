"""``skipinject cache compact``: store steps saved uncompressed again, compressed, in place.

Each step is committed anew with one ``meta.json`` replace, only over the step it read (one recorded anew
meanwhile is kept): the old step or the new one, whole, at every moment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skipinject.cache_tool.common import CommandError, default_dump_dir, human_size, mutable_root, output, say
from skipinject.cache_tool.scan import scan
from skipinject.errors import CacheError
from skipinject.store import Compression, Payload, StepStore, parse_compression


def compact_step(step_dir: Path, compression: Compression, dry_run: bool) -> dict[str, Any]:
    """Store one committed step compressed: its result's state and stored bytes (before, and after)."""
    store, meta = StepStore.at(step_dir)
    if meta.compressed or dry_run:
        state = "already compressed" if meta.compressed else "would compact"
        return {"state": state, "before": meta.stored_size} if dry_run else {"state": state}
    step = int(step_dir.name)
    entry = store.verified(step)
    try:
        payloads = store.load(entry)
        packed = StepStore(store.project_dir, store.role, store.context, plugin=meta.plugin, compression=compression)
        writer = packed.begin(step)
        try:
            for record, payload in zip(meta.parts, payloads, strict=True):
                part = Payload(tensors=dict(payload.tensors), objects=payload.objects, rows=payload.rows)
                writer.add_part(part, record.dir)
            # the writer sets its own keys anew, keeps the role's and ``created``; only over the step it read
            writer.commit(meta, over=meta)
        except BaseException:
            writer.abort()
            raise
    finally:
        entry.release()
    return {"state": "compacted", "before": meta.stored_size, "after": packed.read_meta(step).stored_size}


def cmd_compact(dump_dir: Path | None, *, compression: str, dry_run: bool, as_json: bool) -> int:
    """Exit 1 if a step failed or was skipped as unusable (damaged, partial, untrusted, linked)."""
    root = dump_dir or default_dump_dir()
    try:
        chosen = parse_compression(compression)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    if chosen is None:
        raise CommandError("--compression must name a compression (zstd or zstd-<level>)")
    mutable_root(root, "compact")
    results: list[dict[str, Any]] = []
    problems: list[str] = []
    items = scan(root, problems)
    for problem in problems:  # links, unlistable directories: never compacted, never silently
        results.append({"path": problem.split(": ", 1)[0], "state": "skipped", "problem": problem, "unusable": True})
    for item in items:
        result: dict[str, Any] = {"path": str(item.path), "role": item.role, "step": item.step}
        if item.kind != "skipinject" or item.state != "complete":  # said, never skipped silently
            why = "; ".join(item.problems) or ("verl's own cache" if item.kind != "skipinject" else item.state)
            result["state"], result["problem"] = "skipped", f"{item.state}: {' '.join(why.split())}"
            result["unusable"] = item.kind == "skipinject"
            results.append(result)
            continue
        try:
            result.update(compact_step(item.path, chosen, dry_run))
        except (CacheError, OSError, ValueError, TypeError) as exc:
            result["state"], result["problem"] = "failed", " ".join(str(exc).split())
        results.append(result)
    output("compact", as_json, {"steps": results}, lambda: render(results))
    return 1 if any(r["state"] == "failed" or r.get("unusable") for r in results) else 0


def _ratio(before: int, after: int) -> str:
    return f"{after / before:.0%} of it" if before else "-"


def render(results: list[dict[str, Any]]) -> None:
    for result in results:
        sizes = ""
        if "after" in result:
            before, after = result["before"], result["after"]
            sizes = f": {human_size(before)} -> {human_size(after)} ({_ratio(before, after)})"
        elif "before" in result:
            sizes = f": {human_size(result['before'])}"
        problem = f" ({result['problem']})" if "problem" in result else ""
        say(f"{result['state']} {result['path']}{sizes}{problem}")
    done = [r for r in results if "after" in r]
    before, after = sum(r["before"] for r in done), sum(r["after"] for r in done)
    counts = {state: sum(r["state"] == state for r in results) for state in ("would compact", "already compressed")}
    failed = sum(r["state"] == "failed" for r in results)
    if counts["would compact"]:
        pending = sum(r["before"] for r in results if r["state"] == "would compact")
        head = f"would compact {counts['would compact']} step(s), {human_size(pending)}"
    else:
        head = f"compacted {len(done)} step(s)" + (
            f", {human_size(before)} -> {human_size(after)} ({_ratio(before, after)})" if done else ""
        )
    say(f"{head}; {counts['already compressed']} already compressed, {failed} failed")
