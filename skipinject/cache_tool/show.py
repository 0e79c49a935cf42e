"""``show``: what one step holds, decoded by its role's own codec (or shown raw, saying why)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import skipinject.cache_tool.fields as fields
from skipinject.cache_tool.common import OK, CommandError, existing_dir, writer_text
from skipinject.cache_tool.plugins import InstalledRoles
from skipinject.cache_tool.render import emit_json, human_number, human_size, say, schema, show_table
from skipinject.cache_tool.rows import means, shown_row, step_samples
from skipinject.cache_tool.rows import tokenizer as tokenizer_for
from skipinject.cache_tool.scan import STEP_RE, classify, load_meta_json, open_step, precheck
from skipinject.store.format import META_NAME
from skipinject.store.meta import step_meta


def cmd_show(step_dir: Path, *, as_json: bool, rows: int, tokenizer: str | None) -> int:
    existing_dir(step_dir)
    roles = InstalledRoles()
    meta, step = load_step(step_dir, roles)  # select
    summary, infos, texts = describe(step_dir, meta, step, roles, rows)  # act
    found = step_samples(fields.flatten(step.value))
    decode, source = tokenizer_for(tokenizer, meta) if found else (None, None)
    listed = [shown_row(i, sample, decode).record() for i, sample in enumerate((found or [])[:rows])]
    samples = None if found is None else {"rows": len(found), **means(found), "tokenizer": source, "first": listed}
    if as_json:
        emit_json(
            {
                "schema": schema("show"),
                **summary,
                "fields": [i.record() for i in infos],
                "text": texts,
                "samples": samples,
            }
        )
    else:
        render(step_dir, summary, infos, texts, samples)
    return OK


# ---------------------------------------------------------------- select


def load_step(step_dir: Path, roles: InstalledRoles) -> tuple[dict[str, Any], fields.Decoded]:
    """The meta and decoded value of a verified step (by its role's own codec); raises CorruptCacheError."""
    if not STEP_RE.match(step_dir.name):
        raise CommandError(f"{step_dir}: not a step directory (its name is not a step number)")
    ours = (step_dir / META_NAME).exists() and load_meta_json(step_dir / META_NAME) is not None
    if not ours:
        hint = ""
        if any(item.state == "foreign" for item in classify(step_dir, roles.upstreams())):
            hint = " (it holds verl's own pickles: `skipinject cache import --trust` converts them)"
        raise CommandError(f"{step_dir}: no skipinject cache here{hint}")
    store, meta = open_step(step_dir)
    precheck(store, int(step_dir.name), meta)
    entry = store.verified(int(step_dir.name))
    payloads = store.load(entry)
    return dict(entry.meta), fields.decode(payloads, entry.meta, roles)


# ---------------------------------------------------------------- act


def describe(
    step_dir: Path, meta: dict[str, Any], step: fields.Decoded, roles: InstalledRoles, rows: int
) -> tuple[dict[str, Any], list[fields.FieldInfo], dict[str, list[str]]]:
    """The step's summary, its fields and the first ``rows`` rows of its text fields."""
    flat = fields.flatten(step.value)
    infos = [fields.describe(name, v) for name, v in flat.items()]
    texts = {}
    for name, v in flat.items():
        found = fields.text_rows(v, rows)
        if found:
            texts[name] = found
    inputs = meta.get("inputs") if isinstance(meta.get("inputs"), list) else None
    checked = step_meta(meta, step_dir)
    stored = checked.stored_size
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
        "size": stored,
        "decoded_size": stored + checked.expansion,
        "plugin": roles.plugin_of(str(meta.get("role"))),
        "note": step.note,
    }
    return summary, infos, texts


# ---------------------------------------------------------------- render


def render(
    step_dir: Path,
    summary: dict[str, Any],
    infos: list[fields.FieldInfo],
    texts: dict[str, list[str]],
    samples: dict[str, Any] | None,
) -> None:
    context = summary["context"] or {}
    inputs = summary["inputs"]
    say(f"{step_dir}")
    parts = len(summary["parts"])
    say(f"  role {summary['role']}, step {summary['step']}, {summary['rows']} rows in {parts} part(s)")
    stored, decoded = summary["size"], summary["decoded_size"]
    say(f"  size {human_size(stored)} stored" + ("" if decoded == stored else f" ({human_size(decoded)} decoded)"))
    say(f"  codec {summary['codec']}; created {summary['created']} by {writer_text(summary['writer'] or {})}")
    if summary["plugin"] is not None:
        say(f"  decoded by plugin {summary['plugin']}")
    if summary["note"]:
        say(f"  note: {summary['note']}")
    say("  context " + ", ".join(f"{k}={v}" for k, v in sorted(context.items())))
    if inputs is not None:
        say(f"  input fingerprint: {inputs['rows']} rows, first {', '.join(map(str, inputs['first']))}")
    else:
        say("  input fingerprint: none recorded (prompt mismatches are not detected for this step)")
    say()
    show_table(("FIELD", "KIND", "DTYPE", "SHAPE"), [[i.name, i.kind, i.dtype, i.shape] for i in infos])
    for name, lines in texts.items() if samples is None else ():  # the rows below show a rollout's text
        say()
        say(f"{name}:")
        for index, line in enumerate(lines):
            say(f"  [{index}] {line}")
    if samples is not None:
        say()
        listed = samples["first"]
        heads = ("ROW", "PROMPT", "RESPONSE", "SCORE", "LENGTH")
        table = [[r["row"], r["prompt"], r["response"], human_number(r["score"]), r["length"]] for r in listed]
        show_table(heads, table, right=("ROW", "SCORE", "LENGTH"))
        decoded = f"decoded by {samples['tokenizer']}" if samples["tokenizer"] else "token ids (--tokenizer decodes)"
        say(
            f"{len(listed)} of {samples['rows']} row(s) shown, {decoded}; mean score "
            f"{human_number(samples['mean_score'])}, mean response length {human_number(samples['mean_length'])}"
        )
