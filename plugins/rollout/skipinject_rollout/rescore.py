"""A served rollout is scored by this run's reward (``skip.<role>.rescore``).

A hit replays what the recorded run *generated*. verl >= 0.7 also scores each trajectory inside the
rollout, so the cached batch carries the recorded run's ``rm_scores`` and reward extra infos. At a
hit, :func:`decide` compares the reward identity recorded with the step
(:mod:`skipinject_rollout.reward_identity`) with this run's:

* ``auto`` (default): equal → served as recorded, bit for bit; different or not recorded (caches
  written before identities were) → re-scored;
* ``always``: re-scored; ``never``: served as recorded (one warning per run when the reward differs).

Re-scoring goes through verl's own reward path: the reward-loop workers the agent loop manager of
this run already holds (``reward_loop_worker_handles``, verl >= 0.9), called exactly as
``RewardLoopManager.compute_rm_score`` calls them, with each served row's inputs as the agent loop
hands them to ``_compute_score``; the scores are placed as the agent loop places them (the last
response token) and the reward extra infos replace the recorded ones (columns, ``reward_extra_info``,
``meta_info["reward_extra_keys"]``). Where the manager holds no reward-loop workers (verl < 0.9, whose
workers score privately, or a colocated reward model), the recorded scores are taken out of the batch:
the trainer then scores the responses itself, as it does for a generation that carries none. A batch
without ``rm_scores`` (worker-group rollouts, verl <= 0.6's sync mode) was never scored in the
rollout: its scores are always this run's trainer's, nothing to do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from skipinject import CacheError, Call, RescorePolicy, RoleConfig, count_rescored

from skipinject_rollout.reward_identity import (
    describe_difference,
    recorded_identity,
    reward_identity,
    unreadable_file,
)

logger = logging.getLogger("skipinject")

#: Non-tensor columns of a generated batch that are no agent-loop extra field (see :func:`_tool_extra_fields`).
_NOT_EXTRA_FIELDS = frozenset({"__num_turns__", "multi_modal_inputs", "reward_extra_info"})
_warned_never: set[tuple[str, str, str]] = set()


@dataclass(frozen=True)
class Decision:
    """Whether served rows are re-scored, and the words saying why."""

    rescore: bool
    why: str
    differs: bool = False


def decide(
    policy: RescorePolicy | str, recorded_meta: Mapping[str, Any], current: Mapping[str, Any] | None
) -> Decision:
    """Re-score or serve as recorded, by ``policy`` and the two rewards' identities."""
    policy = RescorePolicy(policy)
    recorded = recorded_identity(recorded_meta)
    if recorded is None:
        differs, what = True, "recorded by an unknown reward: the cache records none"
    elif current is None:
        differs, what = True, "this run's reward is not known here"
    elif (unread := unreadable_file(current)) is not None:
        differs, what = True, f"this run's reward file cannot be read ({unread})"
    elif (unread := unreadable_file(recorded)) is not None:
        differs, what = True, f"recorded with a reward file that could not be read ({unread})"
    elif recorded.get("digest") == current.get("digest"):
        differs, what = False, "recorded by this run's reward"
    else:
        differs, what = True, "recorded by " + describe_difference(recorded, current)
    if policy is RescorePolicy.never:
        return Decision(False, f"{what}; rescore=never", differs)
    if policy is RescorePolicy.always:
        return Decision(True, f"{what}; rescore=always", differs)
    return Decision(differs, what, differs)


def policy_of(settings: RoleConfig | None) -> RescorePolicy:
    return settings.rescore if settings is not None else RescorePolicy.auto


@dataclass(frozen=True)
class Rescored:
    """What re-scoring did: rows scored again (0: none), seconds, and how."""

    rows: int
    seconds: float
    how: str


