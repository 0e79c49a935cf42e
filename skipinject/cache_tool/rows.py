"""A rollout step's rows for ``show`` and ``diff``: prompt, response, score and length, decoded.

What the rows are is verl's business (:mod:`skipinject.verl.samples`); here they are decoded (with
``--tokenizer``, else the recorded model's tokenizer when ``meta.json`` names a local directory that
exists, else shown as shortened token ids), compared and summed up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from skipinject.cache_tool.common import CommandError, shorten
from skipinject.store.local import LocalFiles
from skipinject.verl.samples import Sample, recorded_model, samples

#: Token ids shown of a row without a tokenizer.
SHOWN_IDS = 8
#: Characters of a decoded prompt or response shown per row.
WIDTH = 80

Decode = Callable[[Sequence[int]], str]


def tokenizer(path: str | None, meta: Mapping[str, Any]) -> tuple[Decode | None, str | None]:
    """The decoder of ``path`` (``--tokenizer``: failing to load it is a one-line error), else of the
    recorded model's directory when it exists here (failing quietly), and where it came from."""
    chosen = path or recorded_model(meta)
    if chosen is None or (path is None and (LocalFiles().stat(Path(chosen), follow=True) or ("",))[0] != "directory"):
        return None, None
    try:
        from transformers import AutoTokenizer

        loaded = AutoTokenizer.from_pretrained(chosen, local_files_only=True)
    except Exception as exc:
        if path is None:
            return None, None
        raise CommandError(f"cannot load a tokenizer from {path} ({type(exc).__name__}: {exc})") from exc
    return (lambda ids: str(loaded.decode(list(ids), skip_special_tokens=True))), chosen


def ids_text(ids: Sequence[int]) -> str:
    shown = " ".join(str(i) for i in ids[:SHOWN_IDS])
    return f"[{shown}{' …' if len(ids) > SHOWN_IDS else ''}] ({len(ids)} ids)"


def _chat_text(chat: Any) -> str | None:
    """The last message's content of a chat prompt (verl's ``raw_prompt``), else None."""
    messages = list(chat) if isinstance(chat, (list, tuple)) or hasattr(chat, "tolist") else None
    if messages and isinstance(messages[-1], Mapping) and isinstance(messages[-1].get("content"), str):
        return str(messages[-1]["content"])
    return chat if isinstance(chat, str) else None


def shown_row(index: int, sample: Sample, decode: Decode | None) -> dict[str, Any]:
    """A row's JSON record: prompt and response decoded (else the chat, else token ids), shortened."""
    if decode is not None and sample.prompt_ids is not None:
        prompt = decode(sample.prompt_ids)
    else:
        chat = _chat_text(sample.chat)
        prompt = chat if chat is not None else ids_text(sample.prompt_ids) if sample.prompt_ids is not None else "-"
    response = decode(sample.response_ids) if decode is not None else ids_text(sample.response_ids)
    prompt, response = (shorten(" ".join(text.split()), WIDTH) for text in (prompt, response))
    return {"row": index, "prompt": prompt, "response": response, "score": sample.score, "length": sample.length}


def step_samples(flat: Mapping[str, Any]) -> list[Sample] | None:
    try:
        return samples(flat)
    except Exception:  # a batch that is not verl's after all: no rows to show
        return None


def means(found: Sequence[Sample]) -> dict[str, float | None]:
    scores = [s.score for s in found if s.score is not None]
    return {
        "mean_score": sum(scores) / len(scores) if scores else None,
        "mean_length": sum(s.length for s in found) / len(found) if found else None,
    }


def same_row(a: Sample, b: Sample) -> bool:
    """Identical prompt (ids, else the chat) and response."""
    prompt_a = a.prompt_ids if a.prompt_ids is not None else _chat_text(a.chat)
    prompt_b = b.prompt_ids if b.prompt_ids is not None else _chat_text(b.chat)
    return prompt_a == prompt_b and a.response_ids == b.response_ids
