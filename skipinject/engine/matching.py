"""``action=match``: each row of a call served by its key from any cached step that verifies and records it there
(found through the row index of the project, then of the nearest other batch sizes), only the others generated,
in one call; a committed step is never rewritten: new rows go to a rows record (docs/match.md)."""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from skipinject.engine.book import StepCalls
from skipinject.engine.record import Recorder, rows_per_key
from skipinject.engine.row_index import STEPS, RowIndex, RowSource, match_records
from skipinject.errors import CodecError, ConfigError, CorruptCacheError
from skipinject.report.misses import settings_differ
from skipinject.report.tally import TALLY, hit_amounts
from skipinject.roles import Call, MatchInfo, Role, RowCodec
from skipinject.store import ROWS_DIR, StepMeta
from skipinject.verl.compat import settings_values
from skipinject.verl.layout import layout_label

if TYPE_CHECKING:
    from skipinject.engine.services import Services
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
    """One key per input row: its digest, the ``match_settings`` values, and its occurrence among equal rows
    (GRPO's ``n`` copies map to ``n`` samples)."""
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
    """The cached rows a phase asked for: per served key index, its piece and row there, and its source's
    name; each source's ``meta.json``."""

    rows: dict[int, tuple[Any, int]]
    sources: dict[int, str]
    source_meta: dict[str, StepMeta]
    seconds: float


@dataclass
class _Lookup:
    """The cached rows of some keys: per served key index, its piece and row in the piece."""

    served: dict[int, tuple[int, int]] = field(default_factory=dict)
    pieces: list[Any] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # per piece, the name of its source
    source_meta: dict[str, StepMeta] = field(default_factory=dict)  # per source, its meta.json
    ratio: int | None = None  # output rows per input row
    seconds: float = 0.0


@dataclass
class _Pending:
    """One call being matched: what was served, what the target must generate."""

    record: StepCalls
    index: int
    call: Call
    background: bool
    inputs: list[str] | None = None
    keys: list[str] | None = None
    found: _Lookup = field(default_factory=_Lookup)
    misses: list[int] = field(default_factory=list)
    cut: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # the arguments for the misses (None: run whole)
    padding: int = 0
    generated: Any = None  # the generated rows without the padding
    generation_s: float = 0.0  # the target's time for this call (recorded with what it generated)


def _next_copies(
    copies: list[list[tuple[int, RowSource]]],
    tried: list[int],
    failed: set[tuple[int, int, int]],
    served: Mapping[int, Any],
) -> dict[tuple[int, int, int, int], list[tuple[int, RowSource]]]:
    """The next copy to try of each key not served yet (none in a source that failed), by the source it is in."""
    wanted: dict[tuple[int, int, int, int], list[tuple[int, RowSource]]] = {}
    for row, located in enumerate(copies):
        while row not in served and tried[row] < len(located):
            place, where = located[tried[row]]
            tried[row] += 1
            if (place, where.source, where.number) not in failed:
                wanted.setdefault((place, where.source, where.number, where.call), []).append((row, where))
                break
    return wanted


