"""Replay: which verified cache entry serves a step (or why none does, in one line), loaded, checked against
the call's inputs and served, and the next step read ahead (docs/compression.md). A failing cache never reaches
the training call except with ``action=strict`` or ``on_mismatch=fail``: that rule is here once."""

from __future__ import annotations

import bisect
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skipinject.config import Action, MismatchPolicy, RoleConfig
from skipinject.engine.background import WRITER
from skipinject.errors import CacheMissError, CorruptCacheError, PromptMismatchError, UntrustedCacheError
from skipinject.report.misses import nearest_cache
from skipinject.report.tally import TALLY, hit_amounts
from skipinject.roles import Call, HitInfo, Loaded, Plan, UpstreamFormat
from skipinject.store import StepEntry, StepStore

if TYPE_CHECKING:
    from skipinject.engine.book import StepBook, StepCalls
    from skipinject.engine.services import Services

logger = logging.getLogger("skipinject")


def refuse(
    strict: bool, error: Exception, say: Callable[[], None] | None = None, *, role: str = "", **counts: int
) -> None:
    """The replay policy for a cache that cannot serve, in one place: ``strict`` (``action=strict``,
    ``on_mismatch=fail``) raises ``error``; else ``say`` says why, ``counts`` go to ``role``'s tally (unless
    all 0), and the caller runs the target."""
    if strict:
        raise error
    if say is not None:
        say()
    if any(counts.values()):
        TALLY.add(role, **counts)


def plan_step(
    name: str,
    store: StepStore,
    settings: RoleConfig,
    upstream: Sequence[UpstreamFormat],
    step: int,
    unusable: str | None = None,
    *,
    ahead: StepEntry | None = None,
) -> Plan:
    """The verified entry of role ``name`` to serve at ``step``, or why there is none. ``unusable``: why
    the store cannot be used this run; ``ahead``: ``step``'s entry, verified by the read-ahead. verl's
    own pickle is served only with ``trust_upstream``, else named in ``untrusted_upstream``."""
    action = settings.action
    if unusable is not None:  # reported once, when the store was opened
        refuse(action is Action.strict, CacheMissError(f"{name} step {step}: skip.{name}.action=strict and {unusable}"))
        return Plan(store, step, reason="cache directory unusable", saves=False)
    saving = "saving its result" if settings.save else "not saving it (save=false)"
    if action is Action.refresh:
        logger.info("%s step %d: refresh: running the target and %s in place of any cached one", name, step, saving)
        return Plan(store, step, reason="refresh", saves=settings.save)
    if action is Action.match:  # the call is saved as the step when none is committed there, else its new rows
        if committed(store, step, siblings=True):
            reason = "match: step already cached (new rows saved as a rows record)"
            return Plan(store, step, reason=reason, saves=False)
        return Plan(store, step, reason="match", saves=settings.save)
    problems: list[str] = []
    found: tuple[Path, UpstreamFormat] | None = None
    untrusted_own = [False]  # the step's own directory is another user's: nothing is saved there either
    try:
        plan = _cached_entry(name, store, step, action is Action.repeat, ahead, problems, untrusted_own)
        if plan is not None:
            return plan
        for kind in upstream:  # verl's own cache of the step: the first of the role's formats found
            path = store.upstream_file(step, kind.file_name, kind.directory_of(step))
            if path is not None:
                found = (path, kind)
                break
    except OSError as exc:
        problems.append(f"cannot read the cache directory {store.project_dir} ({type(exc).__name__}: {exc})")
    if found is not None and settings.trust_upstream:
        return Plan(store, step, upstream_file=found[0], upstream_format=found[1], reason="trusted upstream cache")
    return _no_entry(name, store, settings, step, problems, None if found is None else found[0], untrusted_own[0])


