"""``diff``: two steps, or two runs' directories, field by field; exit 1 when they differ."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import skipinject.cache_tool.fields as fields
from skipinject.cache_tool.common import (
    FOUND,
    OK,
    CommandError,
    Progress,
    existing_dir,
    human_number,
    output,
    say,
    show_table,
)
from skipinject.cache_tool.plugins import InstalledRoles
from skipinject.cache_tool.scan import STEP_RE, has_meta, scan
from skipinject.cache_tool.show import load_step
from skipinject.errors import CorruptCacheError
from skipinject.store import StepMeta


def cmd_diff(a: Path, b: Path, *, as_json: bool, rows: int = 3, tokenizer: str | None = None) -> int:
    existing_dir(a)
    existing_dir(b)
    pairs, only = select(a, b)
    reports = []
    roles = InstalledRoles()
    with Progress(len(pairs), "diff", unit="steps") as bar:
        for x, y in pairs:
            reports.append(diff_steps(x, y, roles, rows=rows, tokenizer=tokenizer))
            bar.update(1, x.name)
    differ = bool(only) or any(r["differs"] for r in reports)
    listed = [{"side": side, "step": key} for side, key in only]
    document = {"a": str(a), "b": str(b), "differs": differ, "steps": reports, "only": listed}
    output("diff", as_json, document, lambda: render(reports, only, differ))
    return FOUND if differ else OK


def select(a: Path, b: Path) -> tuple[list[tuple[Path, Path]], list[tuple[str, str]]]:
    """The pairs of steps to compare (two steps, or steps by their path below A and B), and those of one side."""
    if all(STEP_RE.match(side.name) and has_meta(side) for side in (a, b)):
        return [(a, b)], []

    def keyed(root: Path) -> dict[str, Path]:
        complete = (item for item in scan(root) if item.kind == "skipinject" and item.state == "complete")
        return {item.path.relative_to(root).as_posix(): item.path for item in complete}

    ka, kb = keyed(a), keyed(b)
    pairs = [(ka[k], kb[k]) for k in sorted(set(ka) & set(kb))]
    only = [("a", k) for k in sorted(set(ka) - set(kb))] + [("b", k) for k in sorted(set(kb) - set(ka))]
    return pairs, only


def diff_steps(a: Path, b: Path, roles: InstalledRoles, *, rows: int, tokenizer: str | None) -> dict[str, Any]:
    report: dict[str, Any] = {"a": str(a), "b": str(b), "meta": [], "fields": [], "problems": [], "notes": []}
    try:
        meta_a, decoded_a = load_step(a, roles)
        meta_b, decoded_b = load_step(b, roles)
    except (CorruptCacheError, OSError, CommandError) as exc:
        report["problems"].append(str(exc))
        report["differs"] = True
        return report
    report["notes"] = sorted({note for note in (decoded_a.note, decoded_b.note) if note})
    for key in ("role", "step", "rows", "context", "writer"):
        if meta_a.written(key) != meta_b.written(key):
            report["meta"].append({"key": key, "a": meta_a.written(key), "b": meta_b.written(key)})
    ia, ib = meta_a.inputs, meta_b.inputs
    report["inputs_differing"] = None
    if isinstance(ia, list) and isinstance(ib, list):
        report["inputs_differing"] = sum(x != y for x, y in zip(ia, ib, strict=False)) + abs(len(ia) - len(ib))
    flat_a, flat_b = fields.flatten(decoded_a.value), fields.flatten(decoded_b.value)
    diffs = fields.compare_fields(flat_a, flat_b)
    report["fields"] = [d.record() for d in diffs]
    report["samples"] = compare_samples(flat_a, flat_b, meta_a, rows, tokenizer)
    report["differs"] = bool(
        any(m["key"] != "writer" for m in report["meta"])
        or report["inputs_differing"]
        or any(d.status != "same" for d in diffs)
    )
    return report


def compare_samples(
    flat_a: dict[str, Any], flat_b: dict[str, Any], meta: StepMeta, rows: int, tokenizer: str | None
) -> dict[str, Any] | None:
    """Rollout rows side by side: how many are identical, each side's means, the first ``rows`` differing."""
    a, b = fields.step_samples(flat_a), fields.step_samples(flat_b)
    if a is None or b is None:
        return None
    differing = [i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or not fields.same_row(a[i], b[i])]
    decode, source = fields.tokenizer(tokenizer, meta) if differing else (None, None)
    first = [
        {
            "row": i,
            "a": fields.shown_row(i, a[i], decode) if i < len(a) else None,
            "b": fields.shown_row(i, b[i], decode) if i < len(b) else None,
        }
        for i in differing[:rows]
    ]
    return {
        "rows": [len(a), len(b)],
        "identical": min(len(a), len(b)) - len([i for i in differing if i < min(len(a), len(b))]),
        "a": fields.means(a),
        "b": fields.means(b),
        "tokenizer": source,
        "first_differing": first,
    }


