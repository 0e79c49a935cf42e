"""What a loaded step holds: decoded by the role's own codec, flattened into fields, compared; a rollout's
rows (what they are is :mod:`skipinject.verl.samples`'s business) decoded by ``--tokenizer``, else the
recorded model's local tokenizer, else shown as token ids."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from skipinject.cache_tool.common import CommandError, shorten
from skipinject.roles import Call, MergingCodec
from skipinject.store import Payload, StepMeta, bounded_dir_problem, local_kind
from skipinject.verl.samples import Sample, recorded_model, samples

if TYPE_CHECKING:
    from skipinject.cache_tool.plugins import InstalledRoles

#: Token ids shown of a row without a tokenizer, and characters of a decoded prompt or response.
SHOWN_IDS, WIDTH = 8, 80
Decode = Callable[[Sequence[int]], str]


class Decoded(NamedTuple):
    """A step as the engine would replay it, by which codec, and why it is raw when it is."""

    value: Any
    codec: str
    note: str | None = None


def decode(payloads: Sequence[Payload], meta: StepMeta, roles: InstalledRoles) -> Decoded:
    """The step decoded by its role's own codec, parts merged as the engine merges them, calls one by one
    (``call1``, ...). Without the role's plugin, by skipinject's codec its header names, else raw."""
    from skipinject.verl.codecs import codec_named

    role = meta.role if meta.role is not None else "-"
    codec = roles.codec(role)
    if codec is None:
        names = {header if isinstance(header := p.objects.get("codec"), str) else None for p in payloads}
        codec = codec_named(names.pop()) if len(names) == 1 else None
        if codec is None:
            return Decoded(_raw(payloads), "raw", roles.missing(role, meta))
    name = getattr(codec, "name", None)  # the built-ins' header, else the class
    name = name if isinstance(name, str) and name else type(codec).__name__
    call = Call(target=f"skipinject cache ({role})", function=decode, instance=None, args=(), kwargs={})
    try:  # outside a run: no instance, no arguments (a codec that needs them fails, and the step is raw)
        values = [codec.decode(p, call) for p in payloads]
        calls = meta.call_count
        if len(values) == 1:
            return Decoded(values[0], name)
        if calls is not None and calls > 1:
            return Decoded({f"call{i + 1}": v for i, v in enumerate(values)}, name)
        if isinstance(codec, MergingCodec):
            with contextlib.suppress(Exception):  # parts it cannot merge are shown one by one
                return Decoded(codec.merge(values), name)
        return Decoded({f"part{i}": v for i, v in enumerate(values)}, name)
    except Exception as exc:  # a codec that needs the run's call, or a payload it refuses
        why = " ".join(str(exc).split())[:200]
        note = f"the role's codec {name} did not decode it here ({type(exc).__name__}: {why}); shown raw"
        return Decoded(_raw(payloads), "raw", note)


def _raw(payloads: Sequence[Payload]) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    for index, payload in enumerate(payloads):
        prefix = f"part{index}." if len(payloads) > 1 else ""
        raw.update({f"{prefix}tensors.{key}": tensor for key, tensor in payload.tensors.items()})
        raw.update({f"{prefix}objects.{key}": value for key, value in payload.objects.items()})
    return raw


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Leaf fields by dotted name: tensors, numpy arrays, lists and plain values."""
    from skipinject.verl.codecs import is_tensordict, verl_fields

    found = verl_fields(value, prefix, flatten)
    if found is not None:
        return found
    nested = isinstance(value, Mapping) and not prefix.startswith("objects.") and all(isinstance(k, str) for k in value)
    containers = nested and any(type(v).__name__ in ("Tensor", "ndarray") or is_tensordict(v) for v in value.values())
    if nested and (not prefix or containers):
        return {name: leaf for key, item in value.items() for name, leaf in flatten(item, f"{prefix}{key}.").items()}
    if not prefix and isinstance(value, tuple):  # a codec's result of several values, e.g. (tensor, dict)
        return {name: leaf for index, item in enumerate(value) for name, leaf in flatten(item, f"{index}.").items()}
    return {prefix.rstrip(".") or "value": value}


def _jagged(value: Any) -> bool:
    return bool(getattr(value, "is_nested", False))


def describe(name: str, value: Any) -> dict[str, Any]:
    """A field's record: kind (tensor, jagged, array, list, value), dtype, shape and rows."""
    kind, shape = type(value).__name__, tuple(getattr(value, "shape", ()))
    info: list[Any] = ["value", kind, "-", None]
    if kind in ("Tensor", "NestedTensor") or hasattr(value, "is_nested") or kind == "ndarray":
        dtype = str(value.dtype).removeprefix("torch.")
        info = ["array" if kind == "ndarray" else "tensor", dtype, str(shape), shape[0] if shape else None]
        if _jagged(value):
            rows = value.size(0)
            dims = [str(rows), "j", *[str(d) for d in value.shape[2:]]] if value.dim() > 1 else [str(rows)]
            info = ["jagged", dtype, "(" + ", ".join(dims) + ")", rows]
    elif isinstance(value, (list, tuple)):
        types = sorted({type(v).__name__ for v in value})
        info = ["list", "|".join(types[:3]) or "-", f"({len(value)},)", len(value)]
    return dict(zip(("name", "kind", "dtype", "shape", "rows"), [name, *info], strict=True))


