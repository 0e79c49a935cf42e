"""A recording of one verl trainer served to the other by ``action=match``: V0 rows <-> V1 trajectories.

verl 0.9's agent loop makes both from one ``AgentLoopOutput``. The V0 worker pads it
(``AgentLoopWorker._agent_loop_postprocess`` and ``_postprocess``: the prompt left-padded to
``rollout.prompt_length`` and the response right-padded to ``rollout.response_length`` with the pad
token, masks, positions of the mask, the reward on the last response token, the ``extra_fields`` as
columns). The V1 worker (``AgentLoopWorkerTQ._agent_loop_postprocess``) puts it into TransferQueue
unpadded, with the prompt's own fields and per-trajectory tags. Each field here is derived from the
other format as verl derives it, bit for bit; a field that cannot be raises :class:`CodecError` naming
it and why (``action=match`` then generates those rows, one line says so). Nothing a trainer reads
is made up: a field the recording lacks and this run needs is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from skipinject import CodecError, select

#: ``extra_fields`` keys verl's V0 ``_postprocess`` fills with ``None`` for a row whose agent loop set none.
DEFAULT_EXTRA = ("turn_scores", "tool_rewards", "min_global_steps", "max_global_steps", "extras")
#: V0 columns that are not ``extra_fields`` of the row: the turns, the multi-modal inputs, and the prompt
#: (``_agent_loop_postprocess`` writes it among the extra fields from the prompt's own).
OWN_COLUMNS = ("__num_turns__", "multi_modal_inputs", "raw_prompt")
#: Fields whose padded and unpadded forms verl does not derive from each other.
UNCARRIED = {
    "routed_experts": "the V0 row places the router's records at the prompt's start, the V1 trajectory cuts "
    "them to the sequence: which rows the router recorded past it is not kept",
    "teacher_ids": "the teacher's top-k outputs are padded by the teacher loop with its own rules",
    "teacher_logprobs": "the teacher's top-k outputs are padded by the teacher loop with its own rules",
}
#: What the V1 agent loop's ``AgentLoopMetrics`` holds when nothing was measured (V0 keeps no per-row metrics).
UNMEASURED = {"generate_sequences": 0.0, "tool_calls": 0.0, "compute_score": 0.0, "num_preempted": -1}
#: Marks a V1 piece converted from V0 rows: the prompt's own fields are this submit's (added where it is known).
FROM_V0 = "from_v0"


def cannot(field: str, why: str) -> CodecError:
    return CodecError(f"field {field!r} cannot be carried exactly between the trainers' formats: {why}")


def needs_log_probs(config: Any) -> bool:
    """Whether this run's agent loop returns ``rollout_log_probs`` (``rollout.calculate_log_probs``)."""
    return bool(select(config, "actor_rollout_ref.rollout.calculate_log_probs", False))


def _positions(mask: Any) -> Any:
    from verl.utils.model import compute_position_id_with_mask

    return compute_position_id_with_mask(mask)


def _check_uncarried(names: Any) -> None:
    for name, why in UNCARRIED.items():
        if name in names:
            raise cannot(name, why)


# ---------------------------------------------------------------- V0 DataProto rows -> V1 trajectories


