"""``action=match``: each row of a call served by its inputs from any cached step, only the others generated.

A row's key (:func:`row_keys`) digests the role's per-row inputs (``Role.row_key``), the run settings
it names (``Role.match_settings``) and its occurrence among equal rows (GRPO's ``n`` copies map to
``n`` cached samples). Keys are looked up in the project's :class:`~skipinject.engine.row_index.RowIndex`
(this layout's, then the nearest other batch sizes'); a source is served only when it verifies and
records the key where the index said. The target runs once for the other rows, the codec merges the
pieces; a committed step is never rewritten: new rows are saved as a rows record (``{project}/rows/{n}``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from skipinject.engine.context import RoleContext
from skipinject.engine.record import Recorder, rows_per_key
from skipinject.engine.row_index import STEPS, RowIndex, RowSource, match_records
from skipinject.engine.stores import RoleStores
from skipinject.errors import CodecError, ConfigError, CorruptCacheError
from skipinject.report.misses import settings_differ
from skipinject.report.tally import TALLY, hit_amounts
from skipinject.roles import Call, MatchInfo, Role, RowCodec
from skipinject.store.format import ROWS_DIR
from skipinject.verl.compat import settings_values
from skipinject.verl.layout import layout_label

if TYPE_CHECKING:
    from skipinject.engine.calls import StepCalls
    from skipinject.store import StepStore


logger = logging.getLogger("skipinject")
_T = TypeVar("_T")

#: A match line names at most this many of the records rows were served from.
SHOWN_SOURCES = 8
#: Copies of a key tried, the latest first, before its row is generated.
MAX_COPIES = 4
#: Other batch-size layouts of the project a lookup reads the index of (the nearest batch sizes).
MAX_LAYOUTS = 8


def check_matchable(role: Role, codec: Any) -> None:
    """``action=match`` needs a role that keys its rows and a codec that selects and merges them."""
    if role.row_key is None or not isinstance(codec, RowCodec):
        missing = "declares no row_key" if role.row_key is None else f"codec {type(codec).__name__} is no RowCodec"
        raise ConfigError(
            f"skip.{role.name}.action=match: role {role.name!r} cannot serve part of a call ({missing}: it has "
            "no row selector and merger, plugin API 1.2); use action=cache, repeat or strict"
        )


def row_keys(role: Role, call: Call, digests: Sequence[str]) -> list[str]:
    """One key per input row: the row's digest, the run settings, and its occurrence among equal rows."""
    settings = json.dumps(settings_values(call.run_config, role.match_settings), sort_keys=True, default=repr)
    base = hashlib.blake2b(settings.encode(), digest_size=16).digest()
    seen: dict[str, int] = {}
    keys = []
    for digest in digests:
        occurrence = seen.get(digest, 0)
        seen[digest] = occurrence + 1
        material = base + digest.encode("utf-8", "replace") + b"\x1f" + str(occurrence).encode()
        keys.append(hashlib.blake2b(material, digest_size=8).hexdigest())
    return keys


@dataclass(frozen=True)
class Found:
    """The cached rows a phase asked for (:meth:`RowMatcher.find`): per served key index, its piece
    (a result of the role's codec) and row there, the name of its source, each source's ``meta.json``."""

    rows: dict[int, tuple[Any, int]]
    sources: dict[int, str]
    source_meta: dict[str, Mapping[str, Any]]
    seconds: float


