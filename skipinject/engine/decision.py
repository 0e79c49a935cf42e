"""Deciding a call: which verified cache entry serves a step, or why none does (one line).

``cache`` serves the step's own entry; ``repeat`` the exact step, else the largest cached step below,
else the smallest above; ``strict`` is ``cache`` that stops the run when nothing serves; ``refresh``
serves nothing and saves anew; ``match`` serves rows (:mod:`skipinject.engine.matching`). A cache that
cannot be used is never loaded. The strict/fallback rule for every way a cache fails is here, once.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from pathlib import Path

from skipinject.config import Action, RoleConfig
from skipinject.errors import CacheMissError, CorruptCacheError, UntrustedCacheError
from skipinject.report.misses import nearest_cache
from skipinject.roles import Plan, UpstreamFormat
from skipinject.store import StepEntry, StepStore

logger = logging.getLogger("skipinject")


def plan_step(
    name: str,
    store: StepStore,
    settings: RoleConfig,
    upstream: Sequence[UpstreamFormat],
    step: int,
    unusable: str | None = None,
    *,
    ahead: StepEntry | None = None,
) -> Plan:
    """The verified entry of role ``name`` to serve at ``step``, or why there is none. ``unusable``: why
    the store cannot be used this run; ``ahead``: ``step``'s entry, verified by the read-ahead. verl's
    own pickle is served only with ``trust_upstream``, else named in ``untrusted_upstream``."""
    action = settings.action
    if unusable is not None:  # reported once, when the store was opened
        if action is Action.strict:
            raise CacheMissError(f"{name} step {step}: skip.{name}.action=strict and {unusable}")
        return Plan(store, step, reason="cache directory unusable", saves=False)
    saving = "saving its result" if settings.save else "not saving it (save=false)"
    if action is Action.refresh:
        logger.info("%s step %d: refresh: running the target and %s in place of any cached one", name, step, saving)
        return Plan(store, step, reason="refresh", saves=settings.save)
    if action is Action.match:  # the call is saved as the step when none is committed there, else its new rows
        if committed(store, step, siblings=True):
            reason = "match: step already cached (new rows saved as a rows record)"
            return Plan(store, step, reason=reason, saves=False)
        return Plan(store, step, reason="match", saves=settings.save)
    problems: list[str] = []
    untrusted_own = False  # the step's own directory is another user's: nothing is saved there either
    found: tuple[Path, UpstreamFormat] | None = None
    try:
        candidates = repeat_order(store, step) if action is Action.repeat else [step]
        for candidate in candidates:
            if candidate != step and not store.is_committed(candidate):
                continue  # another role's step, or none of ours: not a candidate for repeat
            try:
                entry = ahead if ahead is not None and ahead.step == candidate else store.verified(candidate)
            except FileNotFoundError:
                continue
            except CorruptCacheError as exc:
                problems.append(str(exc))
                untrusted_own = untrusted_own or (candidate == step and isinstance(exc, UntrustedCacheError))
                continue
            if problems:
                logger.warning("%s step %d: cache unusable, not loaded: %s", name, step, summary(problems))
            if candidate == step:
                reason = "own cache"
            elif candidate < step:
                reason = f"repeat: largest cached step below {step}"
            else:
                reason = f"repeat: no cached step below {step}, smallest above"
            return Plan(store, step, entry=entry, reason=reason)
        found = upstream_file(upstream, store, step)
    except OSError as exc:
        problems.append(f"cannot read the cache directory {store.project_dir} ({type(exc).__name__}: {exc})")
    untrusted = None
    if found is not None:
        if settings.trust_upstream:
            return Plan(store, step, upstream_file=found[0], upstream_format=found[1], reason="trusted upstream cache")
        untrusted = found[0]
    where = store.step_dir(step)
    interrupted = None if problems else store.interrupted(step)
    if interrupted:
        problems.append(interrupted)
    near = None if problems else nearest_cache(store, step)
    if action is Action.strict:
        detail = summary(problems) if problems else f"no cache at {where}" + (f" ({near})" if near else "")
        if untrusted is not None:
            detail += f" (verl's own cache {untrusted} is not loaded: skip.{name}.trust_upstream is false)"
        raise CacheMissError(f"{name} step {step}: skip.{name}.action=strict and {detail}")
    if problems:
        logger.warning(
            "%s step %d: cache unusable, not loaded: %s; running the target and %s",
            name,
            step,
            summary(problems),
            "not saving its result there" if untrusted_own else saving,
        )
        saves = settings.save and not untrusted_own
        return Plan(store, step, reason="cache unusable", untrusted_upstream=untrusted, saves=saves)
    reason = f"no cached step in {store.project_dir}" if action is Action.repeat else f"no cache at {where}"
    logger.info(f"{name} step {step}: miss ({reason}{f'; {near}' if near else ''}); running the target and {saving}")
    return Plan(store, step, reason=reason, untrusted_upstream=untrusted, saves=settings.save)


def committed(store: StepStore, step: int, *, siblings: bool = False) -> bool:
    """Whether ``step`` is committed in ``store`` (``siblings``: by a sibling role too, as ``match`` asks); True
    when that cannot be told (nothing is written there)."""
    try:
        return store.is_committed(step, siblings=siblings)
    except OSError:
        return True


def cannot_load(name: str, settings: RoleConfig, plan: Plan, exc: Exception, instead: str) -> None:
    """A planned cache failed to load or fit the call: ``action=strict`` stops the run; else one warning
    and the caller runs the target (``instead`` says so)."""
    where = plan.entry.directory if plan.entry else plan.upstream_file
    if isinstance(exc, CacheMissError):
        raise exc
    if settings.action is Action.strict:
        if isinstance(exc, CorruptCacheError):
            raise exc
        raise CorruptCacheError(f"{name} step {plan.step}: cannot load {where} ({type(exc).__name__}: {exc})") from exc
    logger.warning(f"{name} step {plan.step}: cannot load {where} ({type(exc).__name__}: {exc}); {instead}")


def nothing_more(name: str, settings: RoleConfig, plan: Plan, index: int, calls: int) -> None:
    """Call ``index`` of a served step finds no recorded call: ``action=strict`` stops the run."""
    if settings.action is Action.strict:
        where = plan.entry.directory if plan.entry is not None else plan.upstream_file
        raise CacheMissError(
            f"{name} step {plan.step}: skip.{name}.action=strict and call {index + 1} of this step "
            f"has nothing to serve ({where} holds {calls} call{'s' if calls != 1 else ''})"
        )


#: A decision's log line quotes at most this many of the candidates it could not use, each cut short.
EXAMPLES = 3
EXAMPLE_CHARS = 600


def summary(problems: list[str]) -> str:
    """One bounded line for the candidates a decision could not use (all when few, else the first few)."""
    shown = "; ".join(p if len(p) <= EXAMPLE_CHARS else p[:EXAMPLE_CHARS] + "..." for p in problems[:EXAMPLES])
    if len(problems) <= EXAMPLES:
        return shown
    return f"{len(problems)} cached steps unusable, e.g. {shown}; and {len(problems) - EXAMPLES} more"


def repeat_order(store: StepStore, step: int) -> list[int]:
    """``step``, then the steps on disk below it (largest first), then those above (smallest first)."""
    available = store.step_numbers_on_disk()
    index = bisect.bisect_left(available, step)
    return [step, *available[:index][::-1], *(s for s in available[index:] if s != step)]


def upstream_file(formats: Sequence[UpstreamFormat], store: StepStore, step: int) -> tuple[Path, UpstreamFormat] | None:
    """verl's own cache of ``step`` (the first of the role's upstream formats found), if any."""
    for upstream in formats:
        path = store.upstream_file(step, upstream.file_name, upstream.directory_of(step))
        if path is not None:
            return path, upstream
    return None