def trajectories_from_v0(data: Any, log_probs: bool) -> dict[str, Any]:
    """A V0 recording's rows as V1 trajectories: ``{"rows": [fields], "keys", "tags", FROM_V0: True}``, one
    per row in its order, each with the fields the V1 agent loop derives from its generation (the
    prompt's own fields are this submit's: :func:`with_prompt_fields`). ``log_probs``: this run needs them."""
    import torch

    batch = data.batch
    names = set() if batch is None else set(batch.keys())
    _check_uncarried(names)
    for name in ("prompts", "responses", "response_mask", "attention_mask", "input_ids", "position_ids"):
        if name not in names:
            raise cannot(name, "the V0 recording does not hold it")
    if "rm_scores" not in names:
        raise cannot(
            "rm_scores",
            "the V0 recording's agent loop scored no trajectory (its reward was computed after generation), and a "
            "V1 trajectory carries its reward",
        )
    if log_probs and "rollout_log_probs" not in names:
        raise cannot("rollout_log_probs", "this run computes them in the rollout and the V0 recording has none")
    columns = data.non_tensor_batch
    reward_keys = list(data.meta_info.get("reward_extra_keys", ()))
    if "__num_turns__" not in columns:
        raise cannot("num_turns", "the V0 recording holds no __num_turns__")
    width = int(batch["prompts"].shape[1])
    rows, keys, tags = [], [], []
    for row in range(len(data)):
        mask = batch["attention_mask"][row]
        prompt_mask, response_mask = mask[:width].bool(), mask[width:].bool()
        prompt_len, response_len = int(prompt_mask.sum()), int(response_mask.sum())
        if not (bool(prompt_mask[width - prompt_len :].all()) and bool(response_mask[:response_len].all())):
            raise cannot("attention_mask", "the prompt is not left-padded or the response not right-padded")
        if response_len == 0:
            raise cannot("rm_scores", "an empty response has no last token to hold its reward")
        prompt, response = batch["prompts"][row], batch["responses"][row]
        if not torch.equal(batch["input_ids"][row], torch.cat([prompt, response])):
            raise cannot("input_ids", "not the padded prompt and response side by side")
        positions = batch["position_ids"][row]
        if positions.dim() != 1 or not torch.equal(positions, _positions(mask.unsqueeze(0))[0]):
            raise cannot(
                "position_ids",
                "not the positions of the attention mask (multi-modal rotary positions are computed on the padded "
                "sequence)",
            )
        mm_inputs = columns["multi_modal_inputs"][row] if "multi_modal_inputs" in columns else {}
        if mm_inputs:
            raise cannot("multi_modal_inputs", "the processor's inputs are computed on the padded sequence")
        ids = torch.cat([prompt[width - prompt_len :], response[:response_len]])
        padded_mask = batch["response_mask"][row]
        if bool(padded_mask[response_len:].any()):
            raise cannot("response_mask", "set on padding")
        fields: dict[str, Any] = {
            "prompts": prompt[width - prompt_len :].clone(),
            "responses": response[:response_len].clone(),
            "response_mask": padded_mask[:response_len].clone(),
        }
        if log_probs:
            fields["rollout_log_probs"] = batch["rollout_log_probs"][row][:response_len].clone()
        fields["rm_scores"] = batch["rm_scores"][row][:response_len].clone()
        fields["num_turns"] = int(columns["__num_turns__"][row])
        fields["metrics"] = dict(UNMEASURED)
        extra = {
            key: column[row] for key, column in columns.items() if key not in OWN_COLUMNS and key not in reward_keys
        }
        fields["extra_fields"] = {
            key: value for key, value in extra.items() if not (key in DEFAULT_EXTRA and value is None)
        }
        fields["loss_mask"] = fields["response_mask"]
        fields["input_ids"] = ids
        fields["position_ids"] = _positions(torch.ones(1, len(ids), dtype=torch.int64))[0]
        fields["multi_modal_inputs"] = {}
        rows.append(fields)
        keys.append(f"v0-{row}_0_0")
        tags.append(
            {
                "status": "success",
                "prompt_len": prompt_len,
                "response_len": response_len,
                "seq_len": prompt_len + response_len,
                "global_steps": None,
                "min_global_steps": extra.get("min_global_steps"),
                "max_global_steps": extra.get("max_global_steps"),
            }
        )
    return {"rows": rows, "keys": keys, "tags": tags, FROM_V0: True}


def select_v0_rows(piece: Mapping[str, Any], rows: Sequence[int]) -> dict[str, Any]:
    picked = list(rows)
    return {
        **piece,
        "rows": [piece["rows"][row] for row in picked],
        "keys": [piece["keys"][row] for row in picked],
        "tags": [piece["tags"][row] for row in picked],
    }


def prompt_fields(batch: Any, index: int) -> dict[str, Any]:
    """What the V1 agent loop worker takes of a submitted prompt (``AgentLoopWorkerTQ.generate_sequences``):
    every field of its row but those it consumes (the agent's name, ``n``, whether it samples)."""
    import torch
    from tensordict import NonTensorData, NonTensorStack

    fields: dict[str, Any] = {}
    for key, value in batch.items():
        if key in ("agent_name", "__rollout_n__", "__do_sample__", "validate"):
            continue
        if isinstance(value, torch.Tensor):
            fields[key] = value[index]
        elif isinstance(value, NonTensorStack):
            fields[key] = value[index].data
        elif isinstance(value, NonTensorData):
            fields[key] = value.data
    return fields