def _cached_entry(
    name: str, store: StepStore, step: int, repeat: bool, ahead: StepEntry | None, problems: list[str], own: list[bool]
) -> Plan | None:
    """The plan serving ``step`` from skipinject's own cache (``repeat``: or its nearest cached step), if one
    verifies; what does not is added to ``problems`` (and ``own[0]`` set when it is the step's own, untrusted)."""
    candidates = [step]
    if repeat:  # then the steps below (largest first), then those above (smallest first)
        available = store.step_numbers_on_disk()
        below = bisect.bisect_left(available, step)
        candidates += [*available[:below][::-1], *(s for s in available[below:] if s != step)]
    for candidate in candidates:
        if candidate != step and not store.is_committed(candidate):
            continue  # another role's step, or none of ours: not a candidate for repeat
        try:
            entry = ahead if ahead is not None and ahead.step == candidate else store.verified(candidate)
        except FileNotFoundError:
            continue
        except CorruptCacheError as exc:
            problems.append(str(exc))
            own[0] = own[0] or (candidate == step and isinstance(exc, UntrustedCacheError))
            continue
        if problems:
            logger.warning("%s step %d: cache unusable, not loaded: %s", name, step, summary(problems))
        if candidate == step:
            reason = "own cache"
        elif candidate < step:
            reason = f"repeat: largest cached step below {step}"
        else:
            reason = f"repeat: no cached step below {step}, smallest above"
        return Plan(store, step, entry=entry, reason=reason)
    return None


def _no_entry(
    name: str, store: StepStore, settings: RoleConfig, step: int, problems: list[str], untrusted: Path | None, own: bool
) -> Plan:
    """The plan of a step nothing serves (``untrusted``: verl's own cache, not trusted; ``own``: the step's own
    directory is another user's), said: a miss, or an error with ``action=strict``."""
    action = settings.action
    saving = "saving its result" if settings.save else "not saving it (save=false)"
    where = store.step_dir(step)
    interrupted = None if problems else store.interrupted(step)
    if interrupted:
        problems.append(interrupted)
    near = None if problems else nearest_cache(store, step)
    detail = summary(problems) if problems else f"no cache at {where}" + (f" ({near})" if near else "")
    if untrusted is not None:
        detail += f" (verl's own cache {untrusted} is not loaded: skip.{name}.trust_upstream is false)"
    refuse(action is Action.strict, CacheMissError(f"{name} step {step}: skip.{name}.action=strict and {detail}"))
    if problems:
        logger.warning(
            "%s step %d: cache unusable, not loaded: %s; running the target and %s",
            name,
            step,
            summary(problems),
            "not saving its result there" if own else saving,
        )
        saves = settings.save and not own
        return Plan(store, step, reason="cache unusable", untrusted_upstream=untrusted, saves=saves)
    reason = f"no cached step in {store.project_dir}" if action is Action.repeat else f"no cache at {where}"
    logger.info(f"{name} step {step}: miss ({reason}{f'; {near}' if near else ''}); running the target and {saving}")
    return Plan(store, step, reason=reason, untrusted_upstream=untrusted, saves=settings.save)


def committed(store: StepStore, step: int, *, siblings: bool = False) -> bool:
    """Whether ``step`` is committed (``siblings``: by a sibling role too); True when that cannot be told."""
    try:
        return store.is_committed(step, siblings=siblings)
    except OSError:
        return True


#: A decision's log line quotes at most this many of the candidates it could not use, each cut short.
EXAMPLES = 3
EXAMPLE_CHARS = 600


def summary(problems: list[str]) -> str:
    """One bounded line for the candidates a decision could not use (all when few, else the first few)."""
    shown = "; ".join(p if len(p) <= EXAMPLE_CHARS else p[:EXAMPLE_CHARS] + "..." for p in problems[:EXAMPLES])
    if len(problems) <= EXAMPLES:
        return shown
    return f"{len(problems)} cached steps unusable, e.g. {shown}; and {len(problems) - EXAMPLES} more"