def rescore_rows(batch: Any, call: Call, rows: Sequence[int] | None = None) -> Rescored:
    """Score rows ``rows`` (all when ``None``) of the served ``batch`` (a ``DataProto``) with this run's reward,
    in place. See the module's docstring for the paths."""
    started = time.perf_counter()
    tensors = getattr(batch, "batch", None)  # a served value without a tensor batch carries no scores
    if tensors is None or "rm_scores" not in tensors.keys():
        return Rescored(0, 0.0, "no scores recorded with the responses: this run's trainer scores them")
    chosen = list(range(len(batch))) if rows is None else list(rows)
    if not chosen:
        return Rescored(0, 0.0, "no served rows")
    workers = getattr(call.instance, "reward_loop_worker_handles", None)
    if not workers:
        _drop_scores(batch)
        return Rescored(
            len(chosen),
            time.perf_counter() - started,
            "scores taken out: this run's trainer scores them (no reward-loop workers on the rollout manager)",
        )
    outputs = _score_with_workers(list(workers), _scoring_batch(batch, call, chosen))
    _place(batch, chosen, outputs, whole=chosen == list(range(len(batch))))
    return Rescored(len(chosen), time.perf_counter() - started, "by this run's reward-loop workers")


def _scoring_batch(batch: Any, call: Call, rows: list[int]) -> Any:
    """The rows as the agent loop hands a trajectory to a reward-loop worker (``AgentLoopWorker._compute_score``):
    prompt and response tensors, the prompt's dataset fields, its turns and extra fields."""
    import torch
    from verl import DataProto

    inputs = getattr(call.batch, "non_tensor_batch", None) or {}
    ratio = max(1, len(batch) // max(1, len(call.batch))) if inputs else 1
    keys = [
        key
        for key in ("prompts", "responses", "attention_mask", "input_ids", "position_ids")
        if key in batch.batch.keys()
    ]
    tensors = batch.batch.select(*keys)  # the reward's inputs only (no other column is copied)
    if len(rows) != len(batch) or rows != list(range(len(batch))):
        tensors = tensors[torch.as_tensor(rows, dtype=torch.long)]
    non_tensor: dict[str, np.ndarray] = {}
    for key, column in inputs.items():
        if key != "__do_sample__" and len(column) * ratio == len(batch):
            non_tensor[key] = _objects([column[row // ratio] for row in rows])
    served = batch.non_tensor_batch
    if "__num_turns__" in served:
        non_tensor["__num_turns__"] = served["__num_turns__"][rows]
    non_tensor["tool_extra_fields"] = _objects(_tool_extra_fields(batch, rows))
    return DataProto(batch=tensors, non_tensor_batch=non_tensor)


def _objects(values: list[Any]) -> np.ndarray:
    """A 1-D object array of ``values`` (``np.array`` would make lists of messages a second dimension)."""
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


def _tool_extra_fields(batch: Any, rows: list[int]) -> list[dict[str, Any]]:
    """Each row's agent-loop extra fields as they were before scoring (the served columns that are none of
    the reward's or the batch's own; ``None`` values are defaults the agent loop fills in afterwards)."""
    reward_keys = set(batch.meta_info.get("reward_extra_keys") or ())
    keys = [key for key in batch.non_tensor_batch if key not in _NOT_EXTRA_FIELDS and key not in reward_keys]
    extras = []
    for row in rows:
        fields = {key: batch.non_tensor_batch[key][row] for key in keys}
        extras.append({key: value for key, value in fields.items() if value is not None})
    return extras


def _score_with_workers(workers: list[Any], data: Any) -> list[dict[str, Any]]:
    """``RewardLoopManager.compute_rm_score``'s use of the workers: pad to their number, one chunk each."""
    import ray
    from verl.protocol import pad_dataproto_to_divisor

    padded, pad_size = pad_dataproto_to_divisor(data, len(workers))
    chunks = padded.chunk(len(workers))
    replies = [worker.compute_score_batch.remote(chunk) for worker, chunk in zip(workers, chunks, strict=True)]
    # Ray handles reply with object refs; a handle of a worker in this process, with the values themselves.
    outputs = [ray.get(reply) if isinstance(reply, ray.ObjectRef) else reply for reply in replies]
    flat = [item for chunk in outputs for item in chunk]
    return flat[: len(data)] if pad_size else flat


def _place(batch: Any, rows: list[int], outputs: list[dict[str, Any]], *, whole: bool) -> None:
    """Scores at each row's last response token (``AgentLoopWorker._postprocess``), extra infos beside them."""
    import torch

    tensors = batch.batch
    prompt_length = tensors["prompts"].size(1)
    scores = torch.tensor([float(out["reward_score"]) for out in outputs], dtype=tensors["rm_scores"].dtype)
    if whole:  # every row, in order: no row selection (each indexing kernel costs ms on a loaded machine)
        last = tensors["attention_mask"][:, prompt_length:].sum(dim=1) - 1
        rm_scores = torch.zeros_like(tensors["rm_scores"])
        rm_scores.scatter_(1, last.unsqueeze(1), scores.unsqueeze(1))
    else:
        index = torch.as_tensor(rows, dtype=torch.long)
        last = tensors["attention_mask"][index, prompt_length:].sum(dim=1) - 1
        rm_scores = tensors["rm_scores"].clone()
        rm_scores[index] = 0.0
        rm_scores[index, last] = scores
    tensors["rm_scores"] = rm_scores

    infos = [dict(out.get("reward_extra_info") or {}) for out in outputs]
    new_keys = list(infos[0].keys()) if infos else []
    non_tensor = batch.non_tensor_batch
    old_keys = list(batch.meta_info.get("reward_extra_keys") or ())
    if whole:
        for key in old_keys:
            non_tensor.pop(key, None)
        for key in new_keys:
            non_tensor[key] = np.array([info[key] for info in infos])
        keys = new_keys
    else:
        for key in new_keys:
            column = non_tensor.get(key)
            if column is None or len(column) != len(batch):
                column = np.full(len(batch), None, dtype=object)
            elif column.dtype != object and not all(
                np.can_cast(np.asarray(info[key]).dtype, column.dtype) for info in infos
            ):
                column = column.astype(object)
            else:
                column = column.copy()
            for row, info in zip(rows, infos, strict=True):
                column[row] = info[key]
            non_tensor[key] = column
        keys = old_keys + [key for key in new_keys if key not in old_keys]
    if "reward_extra_info" in non_tensor:
        column = non_tensor["reward_extra_info"].copy()
        for row, info in zip(rows, infos, strict=True):
            column[row] = info
        non_tensor["reward_extra_info"] = column
    batch.meta_info["reward_extra_keys"] = keys


def _drop_scores(batch: Any) -> None:
    """Take the recorded scores out, as a generation that scored nothing leaves them: the trainer scores."""
    batch.batch.pop("rm_scores")
    for key in batch.meta_info.pop("reward_extra_keys", None) or ():
        batch.non_tensor_batch.pop(key, None)
    batch.non_tensor_batch.pop("reward_extra_info", None)


def apply(
    batch: Any,
    call: Call,
    role: str,
    step: int,
    settings: RoleConfig | None,
    sources: Sequence[tuple[Mapping[str, Any], Sequence[int] | None]],
) -> Rescored:
    """Decide for each source of served rows (its ``meta.json``, its rows of ``batch``; ``None``: all) and
    re-score the rows whose source says so, in one call: one line saying which."""
    policy = policy_of(settings)
    current = reward_identity(call.run_config)
    decisions = [(decide(policy, meta, current), meta, rows) for meta, rows in sources]
    chosen: list[int] | None = []
    for decision, _, rows in decisions:
        if decision.rescore:
            chosen = None if rows is None or chosen is None else chosen + list(rows)
    rescoring = [decision for decision, _, _ in decisions if decision.rescore]
    if not rescoring:
        differing = [(decision, meta) for decision, meta, _ in decisions if decision.differs]
        decision, meta = differing[0] if differing else (decisions[0][0], decisions[0][1])
        _say_served(role, step, policy, decision, meta, current)
        return Rescored(0, 0.0, decision.why)
    try:
        done = rescore_rows(batch, call, None if chosen is None else sorted(set(chosen)))
    except Exception as exc:
        raise CacheError(
            f"{role} step {step}: cannot score the served responses with this run's reward ({type(exc).__name__}: "
            f"{exc}); set skip.{role}.rescore=never to train on the recorded scores"
        ) from exc
    _say_rescored(role, step, done, rescoring[0].why + (f"; {len(rescoring)} sources" if len(rescoring) > 1 else ""))
    return done


# ------------------------------------------------------------ V1 trajectories (TransferQueue)

#: Fields of a V1 trajectory that the agent loop's output made (``AgentLoopOutput.as_dict`` and
#: ``AgentLoopWorkerTQ._agent_loop_postprocess``); every other field is one of the prompt's, as the
#: agent loop hands them to the reward (``**kwargs``).
_TRAJECTORY_OUTPUTS = frozenset(
    {
        "prompts",
        "responses",
        "response_mask",
        "loss_mask",
        "input_ids",
        "position_ids",
        "attention_mask",
        "rollout_log_probs",
        "routed_experts",
        "rm_scores",
        "num_turns",
        "metrics",
        "extra_fields",
        "multi_modal_inputs",
        "mm_processor_kwargs",
        "mm_processor_output",
        "teacher_ids",
        "teacher_logprobs",
    }
)


def rescore_trajectories(fields: Any, workers: Sequence[Any] | None) -> Rescored:
    """Score the V1 trajectories ``fields`` (a TensorDict, one row each, jagged token fields) with this run's
    reward, in place: each row as ``AgentLoopWorker._compute_score`` hands it to a reward-loop worker, the
    score on its last response token of ``rm_scores`` (``AgentLoopOutput.as_dict``), the extra infos in
    ``extra_fields["reward_extra_info"]``. Without workers the V1 trainer scores every sampled batch
    itself (``reward_loop_worker_handles is None``): the scores are this run's already."""
    started = time.perf_counter()
    if "rm_scores" not in fields.keys():
        return Rescored(0, 0.0, "no scores recorded with the trajectories: this run's trainer scores them")
    if not workers:
        return Rescored(0, 0.0, "no reward-loop workers: this run's trainer scores every sampled batch itself")
    import torch
    from tensordict import NonTensorStack

    rows = int(fields.batch_size[0])
    prompts = list(fields["prompts"].unbind(0))
    responses = list(fields["responses"].unbind(0))
    outputs = _score_with_workers(list(workers), _trajectory_scoring_batch(fields, prompts, responses, rows))
    scores = [torch.zeros(len(response), dtype=torch.float32) for response in responses]
    for score, out in zip(scores, outputs, strict=True):
        score[-1] = float(out["reward_score"])
    # the layout verl's list_of_dict_to_tensordict gives them: stacked when all rows have one length
    jagged = fields["rm_scores"].is_nested
    fields["rm_scores"] = torch.nested.as_nested_tensor(scores, layout=torch.jagged) if jagged else torch.stack(scores)
    extras = [dict(extra or {}) for extra in _column(fields, "extra_fields", rows)]
    for extra, out in zip(extras, outputs, strict=True):
        extra["reward_extra_info"] = dict(out.get("reward_extra_info") or {})
    fields["extra_fields"] = NonTensorStack(*extras)
    return Rescored(rows, time.perf_counter() - started, "by this run's reward-loop workers")


def _column(fields: Any, key: str, rows: int) -> list[Any]:
    """Field ``key`` of each row: a stack of values, one value shared by all rows, or a tensor's rows."""
    import torch
    from tensordict import NonTensorData, NonTensorStack

    if key not in fields.keys():
        return [None] * rows
    value = fields.get(key)
    if isinstance(value, NonTensorStack):
        values = list(value.tolist())
    elif isinstance(value, NonTensorData):
        return [value.data] * rows
    elif isinstance(value, torch.Tensor):
        values = list(value.unbind(0)) if value.dim() else [value] * rows
    else:
        return [value] * rows
    return values if len(values) == rows else [value] * rows


def _trajectory_scoring_batch(fields: Any, prompts: list[Any], responses: list[Any], rows: int) -> Any:
    """The trajectories as one padded batch (prompts left-, responses right-padded, as a generated V0 batch is):
    the reward managers find each response's valid tokens from the attention mask."""
    import torch
    from verl import DataProto

    prompt_width = max(len(p) for p in prompts)
    response_width = max(len(r) for r in responses)
    prompt_ids = torch.zeros(rows, prompt_width, dtype=torch.int64)
    response_ids = torch.zeros(rows, response_width, dtype=torch.int64)
    attention = torch.zeros(rows, prompt_width + response_width, dtype=torch.int64)
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[row, prompt_width - len(prompt) :] = prompt
        response_ids[row, : len(response)] = response
        attention[row, prompt_width - len(prompt) : prompt_width + len(response)] = 1
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    position_ids = torch.clamp(torch.cumsum(attention, dim=1) - 1, min=0)
    tensors = {
        "prompts": prompt_ids,
        "responses": response_ids,
        "attention_mask": attention,
        "input_ids": input_ids,
        "position_ids": position_ids,
    }
    extras = _column(fields, "extra_fields", rows)
    non_tensor: dict[str, np.ndarray] = {}
    for key in fields.keys():
        if key in _TRAJECTORY_OUTPUTS or isinstance(fields.get(key), torch.Tensor):
            continue
        non_tensor[key] = _objects(_column(fields, key, rows))
    turns = _column(fields, "num_turns", rows)
    non_tensor["__num_turns__"] = np.asarray([int(t) if t is not None else 0 for t in turns], dtype=np.int32)
    non_tensor["tool_extra_fields"] = _objects(
        [{k: v for k, v in (extra or {}).items() if k != "reward_extra_info"} for extra in extras]
    )
    non_tensor["prompt_len"] = np.asarray([len(p) for p in prompts])
    non_tensor["response_len"] = np.asarray([len(r) for r in responses])
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensor)


def apply_trajectories(
    fields: Any,
    workers: Sequence[Any] | None,
    current: Mapping[str, Any] | None,
    role: str,
    step: int,
    settings: RoleConfig | None,
    recorded_meta: Mapping[str, Any],
) -> Rescored:
    """:func:`apply` for V1 trajectories (``current``: this run's reward identity)."""
    policy = policy_of(settings)
    decision = decide(policy, recorded_meta, current)
    if not decision.rescore:
        _say_served(role, step, policy, decision, recorded_meta, current)
        return Rescored(0, 0.0, decision.why)
    try:
        done = rescore_trajectories(fields, workers)
    except Exception as exc:
        raise CacheError(
            f"{role} step {step}: cannot score the served trajectories with this run's reward ({type(exc).__name__}: "
            f"{exc}); set skip.{role}.rescore=never to train on the recorded scores"
        ) from exc
    _say_rescored(role, step, done, decision.why)
    return done


def _say_served(
    role: str,
    step: int,
    policy: RescorePolicy,
    decision: Decision,
    recorded_meta: Mapping[str, Any],
    current: Mapping[str, Any] | None,
) -> None:
    if decision.differs and policy is RescorePolicy.never:
        key = (role, str((recorded_identity(recorded_meta) or {}).get("digest")), str((current or {}).get("digest")))
        if key not in _warned_never:
            _warned_never.add(key)
            logger.warning(
                "%s step %d: the served rewards were not computed by this run's reward (%s): training on them "
                "as recorded",
                role,
                step,
                decision.why,
            )
            return
    logger.info("%s step %d: rewards served as recorded (%s)", role, step, decision.why)


def _say_rescored(role: str, step: int, done: Rescored, why: str) -> None:
    """The line, and the rows counted in the run's summary (here for every trainer: a fully async sample's
    ``meta_info`` cannot carry them)."""
    count_rescored(role, done.rows)
    if done.rows:
        logger.info(
            "%s step %d: %d rows re-scored %s in %.3f s (%s)", role, step, done.rows, done.how, done.seconds, why
        )
    else:
        logger.info("%s step %d: nothing re-scored: %s (%s)", role, step, done.how, why)
