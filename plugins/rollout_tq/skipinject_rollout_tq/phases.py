"""The phases of ``rollout_tq``: submit, refill, sample, and the async warm-up switched off.

verl's V1 trainer splits a rollout in two: ``PPOTrainer._add_batch_to_generate`` submits the
step's prompts (TransferQueue tags + ``generate_sequences``), and ``ReplayBuffer.sample`` later
takes finished trajectories out. So one step's cache is written by the sample phase and served by
the submit phase, and the two share a :class:`StepBook`.

With group filtering (DAPO, ``algorithm.filter_groups.enable``) or failed-group refills the
replay buffer draws more prompts inside ``sample`` through ``PPOTrainer._add_prompts_to_generate``
(its ``refill_fn``): the refill phase counts them, the step's record (``meta.json``) says how many
prompts the step drew in all, and a served step draws that many again, so the dataloader stays
where the recorded run had it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skipinject import Call, CorruptCacheError, Loaded, PhaseContext, StepCache, StepWriting, run_config_of, select
from skipinject_rollout import rescore
from skipinject_rollout.reward_identity import record_reward, reward_identity

from skipinject_rollout_tq.transfer import (
    TRAIN,
    CachedBatch,
    inject,
    prepare,
    prompt_groups,
    snapshot,
)

logger = logging.getLogger("skipinject")


def _count(value: Any) -> int:
    """A non-negative count read from a record, 0 when absent or not a count."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def parameter_sync_step(config: Any) -> int:
    """Mini-batches sampled per step: ``trainer.v1.<trainer_mode>.parameter_sync_step`` (default 1)."""
    mode = select(config, "trainer.v1.trainer_mode", "sync")
    try:
        return max(1, int(select(config, f"trainer.v1.{mode}.parameter_sync_step", 1)))
    except (TypeError, ValueError):
        return 1


def rollout_n(config: Any) -> int:
    return int(select(config, "actor_rollout_ref.rollout.n", 1))


def draws_more(config: Any) -> bool:
    """Whether the replay buffer may draw prompts beyond the submit's: group filtering (DAPO),
    ``sync_refill_failed_groups``, or an async mode (failed and stale groups are refilled)."""
    return bool(
        select(config, "algorithm.filter_groups.enable", False)
        or select(config, "trainer.v1.sampler.sync_refill_failed_groups", False)
        or select(config, "trainer.v1.trainer_mode", "sync") != "sync"
    )


