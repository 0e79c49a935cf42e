"""The phases of ``rollout_tq``: submit, refill, sample, and the async warm-up switched off.

verl's V1 trainer splits a rollout in two: ``PPOTrainer._add_batch_to_generate`` submits the
step's prompts (TransferQueue tags + ``generate_sequences``), and ``ReplayBuffer.sample`` later
takes finished trajectories out. So one step's cache is written by the sample phase and served by
the submit phase: the engine keeps the step's decision (:meth:`PhaseContext.served`), its parts and
its commit (:meth:`PhaseContext.record`, :meth:`PhaseContext.commit`).

With group filtering (DAPO, ``algorithm.filter_groups.enable``) or failed-group refills the
replay buffer draws more prompts inside ``sample`` through ``PPOTrainer._add_prompts_to_generate``
(its ``refill_fn``): the refill phase counts them in the step's notes (:meth:`PhaseContext.notes`),
the step's record (``meta.json``) says how many
prompts the step drew in all, and a served step draws that many again, so the dataloader stays
where the recorded run had it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skipinject import (
    Action,
    Call,
    CorruptCacheError,
    PhaseContext,
    RoleConfig,
    run_config_of,
    select,
)
from skipinject_rollout import weight_sync

if TYPE_CHECKING:
    from skipinject import Loaded, StepCache
from skipinject_rollout.trainer_formats import prompt_fields

from skipinject_rollout_tq.transfer import (
    TRAIN,
    CachedBatch,
    batch_digests,
    inject,
    matched_injection,
    prepare,
    prompt_groups,
    snapshot,
    with_prompts,
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


#: The last step served per cache directory, and what its record says was carried past it.
LastServed = dict[Path, "ServedRecord"]


def _splits(trainer: Any) -> bool:
    return callable(getattr(trainer, "_next_train_batch", None)) and callable(
        getattr(trainer, "_submit_batch_to_rollout", None)
    )


class SubmitPhase:
    """``PPOTrainer._add_batch_to_generate``: fetch the prompts always; inject the cache or submit them.

    The dataloader advances on every step, hit or miss, so the steps after a served one get the
    prompts they would have had without skipping.
    """

    def __init__(self, last_served: LastServed) -> None:
        self.last_served = last_served

    def run(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        if not _splits(call.instance):
            self._cannot_split(role)
            return proceed()
        return self._submit(role, call, step)

    async def run_async(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        if not _splits(call.instance):
            self._cannot_split(role)
            return await proceed()
        import asyncio  # an awaiting caller has it already

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
        if role.settings.action is not Action.match and self._serve(role, call, store, step, uids):
            return
        role.notes(call, step)["prompts_submitted"] = len(uids)  # its refills are counted beside it
        submit_prompts(role, call, step, batch, "submit")

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
        # verl scores V1 trajectories in the rollout: the served ones are scored by this run's reward if the
        # recording's was another (skipinject_rollout.rescore); the reward role, when it serves, wins later.
        from skipinject_rollout import rescore  # a hit's: not imported where the plugin is only loaded
        from skipinject_rollout.reward_identity import reward_identity

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
        self.last_served[store.project_dir] = ServedRecord(step, _count(meta.get("carried_over")))
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
        weight_sync.served(step, meta)
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


def submit_prompts(role: PhaseContext, call: Call, step: int, batch: Any, what: str) -> None:
    """Submit a drawn batch's prompts for generation, noting each prompt's row keys (every recording
    keeps them); with ``action=match`` the prompts whose ``n`` trajectories are cached are put into
    TransferQueue instead, and only the others are submitted."""
    from verl.utils.tensordict_utils import index_select_tensor_dict

    config = run_config_of(call)
    n = rollout_n(config)
    uids = [str(uid) for uid in batch["uid"]]
    notes = role.notes(call, step)
    keys = _prompt_keys(role, call, batch, n)
    if keys is not None:
        notes.setdefault("row_keys", {}).update({uid: keys[i * n : i * n + n] for i, uid in enumerate(uids)})
    served: set[int] = set()
    if keys is not None and role.settings.action is Action.match:
        served = _serve_matched(role, call, step, batch, keys, n, what)
        notes.setdefault("served_uids", set()).update(uids[i] for i in served)
    rest = [i for i in range(len(uids)) if i not in served]
    if not rest:
        return
    notes.setdefault("submitted_at", time.perf_counter())  # its generation time ends with its last sample
    call.instance._submit_batch_to_rollout(batch if not served else index_select_tensor_dict(batch, rest))


def _prompt_keys(role: PhaseContext, call: Call, batch: Any, n: int) -> list[str] | None:
    """Row keys of the batch's prompts, ``n`` per prompt (session ``j`` is the ``j``-th copy, as ``rollout``
    keys verl's interleaved repeat); ``None`` (one warning) when the prompts cannot be keyed."""
    try:
        digests = batch_digests(batch)
        if digests is None:
            raise ValueError("the batch holds no prompt tokens or inputs")
        return role.row_keys(call, [digest for digest in digests for _ in range(n)])
    except Exception as exc:
        role.once(
            ("row_key", type(exc)),
            logging.WARNING,
            "%s: cannot key the prompts (%s: %s); their trajectories are neither matched nor found by a later match",
            role.name,
            type(exc).__name__,
            exc,
        )
        return None


