"""``show --match FILE.parquet PATH``: how many of a dataset's prompts have a cached rollout under PATH.

A prompt counts as cached when a complete step (or rows record) under PATH recorded its input
fingerprint: the digest the rollout roles record per row (``inputs`` / ``call_inputs`` in
``meta.json``) of its chat messages. It says which prompts ``action=match`` may serve; whether it
does also depends on the run's generation settings (model, sampling, lengths), which are in the
run's config, not in the dataset. Only ``meta.json`` files are read (bounded, as everywhere).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skipinject.cache_tool.common import OK, CommandError, existing_dir
from skipinject.cache_tool.render import emit_json, say, schema
from skipinject.cache_tool.scan import scan
from skipinject.plugin_kit import row_digest, row_text

#: Rows of a dataset this command reads at most.
MAX_DATASET_ROWS = 50_000_000


def cmd_show_match(path: Path, dataset: Path, *, column: str, as_json: bool) -> int:
    existing_dir(path)
    digests = dataset_fingerprints(dataset, column)  # select
    cached, steps = cached_fingerprints(path)
    hits = sum(1 for digest in digests if digest in cached)  # act
    unique = set(digests)
    unique_hits = sum(1 for digest in unique if digest in cached)
    if as_json:
        emit_json(
            {
                "schema": schema("show-match"),
                "dataset": str(dataset),
                "path": str(path),
                "column": column,
                "rows": len(digests),
                "cached_rows": hits,
                "prompts": len(unique),
                "cached_prompts": unique_hits,
                "steps_read": steps,
            }
        )
    else:
        share = f" ({100 * hits / len(digests):.1f}%)" if digests else ""
        say(
            f"{hits} of {len(digests)} rows of {dataset}{share} ({unique_hits} of {len(unique)} distinct prompts) "
            f"have a cached rollout in {path} ({steps} step(s) read), by the fingerprint of column {column!r}; "
            "action=match serves them to a run with the same generation settings"
        )
    return OK


def dataset_fingerprints(dataset: Path, column: str) -> list[str]:
    """The rollout roles' input fingerprint of each row's prompt (its chat messages)."""
    try:
        import pyarrow.parquet as pq  # type: ignore[import-not-found]  # comes with verl (pandas, datasets)

        names = [name for name in pq.read_schema(dataset).names if not name.startswith("__")]  # not pyarrow's own
        if column not in names:
            shown = ", ".join(repr(name) for name in names[:40]) + (" ..." if len(names) > 40 else "")
            raise CommandError(f"{dataset}: no column {column!r}; its columns: {shown} (choose one with --column)")
        table = pq.read_table(dataset, columns=[column])
    except CommandError:
        raise
    except FileNotFoundError as exc:
        raise CommandError(f"{dataset}: no such file") from exc
    except Exception as exc:
        raise CommandError(f"{dataset}: cannot read column {column!r} of it ({type(exc).__name__}: {exc})") from exc
    if table.num_rows > MAX_DATASET_ROWS:
        raise CommandError(f"{dataset}: {table.num_rows} rows, more than {MAX_DATASET_ROWS}")
    return [row_digest(row_text(value)) for value in table.column(column).to_pylist()]


def cached_fingerprints(path: Path) -> tuple[set[str], int]:
    """Every input fingerprint the complete steps under ``path`` recorded, and how many steps had some."""
    found: set[str] = set()
    steps = 0
    for item in scan(path):
        if item.kind != "skipinject" or item.state != "complete" or item.meta is None:
            continue
        recorded = _recorded(item.meta)
        if recorded:
            steps += 1
            found.update(recorded)
    return found, steps


def _recorded(meta: dict[str, Any]) -> list[str]:
    calls = meta.get("call_inputs")
    lists = calls if isinstance(calls, list) else [meta.get("inputs")]
    return [d for inputs in lists if isinstance(inputs, list) for d in inputs if isinstance(d, str)]
