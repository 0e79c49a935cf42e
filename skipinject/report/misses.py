"""Why a chosen step missed: the nearest cache of the same role, and the settings that put it elsewhere.

A changed ``data.max_response_length`` (or batch size, ``n``, prompt length) names another layout
directory, a changed ``trainer.experiment_name``/``project_name`` another run directory; the step is
then "not cached" here although it is cached beside. At a miss the engine asks :func:`nearest_cache`:
the same step under another layout of this run directory, else under this layout in another run
directory of the same ``dump_dir``, and says which settings differ, as settings, never digests::

    rollout step 1: miss (no cache at .../e_p/GBS4_N2_in32_out16/1; cached under another layout,
    .../e_p/GBS4_N2_in32_out32/1: data.max_response_length is 32 there, 16 here); running the target ...

The search is bounded: two directory listings (the run directory's layouts, the dump directory's run
directories, each cut at :data:`MAX_NAMES`) and one ``stat`` per candidate (at most
:data:`MAX_CANDIDATES`); the steps of a layout are never listed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skipinject.store.format import META_NAME, step_name
from skipinject.verl.layout import layout_name, layout_values, path_safe, run_names

if TYPE_CHECKING:
    from skipinject.store import StepStore

__all__ = ["MAX_CANDIDATES", "MAX_NAMES", "SETTINGS_KEY", "nearest_cache", "recorded_settings", "settings_differ"]

#: Most names read from one listing, and most candidate directories looked into.
MAX_NAMES = 4096
MAX_CANDIDATES = 64

#: The verl settings naming each field of a layout directory.
LAYOUT_SETTINGS = {
    "gbs": "the batch size (data.gen_batch_size, else data.train_batch_size)",
    "n": "actor_rollout_ref.rollout.n",
    "prompt_length": "data.max_prompt_length",
    "response_length": "data.max_response_length",
}


def nearest_cache(store: StepStore, step: int) -> str | None:
    """Where else ``step`` of this role is cached and what differs, as the end of a miss line; ``None``
    when nowhere near (or the store is not in a layout). Never raises."""
    try:
        return _nearest(store, step)
    except Exception:
        return None


def _nearest(store: StepStore, step: int) -> str | None:
    context = store.context
    if not {"gbs", "n", "prompt_length", "response_length", "experiment_name", "project_name"} <= set(context):
        return None
    ours = layout_name(context)
    run = path_safe(f"{context['experiment_name']}_{context['project_name']}")
    subdir = _subdir(store.project_dir, ours)
    if subdir is None:
        return None
    layout_dir = store.project_dir.parent if subdir else store.project_dir
    run_dir = layout_dir.parent
    if layout_dir.name != ours or run_dir.name != run:
        return None
    backend = store.backend

    def cached(layout: Path) -> Path | None:
        where = layout / subdir / step_name(step) if subdir else layout / step_name(step)
        found = backend.stat(where / META_NAME)
        return where if found is not None and found[0] == "file" else None

    layouts = _listed(backend, run_dir)
    others = [(values, name) for name in layouts if name != ours and (values := layout_values(name)) is not None]
    others.sort(key=lambda item: (_differing(item[0], context), _distance(item[0], context)))
    for values, name in others[:MAX_CANDIDATES]:
        where = cached(run_dir / name)
        if where is not None:
            differ = "; ".join(
                f"{LAYOUT_SETTINGS[key]} is {values[key]} there, {context[key]} here"
                for key in LAYOUT_SETTINGS
                if values[key] != context[key]
            )
            return f"cached under another layout, {_shown(where)}: {differ}"
    runs = [name for name in _listed(backend, run_dir.parent) if name != run]
    runs.sort(key=lambda name: _similarity(name, run), reverse=True)
    for name in runs[:MAX_CANDIDATES]:
        where = cached(run_dir.parent / name / ours)
        if where is not None:
            return f"cached under another run name, {_shown(where)}: {_run_difference(name, context)}"
    return None


def _subdir(project: Path, layout: str) -> str | None:
    """The role's sub-directory below the layout directory (``""``: none), or ``None`` if not in one."""
    if project.name == layout:
        return ""
    if project.parent.name == layout:
        return project.name
    return None


def _listed(backend: Any, location: Path) -> list[str]:
    try:
        names = backend.names(location, directories=True)
    except Exception:
        return []
    return sorted(names)[:MAX_NAMES]


def _differing(values: dict[str, int], context: dict[str, Any]) -> int:
    return sum(values[key] != context[key] for key in LAYOUT_SETTINGS)


def _distance(values: dict[str, int], context: dict[str, Any]) -> int:
    return sum(abs(values[key] - int(context[key])) for key in LAYOUT_SETTINGS)


def _similarity(name: str, run: str) -> int:
    """How much of ``run``'s name ``name`` shares at its start and end (a changed experiment or project)."""
    prefix = len(_common(name, run))
    suffix = len(_common(name[::-1], run[::-1]))
    return prefix + suffix


def _common(a: str, b: str) -> str:
    end = 0
    while end < min(len(a), len(b)) and a[end] == b[end]:
        end += 1
    return a[:end]


def _run_difference(name: str, context: dict[str, Any]) -> str:
    """Which of ``trainer.experiment_name``/``project_name`` differ, when the directory name tells."""
    experiment, project = str(context["experiment_name"]), str(context["project_name"])
    split = run_names(name)
    if split is not None:
        parts = [
            f"trainer.{key} is {_shown(there)!r} there, {_shown(here)!r} here"
            for key, there, here in (("experiment_name", split[0], experiment), ("project_name", split[1], project))
            if there != here
        ]
        if parts:
            return "; ".join(parts)
    here = path_safe(f"{experiment}_{project}")
    return f"trainer.experiment_name/project_name make {_shown(name)!r} there, {_shown(here)!r} here"


def _shown(value: object) -> str:
    from skipinject.cache_tool.common import shown

    return shown(value)


#: ``meta.json``'s record of the run settings a role's rows depend on (its ``match_settings``).
SETTINGS_KEY = "generation_settings"


def recorded_settings(settings: Sequence[str], run_config: Any) -> dict[str, Any]:
    """The values of the run settings ``settings`` names (dotted paths), as ``meta.json`` records them."""
    import json

    from skipinject.verl.compat import select

    values = {}
    for path in settings:
        value = select(run_config, path)
        try:
            from omegaconf import DictConfig, ListConfig, OmegaConf

            if isinstance(value, (DictConfig, ListConfig)):
                value = OmegaConf.to_container(value, resolve=True)
        except ImportError:  # pragma: no cover - omegaconf comes with verl
            pass
        values[path] = json.loads(json.dumps(value, default=repr))
    return values


def settings_differ(store: StepStore, settings: Sequence[str], run_config: Any) -> str | None:
    """Why no row of a call matched when the layout's latest cached step was generated with other
    settings: ``actor_rollout_ref.rollout.temperature is 0.7 there, 1.0 here`` (settings, never digests);
    ``None`` when they are the same, unknown, or nothing is cached. One listing, one ``meta.json``."""
    try:
        steps = store.step_numbers_on_disk()
        if not steps or not settings:
            return None
        recorded = store.read_meta(steps[-1]).get(SETTINGS_KEY)
        if not isinstance(recorded, dict):
            return None
        here = recorded_settings(settings, run_config)
        differ = [
            f"{path} is {_shown(recorded[path])} there, {_shown(here[path])} here"
            for path in settings
            if path in recorded and recorded[path] != here[path]
        ]
    except Exception:
        return None
    if not differ:
        return None
    return f"the cached rows of step {steps[-1]} were generated with other settings: " + "; ".join(differ[:4])
