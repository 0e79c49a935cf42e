"""``show``: what one step holds, decoded by its role's own codec (or shown raw, saying why)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import skipinject.cache_tool.fields as fields
from skipinject.cache_tool.common import (
    OK,
    CommandError,
    emit_json,
    existing_dir,
    human_number,
    human_size,
    say,
    schema,
    show_table,
    writer_text,
)
from skipinject.cache_tool.plugins import InstalledRoles
from skipinject.cache_tool.rows import means, shown_row, step_samples
from skipinject.cache_tool.rows import tokenizer as tokenizer_for
from skipinject.cache_tool.scan import STEP_RE, classify, has_meta, load_meta_json, open_step
from skipinject.store.format import META_NAME
from skipinject.store.meta import step_meta


def cmd_show(
    step_path: Path,
    *,
    as_json: bool,
    rows: int = 3,
    tokenizer: str | None = None,
    match: Path | None = None,
    column: str = "prompt",
) -> int:
    if match is not None:
        from skipinject.cache_tool.match import cmd_show_match

        return cmd_show_match(step_path, match, column=column, as_json=as_json)
    existing_dir(step_path)
    roles = InstalledRoles()
    meta, step = load_step(step_path, roles)
    summary, infos, texts = describe(step_path, meta, step, roles, rows)
    found = step_samples(fields.flatten(step.value))
    decode, source = tokenizer_for(tokenizer, meta) if found else (None, None)
    listed = [shown_row(i, sample, decode) for i, sample in enumerate((found or [])[:rows])]
    samples = None if found is None else {"rows": len(found), **means(found), "tokenizer": source, "first": listed}
    if as_json:
        records = [i.record() for i in infos]
        emit_json({"schema": schema("show"), **summary, "fields": records, "text": texts, "samples": samples})
    else:
        render(step_path, summary, infos, texts, samples)
    return OK


def load_step(step_dir: Path, roles: InstalledRoles) -> tuple[dict[str, Any], fields.Decoded]:
    """The meta and decoded value of a verified step (by its role's own codec); raises CorruptCacheError."""
    if not STEP_RE.match(step_dir.name):
        raise CommandError(f"{step_dir}: not a step directory (its name is not a step number)")
    if not has_meta(step_dir) or load_meta_json(step_dir / META_NAME) is None:
        hint = ""
        if any(item.state == "foreign" for item in classify(step_dir, roles.upstreams())):
            hint = " (it holds verl's own pickles: `skipinject cache import --trust` converts them)"
        raise CommandError(f"{step_dir}: no skipinject cache here{hint}")
    store, meta = open_step(step_dir)
    store.precheck(int(step_dir.name), meta)
    entry = store.verified(int(step_dir.name))
    return dict(entry.meta), fields.decode(store.load(entry), entry.meta, roles)


def describe(
    step_dir: Path, meta: dict[str, Any], step: fields.Decoded, roles: InstalledRoles, rows: int
) -> tuple[dict[str, Any], list[fields.FieldInfo], dict[str, list[str]]]:
    """The step's summary, its fields and the first ``rows`` rows of its text fields."""
    flat = fields.flatten(step.value)
    infos = [fields.describe(name, v) for name, v in flat.items()]
    texts = {name: found for name, v in flat.items() if (found := fields.text_rows(v, rows))}
    inputs = meta.get("inputs") if isinstance(meta.get("inputs"), list) else None
    checked = step_meta(meta, step_dir)
    summary: dict[str, Any] = {
        "path": str(step_dir),
        "role": meta.get("role"),
        "step": meta.get("step"),
        "rows": meta.get("rows"),
        "parts": [p.get("dir") for p in meta.get("parts", [])],
        "codec": step.codec,
        "context": meta.get("context"),
        "created": meta.get("created"),
        "writer": meta.get("writer"),
        "inputs": {"rows": len(inputs), "first": inputs[:rows]} if inputs is not None else None,
        "calls": meta.get("calls") if type(meta.get("calls")) is int else None,
        "size": checked.stored_size,
        "decoded_size": checked.stored_size + checked.expansion,
        "plugin": roles.plugin_of(str(meta.get("role"))),
        "note": step.note,
    }
    return summary, infos, texts


def render(
    step_dir: Path,
    summary: dict[str, Any],
    infos: list[fields.FieldInfo],
    texts: dict[str, list[str]],
    samples: dict[str, Any] | None,
) -> None:
    inputs, stored, decoded = summary["inputs"], summary["size"], summary["decoded_size"]
    say(f"{step_dir}")
    say(f"  role {summary['role']}, step {summary['step']}, {summary['rows']} rows in {len(summary['parts'])} part(s)")
    say(f"  size {human_size(stored)} stored" + ("" if decoded == stored else f" ({human_size(decoded)} decoded)"))
    say(f"  codec {summary['codec']}; created {summary['created']} by {writer_text(summary['writer'] or {})}")
    if summary["plugin"] is not None:
        say(f"  decoded by plugin {summary['plugin']}")
    if summary["note"]:
        say(f"  note: {summary['note']}")
    say("  context " + ", ".join(f"{k}={v}" for k, v in sorted((summary["context"] or {}).items())))
    if inputs is not None:
        say(f"  input fingerprint: {inputs['rows']} rows, first {', '.join(map(str, inputs['first']))}")
    else:
        say("  input fingerprint: none recorded (prompt mismatches are not detected for this step)")
    say()
    show_table("FIELD|KIND|DTYPE|SHAPE", [[i.name, i.kind, i.dtype, i.shape] for i in infos])
    for name, lines in texts.items() if samples is None else ():  # the rows below show a rollout's text
        say()
        say(f"{name}:")
        for index, line in enumerate(lines):
            say(f"  [{index}] {line}")
    if samples is not None:
        say()
        listed = samples["first"]
        table = [[r["row"], r["prompt"], r["response"], human_number(r["score"]), r["length"]] for r in listed]
        show_table("ROW|PROMPT|RESPONSE|SCORE|LENGTH", table, right="ROW|SCORE|LENGTH")
        decoded_by = f"decoded by {samples['tokenizer']}" if samples["tokenizer"] else "token ids (--tokenizer decodes)"
        say(
            f"{len(listed)} of {samples['rows']} row(s) shown, {decoded_by}; mean score "
            f"{human_number(samples['mean_score'])}, mean response length {human_number(samples['mean_length'])}"
        )
