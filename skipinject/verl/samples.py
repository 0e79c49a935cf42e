"""A rollout batch's rows as people read them (``skipinject cache``): prompt, response, score and length.

Works on the fields as the cache tool flattens them (``batch.responses``, a V1 sample's
``tensordict.rm_scores``...), for dense padded tensors (the mask says which tokens count) and jagged ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RESPONSES = "responses"
PROMPTS = "prompts"
RESPONSE_MASK = "response_mask"
ATTENTION_MASK = "attention_mask"
#: Where verl puts a row's reward: token-level, on the response's tokens (its sum is the score).
SCORE_KEYS = ("rm_scores", "token_level_scores", "token_level_rewards")
#: The prompt as chat messages (shown when no tokenizer decodes the prompt's ids).
CHAT_PROMPT = "raw_prompt"
#: A recorded run's model directory (its tokenizer decodes the rows), where ``meta.json`` records it.
MODEL_KEYS = ("model", "model_path")


@dataclass
class Sample:
    """One row: token ids without padding, the chat prompt if recorded, the score if scored."""

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


def samples(fields: Mapping[str, Any]) -> list[Sample] | None:
    """The rows of a rollout batch from its flattened fields; None when it holds no responses."""
    key = next((k for k in fields if k == RESPONSES or k.endswith(f".{RESPONSES}")), None)
    if key is None:
        return None
    value = fields[key]
    responses = _rows(value)
    if responses is None or value.dtype.is_floating_point:
        return None
    prefix = key[: -len(RESPONSES)]
    jagged = bool(getattr(value, "is_nested", False))
    width = 0 if jagged else int(value.shape[-1])
    masks = _rows(fields.get(prefix + RESPONSE_MASK))
    attention = _rows(fields.get(prefix + ATTENTION_MASK))
    if masks is None and attention is not None and not jagged:
        masks = [row[-width:] for row in attention]
    prompts = _rows(fields.get(prefix + PROMPTS))
    scores = next((_rows(fields[prefix + k]) for k in SCORE_KEYS if fields.get(prefix + k) is not None), None)
    chats = next((v for k, v in fields.items() if k == CHAT_PROMPT or k.endswith(f".{CHAT_PROMPT}")), None)
    out = []
    for index, response in enumerate(responses):
        mask = masks[index] if masks is not None and index < len(masks) else None
        kept = response[mask.bool()] if mask is not None and mask.shape == response.shape else response
        prompt_ids = None
        if prompts is not None and index < len(prompts):
            prompt = prompts[index]
            if attention is not None and not jagged and index < len(attention):
                prompt = prompt[attention[index][: prompt.shape[-1]].bool()]
            prompt_ids = [int(t) for t in prompt.reshape(-1).tolist()]
        score = None
        if scores is not None and index < len(scores):
            score = float(scores[index].double().sum())
        chat = chats[index] if chats is not None and index < len(chats) else None
        out.append(Sample(prompt_ids, chat, [int(t) for t in kept.reshape(-1).tolist()], score))
    return out


def recorded_model(meta: Mapping[str, Any]) -> str | None:
    """The model directory a step's ``meta.json`` records (where a rollout role records it), or None."""
    for key in MODEL_KEYS:
        value = meta.get(key)
        if isinstance(value, str) and value:
            return value
    return None
