"""The trainer's weight sync into the rollout engine, deferred while the coming generation is served.

verl's colocated trainers (V0 ``RayPPOTrainer.fit``, V1 ``sync`` and ``colocate_async``) call
``CheckpointEngineManager.update_weights(global_steps)`` before the first step and after every actor
update, and ``sleep_replicas()`` after each generation: on a GPU cluster the sync wakes the engine,
re-allocates its KV cache and moves every weight of the policy into it. A served step generates nothing,
so while the coming step (``global_steps + 1``) is served from the cache, or no training step follows,
the sync is not carried out but kept pending (the latest one: its arguments carry the trainer's step).

Exactness rests on one rule: before anything reaches the engine again in this process -- a generation
that runs (a miss, a ``match`` call with rows to generate, a refill, validation), a wake-up or KV-cache call
-- the pending sync is carried out first, once, with the trainer's weights of that moment, which are those
the skipped sync would have moved (nothing trains between a sync and the next generation). The generation
targets carry it out in their ``Target.before``; the manager's other engine calls in their phase. A run
whose remaining steps are all served ends with none. While a sync is pending the engine is still asleep:
``sleep_replicas`` (and ``colocate_async``'s ``abort_replicas``) are not called again, and neither is
its ``resume_generation_replicas``. A sync that follows an abort carried out (``colocate_async`` after a
generated step: requests it parked resume after the sync, with its weights) is never deferred.

Trainers whose engine generates while the trainer trains (V1 ``separate_async``, one-step-off, fully async:
``actor_rollout_ref.hybrid_engine=False``) keep every sync; one line says so. verl < 0.8 has no
``CheckpointEngineManager``: its worker-group rollout syncs inside ``generate_sequences``, which a served
step never calls.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from skipinject import (
    Action,
    Call,
    PhaseContext,
    StepSource,
    Target,
    count_weight_syncs,
    default_bypass,
    run_config_of,
)

logger = logging.getLogger("skipinject")

MANAGER = "verl.checkpoint_engine.base:CheckpointEngineManager"
#: ``CheckpointEngineManager`` exists from verl 0.8 on.
MANAGER_VERL = ">=0.8"
#: The manager's calls that reach the engine apart from sync, sleep, abort and resume: a pending sync first.
ENGINE_CALLS = ("wake_up_replicas", "release_kv_cache_replicas", "resume_kv_cache_replicas")

#: ``eligible(run_config) -> reason or None``: why this trainer keeps every sync (``None``: it may defer).
Eligible = Callable[[Any], "str | None"]

_TOTAL = StepSource.clock("total_training_steps")


#: The manager classes whose methods :func:`manager_targets` patched (``package.module:Class``).
_MANAGERS: set[str] = set()


def step_zero_before_fit(call: Call) -> int | None:
    """The manager's calls made before the trainer's ``fit`` (its set-up's sleep, V1's first sync): step 0."""
    return 0 if call.target.rpartition(".")[0] in _MANAGERS else None


#: A rollout role's step source ends with this: the manager's calls carry no step before ``fit``.
BEFORE_TRAINING = StepSource.per_call(step_zero_before_fit)
_GENERATION_STEP = StepSource.meta("global_steps").or_else(StepSource.clock("global_steps"))


@dataclass
class Pending:
    """A sync not carried out: its call's arguments, the step whose weights it carries and the step it waits for."""

    role: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    weights_of: int
    coming: int
    #: What the sync took in the recording run (the served step's ``meta.json``), counted as saved.
    seconds: float = 0.0
    #: ``resume_generation_replicas`` asked while pending (the engine's gate is closed): after the sync.
    resume: bool = False


@dataclass
class EngineState:
    """What this process knows of one manager's engine."""

    asleep: bool = False
    gate_closed: bool = False
    pending: Pending | None = None


@dataclass
class WeightSyncs:
    """The managers of this process (weakly held) and the last sync carried out (its seconds go in meta.json)."""

    engines: weakref.WeakKeyDictionary[Any, EngineState] = field(default_factory=weakref.WeakKeyDictionary)
    last_seconds: float | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    carrying: threading.local = field(default_factory=threading.local)

    def of(self, manager: Any) -> EngineState:
        with self.lock:
            state = self.engines.get(manager)
            if state is None:
                state = self.engines[manager] = EngineState()
            return state

    def pending(self) -> list[tuple[Any, EngineState]]:
        with self.lock:
            return [(manager, state) for manager, state in self.engines.items() if state.pending is not None]

    def clear(self) -> None:
        with self.lock:
            self.engines.clear()
            self.last_seconds = None