def _serve_matched(
    role: PhaseContext, call: Call, step: int, batch: Any, keys: list[str], n: int, what: str
) -> set[int]:
    """Put the prompts whose ``n`` trajectories are cached into TransferQueue; returns their indices (none, after
    one warning, when the served trajectories cannot be put together: all are submitted then)."""
    uids = [str(uid) for uid in batch["uid"]]
    found = role.match_rows(call, keys, n)  # whole groups only
    served = [i for i in range(len(uids)) if i * n in found.rows]
    pieces: list[Any] = []
    names: list[str] = []
    index_of: dict[int, int] = {}  # a loaded piece's place in ``pieces``, by identity
    rows: list[tuple[int, int]] = []
    counts: dict[str, int] = {}
    for i in served:
        for j in range(n):
            piece, position = found.rows[i * n + j]
            if id(piece) not in index_of:
                index_of[id(piece)] = len(pieces)
                pieces.append(piece)
                names.append(found.sources[i * n + j])
            index = index_of[id(piece)]
            rows.append((index, position))
            counts[names[index]] = counts.get(names[index], 0) + 1
    started = time.perf_counter()
    if served:
        from skipinject_rollout import rescore  # a hit's: not imported where the plugin is only loaded
        from skipinject_rollout.reward_identity import reward_identity

        config = run_config_of(call)
        handles = getattr(getattr(call.instance, "reward_loop_manager", None), "reward_loop_worker_handles", None)
        try:  # trajectories read from a V0 recording take their prompts' fields
            pieces, rows = with_prompts(pieces, rows, n, lambda index: prompt_fields(batch, served[index]))
        except Exception as exc:
            return _cannot_serve(role, step, what, len(served), exc)
        for piece, name in zip(pieces, names, strict=True):  # served rows scored by this run's reward
            meta = found.source_meta.get(name, {})
            rescore.apply_trajectories(
                piece["tensordict"], handles, reward_identity(config), role.name, step, role.settings, meta
            )
        try:
            injection = matched_injection(pieces, rows, [uids[i] for i in served], n, step)
        except Exception as exc:
            return _cannot_serve(role, step, what, len(served), exc)
        inject(injection)
    shown = ", ".join(f"{name} ({count})" for name, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    rest = len(uids) - len(served)
    logger.info(
        "%s step %d: match (%s): %d of %d prompts served (%d trajectories%s) in %.3f s; %s",
        role.name,
        step,
        what,
        len(served),
        len(uids),
        len(served) * n,
        f" from {shown}" if shown else "",
        found.seconds + time.perf_counter() - started,
        f"{rest} submitted for generation" if rest else "rollout not submitted",
    )
    return set(served)


def _cannot_serve(role: PhaseContext, step: int, what: str, prompts: int, exc: Exception) -> set[int]:
    """One warning: the served prompts' trajectories cannot be put together; all are submitted instead."""
    logger.warning(
        "%s step %d: match (%s): cannot put the %d served prompts' trajectories together (%s: %s); submitting them "
        "for generation",
        role.name,
        step,
        what,
        prompts,
        type(exc).__name__,
        exc,
    )
    return set()


def match_caveat(config: Any, settings: RoleConfig) -> str | None:
    """Why ``action=match`` cannot be exact in a run of ``config`` (said once, at the run's start: the role's
    ``caveat``): served groups are finished when submitted, so a mode that samples groups as they finish
    trains them first. ``None`` for another action or the exact mode (``sync``, one mini-batch a step)."""
    if settings.action is not Action.match:
        return None
    mode = select(config, "trainer.v1.trainer_mode", "sync")
    k = parameter_sync_step(config)
    if mode != "sync":
        why = (
            f"trainer.v1.trainer_mode={mode}: the replay buffer samples groups as they finish, across steps, and "
            "served groups are finished when submitted, so they are trained before the generated ones and a "
            "step may train on other prompts than it would have"
        )
    elif k > 1:
        why = (
            f"parameter_sync_step={k}: a step's mini-batches take groups as they finish, and served groups are "
            "finished when submitted, so they fill the first mini-batches"
        )
    else:
        return None
    return f"action=match is not exact with {why}"


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

    def run(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        self.before_refill(role, call, step)
        if role.served(call, step) or not _splits(call.instance):
            return proceed()
        return self._refill(role, call, step)

    async def run_async(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        self.before_refill(role, call, step)
        if role.served(call, step) or not _splits(call.instance):
            return await proceed()
        import asyncio  # an awaiting caller has it already

        return await asyncio.to_thread(self._refill, role, call, step)

    @staticmethod
    def _refill(role: PhaseContext, call: Call, step: int) -> int:
        """What ``_add_prompts_to_generate`` does, its prompts keyed (and matched, with ``action=match``)."""
        batch = call.instance._next_train_batch(call.argument("num_prompts"))
        submit_prompts(role, call, step, batch, "refill")
        return len(batch)

    def before_refill(self, role: PhaseContext, call: Call, step: int) -> None:
        prompts = _count(call.argument("num_prompts"))
        if role.served(call, step):
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
        notes = role.notes(call, step)
        notes.setdefault("refills", []).append(prompts)
        drawn = _drawn(notes)
        logger.info(
            "%s step %d: refill of %d prompts generated (the replay buffer evicted groups); the step has drawn %s "
            "prompts so far",
            role.name,
            step,
            prompts,
            "an unknown number of" if drawn is None else drawn,
        )


class SamplePhase:
    """``ReplayBuffer.sample``: after the real sample, save the train batch of a step generated in this run.

    With ``parameter_sync_step = k`` the trainer samples k mini-batches per step; they become parts
    ``0..k-1`` of one step commit, published only after the k-th, so a step is loadable only whole.
    Its targets are ``every_step``: a sample at any later step tells the engine the run moved past
    an unfinished one, which is then dropped. Parts are copied in the call and written (and the step
    committed) by the engine's background writer.
    """

    def __init__(self, last_served: LastServed) -> None:
        self.last_served = last_served

    def run(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        result = proceed()
        self.after_sample(role, call, step, result)
        return result

    async def run_async(self, role: PhaseContext, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        result = await proceed()
        import asyncio  # an awaiting caller has it already

        await asyncio.to_thread(self.after_sample, role, call, step, result)
        return result

    def after_sample(self, role: PhaseContext, call: Call, step: int, result: Any) -> None:
        """Read the mini-batch back and hand it to the engine as the step's next part; commit after the last.

        The copy is what training sampled, whatever TransferQueue's buffers or the trainer do with
        the data afterwards; the write, fsync and checksums run in the engine's background writer,
        in order with this store's other jobs (the next step's submit waits for them).
        """
        batch = result[0] if isinstance(result, tuple) and result else result
        if getattr(batch, "partition_id", None) != TRAIN:
            return
        if self.last_served:
            self._after_served(role, call, step)
        if not role.settings.allows(step) or role.served(call, step):
            return
        try:
            sampled = snapshot(batch, step)
        except Exception as exc:  # the step misses a part: it is never committed
            role.once(
                ("sample", step),
                logging.WARNING,
                "%s step %d: cannot read the sampled mini-batch back (%s: %s); the step is not cached",
                role.name,
                step,
                type(exc).__name__,
                exc,
            )
            return
        part = role.record(call, step, sampled)
        notes = role.notes(call, step)
        if part is None:
            if role.settings.action is Action.match and role.store_for(call).is_committed(step, siblings=True):
                _keep_generated(role, call, step, sampled, notes)
            return
        notes["trajectories"] = notes.get("trajectories", 0) + len(sampled["keys"])
        notes.setdefault("part_keys", {})[part] = trajectory_keys(notes, sampled["keys"])
        expected = parameter_sync_step(run_config_of(call))
        if part + 1 < expected:
            return
        record = self._record(role, call, step, notes)
        meta = {"parameter_sync_step": expected, "trajectories": notes["trajectories"], **record}
        keyed = [notes["part_keys"].get(index) for index in range(part + 1)]
        if any(keys is not None for keys in keyed):  # a later match finds these trajectories
            meta.update(row_keys=keyed, rows_per_input=[None if keys is None else 1 for keys in keyed])
        submitted = notes.get("submitted_at")
        if isinstance(submitted, float):  # from the submit to the last sample: what a hit of the step saves
            meta["generation_s"] = round(time.perf_counter() - submitted, 6)
        role.commit(call, step, meta, unit="trajectories", note=_describe_record(record))

    def _after_served(self, role: PhaseContext, call: Call, step: int) -> None:
        """Say so when a step generated after a served one misses what the recorded run carried into it.

        In the async modes the recorded run's buffer kept groups of a step (drawn there, finished or
        in flight, not sampled) for the steps after it; a served step drew their prompts but has no
        trajectories for them, so the first generated step after it trains on other prompts.
        """
        project = role.store_for(call).project_dir
        record = self.last_served.get(project)
        if record is None or record.step >= step:
            return
        self.last_served.pop(project, None)
        if record.carried_over and not role.served(call, step):
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

    @staticmethod
    def _record(role: PhaseContext, call: Call, step: int, notes: Mapping[str, Any]) -> dict[str, Any]:
        """What the step's ``meta.json`` says besides its parts, read after its last sample.

        ``prompts_drawn``: prompts the dataloader gave the step (the submit's, ``prompts_submitted``,
        plus each refill's, ``refills``), absent if a draw went unseen; ``carried_over``: prompt
        groups left in the replay buffer for later steps (0 unless groups of earlier steps were in
        it: group filtering's ``sync`` sampling drops its surplus, and refills replace evicted
        groups one for one).
        """
        record: dict[str, Any] = {}
        drawn = _drawn(notes)
        if drawn is not None:
            refills = list(notes.get("refills", ()))
            record.update(prompts_drawn=drawn, prompts_submitted=notes["prompts_submitted"], refills=refills)
        try:
            record["carried_over"] = prompt_groups()
        except Exception as exc:  # the record is still whole without it; the served step then assumes 0
            role.once(
                ("carried", str(role.store_for(call).project_dir)),
                logging.WARNING,
                "%s step %d: cannot count the prompt groups left in the replay buffer (%s: %s); not recorded",
                role.name,
                step,
                type(exc).__name__,
                exc,
            )
        return record


def trajectory_keys(notes: Mapping[str, Any], keys: list[str]) -> list[str] | None:
    """The row key of each sampled trajectory (``{uid}_{session}_{index}``): its prompt's key for that
    session, as noted when the prompt was drawn; ``None`` when a prompt was drawn unseen (another step)."""
    by_uid = notes.get("row_keys", {})
    out = []
    for key in keys:
        uid, _, rest = key.partition("_")
        prompt = by_uid.get(uid)
        session = rest.partition("_")[0]
        if prompt is None or not session.isdigit() or int(session) >= len(prompt):
            return None
        out.append(prompt[int(session)])
    return out


def _keep_generated(
    role: PhaseContext, call: Call, step: int, sampled: Mapping[str, Any], notes: Mapping[str, Any]
) -> None:
    """``match`` at a step committed before (never rewritten): its generated trajectories kept as a rows record."""
    served = notes.get("served_uids", set())
    rows = [row for row, key in enumerate(sampled["keys"]) if key.partition("_")[0] not in served]
    if not rows:
        return
    fresh = role.codec.select_rows(sampled, rows)  # type: ignore[attr-defined]
    keys = trajectory_keys(notes, fresh["keys"])
    if keys is not None:
        role.record_rows(call, step, fresh, keys)


def _drawn(notes: Mapping[str, Any]) -> int | None:
    """The prompts a step drew so far (its submit's and refills'), ``None`` when its submit went unseen."""
    submitted = notes.get("prompts_submitted")
    return None if submitted is None else submitted + sum(notes.get("refills", ()))


class WarmupOff:
    """``PPOTrainer._add_async_warmup_batches`` (verl 0.9.0: the async modes' ``on_train_begin``, which only
    warms up): a no-op while the role is enabled.

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
