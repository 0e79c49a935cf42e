"""Deciding a call: which verified cache entry serves a step, or why none does.

``cache`` serves the step's own entry; ``repeat`` the exact step, else the largest cached step
below, else the smallest above; ``strict`` is ``cache`` that stops the run when there is nothing to
serve. A cache that cannot be used (damaged, foreign, unreadable) is never loaded: the decision is
logged in one line and the step is generated again.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from skipinject.config import Action
from skipinject.errors import CacheMissError, CorruptCacheError, UntrustedCacheError
from skipinject.store import StepEntry, StepStore

if TYPE_CHECKING:
    from skipinject.engine.runtime import RoleRuntime
    from skipinject.roles import Call, UpstreamFormat

logger = logging.getLogger("skipinject")


@dataclass
class Plan:
    """What the engine decided for one call: the entry to serve (or trusted upstream file), and why."""

    store: StepStore
    step: int
    entry: StepEntry | None = None
    upstream_file: Path | None = None
    upstream_format: UpstreamFormat | None = None
    reason: str = ""
    #: Whether a fresh result may be saved (not into a step directory another user controls).
    saves: bool = True

    @property
    def served_step(self) -> int:
        return self.entry.step if self.entry else self.step


def plan_step(role: RoleRuntime, call: Call, step: int) -> Plan:
    """Find the entry to serve (verified), or explain why there is none. Logs the decision in one line.

    A cache that cannot be used (damaged, foreign, unreadable) is never loaded: the run regenerates
    the step, or stops with :class:`CacheMissError` for ``action=strict``.
    """
    store = role.store_for(call)
    action = role.settings.action
    unusable = role.unusable(store)
    if unusable is not None:  # reported once, when the store was opened
        if action is Action.strict:
            raise CacheMissError(f"{role.name} step {step}: skip.{role.name}.action=strict and {unusable}")
        return Plan(store, step, reason="cache directory unusable", saves=False)
    problems: list[str] = []
    untrusted_own = False  # the step's own directory is another user's: nothing is saved there either
    found: tuple[Path, UpstreamFormat] | None = None
    try:
        candidates = repeat_order(store, step) if action is Action.repeat else [step]
        for candidate in candidates:
            if candidate != step and not store.is_committed(candidate):
                continue  # another role's step, or none of ours: not a candidate for repeat
            try:
                entry = store.verified(candidate)
            except FileNotFoundError:
                continue
            except CorruptCacheError as exc:
                problems.append(str(exc))
                untrusted_own = untrusted_own or (candidate == step and isinstance(exc, UntrustedCacheError))
                continue
            if problems:
                logger.warning("%s step %d: cache unusable, not loaded: %s", role.name, step, summary(problems))
            if candidate == step:
                reason = "own cache"
            elif candidate < step:
                reason = f"repeat: largest cached step below {step}"
            else:
                reason = f"repeat: no cached step below {step}, smallest above"
            return Plan(store, step, entry=entry, reason=reason)
        found = upstream_file(role, store, step)
    except OSError as exc:
        problems.append(f"cannot read the cache directory {store.project_dir} ({type(exc).__name__}: {exc})")
    if found is not None:
        upstream = found[0]
        if role.settings.trust_upstream:
            return Plan(store, step, upstream_file=upstream, upstream_format=found[1], reason="trusted upstream cache")
        role.once(
            ("untrusted", str(upstream)),
            logging.WARNING,
            "%s step %d: found verl's own cache %s but did not load it: it is a pickle, which runs code "
            "when loaded. Set skip.%s.trust_upstream=true if you trust it; generating again and caching "
            "in skipinject's format beside it",
            role.name,
            step,
            upstream,
            role.name,
        )
    where = store.step_dir(step)
    interrupted = None if problems else store.interrupted(step)
    if interrupted:
        problems.append(interrupted)
    if action is Action.strict:
        detail = summary(problems) if problems else f"no cache at {where}"
        raise CacheMissError(f"{role.name} step {step}: skip.{role.name}.action=strict and {detail}")
    if problems:
        logger.warning(
            "%s step %d: cache unusable, not loaded: %s; running the target and %s",
            role.name,
            step,
            summary(problems),
            "not saving its result there" if untrusted_own else "saving its result",
        )
        return Plan(store, step, reason="cache unusable", saves=not untrusted_own)
    reason = f"no cached step in {store.project_dir}" if action is Action.repeat else f"no cache at {where}"
    logger.info("%s step %d: miss (%s); running the target and saving its result", role.name, step, reason)
    return Plan(store, step, reason=reason)


#: A decision's log line quotes at most this many of the candidates it could not use, each cut short.
EXAMPLES = 3
EXAMPLE_CHARS = 600


def summary(problems: list[str]) -> str:
    """One bounded line for the candidates a decision could not use: all of them when few, else the
    count and the first :data:`EXAMPLES` (``repeat`` over a thousand damaged steps logs one line)."""

    def cut(text: str) -> str:
        return text if len(text) <= EXAMPLE_CHARS else text[:EXAMPLE_CHARS] + "..."

    if len(problems) <= EXAMPLES:
        return "; ".join(cut(p) for p in problems)
    shown = "; ".join(cut(p) for p in problems[:EXAMPLES])
    return f"{len(problems)} cached steps unusable, e.g. {shown}; and {len(problems) - EXAMPLES} more"


def repeat_order(store: StepStore, step: int) -> list[int]:
    """``step``, then the steps on disk below it (largest first), then those above (smallest first).

    Names only: the candidates are read one by one in this order until one is usable.
    """
    available = store.step_numbers_on_disk()
    index = bisect.bisect_left(available, step)
    return [step, *available[:index][::-1], *(s for s in available[index:] if s != step)]


def upstream_file(role: RoleRuntime, store: StepStore, step: int) -> tuple[Path, UpstreamFormat] | None:
    """verl's own cache of ``step`` (the first of the role's upstream formats found), if any."""
    for upstream in role.role.upstream_formats:
        path = store.upstream_file(step, upstream.file_name, upstream.directory_of(step))
        if path is not None:
            return path, upstream
    return None