SYNCS = WeightSyncs()


def _carrying_out() -> bool:
    return bool(getattr(SYNCS.carrying, "active", False))


def carry_out(manager: Any, state: EngineState, before: str, step: int | None) -> None:
    """Carry ``state``'s pending sync out now (its resume after it), one line saying before what. Under the
    lock: a generation on another thread waits until the weights are in the engine."""
    with SYNCS.lock:
        pending = state.pending
        if pending is None:
            return
        state.pending = None
        count_weight_syncs(pending.role, -1, -pending.seconds)  # it was not skipped after all
        SYNCS.carrying.active = True
        started = time.perf_counter()
        try:
            manager.update_weights(*pending.args, **pending.kwargs)
            if pending.resume:
                manager.resume_generation_replicas()
        finally:
            SYNCS.carrying.active = False
    at = f"step {step}" if step is not None else f"step {pending.weights_of}"
    logger.info(
        "%s %s: pending weight sync carried out before %s (weights of step %d, in %.3f s)",
        pending.role,
        at,
        before,
        pending.weights_of,
        time.perf_counter() - started,
    )


def before_generation(call: Call) -> None:
    """``Target.before`` of a generation target: a pending sync is carried out before the engine generates."""
    if not SYNCS.engines:
        return
    try:
        step = _GENERATION_STEP.resolve(call)
        validation = bool(default_bypass(call))
    except Exception:
        step, validation = None, False
    what = (
        "validation's generation" if validation else f"step {step}'s generation" if step is not None else "a generation"
    )
    for manager, state in SYNCS.pending():
        carry_out(manager, state, what, step)


def served(step: int, meta: Mapping[str, Any]) -> None:
    """A step served whole: the sync deferred for it took ``meta["weight_sync_s"]`` in the recording run."""
    seconds = meta.get("weight_sync_s")
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 < seconds < 1e9:
        return
    with SYNCS.lock:
        for _, state in SYNCS.pending():
            pending = state.pending
            if pending is not None and pending.coming == step and not pending.seconds:
                pending.seconds = float(seconds)
                count_weight_syncs(pending.role, 0, pending.seconds)


def recorded_meta() -> dict[str, Any]:
    """For a recorded step's ``meta.json``: what the sync before its generation took (this process's last)."""
    seconds = SYNCS.last_seconds
    return {} if seconds is None else {"weight_sync_s": round(seconds, 6)}


def _weights_of(call: Call, step: int) -> int:
    given = call.argument("global_steps")
    return given if isinstance(given, int) and not isinstance(given, bool) else step


def hybrid_engine(config: Any) -> str | None:
    """The V0 trainer: the rollout engine sleeps while the trainer trains unless it has GPUs of its own."""
    from skipinject import select

    if select(config, "actor_rollout_ref.hybrid_engine", True) is False:
        return "actor_rollout_ref.hybrid_engine=False: the rollout engine generates while the trainer trains"
    return None