def gen_batch_size(config: Any) -> int:
    """The dataloader's fetch size: ``data.gen_batch_size``, else ``data.train_batch_size``."""
    for key in ("data.gen_batch_size", "data.train_batch_size"):
        value = select(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 1


@dataclass
class _SavingStep:
    """The step whose sampled mini-batches are being saved (or deliberately not saved)."""

    step: int
    expected: int
    writer: StepWriting | None  # None: nothing (more) to save for this step (the sampling side's view)
    written: int = 0  # parts handed to the background writer
    rows: int = 0
    #: What the step's record says besides its parts: the prompts it drew, what it left in the buffer.
    record: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    #: Set by the background job whose part failed: the step is aborted and its later parts are dropped.
    failed: bool = False
    #: What scored the trajectories (:func:`skipinject_rollout.reward_identity.record_reward`), for ``meta.json``.
    scored_by: dict[str, Any] = field(default_factory=dict)


@dataclass
class Draws:
    """The prompts the dataloader gave one step of this run: the submit's, then each refill's."""

    step: int
    submitted: int
    refills: list[int] = field(default_factory=list)
    #: ``False`` once prompts were drawn outside the phases' sight (the total is then unknown).
    known: bool = True

    @property
    def total(self) -> int:
        return self.submitted + sum(self.refills)


@dataclass(frozen=True)
class ServedRecord:
    """A step served in this run and what its record says the recorded run carried into the next step."""

    step: int
    carried_over: int


def _describe_record(record: Mapping[str, Any]) -> str:
    """The draw counts of a step's record for its save line ("" when there are none)."""
    text = ""
    if "prompts_drawn" in record:
        refills = record.get("refills") or []
        how = f" ({record.get('prompts_submitted')} + refills {refills})" if refills else ""
        text += f"; the step drew {record['prompts_drawn']} prompts{how}"
    if record.get("carried_over"):
        text += f", left {record['carried_over']} prompt groups in the replay buffer"
    return text


class StepBook:
    """What the submit phase decided per cache directory, and the open writer of the sample phase.

    State is per cache directory and per step: a writer left open by a step whose last mini-batch
    never came is aborted as soon as another step samples, so its parts are never committed.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.served: dict[Path, tuple[int, bool]] = {}
        self.saving: dict[Path, _SavingStep] = {}
        #: The prompts drawn by the step being generated (its submit and refills), per cache directory.
        self.draws: dict[Path, Draws] = {}
        #: The last step served, per cache directory (for the step after it).
        self.last_served: dict[Path, ServedRecord] = {}

    def record_submit(self, store: StepCache, step: int, served: bool) -> None:
        with self.lock:
            self.served[store.project_dir] = (step, served)

    def record_draws(self, store: StepCache, step: int, submitted: int) -> None:
        """The submit of a generated step drew ``submitted`` prompts; its refills come next."""
        with self.lock:
            self.draws[store.project_dir] = Draws(step, submitted)

    def record_refill(self, store: StepCache, step: int, prompts: int) -> Draws:
        """A refill of ``prompts`` at ``step``; returns the step's draws so far."""
        with self.lock:
            draws = self.draws.get(store.project_dir)
            if draws is None or draws.step != step:  # the submit of this step was not seen
                draws = self.draws[store.project_dir] = Draws(step, 0, known=False)
            draws.refills.append(prompts)
            return draws

    def draws_of(self, store: StepCache, step: int) -> Draws | None:
        with self.lock:
            draws = self.draws.get(store.project_dir)
        return draws if draws is not None and draws.step == step else None

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
            self.book.record_draws(store, step, len(uids))
            trainer._submit_batch_to_rollout(batch)

    def _serve(self, role: PhaseContext, call: Call, store: StepCache, step: int, uids: list[str]) -> bool:
        """Inject the planned cache into TransferQueue; ``False`` (after the engine logged why) to generate instead."""
        config = run_config_of(call)
        n = rollout_n(config)
        expected = parameter_sync_step(config)

        def ready(loaded: Loaded) -> Any:
            parts = loaded.results if loaded.plan.entry is not None else _trusted_upstream(loaded, expected)
            return prepare(CachedBatch.from_payloads(parts, role.codec.merge), uids, n, step)  # type: ignore[attr-defined]

        loaded = role.load(call, step, ready)  # the engine's policy: logs a miss, stops for action=strict
        if loaded is None:
            return False
        started = time.perf_counter() - loaded.seconds
        plan = loaded.plan
        if plan.entry is not None:
            source = plan.entry.directory
        else:
            assert plan.upstream_file is not None
            source = plan.upstream_file.parent.parent  # the step: its loader read every part
        notes: list[str] = []
        try:
            earlier = prompt_groups()  # prompt groups of earlier steps still in the replay buffer
        except Exception as exc:  # only the note below depends on it
            earlier = 0
            notes.append(f"could not count the groups already in the replay buffer ({type(exc).__name__}: {exc})")
        meta: Mapping[str, Any] = plan.entry.meta if plan.entry is not None else {}
        config = run_config_of(call)
        # verl scores V1 trajectories in the rollout: the served ones are scored by this run's reward if the
        # recording's was another (skipinject_rollout.rescore); the reward role, when it serves, wins later.
        reward_loop = getattr(call.instance, "reward_loop_manager", None)
        rescore.apply_trajectories(
            loaded.value.fields,
            getattr(reward_loop, "reward_loop_worker_handles", None),
            reward_identity(config),
            role.name,
            step,
            role.settings,
            meta,
        )
        remapped = inject(loaded.value)
        with self.book.lock:
            self.book.last_served[store.project_dir] = ServedRecord(step, _count(meta.get("carried_over")))
        exact = self._draw_recorded(call, plan.served_step, step, meta, len(uids), notes)
        if earlier:
            exact = False
            notes.append(
                f"{earlier} prompt groups of earlier steps are still in the replay buffer and are sampled "
                "with (or before) the served ones, so this step does not train on exactly the recorded batch"
            )
        if remapped.groups != len(uids):
            how = "cycled through" if remapped.groups < len(uids) else "used the first"
            notes.append(f"{remapped.groups} cached prompt groups for {len(uids)} prompts, {how} them")
        logger.log(
            logging.INFO if exact else logging.WARNING,
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
            "".join(f"; {note}" for note in notes),
        )
        return True

    @staticmethod
    def _draw_recorded(
        call: Call, served_step: int, step: int, meta: Mapping[str, Any], submitted: int, notes: list[str]
    ) -> bool:
        """Draw (and drop) the prompts the recorded step drew beyond its submit; ``False`` if that is not exact.

        The recorded run's refills took ``prompts_drawn - submitted`` more prompts from the dataloader
        at this step; drawing as many keeps the later steps on the recorded run's prompts.
        """
        config = run_config_of(call)
        recorded = meta.get("prompts_drawn")
        if served_step != step:
            if draws_more(config):
                notes.append(
                    f"the dataloader gave this step its submit's {submitted} prompts only "
                    f"(the record is step {served_step}'s)"
                )
            return True  # repeat stands in another step's data on purpose
        if not isinstance(recorded, int) or isinstance(recorded, bool) or recorded < 0:
            if not draws_more(config):
                return True
            notes.append(
                "the record does not say how many prompts the step drew (an older or verl's own cache): the "
                f"dataloader gave the submit's {submitted} only, so later steps may see other prompts than"
                " the recorded run"
            )
            return False
        extra = recorded - submitted
        if extra < 0:
            notes.append(f"the recorded step drew {recorded} prompts, fewer than this submit's {submitted}")
            return False
        if extra == 0:
            return True
        chunk = gen_batch_size(config)
        whole = extra - extra % chunk
        if whole:
            call.instance._next_train_batch(whole)  # what the recorded run's refills drew; not generated
        notes.append(
            f"drew {submitted + whole} prompts as the recorded step did ({submitted} + {whole} that its refills drew, "
            "dropped ungenerated)"
        )
        if whole != extra:
            notes.append(f"{extra - whole} of them are not a whole dataloader fetch of {chunk}: not drawn")
            return False
        return True


def _trusted_upstream(loaded: Loaded, expected: int) -> list[dict[str, Any]]:
    """The first ``expected`` mini-batches of verl's own cache of a step (its loader reads every part)."""
    parts = loaded.results[0]
    if len(parts) < expected:
        raise CorruptCacheError(
            f"verl's cache has {len(parts)} of the {expected} mini-batches (parameter_sync_step) of this step"
        )
    return list(parts[:expected])


class RefillPhase:
    """``PPOTrainer._add_prompts_to_generate`` at a chosen step: the replay buffer's ``refill_fn``.

    Group filtering (DAPO) evicts groups whose rewards are all equal and has the buffer draw and
    generate more prompts through it (so do failed and, in the async modes, stale groups). At a
    generated step the refill runs and its prompts are counted for the step's record; a served step
    injects groups that passed the filter in the recorded run, so no refill comes. If one does (a
    cached group evicted anyway, or groups of earlier steps still in the buffer), it is generated
    and said so: nothing else could satisfy the buffer, which waits for the groups it asked for.
    """

    def __init__(self, book: StepBook) -> None:
        self.book = book

    def run(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        self.before_refill(role, call, step)
        return proceed()

    async def run_async(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        self.before_refill(role, call, step)
        return await proceed()

    def before_refill(self, role: PhaseContext, call: Call, step: int) -> None:
        store = role.store_for(call)
        prompts = _count(call.argument("num_prompts"))
        if self.book.was_served(store, step):
            logger.warning(
                "%s step %d: the replay buffer asks for %d more prompts at this served step (it evicted groups); "
                "generating them: the step no longer trains on exactly the recorded data, and the dataloader runs "
                "%d prompts ahead of the recorded run",
                role.name,
                step,
                prompts,
                prompts,
            )
            return
        draws = self.book.record_refill(store, step, prompts)
        logger.info(
            "%s step %d: refill of %d prompts generated (the replay buffer evicted groups); the step has drawn %s "
            "prompts so far",
            role.name,
            step,
            prompts,
            draws.total if draws.known else "an unknown number of",
        )


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
        if self.book.last_served:
            self._after_served(role, role.store_for(call), step)
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

    def _after_served(self, role: PhaseContext, store: StepCache, step: int) -> None:
        """Say so when a step generated after a served one misses what the recorded run carried into it.

        In the async modes the recorded run's buffer kept groups of a step (drawn there, finished or
        in flight, not sampled) for the steps after it; a served step drew their prompts but has no
        trajectories for them, so the first generated step after it trains on other prompts.
        """
        with self.book.lock:
            record = self.book.last_served.get(store.project_dir)
            if record is None or record.step >= step:
                return
            del self.book.last_served[store.project_dir]
        if record.carried_over and not self.book.was_served(store, step):
            logger.warning(
                "%s step %d: served step %d's record says the recorded run carried %d prompt groups (drawn then, "
                "sampled later) past it; this run has none of them (their prompts were drawn and dropped at step %d), "
                "so step %d trains on other prompts than the recorded run",
                role.name,
                step,
                record.step,
                record.carried_over,
                record.step,
                step,
            )

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
        if writer is not None:
            current.scored_by = dict(record_reward(call) or {})
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
        if last:
            saving.record = self._record(role, store, step)
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
            directory = writer.commit(
                {
                    **saving.scored_by,
                    "parameter_sync_step": saving.expected,
                    "trajectories": saving.rows,
                    **saving.record,
                }
            )
        except Exception as exc:
            writer.abort()
            saving.failed = True
            self._save_failed(role, store, saving, part, exc)
            return
        logger.info(
            "%s step %d: saved %d trajectories in %d part(s) to %s in %.3f s%s",
            role.name,
            saving.step,
            saving.rows,
            saving.expected,
            directory,
            time.perf_counter() - saving.started,
            _describe_record(saving.record),
        )

    def _record(self, role: PhaseContext, store: StepCache, step: int) -> dict[str, Any]:
        """What the step's ``meta.json`` says besides its parts, read after its last sample.

        ``prompts_drawn``: prompts the dataloader gave the step (the submit's, ``prompts_submitted``,
        plus each refill's, ``refills``), absent if a draw went unseen; ``carried_over``: prompt
        groups left in the replay buffer for later steps (0 unless groups of earlier steps were in
        it: group filtering's ``sync`` sampling drops its surplus, and refills replace evicted
        groups one for one).
        """
        record: dict[str, Any] = {}
        draws = self.book.draws_of(store, step)
        if draws is not None and draws.known:
            record.update(prompts_drawn=draws.total, prompts_submitted=draws.submitted, refills=list(draws.refills))
        try:
            record["carried_over"] = prompt_groups()
        except Exception as exc:  # the record is still whole without it; the served step then assumes 0
            role.once(
                ("carried", str(store.project_dir)),
                logging.WARNING,
                "%s step %d: cannot count the prompt groups left in the replay buffer (%s: %s); not recorded",
                role.name,
                step,
                type(exc).__name__,
                exc,
            )
        return record

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
