"""The three phases of ``rollout_tq``: submit, sample, and the async warm-up switched off.

verl's V1 trainer splits a rollout in two: ``PPOTrainer._add_batch_to_generate`` submits the
step's prompts (TransferQueue tags + ``generate_sequences``), and ``ReplayBuffer.sample`` later
takes finished trajectories out. So one step's cache is written by the sample phase and served by
the submit phase, and the two share a :class:`StepBook`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skipinject import CacheError, Call, CorruptCacheError, PhaseContext, StepCache, StepWriting, run_config_of, select

from skipinject_rollout_tq.transfer import (
    TRAIN,
    CachedBatch,
    inject,
    load_upstream,
    prepare,
    snapshot,
    upstream_parts,
)

logger = logging.getLogger("skipinject")

_LOAD_ERRORS = (CacheError, OSError, ValueError, RuntimeError, KeyError, TypeError)


def parameter_sync_step(config: Any) -> int:
    """Mini-batches sampled per step: ``trainer.v1.<trainer_mode>.parameter_sync_step`` (default 1)."""
    mode = select(config, "trainer.v1.trainer_mode", "sync")
    try:
        return max(1, int(select(config, f"trainer.v1.{mode}.parameter_sync_step", 1)))
    except (TypeError, ValueError):
        return 1


def rollout_n(config: Any) -> int:
    return int(select(config, "actor_rollout_ref.rollout.n", 1))


@dataclass
class _SavingStep:
    """The step whose sampled mini-batches are being saved (or deliberately not saved)."""

    step: int
    expected: int
    writer: StepWriting | None  # None: nothing (more) to save for this step (the sampling side's view)
    written: int = 0  # parts handed to the background writer
    rows: int = 0
    started: float = field(default_factory=time.perf_counter)
    #: Set by the background job whose part failed: the step is aborted and its later parts are dropped.
    failed: bool = False


class StepBook:
    """What the submit phase decided per cache directory, and the open writer of the sample phase.

    State is per cache directory and per step: a writer left open by a step whose last mini-batch
    never came is aborted as soon as another step samples, so its parts are never committed.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.served: dict[Path, tuple[int, bool]] = {}
        self.saving: dict[Path, _SavingStep] = {}

    def record_submit(self, store: StepCache, step: int, served: bool) -> None:
        with self.lock:
            self.served[store.project_dir] = (step, served)

    def was_served(self, store: StepCache, step: int) -> bool | None:
        with self.lock:
            decision = self.served.get(store.project_dir)
        return decision[1] if decision is not None and decision[0] == step else None


def _splits(trainer: Any) -> bool:
    return callable(getattr(trainer, "_next_train_batch", None)) and callable(
        getattr(trainer, "_submit_batch_to_rollout", None)
    )