#: Returned by :meth:`Replay.serve_call` when the target must run after all.
REGENERATE = object()
#: Libraries a hit may import on their first use in a process (reading, rebuilding tensors, decoding): a hit
#: that does says so beside its time, which includes it (nothing is imported ahead that a step does not need).
FIRST_USE_LIBRARIES = ("numpy", "torch", "tensordict")


def not_imported() -> tuple[str, ...]:
    """The :data:`FIRST_USE_LIBRARIES` this process has not imported yet."""
    return tuple(name for name in FIRST_USE_LIBRARIES if name not in sys.modules)


def first_use(absent: Sequence[str]) -> str:
    """``" (including the first import of torch in this process)"`` for those of ``absent`` imported since."""
    imported = [name for name in absent if name in sys.modules]
    return f" (including the first import of {', '.join(imported)} in this process)" if imported else ""


def regenerated(plan: Plan) -> Plan:
    """``plan`` turned into a recording: its cache could not serve."""
    return replace(plan, entry=None, upstream_file=None, upstream_format=None, reason="regenerated")


#: Committed-or-not checks a read-ahead makes among the allowed steps found after the current one
#: (steps of other roles sharing the directory, interrupted saves) before it gives up.
CANDIDATES = 8


@dataclass
class _Reading:
    """One step being read ahead, from its search on (``found``: its ``step`` is known)."""

    store: StepStore
    after: int
    thread: threading.Thread | None = None
    found: threading.Event = field(default_factory=threading.Event)
    step: int | None = None
    entry: StepEntry | None = None
    dropped: bool = False