def render(reports: list[dict[str, Any]], only: list[tuple[str, str]], differ: bool) -> None:
    for report in reports:
        say(f"A {report['a']}")
        say(f"B {report['b']}")
        for line in _step_lines(report):
            say(f"  {line}")
        rows = []
        for f in (f for f in report["fields"] if f["status"] != "same"):
            counted = "-" if f["rows_differing"] is None else f"{f['rows_differing']}/{f['rows']}"
            amounts = [
                human_number(v) if isinstance(v, (int, float)) else v for v in (f["max_abs_diff"], f["mean_abs_diff"])
            ]
            rows.append([f["name"], f["status"], counted, *amounts, f["note"]])
        heads = ("FIELD", "STATUS", "ROWS DIFFERING", "MAX |A-B|", "MEAN |A-B|", "NOTE")
        if rows:
            show_table(heads, rows, right=heads[2:5])
        elif not report["problems"]:
            say(f"  all {len(report['fields'])} field(s) identical")
        say()
    for side, key in only:
        say(f"only in {side.upper()}: {key}")
    if not reports and not only:
        say("no cached steps to compare")
    say("differences found" if differ else "no differences")


def _step_lines(report: dict[str, Any]) -> Iterator[str]:
    """A compared pair's lines above its field table: problems, notes, meta, inputs and rows."""
    yield from (f"cannot compare: {problem}" for problem in report["problems"])
    yield from (f"note: {note}" for note in report.get("notes", []))
    yield from (f"meta {item['key']}: {item['a']!r} vs {item['b']!r}" for item in report["meta"])
    if report.get("inputs_differing"):
        yield f"inputs: {report['inputs_differing']} row(s) were generated from other prompts"
    samples = report.get("samples")
    if samples is None:
        return
    rows_a, rows_b = samples["rows"]
    counted = f"{rows_a}" if rows_a == rows_b else f"{rows_a} (A) and {rows_b} (B)"
    yield f"rows: {samples['identical']} of {counted} identical (prompt and response)"
    for side in ("a", "b"):
        mean = samples[side]
        length = human_number(mean["mean_length"])
        yield f"{side.upper()}: mean score {human_number(mean['mean_score'])}, mean response length {length}"
    for pair in samples["first_differing"]:
        a, b = pair["a"], pair["b"]
        if a is not None and b is not None and a["prompt"] != b["prompt"]:  # each side's own prompt
            yield f"row {pair['row']}: prompts differ"
            yield f"  A prompt: {a['prompt']}"
            yield f"  B prompt: {b['prompt']}"
        else:
            yield f"row {pair['row']}: prompt {(a or b)['prompt']}"
        for side, row in (("A", a), ("B", b)):
            if row is None:
                yield f"  {side}: (no such row)"
            else:
                yield f"  {side}: {row['response']} (score {human_number(row['score'])}, {row['length']} tokens)"
