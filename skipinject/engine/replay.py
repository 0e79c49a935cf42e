"""Replay: a chosen step planned, its cached calls loaded, checked against the call's inputs and served.
Failures of the cache never reach the training call, except with ``action=strict`` or
``on_mismatch=fail``: the target runs instead (see :mod:`skipinject.engine.decision`)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from skipinject.config import Action, MismatchPolicy
from skipinject.engine.background import WRITER
from skipinject.engine.calls import StepBook, StepCalls, recorded_inputs
from skipinject.engine.decision import cannot_load, nothing_more, plan_step
from skipinject.engine.read_ahead import ReadAhead
from skipinject.engine.stores import RoleContext
from skipinject.errors import CorruptCacheError, PromptMismatchError
from skipinject.report.tally import TALLY, hit_amounts
from skipinject.roles import Call, HitInfo, Loaded, Plan

logger = logging.getLogger("skipinject")

#: Returned by :meth:`Replay.serve_call` when the target must run after all.
REGENERATE = object()
#: Modules a first hit would import while it is timed (the store's readers, the codecs' libraries).
WARM_MODULES = ("numpy", "torch", "tensordict", "skipinject.codecs", "skipinject.store.tensorfile")


@functools.cache
def warm_imports() -> None:
    """Import what decoding imports on first use before a hit is timed: a hit's time is the load's."""
    for name in WARM_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                importlib.import_module(name)
        except Exception:  # a library that does not import here: decoding says so, if it needs it
            continue


def regenerated(plan: Plan, failed: bool = True) -> Plan:
    """``plan`` turned into a recording (``failed``: its cache could not serve)."""
    if not failed:
        return plan
    return replace(plan, entry=None, upstream_file=None, upstream_format=None, reason="regenerated")


class Replay:
    """One role's serving from its cache in this process."""

    def __init__(self, runtime: RoleContext, steps: StepBook) -> None:
        self.runtime = runtime
        self.steps = steps
        #: The next chosen step, verified and loaded in the background while this one trains (``read_ahead``).
        self.read_ahead = ReadAhead(runtime.role.name)

    def plan(self, call: Call, step: int) -> Plan:
        """See :func:`skipinject.engine.decision.plan_step` (after this project's pending saves)."""
        rt = self.runtime
        store = self.runtime.store_for(call)
        WRITER.flush(store.project_dir)
        if self.steps.recorded_here(store.project_dir, step):  # 1 -> 2 -> 1: never served its own recording
            message = f"{rt.name} step {step}: recorded by this run already; generating it again (not saved)"
            rt.once(("revisit", str(store.project_dir), step), logging.INFO, message)
            return Plan(store, step, reason="recorded by this run", saves=False)
        ahead = self.read_ahead.take(store, step) if rt.settings.read_ahead else None
        entry, waited = ahead if ahead is not None else (None, 0.0)
        unusable = self.runtime.unusable(store)
        try:
            plan = plan_step(rt.name, store, rt.settings, rt.role.upstream_formats, step, unusable, ahead=entry)
        except BaseException:
            if entry is not None:
                entry.release()
            raise
        if entry is not None and plan.entry is entry:
            plan = replace(plan, reason=f"{plan.reason}; read ahead, waited {waited:.3f} s")
        elif entry is not None:
            entry.release()
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

    def load(self, plan: Plan, call: Call, prepare: Callable[[Loaded], Any] | None = None) -> Loaded | None:
        """See :meth:`skipinject.roles.PhaseContext.load`: what serves ``plan``, loaded, or ``None``."""
        try:
            if not plan.serves:
                return None
            warm_imports()
            started = time.perf_counter()
            try:
                loaded = Loaded(plan, self._payloads(plan, call, decode=True))
                if prepare is not None:
                    loaded.value = prepare(loaded)
            except Exception as exc:  # whatever is wrong with the cache, it is not trained on
                cannot_load(self.runtime.name, self.runtime.settings, plan, exc, "running the target instead")
                TALLY.add(self.runtime.name, failed_steps=1, generated_steps=1)
                return None
            loaded.seconds = time.perf_counter() - started
            self._hit(plan)
            return loaded
        finally:
            self.read_after(plan)

    def _payloads(self, plan: Plan, call: Call, *, decode: bool) -> list[Any]:
        """The planned step's results (verl's own file: one), decoded or as stored."""
        if plan.upstream_file is not None:
            assert plan.upstream_format is not None
            return [plan.upstream_format.load(plan.upstream_file)]
        assert plan.entry is not None
        payloads = plan.store.load(plan.entry)
        return [self.runtime.codec.decode(payload, call) for payload in payloads] if decode else list(payloads)

    def _hit(self, plan: Plan) -> None:
        """Count the hit, and in the served step's usage record (not with ``save=false``); never raises."""
        TALLY.add(self.runtime.name, **hit_amounts(plan.entry.meta if plan.entry is not None else {}))
        if plan.entry is not None and self.runtime.settings.save:
            plan.store.note_hit(plan.entry.step)

    def read_after(self, plan: Plan) -> None:
        """The planned step's first call is done: read the next chosen cached step ahead (``read_ahead``;
        actions that serve whole steps)."""
        settings = self.runtime.settings
        if (
            not settings.read_ahead
            or settings.action in (Action.match, Action.refresh)
            or self.runtime.unusable(plan.store) is not None
        ):
            return
        project, steps = plan.store.project_dir, self.steps

        def ahead(step: int) -> bool:  # chosen, and not met by this run yet (concurrent calls may be ahead)
            return (
                settings.allows(step) and steps.find(project, step) is None and not steps.recorded_here(project, step)
            )

        self.read_ahead.start(plan.store, plan.step, ahead)

    def serve_call(self, record: StepCalls, index: int, call: Call) -> Any:
        """Call ``index`` of a replayed step: its recorded result, or ``REGENERATE`` to run the target (at
        the step's first call, a failure or mismatch turns the step into a recording)."""
        rt = self.runtime
        plan = record.plan
        assert plan is not None
        warm_imports()
        started = time.perf_counter()
        try:
            if record.payloads is None:
                record.payloads = self._payloads(plan, call, decode=False)
                calls = plan.entry.meta.get("calls", 1) if plan.entry is not None else 1
                if type(calls) is not int or calls != len(record.payloads):
                    raise CorruptCacheError(
                        f"{plan.source}: meta.json records {str(calls)[:40]!r} calls but holds "
                        f"{len(record.payloads)} parts"
                    )
                record.recorded_inputs = [None] if plan.entry is None else recorded_inputs(plan.entry.meta, calls)
            calls = len(record.payloads)
            if index >= calls:
                nothing_more(rt.name, rt.settings, plan, index, calls)
                rt.once(
                    ("extra", id(record)),
                    logging.INFO,
                    f"{rt.name} step {plan.step}: this run calls the target more often than the cached step "
                    f"{plan.served_step} holds ({calls} call{'s' if calls != 1 else ''}, in {plan.source}); running "
                    f"the target for call {index + 1} and any later ones (not saved)",
                )
                return REGENERATE
            if plan.upstream_file is not None:
                result, source = record.payloads[index], str(plan.upstream_file)
            else:
                assert plan.entry is not None
                result, source = rt.codec.decode(record.payloads[index], call), str(plan.entry.directory)
        except Exception as exc:  # whatever is wrong with the cache, it is not trained on
            cannot_load(rt.name, rt.settings, plan, exc, "running the target instead")
            if index == 0:
                TALLY.add(rt.name, failed_steps=1, generated_steps=1)
            return self._regenerate(record, index)
        elapsed = time.perf_counter() - started
        stored, current = record.recorded_inputs[index], rt.fingerprint(call)
        mismatched = compared = 0
        if isinstance(stored, list) and current is not None:
            compared = max(len(stored), len(current))
            mismatched = compared - sum(1 for a, b in zip(stored, current, strict=False) if a == b)
        which = f" call {index + 1} of {calls}" if calls > 1 else ""
        if mismatched:
            policy = rt.settings.on_mismatch
            message = (
                f"{rt.name} step {plan.step}{which}: the cache served (step {plan.served_step}) was generated from "
                f"other inputs in {mismatched} of {compared} rows (changed data order, seed or step); "
            )
            if policy is MismatchPolicy.fail:
                raise PromptMismatchError(message + f"skip.{rt.name}.on_mismatch=fail")
            if policy is MismatchPolicy.regenerate:
                logger.warning("%s", message + "regenerating (on_mismatch=regenerate)")
                if index == 0:
                    TALLY.add(rt.name, generated_steps=1)
                return self._regenerate(record, index)
            logger.warning("%s", message + "training on them anyway (on_mismatch=warn)")
        logger.info(
            f"{rt.name} step {plan.step}: hit{f' ({which.strip()})' if which else ''}, served step {plan.served_step} "
            f"({plan.reason}) from {source} in {elapsed:.3f} s; target not called"
        )
        if index == 0:
            self._hit(plan)
        if rt.role.on_hit is not None:
            recorded = plan.entry.meta if plan.entry is not None else {}
            info = HitInfo(plan.step, plan.served_step, elapsed, mismatched, compared, source, recorded, rt.settings)
            result = rt.role.on_hit(result, call, info)
        return result

    def _regenerate(self, record: StepCalls, index: int) -> Any:
        """The cache cannot serve call ``index``: at the step's first call, record the step anew
        (a later call only runs the target; the step stays as recorded)."""
        with record.lock:
            plan = record.plan
            if index == 0 and record.started == 1 and plan is not None:
                record.plan = regenerated(plan)
                record.payloads = None
        return REGENERATE