def with_prompt_fields(
    piece: Mapping[str, Any], prompts: Sequence[dict[str, Any]], sessions: Sequence[int]
) -> dict[str, Any]:
    """A converted piece (:func:`trajectories_from_v0`) as the V1 agent loop writes it: row ``r`` is session
    ``sessions[r]`` of the prompt whose fields are ``prompts[r]`` (:func:`prompt_fields`); the fields the
    loop derives from its generation are set after them, as it sets them."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    rows = []
    for generated, prompt, session in zip(piece["rows"], prompts, sessions, strict=True):
        fields = {key: value for key, value in generated.items() if key not in LAST}
        fields.update(prompt)
        fields["session_id"] = session
        fields.update({key: generated[key] for key in LAST})
        rows.append(fields)
    return {"tensordict": list_of_dict_to_tensordict(rows), "keys": list(piece["keys"]), "tags": list(piece["tags"])}


#: Set by the V1 agent loop after the prompt's fields (they win over a prompt field of the same name).
LAST = ("loss_mask", "input_ids", "position_ids", "multi_modal_inputs")


# ---------------------------------------------------------------- V1 trajectories -> V0 DataProto rows


@functools.lru_cache(maxsize=4)
def _pad_token_id(path: str, trust_remote_code: bool) -> int:
    from verl.utils import hf_tokenizer
    from verl.utils.fs import copy_to_local

    tokenizer = hf_tokenizer(copy_to_local(path), trust_remote_code=trust_remote_code)
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)


def pad_token_id(config: Any) -> int:
    """The pad token verl's agent loop pads with: its tokenizer's (``model.tokenizer_path``, else ``model.path``)."""
    path = select(config, "actor_rollout_ref.model.tokenizer_path", None) or select(
        config, "actor_rollout_ref.model.path", None
    )
    if not path:
        raise cannot("prompts", "this run names no model whose tokenizer gives the pad token")
    try:
        return _pad_token_id(str(path), bool(select(config, "actor_rollout_ref.model.trust_remote_code", False)))
    except Exception as exc:
        raise cannot("prompts", f"the pad token of {path} is not known ({type(exc).__name__}: {exc})") from exc


def _values(value: Any) -> list[Any]:
    """A TensorDict field's rows: tensors (jagged or dense) unbound, non-tensors as their values."""
    import torch

    if isinstance(value, torch.Tensor):
        return list(value.unbind(0))
    return list(value.tolist()) if hasattr(value, "tolist") else list(value)  # a NonTensorStack, or a list


