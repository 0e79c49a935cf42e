"""A role with its settings in this process: the engine's side of :class:`~skipinject.roles.PhaseContext`.

It finds the call's step, names the call's store, serves a planned entry (decode, compare the
inputs' fingerprints, ``on_hit``) and saves fresh results; failures of the cache never reach the
training call, except with ``action=strict`` or ``on_mismatch=fail``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from skipinject.config import Action, MismatchPolicy, RoleConfig
from skipinject.engine.background import WRITER
from skipinject.engine.calls import StepBook, StepCalls, part_name, recorded_inputs
from skipinject.engine.decision import cannot_load, nothing_more, plan_step
from skipinject.engine.matching import RowMatcher
from skipinject.engine.read_ahead import ReadAhead
from skipinject.errors import CorruptCacheError, PromptMismatchError
from skipinject.roles import Call, Codec, HitInfo, Loaded, Plan, Role, RowCodec, StepCache
from skipinject.store import Payload, StepStore
from skipinject.store.compression import compression_for
from skipinject.store.hit_memory import HitMemory
from skipinject.verl.compat import STEP_KEY
from skipinject.verl.layout import other_batch_sizes, project_dir

logger = logging.getLogger("skipinject")

#: Returned by :meth:`RoleRuntime.serve` when the target must run after all.
REGENERATE = object()


class RoleRuntime:
    """A role with its settings in this process: finds, serves and saves its cache entries."""

    def __init__(self, role: Role, settings: RoleConfig, owner: str) -> None:
        self.role = role
        self.settings = settings
        self.owner = owner
        self._stores: dict[Path, StepStore] = {}  # a RemotePath stands in for a Path
        #: The memory this role's compressed hits decode into, kept between hits (``reuse_hit_memory``).
        self.hit_memory = HitMemory(settings.reuse_hit_memory)
        #: The next chosen step, verified and loaded in the background while this one trains (``read_ahead``).
        self.read_ahead = ReadAhead(role.name)
        self._unusable: dict[Path, str | None] = {}
        self._lock = threading.Lock()
        self._warned: set[Any] = set()
        self._default_codec: Codec | None = None
        #: The steps this process's calls are in (see :mod:`skipinject.engine.calls`).
        self.steps = StepBook(clocked=bool(role.clocks))
        #: ``action=match`` (and the row keys every recording of a keyed role saves).
        self.matcher = RowMatcher(self)

    # ------------------------------------------------------------ helpers for phases

    @property
    def name(self) -> str:
        return self.role.name

    @property
    def codec(self) -> Codec:
        if self.role.codec is not None:
            return self.role.codec
        if self._default_codec is None:
            from skipinject.verl.codecs import DataProtoCodec

            self._default_codec = DataProtoCodec()
        return self._default_codec

    def once(self, key: Any, level: int, message: str, *args: Any) -> None:
        """Log ``message`` the first time ``key`` is seen."""
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        logger.log(level, message, *args)

    def applicable_step(self, call: Call, *, any_step: bool = False) -> int | None:
        """The call's step if this role may act on it, else ``None`` (the original runs).

        ``any_step``: also steps outside ``skip.<role>.steps`` (targets declared ``every_step``).
        """
        try:
            if self.role.bypass(call):
                return None
        except Exception as exc:
            self.once(
                ("bypass", type(exc)), logging.WARNING, "%s: validation check failed (%s); not skipping", self.name, exc
            )
            return None
        try:
            step = self.role.step.resolve(call)
        except Exception as exc:  # a plugin's step extractor must not break the user's call
            self.once(
                ("step", type(exc)),
                logging.WARNING,
                "%s: finding the step of %s failed (%s: %s); not skipping",
                self.name,
                call.target,
                type(exc).__name__,
                exc,
            )
            return None
        if step is None:
            self.once(
                "nostep",
                logging.WARNING,
                "%s: no training step found for %s (looked at %s); not skipping",
                self.name,
                call.target,
                self.role.step.describe(),
            )
            return None
        self.moved_to(step)
        self.read_ahead.moved_to(step)
        if not any_step and not self.settings.allows(step):
            return None
        return step

    def store_for(self, call: Call) -> StepStore:
        """The store of this run (directory named by the run's verl config, like upstream)."""
        config = call.run_config
        subdir = self.role.name if self.role.cache_subdir is None else self.role.cache_subdir
        project, context = project_dir(self.settings.root, config, subdir)
        with self._lock:
            store = self._stores.get(project)
            if store is None:
                store = self._stores[project] = self._open_store(project, context)
                if config is None:
                    logger.info("%s: no verl trainer config seen; caching under %s", self.name, project)
                problem = store.unusable()
                self._unusable[project] = problem
                if problem is not None:
                    logger.warning(
                        "%s: cache directory unusable (%s); this run neither loads nor saves caches there",
                        self.name,
                        problem,
                    )
            return store

    def sibling_store(self, store: StepStore, name: str) -> StepStore:
        """A store of this role in ``name`` under ``store``'s project directory (same trainer context)."""
        return self._open_store(store.project_dir / name, store.context)

    def batch_size_stores(self, store: StepStore, limit: int) -> list[StepStore]:
        """This role's stores in the project's layouts that differ from ``store``'s in the batch size
        only (at most ``limit``, the nearest batch sizes first; one listing of the experiment
        directory), each usable: ``action=match`` looks rows up there too. Never raises."""
        if self.unusable(store) is not None:
            return []
        subdir = self.role.name if self.role.cache_subdir is None else self.role.cache_subdir
        try:
            found = other_batch_sizes(store.project_dir, store.context, subdir, store.names_above)
        except Exception:
            return []
        experiment = store.project_dir.parent.parent if subdir else store.project_dir.parent
        if len(found) > limit:
            self.once(
                ("layouts", str(experiment)),
                logging.INFO,
                "%s: %s holds %d other batch-size layouts; match looks rows up in the %d nearest",
                self.name,
                experiment,
                len(found),
                limit,
            )
        siblings = (self._open_store(directory, context) for directory, context in found[:limit])
        return [sibling for sibling in siblings if sibling.unusable() is None]

    def unusable(self, store: StepStore) -> str | None:
        """Why ``store`` cannot be used at all this run (found once, logged once when it was opened)."""
        return self._unusable.get(store.project_dir)

    def _open_store(self, project: Path, context: dict[str, Any]) -> StepStore:
        """One store class for every ``dump_dir``; the backend (local files or fsspec) comes from its root."""
        root = self.settings.root
        trust = self.settings.trust_dir_permissions
        return StepStore(
            project,
            self.role.name,
            context,
            trust_permissions=trust,
            dump_dir=root.path,
            plugin=self.owner,
            backend=root.backend(trust_permissions=trust),
            compression=compression_for(self.settings.compression, root.location()),
            memory=self.hit_memory,
            step_aliases=(STEP_KEY,),
        )

    # ------------------------------------------------------------ deciding

    def plan(self, call: Call, step: int) -> Plan:
        """See :func:`skipinject.engine.decision.plan_step` (after this project's pending saves)."""
        store = self.store_for(call)
        WRITER.flush(store.project_dir)
        ahead = self.read_ahead.take(store, step) if self.settings.read_ahead else None
        entry, waited = ahead if ahead is not None else (None, 0.0)
        try:
            plan = plan_step(
                self.name, store, self.settings, self.role.upstream_formats, step, self.unusable(store), ahead=entry
            )
        except BaseException:
            if entry is not None:
                entry.release()
            raise
        if entry is not None and plan.entry is entry:
            plan = replace(plan, reason=f"{plan.reason}; read ahead, waited {waited:.3f} s")
        elif entry is not None:
            entry.release()
        if plan.untrusted_upstream is not None:
            self.once(
                ("untrusted", str(plan.untrusted_upstream)),
                logging.WARNING,
                "%s step %d: found verl's own cache %s but did not load it: it is a pickle, which runs code "
                "when loaded. Set skip.%s.trust_upstream=true if you trust it; generating again and caching "
                "in skipinject's format beside it",
                self.name,
                step,
                plan.untrusted_upstream,
                self.name,
            )
        return plan

    def load(self, call: Call, step: int, prepare: Callable[[Loaded], Any] | None = None) -> Loaded | None:
        """See :meth:`skipinject.roles.PhaseContext.load`: every part of the planned step, decoded."""
        plan = self.plan(call, step)
        try:
            return self._load_plan(plan, call, prepare)
        finally:
            self.read_after(plan)

    def _load_plan(self, plan: Plan, call: Call, prepare: Callable[[Loaded], Any] | None) -> Loaded | None:
        if not plan.serves:
            return None
        started = time.perf_counter()
        try:
            if plan.upstream_file is not None:
                assert plan.upstream_format is not None
                results = [plan.upstream_format.load(plan.upstream_file)]
            else:
                assert plan.entry is not None
                results = [self.codec.decode(payload, call) for payload in plan.store.load(plan.entry)]
            loaded = Loaded(plan, results)
            if prepare is not None:
                loaded.value = prepare(loaded)
        except Exception as exc:  # whatever is wrong with the cache, it is not trained on
            cannot_load(self.name, self.settings, plan, exc, "running the target instead")
            return None
        loaded.seconds = time.perf_counter() - started
        return loaded

    def read_after(self, plan: Plan) -> None:
        """The planned step's first call is done: read the next chosen cached step ahead (``read_ahead``;
        actions that serve whole steps)."""
        settings = self.settings
        if not settings.read_ahead or settings.action is Action.match or self.unusable(plan.store) is not None:
            return
        project = plan.store.project_dir

        def ahead(step: int) -> bool:  # chosen, and not met by this run yet (concurrent calls may be ahead)
            return settings.allows(step) and not self.steps.known(project, step)

        self.read_ahead.start(plan.store, plan.step, ahead)

    # ------------------------------------------------------------ the calls of a step

    def enter(self, call: Call, step: int) -> tuple[StepCalls, int]:
        """Begin a call at ``step``: its step's record (planned at the step's first call) and its index.

        Steps the run has moved past are closed first (their commit is queued before this step's
        plan reads the store). Every ``enter`` that returns is followed by one :meth:`leave`.
        """
        store = self.store_for(call)
        record, passed = self.steps.get(store.project_dir, step)
        self.close(passed)
        with record.lock:
            if record.plan is None:
                record.plan = self.plan(call, step)
            index = record.started
            record.started += 1
            record.running += 1
        return record, index

    def leave(self, record: StepCalls) -> None:
        """A call of ``record`` ended: commit the step if the run moved past it (or, without a clock, now)."""
        with record.lock:
            record.running -= 1
            due = record.running == 0 and (record.closed or not self.steps.clocked)
            first, record.left = not record.left, True
        if first and record.plan is not None:
            self.read_after(record.plan)
        if due:
            self._commit(record)

    def moved_to(self, step: int) -> None:
        """The run is at ``step`` (a call of this role was seen there): close the steps it moved past."""
        if self.steps.open:
            self.close(self.steps.moved_to(step))

    def close_all(self) -> None:
        """The run ended (``fit`` returned, the engine stops, the interpreter exits): close every step."""
        self.read_ahead.close()
        self.close(self.steps.take_all())

    def close(self, records: Sequence[StepCalls]) -> None:
        for record in records:
            with record.lock:
                record.closed = True
                record.payloads = None if record.running == 0 else record.payloads
                due = record.running == 0
            if due:
                self._commit(record)

    # ------------------------------------------------------------ serving

    def serve_call(self, record: StepCalls, index: int, call: Call) -> Any:
        """Call ``index`` of a replayed step: its recorded result, or ``REGENERATE`` to run the target.

        A failure to load or a mismatch at the step's first call turns the step into a recording
        (it is generated and saved anew); at a later call, only that call runs the target.
        """
        plan = record.plan
        assert plan is not None
        started = time.perf_counter()
        try:
            if record.payloads is None:
                if plan.upstream_file is not None:
                    assert plan.upstream_format is not None
                    record.payloads = [plan.upstream_format.load(plan.upstream_file)]
                    record.recorded_inputs = [None]
                else:
                    record.payloads, record.recorded_inputs = self._load_calls(plan)
            if index >= record.recorded_calls:
                return self._extra_call(record, index)
            if plan.upstream_file is not None:
                result = record.payloads[index]
                source = str(plan.upstream_file)
            else:
                assert plan.entry is not None
                result = self.codec.decode(record.payloads[index], call)
                source = str(plan.entry.directory)
        except Exception as exc:  # whatever is wrong with the cache, it is not trained on
            cannot_load(self.name, self.settings, plan, exc, "running the target instead")
            return self._regenerate(record, index)
        elapsed = time.perf_counter() - started
        mismatched, compared = self._compare_inputs(record.recorded_inputs[index], call)
        calls = record.recorded_calls
        which = f" call {index + 1} of {calls}" if calls > 1 else ""
        if mismatched:
            policy = self.settings.on_mismatch
            message = (
                f"{self.name} step {plan.step}{which}: the cache served (step {plan.served_step}) was generated from "
                f"other inputs in {mismatched} of {compared} rows (changed data order, seed or step); "
            )
            if policy is MismatchPolicy.fail:
                raise PromptMismatchError(message + f"skip.{self.name}.on_mismatch=fail")
            if policy is MismatchPolicy.regenerate:
                logger.warning("%s", message + "regenerating (on_mismatch=regenerate)")
                return self._regenerate(record, index)
            logger.warning("%s", message + "training on them anyway (on_mismatch=warn)")
        logger.info(
            "%s step %d: hit%s, served step %d (%s) from %s in %.3f s; target not called",
            self.name,
            plan.step,
            f" ({which.strip()})" if which else "",
            plan.served_step,
            plan.reason,
            source,
            elapsed,
        )
        if self.role.on_hit is not None:
            recorded = plan.entry.meta if plan.entry is not None else {}
            info = HitInfo(plan.step, plan.served_step, elapsed, mismatched, compared, source, recorded, self.settings)
            result = self.role.on_hit(result, call, info)
        return result

    def _load_calls(self, plan: Plan) -> tuple[list[Payload], list[Any]]:
        """Every recorded call of the planned entry (one part each), with their recorded inputs."""
        assert plan.entry is not None
        payloads = plan.store.load(plan.entry)
        meta = plan.entry.meta
        calls = meta.get("calls", 1)
        if type(calls) is not int or calls != len(payloads):
            raise CorruptCacheError(
                f"{plan.entry.directory}: meta.json records {str(calls)[:40]!r} calls but holds {len(payloads)} parts"
            )
        return payloads, recorded_inputs(meta, calls)

    def _extra_call(self, record: StepCalls, index: int) -> Any:
        plan = record.plan
        assert plan is not None
        calls = record.recorded_calls
        nothing_more(self.name, self.settings, plan, index, calls)
        where = plan.source
        self.once(
            ("extra", id(record)),
            logging.INFO,
            "%s step %d: this run calls the target more often than the cached step %d holds (%d call%s, in %s); "
            "running the target for call %d and any later ones (not saved)",
            self.name,
            plan.step,
            plan.served_step,
            calls,
            "s" if calls != 1 else "",
            where,
            index + 1,
        )
        return REGENERATE

    def _regenerate(self, record: StepCalls, index: int) -> Any:
        """The cache cannot serve call ``index``: at the step's first call, record the step anew
        (a later call only runs the target; the step stays as recorded)."""
        with record.lock:
            plan = record.plan
            if index == 0 and record.started == 1 and plan is not None:
                record.plan = replace(plan, entry=None, upstream_file=None, upstream_format=None, reason="regenerated")
                record.payloads = None
        return REGENERATE

    def decode(self, payloads: Sequence[Payload], call: Call) -> Any:
        """The result of a one-call step."""
        if len(payloads) != 1:
            raise CorruptCacheError(f"{self.name}: expected one part, the cache has {len(payloads)}")
        return self.codec.decode(payloads[0], call)

    def fingerprint(self, call: Call) -> list[str] | None:
        if self.role.fingerprint is None:
            return None
        try:
            rows = self.role.fingerprint(call)
        except Exception as exc:
            self.once(
                ("fingerprint", type(exc)),
                logging.WARNING,
                "%s: cannot fingerprint the inputs (%s); mismatches will not be detected",
                self.name,
                exc,
            )
            return None
        return None if rows is None else [str(r) for r in rows]

    def _compare_inputs(self, stored: Any, call: Call) -> tuple[int, int]:
        if not isinstance(stored, list):
            return 0, 0
        current = self.fingerprint(call)
        if current is None:
            return 0, 0
        compared = max(len(stored), len(current))
        same = sum(1 for a, b in zip(stored, current, strict=False) if a == b)
        return compared - same, compared

    # ------------------------------------------------------------ saving

    def record(
        self,
        record: StepCalls,
        index: int,
        call: Call,
        result: Any,
        inputs: Sequence[str] | None = None,
        *,
        background: bool = True,
        keys: Sequence[str] | None = None,
    ) -> None:
        """Save call ``index``'s fresh result as the step's part ``index``; failures are logged, never raised.

        Encoding and a private copy happen now (the caller gets ``result`` afterwards and may change
        it); writing happens in the background writer when the engine knows where the run ends (the
        role has clocks: the trainer's ``fit`` returning waits for it; a Ray actor may be killed
        without running exit hooks), else here, as with ``background=False`` (callers already off
        the training thread). ``inputs``: the call's fingerprint taken before the target ran;
        ``keys``: its row keys (``action=match``), saved when the result has a whole number of rows
        per key. The step is committed by :meth:`leave` or :meth:`close`.
        """
        plan = record.plan
        assert plan is not None
        if record.failed or not plan.saves:
            return  # an unusable or untrusted cache directory was reported once already
        if result is None:
            self._drop_step(record, f"call {index + 1} returned None")
            return
        started = time.perf_counter()
        try:
            snapshot = self.codec.encode(result).private_copy()
        except Exception as exc:
            self._drop_step(record, f"cannot encode call {index + 1} ({type(exc).__name__}: {exc})")
            return
        extra = self.extra_meta(call) if index == 0 else {}
        with record.lock:
            if index == 0:
                record.extra_meta = extra
            if record.writer is None:
                record.writer = plan.store.begin(plan.step)
            writer = record.writer
            record.inputs[index] = list(inputs) if inputs is not None else self.fingerprint(call)
            ratio = self._rows_per_key(result, keys)
            if keys and ratio:
                record.row_keys[index] = (list(keys), ratio)
            record.parts += 1
            record.rows += snapshot.rows or 0
            record.saving_seconds += time.perf_counter() - started

        def write() -> None:
            if record.failed:
                return
            began = time.perf_counter()
            try:
                writer.add_part(snapshot, part=part_name(index))
                record.saving_seconds += time.perf_counter() - began
            except Exception as exc:
                self._drop_step(record, f"cannot write call {index + 1} ({type(exc).__name__}: {exc})", in_job=True)

        if background:
            self.in_background(plan.store, write)
        else:
            write()

    def extra_meta(self, call: Call) -> dict[str, Any]:
        """The role's ``record_meta`` fields for a result of ``call`` (none when it fails: one warning)."""
        if self.role.record_meta is None:
            return {}
        try:
            return dict(self.role.record_meta(call) or {})
        except Exception as exc:
            self.once(
                ("record_meta", type(exc)),
                logging.WARNING,
                "%s: cannot describe the result for meta.json (%s: %s); saved without it",
                self.name,
                type(exc).__name__,
                exc,
            )
            return {}

    def _rows_per_key(self, result: Any, keys: Sequence[str] | None) -> int | None:
        codec = self.codec
        if not keys or not isinstance(codec, RowCodec):
            return None
        try:
            rows = codec.result_rows(result)
        except Exception:
            return None
        return rows // len(keys) if rows and rows % len(keys) == 0 else None

    def _commit(self, record: StepCalls) -> None:
        """Queue the commit of a recorded step's parts (after their writes, in order)."""
        plan = record.plan
        with record.lock:
            writer = record.writer
            if plan is None or writer is None or record.failed or record.parts <= record.committed_parts:
                return
            meta = record.commit_meta()
            record.committed_parts = record.parts
        store = plan.store

        def commit() -> None:
            if record.failed:
                return
            began = time.perf_counter()
            try:
                directory = writer.commit(meta)
                record.saving_seconds += time.perf_counter() - began
            except Exception as exc:
                self._drop_step(record, f"cannot commit ({type(exc).__name__}: {exc})", in_job=True)
                return
            calls = meta["calls"]
            if calls == 1:
                logger.info(
                    "%s step %d: saved %s rows to %s in %.3f s",
                    self.name,
                    plan.step,
                    record.rows,
                    directory,
                    record.saving_seconds,
                )
            else:
                logger.info(
                    "%s step %d: saved %d calls (%d rows) to %s in %.3f s",
                    self.name,
                    plan.step,
                    calls,
                    record.rows,
                    directory,
                    record.saving_seconds,
                )

        self.in_background(store, commit)

    def _drop_step(self, record: StepCalls, why: str, *, in_job: bool = False) -> None:
        """A part of the step cannot be saved: nothing of the step is cached (one warning).

        ``in_job``: called from a write job (the writer thread): the writer is aborted right here.
        """
        plan = record.plan
        assert plan is not None
        with record.lock:
            already = record.failed
            record.failed = True
            writer = record.writer
        if already:
            return
        if writer is not None:
            if in_job:
                writer.abort()
            else:
                self.in_background(plan.store, writer.abort)
        self.once(
            ("save", str(plan.store.project_dir), plan.step),
            logging.WARNING,
            "%s step %d: could not save the cache to %s (%s); training goes on without it",
            self.name,
            plan.step,
            plan.store.step_dir(plan.step),
            why,
        )

    def in_background(self, store: StepCache, job: Callable[[], None]) -> None:
        """Run ``job`` (a write to ``store``) after the store's earlier jobs, off the calling thread.

        Only when the engine knows where the run ends (the role has clocks: the trainer's ``fit``
        returning waits for every job; a Ray actor may be killed without running exit hooks); else
        ``job`` runs now. A read of the store (:meth:`plan`) waits for its pending jobs first; at most
        :data:`~skipinject.engine.background.MAX_PENDING` jobs wait at once (the next call blocks).
        ``job`` must log its own failures.
        """
        if self.role.clocks:
            WRITER.submit(store.project_dir, job)
        else:
            job()

    def after_miss(self, call: Call, result: Any) -> Any:
        if self.role.on_miss is None:
            return result
        return self.role.on_miss(result, call)