class ReadAhead:
    """The next chosen step verified and loaded in a daemon thread (``skip.<role>.read_ahead``), one at a time
    per role, so that its hit only decodes; let go unused when the run moves past it or ends, never waiting."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._lock = threading.Lock()
        self._reading: _Reading | None = None

    def start(self, store: StepStore, after: int, allows: Callable[[int], bool]) -> None:
        """Read the next step after ``after`` that ``allows`` takes and ``store`` holds, in the background
        (a read of a later step of the same store under way is kept)."""
        with self._lock:
            reading = self._reading
            if reading is not None:
                done_before = reading.found.is_set() and (reading.step is None or reading.step <= after)
                if reading.store is store and not done_before:
                    return
                self._drop(reading)
            reading = _Reading(store, after)
            reading.thread = threading.Thread(
                target=self._read, args=(reading, allows), name=f"skipinject-read-ahead-{self.role}", daemon=True
            )
            try:
                reading.thread.start()
            except RuntimeError:  # no thread to be had: the step is read at its plan
                return
            self._reading = reading

    def _read(self, reading: _Reading, allows: Callable[[int], bool]) -> None:
        store = reading.store
        try:
            numbers = store.step_numbers_on_disk()
            later = (step for step in numbers[bisect.bisect_right(numbers, reading.after) :] if allows(step))
            step = next((s for _, s in zip(range(CANDIDATES), later, strict=False) if store.is_committed(s)), None)
            with self._lock:
                reading.step = step
            reading.found.set()
            if step is None or reading.dropped:
                return
            logger.debug("%s step %d: reading step %d ahead from %s", self.role, reading.after, step, store.location)
            entry = store.verified(step)
            try:
                entry.loaded.extend(store.load(entry))  # tensors rebuilt too: the hit only decodes them
            except BaseException:
                entry.release()
                raise
        except Exception:  # the step's plan verifies it again and reports what is wrong, once
            return
        finally:
            reading.found.set()
        with self._lock:
            if reading.dropped:
                entry.release()
            else:
                reading.entry = entry

    def take(self, store: StepStore, step: int) -> tuple[StepEntry, float] | None:
        """The entry of ``step`` read ahead if still current in ``store``, and the seconds waited for it;
        None: verify as without read-ahead. A read of an earlier step is let go, a later one kept."""
        started = time.perf_counter()
        reading = self._reading
        if reading is None or reading.store is not store:
            return None
        reading.found.wait()
        if reading.step is not None and reading.step > step:
            return None
        with self._lock:
            if self._reading is not reading:
                return None
            self._reading = None
            if reading.step != step:
                self._drop(reading)
                return None
        assert reading.thread is not None
        reading.thread.join()
        with self._lock:
            entry, reading.entry, reading.dropped = reading.entry, None, True
        if entry is None:
            return None
        try:
            current = store.read_meta(step) == entry.meta
        except Exception:
            current = False
        if not current:
            entry.release()
            return None
        return entry, time.perf_counter() - started

    def moved_to(self, step: int) -> None:
        """The run is at ``step``: a step read ahead below it will not be used."""
        reading = self._reading
        if reading is not None and reading.step is not None and reading.step < step:
            self.close(reading)

    def close(self, only: _Reading | None = None) -> None:
        """Let go of the step read ahead (``only``: if it is that one), not waiting for its thread."""
        with self._lock:
            reading = self._reading
            if reading is not None and (only is None or reading is only):
                self._drop(reading)

    def wait(self) -> None:
        """Block until the step being read ahead is read (tests and benchmarks)."""
        reading = self._reading
        if reading is not None and reading.thread is not None:
            reading.thread.join()

    def _drop(self, reading: _Reading) -> None:
        """Let ``reading`` go (under the lock): its entry now, or when its thread is done."""
        reading.dropped = True
        entry, reading.entry = reading.entry, None
        if self._reading is reading:
            self._reading = None
        if entry is not None:
            entry.release()


class Replay:
    """One role's serving from its cache in this process."""

    def __init__(self, services: Services, steps: StepBook) -> None:
        self.services = services
        self.steps = steps
        self.read_ahead = ReadAhead(services.role.name)

    def plan(self, call: Call, step: int) -> Plan:
        """:func:`plan_step`, after this project's pending saves."""
        rt = self.services
        store = self.services.store_for(call)
        WRITER.flush(store.project_dir)
        if self.steps.recorded_here(store.project_dir, step):  # 1 -> 2 -> 1: never served its own recording
            message = f"{rt.name} step {step}: recorded by this run already; generating it again (not saved)"
            rt.once(("revisit", str(store.project_dir), step), logging.INFO, message)
            return Plan(store, step, reason="recorded by this run", saves=False)
        ahead = self.read_ahead.take(store, step) if rt.settings.read_ahead else None
        entry, waited = ahead if ahead is not None else (None, 0.0)
        plan = None
        try:
            plan = plan_step(
                rt.name, store, rt.settings, rt.role.upstream_formats, step, rt.unusable(store), ahead=entry
            )
        finally:
            if entry is not None and (plan is None or plan.entry is not entry):
                entry.release()
        if entry is not None and plan.entry is entry:
            plan = replace(plan, reason=f"{plan.reason}; read ahead, waited {waited:.3f} s")
        if not plan.serves and rt.settings.action is not Action.match:
            failed = plan.reason in ("cache unusable", "cache directory unusable")
            TALLY.add(rt.name, generated_steps=1, failed_steps=int(failed))
        if plan.untrusted_upstream is not None:
            rt.once(
                ("untrusted", str(plan.untrusted_upstream)),
                logging.WARNING,
                f"{rt.name} step {step}: found verl's own cache {plan.untrusted_upstream} but did not load it: it is "
                f"a pickle, which runs code when loaded. Set skip.{rt.name}.trust_upstream=true if you trust it; "
                "generating again and caching in skipinject's format beside it",
            )
        return plan

    def load(self, record: StepCalls, call: Call, prepare: Callable[[Loaded], Any] | None) -> Loaded | None:
        """:meth:`skipinject.roles.PhaseContext.load`: what serves the step, loaded, or ``None`` (it records then)."""
        started = time.perf_counter()  # finding and reading the step are part of the hit's time
        plan, loaded = self.plan(call, record.step), None
        try:
            if plan.serves:
                try:
                    loaded = Loaded(plan, self._payloads(plan, call, decode=True))
                    if prepare is not None:
                        loaded.value = prepare(loaded)
                except Exception as exc:  # whatever is wrong with the cache, it is not trained on
                    loaded = None
                    self._cannot_load(plan, exc)
                else:
                    loaded.seconds = time.perf_counter() - started
                    self._hit(plan)
        finally:
            with record.lock:
                if record.writer is None:
                    record.plan = regenerated(plan) if plan.serves and loaded is None else plan
            self.read_after(plan)
        return loaded

    def _cannot_load(self, plan: Plan, exc: Exception, *, count: bool = True) -> None:
        """A planned cache failed to load or fit the call: ``action=strict`` stops the run; else one warning,
        the target runs and (``count``) the step counts as failed."""
        name, where = self.services.name, plan.source
        if isinstance(exc, CacheMissError):
            raise exc
        error = exc
        if not isinstance(exc, CorruptCacheError):
            error = CorruptCacheError(f"{name} step {plan.step}: cannot load {where} ({type(exc).__name__}: {exc})")
            error.__cause__ = exc
        line = f"{name} step {plan.step}: cannot load {where} ({type(exc).__name__}: {exc}); running the target instead"
        strict = self.services.settings.action is Action.strict
        refuse(strict, error, lambda: logger.warning(line), role=name, failed_steps=count, generated_steps=count)

    def _payloads(self, plan: Plan, call: Call, *, decode: bool) -> list[Any]:
        """The planned step's results (verl's own file: one), decoded or as stored."""
        if plan.upstream_file is not None:
            assert plan.upstream_format is not None
            return [plan.upstream_format.load(plan.upstream_file)]
        assert plan.entry is not None
        payloads = plan.store.load(plan.entry)
        return [self.services.codec.decode(payload, call) for payload in payloads] if decode else list(payloads)

    def _hit(self, plan: Plan) -> None:
        """Count the hit, also in the served step's usage record (not with ``save=false``)."""
        TALLY.add(self.services.name, **hit_amounts(plan.entry.meta if plan.entry is not None else {}))
        if plan.entry is not None and self.services.settings.save:
            plan.store.note_hit(plan.entry.step)

    def read_after(self, plan: Plan) -> None:
        """The planned step's first call is done: read the next chosen cached step ahead."""
        self.read_from(plan.store, plan.step)

    def read_from(self, store: StepStore, after: int, *, start: bool = False) -> None:
        """Read the first chosen cached step after ``after`` ahead (``start``: the run's first, while the
        trainer starts, also when the run's first call already waits for it)."""
        settings = self.services.settings
        if (
            not settings.read_ahead
            or settings.action in (Action.match, Action.refresh)
            or self.services.unusable(store) is not None
        ):
            return
        project, steps = store.project_dir, self.steps

        def ahead(step: int) -> bool:  # chosen, and not met by this run yet (concurrent calls may be ahead)
            return (
                settings.allows(step)
                and (start or steps.find(project, step) is None)
                and not steps.recorded_here(project, step)
            )

        self.read_ahead.start(store, after, ahead)

    def serve_call(self, record: StepCalls, index: int, call: Call) -> Any:
        """Call ``index`` of a replayed step: its recorded result, or ``REGENERATE`` to run the target (at
        the step's first call, a failure or mismatch turns the step into a recording)."""
        rt = self.services
        plan = record.plan
        assert plan is not None
        started = time.perf_counter() - (record.planning_s if index == 0 else 0.0)  # finding and reading it too
        try:
            if record.payloads is None:
                self._stored_parts(record, plan, call)
            assert record.payloads is not None
            calls = len(record.payloads)
            if index >= calls:
                refuse(
                    rt.settings.action is Action.strict,
                    CacheMissError(
                        f"{rt.name} step {plan.step}: skip.{rt.name}.action=strict and call {index + 1} of this "
                        f"step has nothing to serve ({plan.source} holds {calls} call{'s' if calls != 1 else ''})"
                    ),
                    lambda: rt.once(
                        ("extra", id(record)),
                        logging.INFO,
                        f"{rt.name} step {plan.step}: this run calls the target more often than the cached step "
                        f"{plan.served_step} holds ({calls} call{'s' if calls != 1 else ''}, in {plan.source}); "
                        f"running the target for call {index + 1} and any later ones (not saved)",
                    ),
                )
                return REGENERATE
            result, source = record.payloads[index], str(plan.source)
            if plan.entry is not None:
                result = rt.codec.decode(result, call)
        except Exception as exc:  # whatever is wrong with the cache, it is not trained on
            self._cannot_load(plan, exc, count=index == 0)
            return self._regenerate(record, index)
        elapsed = time.perf_counter() - started
        which = f" call {index + 1} of {calls}" if calls > 1 else ""
        rows = self._mismatches(record, index, call, which)
        if rows is None:
            return self._regenerate(record, index)
        mismatched, compared = rows
        logger.info(
            f"{rt.name} step {plan.step}: hit{f' ({which.strip()})' if which else ''}, served step {plan.served_step} "
            f"({plan.reason}) from {source} in {elapsed:.3f} s{first_use(record.absent) if index == 0 else ''}; "
            "target not called"
        )
        if index == 0:
            self._hit(plan)
        if rt.role.on_hit is not None:
            recorded = plan.entry.meta if plan.entry is not None else {}
            info = HitInfo(plan.step, plan.served_step, elapsed, mismatched, compared, source, recorded, rt.settings)
            result = rt.role.on_hit(result, call, info)
        return result

    def _stored_parts(self, record: StepCalls, plan: Plan, call: Call) -> None:
        """The replayed step's parts, as stored, and each call's recorded inputs, at its first call."""
        record.payloads = self._payloads(plan, call, decode=False)
        if plan.entry is None:
            record.recorded_inputs = [None] * len(record.payloads)
            return
        meta = plan.entry.meta
        calls = meta.calls
        if type(calls) is not int or calls != len(record.payloads):
            raise CorruptCacheError(
                f"{plan.source}: meta.json records {str(calls)[:40]!r} calls but holds {len(record.payloads)} parts"
            )
        record.recorded_inputs = meta.inputs_per_call(calls)

    def _mismatches(self, record: StepCalls, index: int, call: Call, which: str) -> tuple[int, int] | None:
        """Rows of call ``index`` whose inputs differ from the recording's, and rows compared, after the
        ``on_mismatch`` policy; ``None``: regenerate the call (``on_mismatch=regenerate``)."""
        rt, plan = self.services, record.plan
        assert plan is not None
        stored, current = record.recorded_inputs[index], rt.fingerprint(call)
        mismatched = compared = 0
        if isinstance(stored, list) and current is not None:
            compared = max(len(stored), len(current))
            mismatched = compared - sum(1 for a, b in zip(stored, current, strict=False) if a == b)
        if not mismatched:
            return mismatched, compared
        policy = rt.settings.on_mismatch
        message = (
            f"{rt.name} step {plan.step}{which}: the cache served (step {plan.served_step}) was generated from "
            f"other inputs in {mismatched} of {compared} rows (changed data order, seed or step); "
        )
        if policy is MismatchPolicy.warn:
            logger.warning("%s", message + "training on them anyway (on_mismatch=warn)")
            return mismatched, compared
        refuse(
            policy is MismatchPolicy.fail,
            PromptMismatchError(message + f"skip.{rt.name}.on_mismatch=fail"),
            lambda: logger.warning("%s", message + "regenerating (on_mismatch=regenerate)"),
            role=rt.name,
            generated_steps=int(index == 0),
        )
        return None

    def _regenerate(self, record: StepCalls, index: int) -> Any:
        """The cache cannot serve call ``index``: at the step's first call, record the step anew."""
        with record.lock:
            plan = record.plan
            if index == 0 and record.started == 1 and plan is not None:
                record.plan = regenerated(plan)
                record.payloads = None
        return REGENERATE
