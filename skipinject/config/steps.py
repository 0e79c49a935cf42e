"""Step sets: the steps a role may skip, held as sorted ranges (``0-1000000`` costs two integers)."""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Iterator
from typing import Any

from skipinject.errors import ConfigError

#: Largest step accepted: far beyond any training run, small enough that every step prints short.
MAX_STEP = 1_000_000_000
_ITEM = re.compile(r"([0-9]+)(?:\s*-\s*([0-9]+))?")


class StepSet:
    """An immutable set of non-negative steps, stored as disjoint sorted inclusive ranges."""

    __slots__ = ("_highs", "_lows")

    def __init__(self, spans: Iterable[tuple[int, int]] = ()) -> None:
        merged: list[list[int]] = []
        for low, high in sorted(spans):
            if merged and low <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], high)
            else:
                merged.append([low, high])
        self._lows = tuple(span[0] for span in merged)
        self._highs = tuple(span[1] for span in merged)

    @classmethod
    def parse(cls, text: str, key: str = "steps") -> StepSet:
        """``[1,2,3]``, ``1-128``, ``[1-4,10]``, ``7`` or ``[]``; errors name ``key`` and the text."""
        body, text = text.strip(), text if text.isprintable() else repr(text)  # errors quote it on one line
        if body.startswith("[") and body.endswith("]"):
            body = body[1:-1]
        elif "[" in body or "]" in body:
            raise ConfigError(f"{key}={text}: unbalanced brackets")
        items = [piece.strip() for piece in body.split(",")]
        return cls() if items == [""] else cls(_span(item, key, text) for item in items)

    @classmethod
    def from_value(cls, value: Any, key: str = "steps") -> StepSet:
        """From what a user wrote: text, one integer, or a list of integers and ``"a-b"`` ranges."""
        if isinstance(value, StepSet):
            return value
        if isinstance(value, str):
            return cls.parse(value, key)
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list of steps (e.g. [1,2,3] or 1-128)")
        spans = []
        for item in value:
            if isinstance(item, str):
                spans.append(_span(item.strip(), key, value))
            elif isinstance(item, int) and not isinstance(item, bool) and 0 <= item <= MAX_STEP:
                spans.append((item, item))
            else:
                raise ConfigError(
                    f"{key}={value!r}: {item!r} is not a step (integers 0..{MAX_STEP} or ranges like 1-128)"
                )
        return cls(spans)

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        index = bisect.bisect_right(self._lows, step) - 1
        return index >= 0 and step <= self._highs[index]

    def __iter__(self) -> Iterator[int]:
        for low, high in zip(self._lows, self._highs, strict=True):
            yield from range(low, high + 1)

    def __len__(self) -> int:
        return sum(high - low + 1 for low, high in zip(self._lows, self._highs, strict=True))

    def __bool__(self) -> bool:
        return bool(self._lows)

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip(self._lows, self._highs, strict=True))

    def format(self) -> str:
        """The shortest text :meth:`parse` reads back (``[1-4,10]``)."""
        runs = [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.spans]
        return "[" + ",".join(runs) + "]"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepSet):
            return self.spans == other.spans
        if isinstance(other, (tuple, list)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.spans)

    def __repr__(self) -> str:
        return f"StepSet({self.format()})"


def _span(item: str, key: str, text: Any) -> tuple[int, int]:
    if not item:
        raise ConfigError(f"{key}={text}: empty item in the step list")
    match = _ITEM.fullmatch(item) if item.isascii() else None
    if match is None:
        raise ConfigError(f"{key}={text}: {item!r} is not a step (integers >= 0 or ranges like 1-128)")
    low_text, high_text = (n.lstrip("0") or "0" for n in (match.group(1), match.group(2) or match.group(1)))
    for number in (low_text, high_text):
        if len(number) > len(str(MAX_STEP)) or int(number) > MAX_STEP:
            raise ConfigError(f"{key}={text}: step {number[:20]} is larger than {MAX_STEP}")
    low, high = int(low_text), int(high_text)
    if low > high:
        raise ConfigError(f"{key}={text}: range {item!r} goes backwards")
    return low, high