def text_rows(value: Any, limit: int, width: int = 100) -> list[str] | None:
    """The first rows of a text-like field (strings, chat messages, JSON records), else None."""
    if type(value).__name__ == "ndarray":
        if value.dtype.kind not in ("U", "S", "O") or value.ndim != 1:
            return None
    elif not isinstance(value, (list, tuple)):
        return None
    rows = list(value[:limit])
    if not rows or not all(isinstance(r, (str, bytes, list)) for r in rows) or not any(len(r) for r in rows):
        return None
    texts = [row if isinstance(row, str) else json.dumps(row, default=str, ensure_ascii=False) for row in rows]
    return [shorten(text, width) for text in texts]


@dataclass
class FieldDiff:
    name: str
    status: str  # same | differs | only-a | only-b | shape | dtype
    rows: int | None = None  # rows compared
    rows_differing: int | None = None
    max_abs_diff: float | None = None
    mean_abs_diff: float | None = None
    note: str = ""

    def record(self) -> dict[str, Any]:
        record = dataclasses.asdict(self)
        for key in ("max_abs_diff", "mean_abs_diff"):  # JSON has no inf or NaN
            record[key] = record[key] if record[key] is None or math.isfinite(record[key]) else str(record[key])
        return record


def compare_fields(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[FieldDiff]:
    out = []
    for name in sorted(set(a) | set(b)):
        if name not in b or name not in a:
            out.append(FieldDiff(name, "only-a" if name in a else "only-b"))
            continue
        try:
            out.append(compare(name, a[name], b[name]))
        except Exception as exc:  # a comparison must not end the report
            out.append(FieldDiff(name, "differs", note=f"not comparable ({type(exc).__name__}: {exc})"))
    return out


def _same(x: Any, y: Any) -> bool:
    import numpy as np
    import torch

    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        both = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        return both and x.shape == y.shape and x.dtype == y.dtype and bool(torch.equal(x, y))
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return bool(np.array_equal(np.asarray(x, dtype=object), np.asarray(y, dtype=object)))
    try:
        return bool(x == y) and type(x) is type(y)
    except Exception:
        return json.dumps(x, default=str, sort_keys=True) == json.dumps(y, default=str, sort_keys=True)


def _delta(x: Any, y: Any) -> Any:
    """|x - y| in float64, NaN against NaN counting as equal."""
    import torch

    return torch.nan_to_num((x.to(torch.float64) - y.to(torch.float64)).abs(), nan=0.0)


def compare(name: str, a: Any, b: Any) -> FieldDiff:
    import numpy as np
    import torch

    def dense(value: Any) -> Any:
        """A torch tensor of a dense numeric field, a numpy array of another dense one, else None."""
        if (
            not isinstance(value, (torch.Tensor, np.ndarray))
            or _jagged(value)
            or getattr(value.dtype, "kind", "") == "O"
        ):
            return None
        return torch.as_tensor(value) if isinstance(value, np.ndarray) and value.dtype.kind in "biufc" else value

    def rows_of(value: Any) -> list[Any] | None:
        if _jagged(value):
            return list(value.unbind(0))
        objects = type(value).__name__ == "ndarray" and value.dtype.kind == "O"
        return list(value) if objects or isinstance(value, (list, tuple)) else None

    ta, tb = dense(a), dense(b)
    if isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor):
        if tuple(ta.shape) != tuple(tb.shape):
            return FieldDiff(name, "shape", note=f"{tuple(ta.shape)} vs {tuple(tb.shape)}")
        if ta.dtype != tb.dtype:
            return FieldDiff(name, "dtype", note=f"{ta.dtype} vs {tb.dtype}".replace("torch.", ""))
        rows = ta.shape[0] if ta.dim() else 1
        unequal = ta != tb
        floating = ta.dtype.is_floating_point or ta.dtype.is_complex
        if floating:
            unequal &= ~(torch.isnan(ta) & torch.isnan(tb))
        differing = int((unequal.reshape(rows, -1).any(dim=1) if ta.dim() else unequal.reshape(1)).sum())
        result = FieldDiff(name, "differs" if differing else "same", rows, differing)
        if floating and ta.numel():  # not for ids, masks, flags
            delta = _delta(ta, tb)
            result.max_abs_diff, result.mean_abs_diff = float(delta.max()), float(delta.mean())
        return result
    if ta is not None and tb is not None:  # strings and other numpy dtypes
        return _row_diff(name, list(np.asarray(a)), list(np.asarray(b)))
    rows_a, rows_b = rows_of(a), rows_of(b)
    if rows_a is not None and rows_b is not None:
        return _row_diff(name, rows_a, rows_b)
    return FieldDiff(name, "same" if _same(a, b) else "differs")