@dataclass
class _Pending:
    """One call being matched: what was served, what the target must generate."""

    record: StepCalls
    index: int
    call: Call
    codec: RowCodec
    background: bool
    inputs: list[str] | None = None
    keys: list[str] | None = None
    served: dict[int, tuple[int, int]] = field(default_factory=dict)  # input row -> (piece, row in piece)
    pieces: list[Any] = field(default_factory=list)
    sources: dict[str, int] = field(default_factory=dict)
    piece_sources: list[str] = field(default_factory=list)  # per piece, the name of its source
    source_meta: dict[str, Mapping[str, Any]] = field(default_factory=dict)  # per source, its meta.json
    ratio: int | None = None
    seconds: float = 0.0
    whole: bool = False
    misses: list[int] = field(default_factory=list)
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    padding: int = 0
    generated: Any = None  # the generated rows without the padding
    merged: Any = None
    generation_s: float = 0.0  # the target's time for this call (recorded with what it generated)

    @property
    def step(self) -> int:
        assert self.record.plan is not None
        return self.record.plan.step

    def timed(self, generate: Callable[[], Any]) -> Any:
        began = time.perf_counter()
        try:
            return generate()
        finally:
            self.add_generation(time.perf_counter() - began)

    def add_generation(self, seconds: float) -> None:
        self.generation_s += seconds
        self.record.generation_seconds += seconds