class SubmitPhase:
    """``PPOTrainer._add_batch_to_generate``: fetch the prompts always; inject the cache or submit them.

    The dataloader advances on every step, hit or miss, so the steps after a served one get the
    prompts they would have had without skipping.
    """

    def __init__(self, book: StepBook) -> None:
        self.book = book

    def run(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        if not _splits(call.instance):
            self._cannot_split(role)
            return proceed()
        return self._submit(role, call, step)

    async def run_async(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        if not _splits(call.instance):
            self._cannot_split(role)
            return await proceed()
        return await asyncio.to_thread(self._submit, role, call, step)

    def _cannot_split(self, role: PhaseContext) -> None:
        role.once(
            "no-split",
            logging.WARNING,
            "%s: this verl's trainer has no _next_train_batch/_submit_batch_to_rollout, so cached steps cannot be "
            "injected; every step is generated",
            role.name,
        )

    def _submit(self, role: PhaseContext, call: Call, step: int) -> None:
        trainer = call.instance
        batch = trainer._next_train_batch()
        uids = [str(uid) for uid in batch["uid"]]
        store = role.store_for(call)
        served = self._serve(role, call, store, step, uids)
        self.book.record_submit(store, step, served)
        if not served:
            trainer._submit_batch_to_rollout(batch)

    def _serve(self, role: PhaseContext, call: Call, store: StepCache, step: int, uids: list[str]) -> bool:
        """Inject the planned cache into TransferQueue; ``False`` (after logging why) to generate instead."""
        plan = role.plan(call, step)  # logs a miss; raises CacheMissError for action=strict
        if plan.entry is None and plan.upstream_file is None:
            return False
        config = run_config_of(call)
        n = rollout_n(config)
        started = time.perf_counter()
        try:
            if plan.entry is not None:
                source = plan.entry.directory
                payloads = [role.codec.decode(payload, call) for payload in store.load(plan.entry)]
            else:
                assert plan.upstream_file is not None
                source = plan.upstream_file.parent.parent
                payloads = self._trusted_upstream(source, parameter_sync_step(config))
            cached = CachedBatch.from_payloads(payloads, role.codec.merge)  # type: ignore[attr-defined]
            ready = prepare(cached, uids, n, step)
        except _LOAD_ERRORS as exc:
            if role.settings.action == "strict":
                raise
            logger.warning(
                "%s step %d: cannot load %s (%s: %s); generating the step instead",
                role.name,
                step,
                source,
                type(exc).__name__,
                exc,
            )
            return False
        remapped = inject(ready)
        fit = ""
        if remapped.groups != len(uids):
            how = "cycled through" if remapped.groups < len(uids) else "used the first"
            fit = f"; {remapped.groups} cached prompt groups for {len(uids)} prompts, {how} them"
        logger.info(
            "%s step %d: hit, served step %d (%s) from %s: injected %d cached trajectories (%d prompts x n=%d) into "
            "TransferQueue in %.3f s%s; rollout not submitted",
            role.name,
            step,
            plan.served_step,
            plan.reason,
            source,
            len(remapped.keys),
            len(uids),
            n,
            time.perf_counter() - started,
            fit,
        )
        return True

    @staticmethod
    def _trusted_upstream(step_dir: Path, expected: int) -> list[dict[str, Any]]:
        found = len(upstream_parts(step_dir))
        if found < expected:
            raise CorruptCacheError(
                f"verl's cache has {found} of the {expected} mini-batches (parameter_sync_step) of this step"
            )
        return load_upstream(step_dir)[:expected]


class SamplePhase:
    """``ReplayBuffer.sample``: after the real sample, save the train batch of a step generated in this run.

    With ``parameter_sync_step = k`` the trainer samples k mini-batches per step; they become parts
    ``0..k-1`` of one step commit, published only after the k-th, so a step is loadable only whole.
    Its targets are ``every_step``: a sample at any later step closes (aborts) an unfinished one.
    Parts are copied in the call and written (and the step committed) by the engine's background writer.
    """

    def __init__(self, book: StepBook) -> None:
        self.book = book

    def run(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        result = proceed()
        self.after_sample(role, call, step, result)
        return result

    async def run_async(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        result = await proceed()
        await asyncio.to_thread(self.after_sample, role, call, step, result)
        return result

    def after_sample(self, role: PhaseContext, call: Call, step: int, result: Any) -> None:
        batch = result[0] if isinstance(result, tuple) and result else result
        if getattr(batch, "partition_id", None) != TRAIN:
            return
        allowed = role.settings.allows(step)
        if not allowed and not self.book.saving:
            return
        store = role.store_for(call)
        with self.book.lock:
            if not allowed:  # seen only to close a step whose last mini-batch never came
                self._close_other(role, store, step)
                return
            saving = self._saving_for(role, call, store, step)
            if saving.writer is None:
                return
            self._save_part(role, store, saving, batch, step)

    def _close_other(self, role: PhaseContext, store: StepCache, step: int) -> None:
        """Forget the step being saved if it is not ``step``; abort its writer if it is incomplete."""
        current = self.book.saving.get(store.project_dir)
        if current is None or current.step == step:
            return
        del self.book.saving[store.project_dir]
        if current.writer is not None:
            role.in_background(store, current.writer.abort)  # after the parts still being written
            logger.warning(
                "%s step %d: only %d of %d mini-batches were sampled before step %d began; the step is not cached",
                role.name,
                current.step,
                current.written,
                current.expected,
                step,
            )

    def _saving_for(self, role: PhaseContext, call: Call, store: StepCache, step: int) -> _SavingStep:
        self._close_other(role, store, step)
        current = self.book.saving.get(store.project_dir)
        if current is not None:
            return current
        expected = parameter_sync_step(run_config_of(call))
        served = self.book.was_served(store, step)
        if served is None:  # the submit phase did not see this step: trust only a committed cache
            served = store.is_committed(step)
        writer = None if served else store.begin(step)
        current = self.book.saving[store.project_dir] = _SavingStep(step, expected, writer)
        return current

    def _save_part(self, role: PhaseContext, store: StepCache, saving: _SavingStep, batch: Any, step: int) -> None:
        """Read the mini-batch back and copy it now; write it (and commit the step after the last) in the background.

        The copy is what training sampled, whatever TransferQueue's buffers or the trainer do with
        the data afterwards; the write, fsync and checksums run in the engine's background writer,
        in order with this store's other jobs (the next step's submit waits for them).
        """
        assert saving.writer is not None
        part = saving.written
        try:
            payload = role.codec.encode(snapshot(batch, step)).private_copy()
        except Exception as exc:
            role.in_background(store, saving.writer.abort)
            saving.writer = None
            self._save_failed(role, store, saving, part, exc)
            return
        saving.written += 1
        saving.rows += payload.rows or 0
        last = saving.written == saving.expected
        writer = saving.writer
        role.in_background(store, lambda: self._write_part(role, store, saving, writer, payload, part, last))
        if last:
            saving.writer = None  # nothing more to save for this step; the job above commits it

    def _write_part(
        self,
        role: PhaseContext,
        store: StepCache,
        saving: _SavingStep,
        writer: StepWriting,
        payload: Any,
        part: int,
        last: bool,
    ) -> None:
        """The background job of one mini-batch: write it, and commit the step if it is the last."""
        if saving.failed:  # an earlier part of this step failed: the step is not cached
            return
        try:
            writer.add_part(payload, part=str(part))
            if not last:
                logger.info(
                    "%s step %d: saved mini-batch %d of %d (%s trajectories); the step is committed after the last",
                    role.name,
                    saving.step,
                    part + 1,
                    saving.expected,
                    payload.rows,
                )
                return
            directory = writer.commit({"parameter_sync_step": saving.expected, "trajectories": saving.rows})
        except Exception as exc:
            writer.abort()
            saving.failed = True
            self._save_failed(role, store, saving, part, exc)
            return
        logger.info(
            "%s step %d: saved %d trajectories in %d part(s) to %s in %.3f s",
            role.name,
            saving.step,
            saving.rows,
            saving.expected,
            directory,
            time.perf_counter() - saving.started,
        )

    @staticmethod
    def _save_failed(role: PhaseContext, store: StepCache, saving: _SavingStep, part: int, exc: Exception) -> None:
        role.once(
            ("save", str(store.project_dir), saving.step),
            logging.WARNING,
            "%s step %d: could not save mini-batch %d to %s (%s: %s); training goes on without the cache",
            role.name,
            saving.step,
            part,
            store.step_dir(saving.step),
            type(exc).__name__,
            exc,
        )


class WarmupOff:
    """``PPOTrainer._add_async_warmup_batches``: a no-op while the role is enabled.

    The async modes prefetch warm-up prompts outside the per-step submit; those would bypass the
    cache and shift the dataloader against it. verl's own skip turns the prefetch off for the same
    reason, but reads ``config.skip.rollout_tq.enable``, which skipinject's overrides never reach.
    """

    def run(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        self._log(role)
        return None

    async def run_async(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        self._log(role)
        return None

    @staticmethod
    def _log(role: PhaseContext) -> None:
        role.once(
            "warmup",
            logging.INFO,
            "%s: async warm-up prefetch switched off while skip.%s is enabled, so every prompt goes through the "
            "per-step submit and the dataloader stays aligned with the cache (as verl does for its own skip)",
            role.name,
            role.name,
        )
