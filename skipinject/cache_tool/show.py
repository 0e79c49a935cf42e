"""``show``: what one step holds, decoded by its role's own codec (or shown raw, saying why)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import skipinject.cache_tool.fields as fields
from skipinject.cache_tool.common import OK, CommandError, existing_dir, writer_text
from skipinject.cache_tool.plugins import InstalledRoles
from skipinject.cache_tool.render import emit_json, human_size, say, schema, shorten, show_table
from skipinject.cache_tool.scan import STEP_RE, classify, load_meta_json, open_step, precheck
from skipinject.store.format import META_NAME
from skipinject.store.meta import step_meta


def cmd_show(step_dir: Path, *, as_json: bool, rows: int, tokenizer: str | None) -> int:
    existing_dir(step_dir)
    roles = InstalledRoles()
    meta, step = load_step(step_dir, roles)  # select
    summary, infos, texts = describe(step_dir, meta, step, roles, rows)  # act
    decoded = _decode_tokens(fields.flatten(step.value), tokenizer, rows) if tokenizer else {}
    if as_json:
        emit_json(
            {
                "schema": schema("show"),
                **summary,
                "fields": [i.record() for i in infos],
                "text": texts,
                "decoded": decoded,
            }
        )
    else:
        render(step_dir, summary, infos, {**texts, **decoded}, rows)
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


def _decode_tokens(flat: dict[str, Any], tokenizer_path: str, rows: int) -> dict[str, list[str]]:
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    except Exception as exc:
        raise CommandError(f"cannot load a tokenizer from {tokenizer_path} ({type(exc).__name__}: {exc})") from exc
    out = {}
    for name, value in flat.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in ("prompts", "responses", "input_ids") or not hasattr(value, "dtype"):
            continue
        if getattr(value.dtype, "is_floating_point", True):
            continue
        seqs = list(value.unbind(0)) if getattr(value, "is_nested", False) else list(value)
        texts = []
        for seq in seqs[:rows]:
            ids = [int(t) for t in seq.reshape(-1).tolist()]
            texts.append(shorten(tokenizer.decode(ids, skip_special_tokens=True), 200))
        out[f"{name} (decoded)"] = texts
    return out


# ---------------------------------------------------------------- render


def render(
    step_dir: Path,
    summary: dict[str, Any],
    infos: list[fields.FieldInfo],
    texts: dict[str, list[str]],
    rows: int,
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
    for name, lines in texts.items():
        say()
        say(f"{name}:")
        for index, line in enumerate(lines):
            say(f"  [{index}] {line}")