class _ReadsAhead:
    """The sources of a ``match`` call, each read (verified, loaded, its rows taken) while the one before it
    is merged: one source ahead at a time, so memory holds at most one more source being read."""

    def __init__(self, reads: Sequence[Callable[[], Any]]) -> None:
        self.reads = list(reads)
        self.pending: dict[int, threading.Thread] = {}
        self.outcomes: dict[int, tuple[Any, BaseException | None]] = {}

    def result(self, index: int) -> Any:
        """Source ``index``'s rows (its exception raised here), the next source's read started first."""
        if index + 1 < len(self.reads):
            self._start(index + 1)
        thread = self.pending.pop(index, None)
        if thread is not None:
            thread.join()
        outcome = self.outcomes.pop(index, None)
        if outcome is None:
            return self.reads[index]()
        value, error = outcome
        if error is not None:
            raise error
        return value

    def _start(self, index: int) -> None:
        def read() -> None:
            try:
                self.outcomes[index] = (self.reads[index](), None)
            except BaseException as exc:  # raised in the caller's thread, as if read there
                self.outcomes[index] = (None, exc)

        thread = threading.Thread(target=read, name="skipinject-match-read", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no thread to be had: read when its turn comes
            return
        self.pending[index] = thread


class RowMatcher:
    """``action=match`` for one role in this process, with the row indexes and rows stores of its projects."""

    def __init__(self, services: Services, recorder: Recorder) -> None:
        self.services = services
        self.recorder = recorder
        self._memo: dict[tuple[str, Any], Any] = {}
        self._lock = threading.Lock()  # awaiting callers look rows up from several threads

    def _project(self, kind: str, store: StepStore, make: Callable[[], _T]) -> _T:
        """``make()``, once per run for ``store``'s project directory."""
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
        return self._project("rows", store, lambda: self.services.open(store.project_dir / ROWS_DIR, store.context))

    def index(self, store: StepStore) -> RowIndex:
        rows = self.rows_store(store)
        return self._project("index", store, lambda: RowIndex(store, rows, saves=self.services.settings.save))

    def keys(self, call: Call) -> list[str] | None:
        """The call's row keys, or ``None`` when the role cannot key it (one warning, the call runs whole)."""
        role = self.services.role
        try:
            digests = None if role.row_key is None else role.row_key(call)
            return None if digests is None else row_keys(role, call, [str(d) for d in digests])
        except Exception as exc:
            self.services.once(
                ("row_key", type(exc)),
                logging.WARNING,
                f"{role.name}: cannot key the rows of a call ({type(exc).__name__}: {exc}); it runs whole",
            )
            return None

    def find(self, store: StepStore, call: Call, keys: list[str], group: int = 1) -> Found:
        """:meth:`skipinject.roles.PhaseContext.match_rows`: rows kept only in whole groups of ``group``."""
        found = self.lookup(store, call, keys) if self.services.unusable(store) is None else _Lookup()
        served = found.served
        rows = {
            row: (found.pieces[piece], at)
            for row, (piece, at) in served.items()
            if all(r in served for r in range(row - row % group, row - row % group + group))
        }
        sources = {row: found.names[served[row][0]] for row in rows}
        TALLY.add(self.services.name, served_rows=len(rows), generated_rows=len(keys) - len(rows))
        return Found(rows, sources, dict(found.source_meta), found.seconds)

    def calls(self, record: StepCalls, index: int, call: Call, background: bool) -> Generator[Any, Any, Any]:
        """One call at a chosen step (run by :func:`skipinject.engine.phases.drive`)."""
        pending: _Pending = yield lambda: self.begin(record, index, call, background)
        if pending.cut is not None:
            fresh = (yield from self._generate(pending, pending.cut)) if pending.misses else None
            merged = yield lambda: self.merge(pending, fresh)
            if merged is not None:
                return (yield lambda: self.finish(pending, merged))
        result = yield from self._generate(pending, ((), {}))
        return (yield lambda: self.finish_whole(pending, result))

    @staticmethod
    def _generate(pending: _Pending, arguments: tuple[tuple[Any, ...], dict[str, Any]]) -> Generator[Any, Any, Any]:
        began = time.perf_counter()
        try:
            return (yield arguments)
        finally:
            seconds = time.perf_counter() - began
            pending.generation_s += seconds
            pending.record.generation_seconds += seconds

    def begin(self, record: StepCalls, index: int, call: Call, background: bool) -> _Pending:
        """Key the call's rows and load the cached ones; say which rows the target must generate."""
        runtime, plan = self.services, record.plan
        assert plan is not None and isinstance(runtime.codec, RowCodec)
        pending = _Pending(record, index, call, background)
        pending.inputs = runtime.fingerprint(call)  # before the target runs: it may change its inputs
        pending.keys = self.keys(call) if runtime.unusable(plan.store) is None else None
        if pending.keys is not None:
            try:
                pending.found = self.lookup(plan.store, call, pending.keys)
            except Exception as exc:  # the index failed as a whole: nothing served
                logger.warning(
                    f"{runtime.name} step {plan.step}: cannot look rows up ({type(exc).__name__}: {exc}); "
                    "generating them"
                )
        if not pending.found.served:
            if pending.keys is not None:
                differ = settings_differ(plan.store, runtime.role.match_settings, call.run_config)
                logger.info(
                    f"{runtime.name} step {plan.step}: match: no row of this call cached ({len(pending.keys)} rows"
                    f"{f'; {differ}' if differ else ''}); running the target"
                )
            return pending
        pending.misses = [row for row in range(len(pending.keys or ())) if row not in pending.found.served]
        pending.cut = ((), {})
        if pending.misses:
            try:
                args, kwargs, pending.padding = runtime.codec.with_rows(call, pending.misses)
                pending.cut = (args, kwargs)
            except Exception as exc:  # a call the codec cannot cut: it runs whole
                self._cannot(pending, "take the uncached rows of", exc)
                pending.cut = None
        return pending

    def _cannot(self, pending: _Pending, what: str, exc: Exception) -> None:
        logger.warning(
            f"{self.services.name} step {pending.record.step}: match: cannot {what} the call "
            f"({type(exc).__name__}: {exc}); running the whole call instead"
        )

    def finish_whole(self, pending: _Pending, result: Any) -> Any:
        """Nothing was cached: the call ran whole and is saved as with ``cache``."""
        count = len(pending.keys or ())
        ratio = rows_per_key(self.services.codec, result, pending.keys) if count else None
        self._save(pending, result, result if ratio else None, range(count), ratio)
        TALLY.add(self.services.name, generated_rows=count)
        return self.services.after_miss(pending.call, result)

    def merge(self, pending: _Pending, fresh: Any) -> Any:
        """The generated rows (``fresh``, with its padding) and the cached ones in the call's order;
        ``None`` (one warning) when they do not fit together: the whole call runs then."""
        codec, keys, misses, found = self.services.codec, pending.keys, pending.misses, pending.found
        assert keys is not None and isinstance(codec, RowCodec)
        ratio = found.ratio
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
            starts = list(itertools.accumulate(map(codec.result_rows, found.pieces), initial=len(misses) * ratio))
            fresh_at = {row: position for position, row in enumerate(misses)}
            order: list[int] = []
            for row in range(len(keys)):
                if row in fresh_at:
                    base = fresh_at[row] * ratio
                else:
                    piece_index, position = found.served[row]
                    base = starts[piece_index] + position * ratio
                order.extend(range(base, base + ratio))
            pieces = ([generated] if generated is not None else []) + found.pieces
            merged = codec.merge_rows(pieces, order, pending.call)
        except Exception as exc:
            self._cannot(pending, "merge the cached and generated rows of", exc)
            return None
        pending.generated, found.ratio = generated, ratio
        return merged

    def finish(self, pending: _Pending, merged: Any) -> Any:
        """Save what is new of a merged call, log it and hand it to the role's ``on_match``."""
        runtime, keys, misses, found = self.services, pending.keys, pending.misses, pending.found
        assert keys is not None
        ratio = found.ratio or 1
        served: dict[str, list[int]] = {}
        for row, (piece, _) in sorted(found.served.items()):
            served.setdefault(found.names[piece], []).extend(range(row * ratio, row * ratio + ratio))
        counts = {name: len(rows) // ratio for name, rows in served.items()}
        sources = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        shown = ", ".join(f"{name} ({count})" for name, count in sources[:SHOWN_SOURCES])
        more = f" and {len(sources) - SHOWN_SOURCES} more" if len(sources) > SHOWN_SOURCES else ""
        called = " (target not called)" if not misses else f" in one call of {len(misses) + pending.padding} rows"
        logger.info(
            f"{runtime.name} step {pending.record.step}: match: {len(found.served)} of {len(keys)} rows served from "
            f"{shown}{more} in {found.seconds:.3f} s; {len(misses)} generated{called}"
        )
        saved = 0.0  # each source's recorded generation time, for the share of its rows served
        for name, rows in served.items():
            meta = found.source_meta.get(name)
            total = None if meta is None else meta.rows
            if meta is not None and total is not None and total > 0:
                saved += hit_amounts(meta)["generation_s_saved"] * min(len(rows), total) / total
        TALLY.add(runtime.name, served_rows=len(found.served), generated_rows=len(misses), generation_s_saved=saved)
        if runtime.role.on_match is not None:  # before saving: what it recomputes is saved as this run's
            info = MatchInfo(
                pending.record.step,
                len(found.served),
                len(misses),
                counts,
                found.seconds,
                served,
                dict(found.source_meta),
                runtime.settings,
            )
            merged = runtime.role.on_match(merged, pending.call, info)
        self._save(pending, merged, pending.generated, misses, found.ratio)
        return merged

    def lookup(self, store: StepStore, call: Call, keys: list[str]) -> _Lookup:
        """The cached rows of ``keys`` that verify; each key's copies tried (this layout's first) the latest first."""
        runtime, found, started = self.services, _Lookup(), time.perf_counter()
        places = [store, *self._project("layouts", store, lambda: runtime.batch_size_stores(store, MAX_LAYOUTS))]
        copies = self._copies(places, keys)
        tried = [0] * len(keys)
        failed: set[tuple[int, int, int]] = set()
        for _ in range(MAX_COPIES):
            wanted = _next_copies(copies, tried, failed, found.served)
            if not wanted:
                break
            ordered = sorted(wanted.items())
            stores = [
                places[place] if source == STEPS else self.rows_store(places[place])
                for (place, source, _, _), _ in ordered
            ]
            reads = _ReadsAhead(
                [
                    functools.partial(self._load_rows, stores[i], number, part, rows, keys, call)
                    for i, ((_, _, number, part), rows) in enumerate(ordered)
                ]
            )
            for i, ((place, source, number, _), rows) in enumerate(ordered):
                where_store = places[place]
                name = f"{'step' if source == STEPS else 'rows'} {number}"
                if place:
                    name += f" of {layout_label(where_store.context, str(where_store.project_dir))}"
                from_store = stores[i]
                try:
                    piece, piece_ratio, kept, meta = reads.result(i)
                except Exception as exc:  # this source does not serve: its rows try their next copy
                    failed.add((place, source, number))
                    if self.index(where_store).forget(source, number):
                        continue  # only the index file said so: it is rebuilt (one line for all of it)
                    runtime.once(
                        ("match-source", str(where_store.project_dir), source, number),
                        logging.WARNING,
                        f"{runtime.name}: cached {name} of {where_store.project_dir} not served "
                        f"({type(exc).__name__}: {exc}); its rows are looked for elsewhere or generated",
                    )
                    continue
                if len(kept) < len(rows):  # the index is stale there: read that record again next time
                    self.index(where_store).forget(source, number)
                if not kept or (found.ratio is not None and piece_ratio != found.ratio):
                    continue  # none left, or recorded with another number of results per input: not mixed
                found.ratio = piece_ratio
                for position, row in enumerate(kept):
                    found.served[row] = (len(found.pieces), position)
                found.pieces.append(piece)
                if runtime.settings.save:  # its usage record: last served, hits
                    from_store.note_hit(number)
                found.names.append(name)
                found.source_meta[name] = meta
        found.seconds = time.perf_counter() - started
        return found

    def _copies(self, places: Sequence[StepStore], keys: list[str]) -> list[list[tuple[int, RowSource]]]:
        """Per key, where its rows are cached (place in ``places``, source), in the order tried."""
        copies: list[list[tuple[int, RowSource]]] = [[] for _ in keys]
        for place, place_store in enumerate(places):
            missing = [row for row in range(len(keys)) if len(copies[row]) < MAX_COPIES]
            if not missing:
                break
            there = self.index(place_store).lookup([keys[row] for row in missing], MAX_COPIES)
            for row, sources in zip(missing, there, strict=True):
                copies[row].extend((place, source) for source in sources[: MAX_COPIES - len(copies[row])])
        return copies

    def _load_rows(
        self, store: StepStore, number: int, part: int, rows: list[tuple[int, RowSource]], keys: list[str], call: Call
    ) -> tuple[Any, int, list[int], Mapping[str, Any]]:
        """The output rows of those of ``rows`` whose key the verified source records where the index
        said, which rows those are, and the source's ``meta.json``."""
        codec = self.services.codec
        assert isinstance(codec, RowCodec)
        entry = store.verified(number, siblings=True)
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
        """The call as the step's part if the step is not committed, else its new rows as a rows record."""
        record, plan, keys, inputs = pending.record, pending.record.plan, pending.keys, pending.inputs
        assert plan is not None
        if plan.saves:
            self.recorder.record(
                record, pending.index, pending.call, result, inputs, keys=keys, background=pending.background
            )
            return
        if fresh is None or not fresh_rows or ratio is None:
            return
        assert keys is not None
        fresh_inputs = [inputs[row] for row in fresh_rows] if inputs and len(inputs) == len(keys) else None
        call, fresh_keys = pending.call, [keys[row] for row in fresh_rows]
        self.save_rows(plan.store, call, plan.step, fresh, fresh_keys, ratio, fresh_inputs, pending.generation_s)

    def save_rows(
        self,
        store: StepStore,
        call: Call,
        step: int,
        fresh: Any,
        keys: Sequence[str],
        ratio: int = 1,
        inputs: list[str] | None = None,
        generation_s: float = 0.0,
    ) -> None:
        """New rows (``ratio`` per key) as the next rows record of ``store`` (also ``record_rows``); never raises."""
        name, count = self.services.name, len(keys)
        if not self.services.settings.save or self.services.unusable(store):
            return
        try:
            snapshot = self.services.codec.encode(fresh).private_copy()
        except Exception as exc:
            logger.warning(f"{name} step {step}: cannot encode the new rows ({type(exc).__name__}: {exc}); not saved")
            return
        meta = StepMeta.build(
            inputs=inputs,
            generation_s=generation_s,
            row_keys=[list(keys)],
            rows_per_input=[ratio],
            generated_at=step,
            extra=self.services.extra_meta(call),
        )
        rows_store = self.rows_store(store)

        def write() -> None:
            token = f"{int(time.time())}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            number = None
            try:  # the next number no concurrent run takes too (both records survive)
                number = rows_store.claim(token)
                directory = rows_store.save(number, snapshot, meta)
            except Exception as exc:
                logger.warning(
                    f"{name} step {step}: could not save {count} new rows to {rows_store.project_dir} "
                    f"({type(exc).__name__}: {exc})"
                )
                return
            finally:
                if number is not None:
                    rows_store.release(number, token)
            logger.info("%s step %d: saved %d new rows to %s", name, step, count, directory)

        self.recorder.in_background(store, write)