def v0_rows_from_trajectories(
    result: Mapping[str, Any], config: Any, scores_in_loop: bool
) -> Any:  # verl.protocol.DataProto
    """A V1 recording's trajectories as the V0 agent loop manager returns rows (one per trajectory, in its
    order), padded to this run's ``rollout.prompt_length`` / ``response_length`` with its tokenizer's pad
    token. ``scores_in_loop``: this run's agent loop scores its rows (``reward_loop_worker_handles``)."""
    import numpy as np
    import torch
    from tensordict import TensorDict
    from verl.protocol import DataProto

    data = result["tensordict"]
    names = set(data.keys())
    _check_uncarried(names)
    if not scores_in_loop:
        raise cannot(
            "rm_scores",
            "this run's agent loop scores no row (the reward is computed after generation: a V0 row then carries "
            "the call's inputs instead), while the V1 recording carries its reward",
        )
    for name in ("prompts", "responses", "response_mask", "rm_scores", "num_turns", "extra_fields", "raw_prompt"):
        if name not in names:
            raise cannot(name, "the V1 recording does not hold it")
    log_probs = needs_log_probs(config)
    if log_probs and "rollout_log_probs" not in names:
        raise cannot("rollout_log_probs", "this run computes them in the rollout and the V1 recording has none")
    prompt_width = int(
        select(config, "actor_rollout_ref.rollout.prompt_length", None) or select(config, "data.max_prompt_length")
    )
    response_width = int(
        select(config, "actor_rollout_ref.rollout.response_length", None) or select(config, "data.max_response_length")
    )
    pad = pad_token_id(config)
    prompts, responses = _values(data["prompts"]), _values(data["responses"])
    masks, scores = _values(data["response_mask"]), _values(data["rm_scores"])
    logps = _values(data["rollout_log_probs"]) if log_probs else []
    extras = _values(data["extra_fields"])
    rows = len(prompts)
    if "position_ids" in names and any(p.dim() != 1 for p in _values(data["position_ids"])):
        raise cannot("position_ids", "multi-modal rotary positions are computed on the padded sequence")
    if "multi_modal_inputs" in names and any(_values(data["multi_modal_inputs"])):
        raise cannot("multi_modal_inputs", "the processor's inputs are computed on the padded sequence")
    padded: dict[str, list[Any]] = {key: [] for key in ("prompts", "responses", "response_mask", "attention_mask")}
    padded.update(rm_scores=[], rollout_log_probs=[])
    for row in range(rows):
        prompt, response = prompts[row], responses[row]
        if len(prompt) > prompt_width or len(response) > response_width:
            raise cannot("prompts", f"longer than this run's widths ({prompt_width}, {response_width})")
        left, right = prompt_width - len(prompt), response_width - len(response)
        padded["prompts"].append(torch.cat([torch.full((left,), pad, dtype=torch.int64), prompt.to(torch.int64)]))
        padded["responses"].append(torch.cat([response.to(torch.int64), torch.full((right,), pad, dtype=torch.int64)]))
        padded["attention_mask"].append(
            torch.cat(
                [
                    torch.zeros(left, dtype=torch.int64),
                    torch.ones(len(prompt) + len(response), dtype=torch.int64),
                    torch.zeros(right, dtype=torch.int64),
                ]
            )
        )
        padded["response_mask"].append(torch.cat([masks[row].to(torch.int64), torch.zeros(right, dtype=torch.int64)]))
        padded["rm_scores"].append(torch.cat([scores[row].to(torch.float32), torch.zeros(right, dtype=torch.float32)]))
        if log_probs:
            padded["rollout_log_probs"].append(
                torch.cat([logps[row].to(torch.float32), torch.zeros(right, dtype=torch.float32)])
            )
    prompt_ids, response_ids = torch.stack(padded["prompts"]), torch.stack(padded["responses"])
    attention = torch.stack(padded["attention_mask"])
    tensors = {
        "prompts": prompt_ids,
        "responses": response_ids,
        "response_mask": torch.stack(padded["response_mask"]),
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention,
        "position_ids": _positions(attention),
        "rm_scores": torch.stack(padded["rm_scores"]),
    }
    if log_probs:
        tensors["rollout_log_probs"] = torch.stack(padded["rollout_log_probs"])
    non_tensor: dict[str, Any] = {
        "__num_turns__": np.array([int(turns) for turns in _values(data["num_turns"])], dtype=np.int32)
    }
    infos = [dict(extra or {}).get("reward_extra_info", {}) or {} for extra in extras]
    reward_keys = list(infos[0].keys()) if infos else []
    if any(set(info) != set(reward_keys) for info in infos):
        raise cannot("extra_fields", "the trajectories' reward_extra_info differ in their keys")
    for key in reward_keys:
        non_tensor[key] = np.array([info[key] for info in infos])
    if "multi_modal_inputs" in names:
        non_tensor["multi_modal_inputs"] = _objects(_values(data["multi_modal_inputs"]))
    raw_prompts = _values(data["raw_prompt"])
    row_extras = [{**dict(extra or {}), "raw_prompt": raw_prompts[row]} for row, extra in enumerate(extras)]
    for key in {key for extra in row_extras for key in extra} | set(DEFAULT_EXTRA):
        non_tensor[key] = _objects([extra.get(key) for extra in row_extras])
    return DataProto(
        batch=TensorDict(tensors, batch_size=rows),
        non_tensor_batch=non_tensor,
        meta_info={"reward_extra_keys": reward_keys},
    )


def _objects(values: list[Any]) -> Any:
    import numpy as np

    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column
