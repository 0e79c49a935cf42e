"""``show``: what one step holds, decoded by its role's own codec (or shown raw, saying why); with
``--match FILE.parquet``, how many of a dataset's prompts a complete step under PATH recorded the input
fingerprint of (only ``meta.json`` files are read).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import skipinject.cache_tool.fields as fields
from skipinject.cache_tool.common import (
    OK,
    CommandError,
    existing_dir,
    human_number,
    human_size,
    output,
    say,
    show_table,
    writer_text,
)
from skipinject.cache_tool.plugins import InstalledRoles
from skipinject.cache_tool.scan import STEP_RE, classify, has_meta, scan
from skipinject.plugin_kit import row_digest, row_text
from skipinject.store import StepMeta, StepStore, open_plain, read_record


def cmd_show(
    step_path: Path, *, as_json: bool, rows: int, tokenizer: str | None, match: Path | None, column: str
) -> int:
    if match is not None:
        return cmd_show_match(step_path, match, column=column, as_json=as_json)
    existing_dir(step_path)
    roles = InstalledRoles()
    meta, step = load_step(step_path, roles)
    flat = fields.flatten(step.value)
    inputs = meta.inputs if isinstance(meta.inputs, list) else None
    found = fields.step_samples(flat)
    decode, source = fields.tokenizer(tokenizer, meta) if found else (None, None)
    listed = [fields.shown_row(i, sample, decode) for i, sample in enumerate((found or [])[:rows])]
    samples = (
        None if found is None else {"rows": len(found), **fields.means(found), "tokenizer": source, "first": listed}
    )
    document: dict[str, Any] = {
        "path": str(step_path),
        **meta.as_written(codec=step.codec),
        "inputs": {"rows": len(inputs), "first": inputs[:rows]} if inputs is not None else None,
        "calls": meta.call_count,
        "size": meta.stored_size,
        "decoded_size": meta.stored_size + meta.expansion,
        "plugin": roles.plugin_of(str(meta.role)),
        "note": step.note,
        "fields": [fields.describe(name, v) for name, v in flat.items()],
        "text": {name: text for name, v in flat.items() if (text := fields.text_rows(v, rows))},
        "samples": samples,
    }
    output("show", as_json, document, lambda: render(document))
    return OK


def load_step(step_dir: Path, roles: InstalledRoles) -> tuple[StepMeta, fields.Decoded]:
    """The meta and decoded value of a verified step; raises CorruptCacheError."""
    if not STEP_RE.match(step_dir.name):
        raise CommandError(f"{step_dir}: not a step directory (its name is not a step number)")
    record = read_record(step_dir) if has_meta(step_dir) else None
    if record is None:
        foreign = any(item.state == "foreign" for item in classify(step_dir, roles.upstreams()))
        hint = " (it holds verl's own pickles: `skipinject cache import --trust` converts them)" if foreign else ""
        raise CommandError(f"{step_dir}: no skipinject cache here{hint}")
    store, meta = StepStore.at(step_dir, record=record)
    store.precheck(int(step_dir.name), meta)
    entry = store.verified(int(step_dir.name))
    return entry.meta, fields.decode(store.load(entry), entry.meta, roles)


def render(summary: dict[str, Any]) -> None:
    inputs, stored, decoded, samples = summary["inputs"], summary["size"], summary["decoded_size"], summary["samples"]
    say(summary["path"])
    say(f"  role {summary['role']}, step {summary['step']}, {summary['rows']} rows in {len(summary['parts'])} part(s)")
    say(f"  size {human_size(stored)} stored" + ("" if decoded == stored else f" ({human_size(decoded)} decoded)"))
    say(f"  codec {summary['codec']}; created {summary['created']} by {writer_text(summary['writer'])}")
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
    show_table("FIELD|KIND|DTYPE|SHAPE", [[i["name"], i["kind"], i["dtype"], i["shape"]] for i in summary["fields"]])
    for name, lines in summary["text"].items() if samples is None else ():  # the rows below show a rollout's text
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


# ---------------------------------------------------------------- show --match

#: Rows of a dataset read at most (checked in the footer first, and as they are read), and at a time.
MAX_DATASET_ROWS = 10_000_000
BATCH_ROWS = 1024
#: Bytes the column may take decoded: this many times the file's size, plus 256 MiB (a few KB of
#: repeated dictionary values must not decode to gigabytes).
MAX_EXPANSION = 64


def cmd_show_match(path: Path, dataset: Path, *, column: str, as_json: bool) -> int:
    existing_dir(path)
    digests = dataset_fingerprints(dataset, column)
    cached, steps = cached_fingerprints(path)
    hits = sum(1 for digest in digests if digest in cached)
    unique = set(digests)
    unique_hits = len(unique & cached)
    counts = {"rows": len(digests), "cached_rows": hits, "prompts": len(unique), "cached_prompts": unique_hits}
    document = {"dataset": str(dataset), "path": str(path), "column": column, **counts, "steps_read": steps}
    share = f" ({100 * hits / len(digests):.1f}%)" if digests else ""
    summary = (
        f"{hits} of {len(digests)} rows of {dataset}{share} ({unique_hits} of {len(unique)} distinct prompts) "
        f"have a cached rollout in {path} ({steps} step(s) read), by the fingerprint of column {column!r}; "
        "action=match serves them to a run with the same generation settings"
    )
    output("show-match", as_json, document, lambda: say(summary))
    return OK


def dataset_fingerprints(dataset: Path, column: str) -> list[str]:
    """The rollout roles' input fingerprint of each row's prompt, read a batch at a time from a regular file."""
    try:
        opened = open_plain(dataset, "a parquet file")  # not a regular file: CorruptCacheError, one line
    except FileNotFoundError as exc:
        raise CommandError(f"{dataset}: no such file") from exc
    except OSError as exc:
        raise CommandError(f"{dataset}: cannot open it ({type(exc).__name__}: {exc.strerror})") from exc
    with opened as handle:
        digests: list[str] = []
        limit, decoded = MAX_EXPANSION * handle.seek(0, 2) + (256 << 20), 0
        handle.seek(0)
        try:
            import pyarrow.parquet as pq  # type: ignore[import-not-found]  # comes with verl (pandas, datasets)

            parquet = pq.ParquetFile(handle)
            names = [name for name in parquet.schema_arrow.names if not name.startswith("__")]  # not pyarrow's own
            if column not in names:
                shown = ", ".join(repr(name) for name in names[:40]) + (" ..." if len(names) > 40 else "")
                raise CommandError(f"{dataset}: no column {column!r}; its columns: {shown} (choose one with --column)")
            if parquet.metadata.num_rows > MAX_DATASET_ROWS:
                raise CommandError(f"{dataset}: {parquet.metadata.num_rows} rows, more than {MAX_DATASET_ROWS}")
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=[column]):
                if len(digests) + batch.num_rows > MAX_DATASET_ROWS:
                    raise CommandError(f"{dataset}: more than {MAX_DATASET_ROWS} rows (more than its footer says)")
                for value in batch.column(0).to_pylist():
                    text = row_text(value)
                    decoded += len(text)
                    if decoded > limit:
                        raise CommandError(f"{dataset}: column {column!r} decodes to more than {limit} bytes; not read")
                    digests.append(row_digest(text))
        except CommandError:
            raise
        except Exception as exc:
            raise CommandError(f"{dataset}: cannot read column {column!r} of it ({type(exc).__name__}: {exc})") from exc
    return digests


def cached_fingerprints(path: Path) -> tuple[set[str], int]:
    """Every input fingerprint the complete steps under ``path`` recorded, and how many steps had some."""
    found: set[str] = set()
    steps = 0
    for item in scan(path):
        if item.kind != "skipinject" or item.state != "complete" or item.meta is None:
            continue
        lists = item.meta.input_lists()
        recorded = [d for inputs in lists if isinstance(inputs, list) for d in inputs if isinstance(d, str)]
        steps += bool(recorded)
        found.update(recorded)
    return found, steps
