"""A rollout batch's rows as people read them (``skipinject cache``): prompt, response, score and length, from
the fields as the cache tool flattens them (``batch.responses``, ``tensordict.rm_scores``...), dense or jagged."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Where verl puts a row's reward: token-level, on the response's tokens (its sum is the score).
SCORE_KEYS = ("rm_scores", "token_level_scores", "token_level_rewards")


@dataclass
class Sample:
    """One row: token ids without padding, the chat prompt (``raw_prompt``) if recorded, the score if scored."""

    prompt_ids: list[int] | None
    chat: Any
    response_ids: list[int]
    score: float | None

    @property
    def length(self) -> int:
        return len(self.response_ids)


def _rows(value: Any) -> list[Any] | None:
    """Per-row tensors of a dense (rows, ...) or jagged tensor; None for anything else."""
    if not hasattr(value, "dtype") or not hasattr(value, "unbind") or value.dim() < 1:
        return None
    return list(value.unbind(0))


def _row(rows: Any, index: int) -> Any:
    return rows[index] if rows is not None and index < len(rows) else None


def samples(fields: Mapping[str, Any]) -> list[Sample] | None:
    """The rows of a rollout batch from its flattened fields; None when it holds no responses."""
    key = next((k for k in fields if k == "responses" or k.endswith(".responses")), None)
    if key is None:
        return None
    value = fields[key]
    responses = _rows(value)
    if responses is None or value.dtype.is_floating_point:
        return None
    prefix = key[: -len("responses")]
    jagged = bool(getattr(value, "is_nested", False))
    masks = _rows(fields.get(prefix + "response_mask"))
    attention = None if jagged else _rows(fields.get(prefix + "attention_mask"))
    if masks is None and attention is not None:
        masks = [row[-int(value.shape[-1]) :] for row in attention]
    prompts = _rows(fields.get(prefix + "prompts"))
    scores = next((_rows(fields[prefix + k]) for k in SCORE_KEYS if fields.get(prefix + k) is not None), None)
    chats = next((v for k, v in fields.items() if k == "raw_prompt" or k.endswith(".raw_prompt")), None)
    out = []
    for index, response in enumerate(responses):
        mask = _row(masks, index)
        kept = response[mask.bool()] if mask is not None and mask.shape == response.shape else response
        prompt, attended = _row(prompts, index), _row(attention, index)
        if prompt is not None and attended is not None:
            prompt = prompt[attended[: prompt.shape[-1]].bool()]
        prompt_ids = None if prompt is None else [int(t) for t in prompt.reshape(-1).tolist()]
        score = _row(scores, index)
        response_ids = [int(t) for t in kept.reshape(-1).tolist()]
        out.append(
            Sample(prompt_ids, _row(chats, index), response_ids, None if score is None else float(score.double().sum()))
        )
    return out


def recorded_model(meta: Mapping[str, Any]) -> str | None:
    """The model directory a step's ``meta.json`` records (``model`` or ``model_path``), or None."""
    for key in ("model", "model_path"):
        value = meta.get(key)
        if isinstance(value, str) and value:
            return value
    return None