class RowMatcher:
    """``action=match`` for one role in this process: the row indexes and rows stores of its projects."""

    def __init__(self, runtime: RoleContext, stores: RoleStores, recorder: Recorder) -> None:
        self.runtime = runtime
        self.stores = stores
        self.recorder = recorder
        self._memo: dict[tuple[str, Any], Any] = {}
        self._lock = threading.Lock()  # awaiting callers look rows up from several threads

    def _project(self, kind: str, store: StepStore, make: Callable[[], _T]) -> _T:
        """What ``make`` gives for ``store``'s project directory, made once per run."""
        key = (kind, store.project_dir)
        with self._lock:
            found: _T | None = self._memo.get(key)
        if found is None:
            made = make()
            with self._lock:
                found = self._memo.setdefault(key, made)
        return found

    def rows_store(self, store: StepStore) -> StepStore:
        """Where the rows generated at already committed steps of ``store`` are kept."""
        return self._project("rows", store, lambda: self.stores.open(store.project_dir / ROWS_DIR, store.context))

    def index(self, store: StepStore) -> RowIndex:
        rows = self.rows_store(store)
        return self._project("index", store, lambda: RowIndex(store, rows, saves=self.runtime.settings.save))

    def batch_size_stores(self, store: StepStore) -> list[StepStore]:
        """The stores of the project's other batch-size layouts (found once per run and layout)."""
        return self._project("layouts", store, lambda: self.stores.batch_size_stores(store, MAX_LAYOUTS))

    def keys(self, call: Call) -> list[str] | None:
        """The call's row keys, or ``None`` when the role cannot key it (one warning, the call runs whole)."""
        role = self.runtime.role
        try:
            digests = None if role.row_key is None else role.row_key(call)
            return None if digests is None else row_keys(role, call, [str(d) for d in digests])
        except Exception as exc:
            self.runtime.once(
                ("row_key", type(exc)),
                logging.WARNING,
                "%s: cannot key the rows of a call (%s: %s); it runs whole",
                role.name,
                type(exc).__name__,
                exc,
            )
            return None

    def find(self, store: StepStore, call: Call, keys: list[str], group: int = 1) -> Found:
        """The cached rows of ``keys`` that verify, for a phase serving part of a step itself
        (:meth:`skipinject.roles.PhaseContext.match_rows`): looked up as a call's rows are, kept only
        in whole groups of ``group`` consecutive keys (a prompt's ``n`` samples), counted for the summary."""
        assert isinstance(self.runtime.codec, RowCodec)
        pending = _Pending(cast(Any, None), 0, call, self.runtime.codec, False, keys=keys)
        started = time.perf_counter()
        if self.stores.unusable(store) is None:
            self._serve_cached(store, call, pending)
        whole = {
            row
            for row in pending.served
            if all(r in pending.served for r in range(row - row % group, row - row % group + group))
        }
        rows = {row: (pending.pieces[piece], at) for row, (piece, at) in pending.served.items() if row in whole}
        sources = {row: pending.piece_sources[piece] for row, (piece, _) in pending.served.items() if row in whole}
        TALLY.add(self.runtime.name, served_rows=len(rows), generated_rows=len(keys) - len(rows))
        return Found(rows, sources, dict(pending.source_meta), time.perf_counter() - started)

    def run(self, record: StepCalls, index: int, call: Call, proceed: Callable[..., Any]) -> Any:
        """One call at a chosen step: the cached rows served, the target called once for the others."""
        pending = self.begin(record, index, call)
        if not pending.whole:
            fresh = pending.timed(lambda: proceed(*pending.args, **pending.kwargs)) if pending.misses else None
            if self.merge(pending, fresh):
                return self.finish(pending)
        return self.finish_whole(pending, pending.timed(proceed))

    async def run_async(self, record: StepCalls, index: int, call: Call, proceed: Callable[..., Any]) -> Any:
        """:meth:`run` for awaiting callers (the store is read and written off the event loop)."""
        pending = await asyncio.to_thread(self.begin, record, index, call, background=False)
        if not pending.whole:
            began = time.perf_counter()
            fresh = await proceed(*pending.args, **pending.kwargs) if pending.misses else None
            pending.add_generation(time.perf_counter() - began if pending.misses else 0.0)
            if await asyncio.to_thread(self.merge, pending, fresh):
                return await asyncio.to_thread(self.finish, pending)
        began = time.perf_counter()
        result = await proceed()
        pending.add_generation(time.perf_counter() - began)
        return await asyncio.to_thread(self.finish_whole, pending, result)

    def begin(self, record: StepCalls, index: int, call: Call, *, background: bool = True) -> _Pending:
        """Key the call's rows and load the cached ones; say which rows the target must generate."""
        runtime, plan = self.runtime, record.plan
        assert plan is not None and isinstance(runtime.codec, RowCodec)
        pending = _Pending(record, index, call, runtime.codec, background)
        pending.inputs = runtime.fingerprint(call)  # before the target runs: it may change its inputs
        pending.keys = self.keys(call) if self.stores.unusable(plan.store) is None else None
        started = time.perf_counter()
        if pending.keys is not None:
            try:
                pending.ratio = self._serve_cached(plan.store, call, pending)
            except Exception as exc:  # the index failed as a whole: nothing served
                logger.warning(
                    "%s step %d: cannot look rows up (%s: %s); generating them",
                    runtime.name,
                    plan.step,
                    type(exc).__name__,
                    exc,
                )
                pending.served.clear()
                pending.pieces.clear()
                pending.sources.clear()
        pending.seconds = time.perf_counter() - started
        if not pending.served:
            if pending.keys is not None:
                differ = settings_differ(plan.store, runtime.role.match_settings, call.run_config)
                logger.info(
                    "%s step %d: match: no row of this call cached (%d rows%s); running the target",
                    runtime.name,
                    plan.step,
                    len(pending.keys),
                    f"; {differ}" if differ else "",
                )
            pending.whole = True
            return pending
        pending.misses = [row for row in range(len(pending.keys or ())) if row not in pending.served]
        if pending.misses:
            try:
                pending.args, pending.kwargs, pending.padding = pending.codec.with_rows(call, pending.misses)
            except Exception as exc:  # a call the codec cannot cut: it runs whole
                self._cannot(pending, "take the uncached rows of", exc)
                pending.whole = True
        return pending

    def _cannot(self, pending: _Pending, what: str, exc: Exception) -> None:
        logger.warning(
            "%s step %d: match: cannot %s the call (%s: %s); running the whole call instead",
            self.runtime.name,
            pending.step,
            what,
            type(exc).__name__,
            exc,
        )

    def finish_whole(self, pending: _Pending, result: Any) -> Any:
        """Nothing was cached: the call ran whole and is saved as with ``cache``."""
        count = len(pending.keys or ())
        ratio = rows_per_key(pending.codec, result, pending.keys) if count else None
        self._save(pending, result, result if ratio else None, range(count), ratio)
        TALLY.add(self.runtime.name, generated_rows=count)
        return self.runtime.after_miss(pending.call, result)

    def merge(self, pending: _Pending, fresh: Any) -> bool:
        """Merge the generated rows (``fresh``, with its padding) and the cached ones in the call's
        order; False (one warning) when they do not fit together: the whole call runs then."""
        codec, keys, misses, ratio = pending.codec, pending.keys, pending.misses, pending.ratio
        assert keys is not None
        try:
            generated = None
            if fresh is not None:
                asked = len(misses) + pending.padding
                out = codec.result_rows(fresh)
                if out % asked:
                    raise CodecError(f"the target returned {out} rows for {asked} inputs")
                if ratio is not None and out // asked != ratio:
                    raise CodecError(f"cached rows hold {ratio} results per input, this call {out // asked}")
                ratio = out // asked
                generated = codec.select_rows(fresh, range(len(misses) * ratio)) if pending.padding else fresh
            assert ratio is not None
            # where each output row is in the concatenation: the generated rows first, then the pieces
            starts = [len(misses) * ratio]
            for piece in pending.pieces:
                starts.append(starts[-1] + codec.result_rows(piece))
            fresh_at = {row: position for position, row in enumerate(misses)}
            order: list[int] = []
            for row in range(len(keys)):
                if row in fresh_at:
                    base = fresh_at[row] * ratio
                else:
                    piece_index, position = pending.served[row]
                    base = starts[piece_index] + position * ratio
                order.extend(range(base, base + ratio))
            pieces = ([generated] if generated is not None else []) + pending.pieces
            pending.merged = codec.merge_rows(pieces, order, pending.call)
        except Exception as exc:
            self._cannot(pending, "merge the cached and generated rows of", exc)
            return False
        pending.generated, pending.ratio = generated, ratio
        return True

    def finish(self, pending: _Pending) -> Any:
        """Save what is new of a merged call, log it and hand it to the role's ``on_match``."""
        runtime, keys, misses, merged = self.runtime, pending.keys, pending.misses, pending.merged
        assert keys is not None
        ratio = pending.ratio or 1
        served: dict[str, list[int]] = {}
        for row, (piece, _) in sorted(pending.served.items()):
            served.setdefault(pending.piece_sources[piece], []).extend(range(row * ratio, row * ratio + ratio))
        sources = sorted(pending.sources.items(), key=lambda item: (-item[1], item[0]))
        shown = ", ".join(f"{name} ({count})" for name, count in sources[:SHOWN_SOURCES])
        more = f" and {len(sources) - SHOWN_SOURCES} more" if len(sources) > SHOWN_SOURCES else ""
        logger.info(
            "%s step %d: match: %d of %d rows served from %s%s in %.3f s; %d generated%s",
            runtime.name,
            pending.step,
            len(pending.served),
            len(keys),
            shown,
            more,
            pending.seconds,
            len(misses),
            " (target not called)" if not misses else f" in one call of {len(misses) + pending.padding} rows",
        )
        saved = 0.0  # each source's recorded generation time, for the share of its rows served
        for name, rows in served.items():
            meta = pending.source_meta.get(name, {})
            total = meta.get("rows")
            if type(total) is int and total > 0:
                saved += hit_amounts(meta)["generation_s_saved"] * min(len(rows), total) / total
        TALLY.add(runtime.name, served_rows=len(pending.served), generated_rows=len(misses), generation_s_saved=saved)
        if runtime.role.on_match is not None:  # before saving: what it recomputes is saved as this run's
            info = MatchInfo(
                pending.step,
                len(pending.served),
                len(misses),
                dict(pending.sources),
                pending.seconds,
                served,
                dict(pending.source_meta),
                runtime.settings,
            )
            merged = runtime.role.on_match(merged, pending.call, info)
        self._save(pending, merged, pending.generated, misses, pending.ratio)
        return merged

    def _serve_cached(self, store: StepStore, call: Call, pending: _Pending) -> int | None:
        """Fill ``pending`` with the cached rows that verify; returns their rows per input (``None``: none).

        Each key's copies (this layout's, then other batch sizes') are tried the latest first: a row whose
        copy does not serve (its step does not verify or no longer records the key) falls back to the next."""
        runtime, keys = self.runtime, pending.keys
        assert keys is not None
        places = [store, *self.batch_size_stores(store)]
        copies: list[list[tuple[int, RowSource]]] = [[] for _ in keys]  # per row, in the order tried
        for place, place_store in enumerate(places):
            missing = [row for row in range(len(keys)) if len(copies[row]) < MAX_COPIES]
            if not missing:
                break
            found = self.index(place_store).lookup([keys[row] for row in missing], MAX_COPIES)
            for row, there in zip(missing, found, strict=True):
                copies[row].extend((place, source) for source in there[: MAX_COPIES - len(copies[row])])
        tried = [0] * len(keys)
        failed: set[tuple[int, int, int]] = set()
        ratio: int | None = None
        for _ in range(MAX_COPIES):
            wanted: dict[tuple[int, int, int, int], list[tuple[int, RowSource]]] = {}
            for row, located in enumerate(copies):
                while row not in pending.served and tried[row] < len(located):
                    place, where = located[tried[row]]
                    tried[row] += 1
                    if (place, where.source, where.number) not in failed:
                        wanted.setdefault((place, where.source, where.number, where.call), []).append((row, where))
                        break
            if not wanted:
                break
            for (place, source, number, part), rows in sorted(wanted.items()):
                where_store = places[place]
                name = f"{'step' if source == STEPS else 'rows'} {number}"
                if place:
                    name += f" of {layout_label(where_store.context, str(where_store.project_dir))}"
                from_store = where_store if source == STEPS else self.rows_store(where_store)
                try:
                    piece, piece_ratio, kept, meta = self._load_rows(from_store, number, part, rows, keys, call)
                except Exception as exc:  # this source does not serve: its rows try their next copy
                    failed.add((place, source, number))
                    if self.index(where_store).forget(source, number):
                        continue  # only the index file said so: it is rebuilt (one line for all of it)
                    runtime.once(
                        ("match-source", str(where_store.project_dir), source, number),
                        logging.WARNING,
                        "%s: cached %s of %s not served (%s: %s); its rows are looked for elsewhere or generated",
                        runtime.name,
                        name,
                        where_store.project_dir,
                        type(exc).__name__,
                        exc,
                    )
                    continue
                if len(kept) < len(rows):  # the index is stale there: read that record again next time
                    self.index(where_store).forget(source, number)
                if not kept or (ratio is not None and piece_ratio != ratio):
                    continue  # none left, or recorded with another number of results per input: not mixed
                ratio = piece_ratio
                for position, row in enumerate(kept):
                    pending.served[row] = (len(pending.pieces), position)
                pending.pieces.append(piece)
                if runtime.settings.save:  # its usage record: last served, hits
                    from_store.note_hit(number)
                pending.piece_sources.append(name)
                pending.source_meta[name] = meta
                pending.sources[name] = pending.sources.get(name, 0) + len(kept)
        return ratio

    def _load_rows(
        self, store: StepStore, number: int, part: int, rows: list[tuple[int, RowSource]], keys: list[str], call: Call
    ) -> tuple[Any, int, list[int], Mapping[str, Any]]:
        """The output rows of those of ``rows`` whose key the verified source records where the index
        said, which rows those are (the others are not served from here) and the source's ``meta.json``."""
        codec = self.runtime.codec
        assert isinstance(codec, RowCodec)
        entry = store.verified(number)
        try:
            records = match_records(entry.meta)
            record = records[part] if part < len(records) else None
            if record is None:
                raise CorruptCacheError(f"{entry.directory}: records no row keys for call {part + 1}")
            recorded, ratio = record
            kept = [(row, at) for row, at in rows if at.row < len(recorded) and recorded[at.row] == keys[row]]
            if not kept:
                return None, ratio, [], entry.meta
            payloads = store.load(entry)
            if part >= len(payloads):
                raise CorruptCacheError(f"{entry.directory}: holds {len(payloads)} parts, not call {part + 1}")
            result = codec.decode(payloads[part], call)
            if codec.result_rows(result) != len(recorded) * ratio:
                raise CorruptCacheError(
                    f"{entry.directory}: holds {codec.result_rows(result)} rows, not {len(recorded) * ratio}"
                )
            picked = [where.row * ratio + j for _, where in kept for j in range(ratio)]
            return codec.select_rows(result, picked), ratio, [row for row, _ in kept], entry.meta
        finally:
            entry.release()

    def _save(self, pending: _Pending, result: Any, fresh: Any, fresh_rows: Sequence[int], ratio: int | None) -> None:
        """The whole call as the step's part when the step is not committed; else its new rows (``fresh``)
        as the next rows record: a committed step is never rewritten. Logged, never raised."""
        record, plan, keys, inputs = pending.record, pending.record.plan, pending.keys, pending.inputs
        assert plan is not None
        if plan.saves:
            self.recorder.record(
                record, pending.index, pending.call, result, inputs, keys=keys, background=pending.background
            )
            return
        settings = self.runtime.settings
        if fresh is None or not fresh_rows or ratio is None or not settings.save or self.stores.unusable(plan.store):
            return
        assert keys is not None
        fresh_inputs = [inputs[row] for row in fresh_rows] if inputs and len(inputs) == len(keys) else None
        fresh_keys = [keys[row] for row in fresh_rows]
        self._save_rows(
            plan.store, pending.call, plan.step, fresh, fresh_keys, ratio, fresh_inputs, pending.generation_s
        )

    def save_rows(self, store: StepStore, call: Call, step: int, result: Any, keys: Sequence[str]) -> None:
        """Keep a phase's newly generated rows (one per key) as the next rows record of ``store``
        (:meth:`skipinject.roles.PhaseContext.record_rows`)."""
        if self.runtime.settings.save and not self.stores.unusable(store):
            self._save_rows(store, call, step, result, list(keys), 1, None, 0.0)

    def _save_rows(
        self,
        store: StepStore,
        call: Call,
        step: int,
        fresh: Any,
        keys: list[str],
        ratio: int,
        inputs: list[str] | None,
        generation_s: float,
    ) -> None:
        name, count = self.runtime.name, len(keys)
        try:
            snapshot = self.runtime.codec.encode(fresh).private_copy()
        except Exception as exc:
            logger.warning(
                "%s step %d: cannot encode the new rows (%s: %s); not saved", name, step, type(exc).__name__, exc
            )
            return
        extra = self.runtime.extra_meta(call)
        if generation_s > 0:
            extra["generation_s"] = round(generation_s, 6)
        meta = {
            **extra,
            "inputs": inputs,
            "calls": 1,
            "row_keys": [keys],
            "rows_per_input": [ratio],
            "generated_at": step,
        }
        rows_store = self.rows_store(store)

        def write() -> None:
            token = f"{int(time.time())}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            number = None
            try:  # the next number no concurrent run takes too (both records survive)
                number = rows_store.claim(token)
                directory = rows_store.save(number, snapshot, meta)
            except Exception as exc:
                logger.warning(
                    "%s step %d: could not save %d new rows to %s (%s: %s)",
                    name,
                    step,
                    count,
                    rows_store.project_dir,
                    type(exc).__name__,
                    exc,
                )
                return
            finally:
                if number is not None:
                    rows_store.release(number, token)
            logger.info("%s step %d: saved %d new rows to %s", name, step, count, directory)

        self.recorder.in_background(store, write)