class _ManagerPhase:
    """What the phases of the manager's methods share: whether this run defers (said once when it does not)."""

    def __init__(self, eligible: Eligible) -> None:
        self.eligible = eligible

    def defers(self, role: PhaseContext, call: Call) -> bool:
        if role.settings.defer_weight_sync == "never":
            return False
        config = run_config_of(call)
        if config is None:  # no trainer seen: nothing to decide with
            return False
        try:
            reason = self.eligible(config)
        except Exception:
            reason = "its settings could not be read"
        if reason:
            role.once(
                "weight-sync-kept",
                logging.INFO,
                "%s: weight syncs are carried out as verl makes them in this run (%s)",
                role.name,
                reason,
            )
            return False
        return True

    async def run_async(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        # An awaiting caller (verl's own async code): the manager's calls are carried out as verl makes them.
        return await proceed()


class SyncPhase(_ManagerPhase):
    """``CheckpointEngineManager.update_weights``: deferred while the coming step is served, else carried out."""

    def run(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        manager, weights_of = call.instance, _weights_of(call, step)
        state = SYNCS.of(manager)
        # A gate an abort really closed (``colocate_async``) may hold requests that resume right after this sync
        # and generate with its weights, as verl has them: such a sync is carried out.
        if not _carrying_out() and not state.gate_closed and self.defers(role, call):
            coming = weights_of + 1
            why = will_serve(role, call, coming)
            if why is not None:
                with SYNCS.lock:
                    earlier = state.pending
                    state.pending = Pending(
                        role.name,
                        call.args,
                        dict(call.kwargs),
                        weights_of,
                        coming,
                        resume=bool(earlier and earlier.resume),
                    )
                count_weight_syncs(role.name, 1)
                logger.info("%s step %d: weight sync deferred (%s)", role.name, coming, why)
                return {}
        earlier = state.pending
        state.pending = None  # superseded by this one, carried out now (it stays counted as skipped)
        started = time.perf_counter()
        result = proceed()
        SYNCS.last_seconds = time.perf_counter() - started
        state.asleep = False
        if earlier is not None and earlier.resume:  # the gate it would have opened, opened after this sync
            manager.resume_generation_replicas()
        return result

    async def run_async(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        state = SYNCS.of(call.instance)
        state.pending = None  # an awaited sync (verl's own async code) supersedes a pending one
        result = await proceed()
        state.asleep = False
        return result


def will_serve(role: PhaseContext, call: Call, coming: int) -> str | None:
    """Why the generation of step ``coming`` needs no sync now (``None``: it may generate)."""
    try:
        total = _TOTAL.resolve(call)
    except Exception:
        total = None
    if total is not None and coming > total:
        return f"no training step follows step {coming - 1}; carried out only if something generates"
    settings = role.settings
    if not settings.allows(coming) or settings.action is Action.refresh:
        return None
    if settings.action is Action.match:
        return "action=match: carried out before the step's call if it has rows to generate"
    try:
        store = role.store_for(call)
        if settings.action is Action.repeat:
            found = any(store.is_committed(s) for s in store.step_numbers_on_disk()[:8])
            what = "a cached step serves it (action=repeat)"
        else:
            found = store.is_committed(coming)
            what = "the step is cached"
    except Exception:
        return None
    return f"{what}: the rollout engine is not woken; carried out before anything generates" if found else None


class SleepPhase(_ManagerPhase):
    """``sleep_replicas``: not called again while the engine is asleep."""

    def run(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        state = SYNCS.of(call.instance)
        if state.asleep and not _carrying_out() and self.defers(role, call):
            logger.debug("%s step %d: the rollout engine is asleep; not put to sleep again", role.name, step)
            return None
        result = proceed()
        state.asleep = True
        return result


class AbortPhase(_ManagerPhase):
    """``abort_replicas`` (``colocate_async``): nothing to abort on an engine asleep with a sync pending."""

    def run(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        state = SYNCS.of(call.instance)
        if state.pending is not None and state.asleep and self.defers(role, call):
            return None
        result = proceed()
        state.gate_closed = True
        return result


class ResumePhase(_ManagerPhase):
    """``resume_generation_replicas``: with a sync pending, after it (when the gate was really closed)."""

    def run(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        state = SYNCS.of(call.instance)
        pending = state.pending
        if pending is not None and not _carrying_out() and self.defers(role, call):
            pending.resume = pending.resume or state.gate_closed
            return None
        result = proceed()
        state.gate_closed = False
        return result


class EngineCallPhase(_ManagerPhase):
    """The manager's other engine calls (wake-up, KV cache): a pending sync is carried out first."""

    def __init__(self, eligible: Eligible, method: str) -> None:
        super().__init__(eligible)
        self.method = method

    def run(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        state = SYNCS.of(call.instance)
        if state.pending is not None:
            carry_out(call.instance, state, f"{self.method}", step)
        result = proceed()
        if self.method == "wake_up_replicas":
            state.asleep = False
        return result

    async def run_async(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        state = SYNCS.of(call.instance)
        if state.pending is not None:
            import asyncio  # an awaiting caller has it already

            await asyncio.to_thread(carry_out, call.instance, state, self.method, step)
        return await proceed()


def manager_targets(eligible: Eligible, manager: str = MANAGER, verl: str | None = MANAGER_VERL) -> list[Target]:
    """The manager's targets of a rollout role (every step: a sync's decision looks at the coming one);
    ``manager``: the class (``package.module:Class``), verl's ``CheckpointEngineManager`` by default."""
    _MANAGERS.add(manager)
    phases: dict[str, Any] = {
        "update_weights": SyncPhase(eligible),
        "sleep_replicas": SleepPhase(eligible),
        "abort_replicas": AbortPhase(eligible),
        "resume_generation_replicas": ResumePhase(eligible),
        **{method: EngineCallPhase(eligible, method) for method in ENGINE_CALLS},
    }
    return [Target(f"{manager}.{name}", phase=phase, every_step=True, verl=verl) for name, phase in phases.items()]