def _row_diff(name: str, ra: list[Any], rb: list[Any]) -> FieldDiff:
    import torch

    if len(ra) != len(rb):
        return FieldDiff(name, "shape", note=f"{len(ra)} rows vs {len(rb)}")
    max_abs, total, count, numeric = 0.0, 0.0, 0, True
    for x, y in zip(ra, rb, strict=True):
        tensors = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
        numeric = numeric and tensors and x.dtype.is_floating_point  # a difference of token ids means nothing
        if numeric and x.numel():
            delta = _delta(x, y)
            max_abs, total, count = max(max_abs, float(delta.max())), total + float(delta.sum()), count + delta.numel()
    differing = sum(not _same(x, y) for x, y in zip(ra, rb, strict=True))
    result = FieldDiff(name, "differs" if differing else "same", len(ra), differing)
    if numeric and count:
        result.max_abs_diff, result.mean_abs_diff = max_abs, total / count
    return result


# ---------------------------------------------------------------- rollout rows


def tokenizer(path: str | None, meta: Mapping[str, Any]) -> tuple[Decode | None, str | None]:
    """The decoder of ``--tokenizer`` (failing: a one-line error), else of the recorded model's directory
    when it exists here (failing quietly), and where it came from."""
    chosen = path or recorded_model(meta)
    if chosen is not None and "\x00" in chosen:  # no file system path holds one
        if path is not None:
            raise CommandError(f"cannot load a tokenizer from {path!r}: a path holds no NUL character")
        logging.getLogger("skipinject").warning(
            "the recorded model directory %s is no path (it holds a NUL character): rows shown as token ids",
            shorten(repr(chosen)),
        )
        return None, None
    if chosen is None or (path is None and local_kind(Path(chosen), follow=True) != "directory"):
        return None, None
    problem = bounded_dir_problem(Path(chosen), TOKENIZER_FILES, MAX_TOKENIZER_FILE_BYTES, trusted=path is not None)
    if problem is not None:
        if path is not None:
            raise CommandError(f"cannot load a tokenizer from {shorten(repr(path))}: {problem}")
        logging.getLogger("skipinject").warning(
            "the recorded model directory %s is not used (%s): rows shown as token ids", shorten(repr(chosen)), problem
        )
        return None, None
    try:
        from transformers import AutoTokenizer  # first: its import sets its loggers' levels

        with _no_code_no_prompt_no_chatter():
            loaded = AutoTokenizer.from_pretrained(chosen, local_files_only=True, trust_remote_code=False)
    except Exception as exc:
        if path is None:
            return None, None
        if "trust_remote_code" in str(exc) or "custom code" in str(exc):
            raise CommandError(
                f"cannot load a tokenizer from {path}: it names code of its own (auto_map), which skipinject never "
                "runs; give --tokenizer a directory without it"
            ) from exc
        first = next(iter(str(exc).strip().splitlines()), "")
        raise CommandError(f"cannot load a tokenizer from {path} ({type(exc).__name__}: {shorten(first)})") from exc
    return (lambda ids: str(loaded.decode(list(ids), skip_special_tokens=True))), chosen


#: The files of a model directory a tokenizer reads, and the largest one read (real ones are a few MB to ~35 MB).
TOKENIZER_FILES = re.compile(
    r"tokenizer.*|vocab.*|merges.*|special_tokens_map\.json|added_tokens\.json|.*config\.json|.*\.model|.*\.tiktoken"
)
MAX_TOKENIZER_FILE_BYTES = 64 << 20


@contextlib.contextmanager
def _no_code_no_prompt_no_chatter() -> Iterator[None]:
    """While a tokenizer named by a cache or an argument loads: its directory's code is refused
    (``trust_remote_code=False`` at the call), nothing can ask on stdin (an empty stdin answers any prompt
    with end of input, whatever the terminal holds), and transformers' own warnings, which quote that
    directory's ``config.json`` strings, are not printed."""
    import io
    import sys
    import warnings

    hf_logger = logging.getLogger("transformers")
    level, stdin = hf_logger.level, sys.stdin
    hf_logger.setLevel(logging.ERROR + 10)
    sys.stdin = io.StringIO("")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        sys.stdin = stdin
        hf_logger.setLevel(level)


def _ids_text(ids: Sequence[int]) -> str:
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
        prompt = chat if chat is not None else _ids_text(sample.prompt_ids) if sample.prompt_ids is not None else "-"
    response = decode(sample.response_ids) if decode is not None else _ids_text(sample.response_ids)
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
