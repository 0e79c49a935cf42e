"""``show --match FILE.parquet PATH``: how many of a dataset's prompts have a cached rollout under PATH.

A prompt counts as cached when a complete step (or rows record) under PATH recorded its input
fingerprint (``inputs`` / ``call_inputs`` in ``meta.json``): the prompts ``action=match`` may serve
to a run with the same generation settings. Only ``meta.json`` files are read.
"""

from __future__ import annotations

from pathlib import Path

from skipinject.cache_tool.common import OK, CommandError, emit_json, existing_dir, say, schema
from skipinject.cache_tool.scan import scan
from skipinject.plugin_kit import row_digest, row_text

#: Rows of a dataset this command reads at most (checked in the file's footer before any is read, and
#: again as they are read), and rows read at a time.
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
    """The rollout roles' input fingerprint of each row's prompt, read a batch at a time from a regular
    file, at most :data:`MAX_DATASET_ROWS` rows and :data:`MAX_EXPANSION` times the file's size decoded."""
    from skipinject.errors import CorruptCacheError
    from skipinject.store.files import open_plain

    try:
        opened = open_plain(dataset, "a parquet file")
    except FileNotFoundError as exc:
        raise CommandError(f"{dataset}: no such file") from exc
    except CorruptCacheError as exc:
        raise CommandError(str(exc)) from exc
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
        calls = item.meta.get("call_inputs")
        lists = calls if isinstance(calls, list) else [item.meta.get("inputs")]
        recorded = [d for inputs in lists if isinstance(inputs, list) for d in inputs if isinstance(d, str)]
        steps += bool(recorded)
        found.update(recorded)
    return found, steps
