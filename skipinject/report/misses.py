"""Why a chosen step missed: the same step cached under another layout or run name, and which settings
differ (never digests). Bounded: two listings of at most :data:`MAX_NAMES`, one ``stat`` per candidate.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from os.path import commonprefix
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skipinject.text import shown
from skipinject.verl.layout import LAYOUT_SETTINGS, RUN_SETTINGS, layout_name, layout_values, path_safe, run_names

if TYPE_CHECKING:
    from skipinject.store import StepStore

#: Most names read from one listing, and most candidate directories looked into.
MAX_NAMES = 4096
MAX_CANDIDATES = 64
#: ``meta.json``'s record of the run settings a role's rows depend on (its ``match_settings``).
SETTINGS_KEY = "generation_settings"


def nearest_cache(store: StepStore, step: int) -> str | None:
    """Where else ``step`` of this role is cached and what differs (the end of a miss line), else ``None``."""
    context, project = store.context, store.project_dir
    try:
        if not {*LAYOUT_SETTINGS, *RUN_SETTINGS} <= set(context):
            return None
        ours, run = layout_name(context), path_safe(f"{context['experiment_name']}_{context['project_name']}")
        subdir = "" if project.name == ours else project.name  # the role's directory below the layout's
        layout_dir = project.parent if subdir else project
        run_dir = layout_dir.parent
        if layout_dir.name != ours or run_dir.name != run:
            return None

        def cached(layout: Path) -> Path | None:
            where = layout / subdir / store.step_dir(step).name
            return where if store.holds_step(where) else None

        def nearness(values: dict[str, int]) -> tuple[int, int]:
            """Fewest settings differing first, then the smallest difference."""
            differ = [abs(values[key] - int(context[key])) for key in LAYOUT_SETTINGS]
            return sum(map(bool, differ)), sum(differ)

        names = store.neighbours(2 if subdir else 1, MAX_NAMES)
        layouts = sorted(
            ((v, n) for n in names if n != ours and (v := layout_values(n))), key=lambda it: nearness(it[0])
        )
        for values, name in layouts[:MAX_CANDIDATES]:
            if (where := cached(run_dir / name)) is not None:
                differ = [key for key in LAYOUT_SETTINGS if values[key] != context[key]]
                text = "; ".join(
                    f"{LAYOUT_SETTINGS[key]} is {values[key]} there, {context[key]} here" for key in differ
                )
                return f"cached under another layout, {shown(where)}: {text}"
        runs = [name for name in store.neighbours(3 if subdir else 2, MAX_NAMES) if name != run]
        runs.sort(key=lambda name: _shared(name, run), reverse=True)
        for name in runs[:MAX_CANDIDATES]:
            if (where := cached(run_dir.parent / name / ours)) is not None:
                return f"cached under another run name, {shown(where)}: {_run_difference(name, context)}"
    except Exception:
        return None
    return None


def _shared(name: str, run: str) -> int:
    """Characters ``name`` shares with ``run`` at its start and end."""
    return len(commonprefix([name, run])) + len(commonprefix([name[::-1], run[::-1]]))  # noqa: RUF071 - not paths


def _run_difference(name: str, context: dict[str, Any]) -> str:
    """Which of ``trainer.experiment_name``/``project_name`` differ, when the directory name tells."""
    here = [str(context[key]) for key in RUN_SETTINGS]
    there = run_names(name) or here
    parts = [
        f"trainer.{key} is {shown(a)!r} there, {shown(b)!r} here"
        for key, a, b in zip(RUN_SETTINGS, there, here, strict=True)
        if a != b
    ]
    joined = path_safe("_".join(here))
    return "; ".join(parts) or f"trainer.experiment_name/project_name make {shown(name)!r} there, {joined!r} here"


def recorded_settings(settings: Sequence[str], run_config: Any) -> dict[str, Any]:
    """The values of the run settings ``settings`` names (dotted paths), as ``meta.json`` records them."""
    from omegaconf import OmegaConf

    from skipinject.verl.compat import select

    def plain(value: Any) -> Any:
        value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        return json.loads(json.dumps(value, default=repr))

    return {path: plain(select(run_config, path)) for path in settings}


def settings_differ(store: StepStore, settings: Sequence[str], run_config: Any) -> str | None:
    """Which recorded settings of the layout's latest cached step differ from this run's (``path is a there,
    b here``), else ``None``. One listing, one ``meta.json``."""
    try:
        steps = store.step_numbers_on_disk()
        recorded = store.read_meta(steps[-1]).generation_settings if steps and settings else None
        if not isinstance(recorded, dict):
            return None
        here = recorded_settings(settings, run_config)
        differ = [
            f"{path} is {shown(recorded[path])} there, {shown(here[path])} here"
            for path in settings
            if path in recorded and recorded[path] != here[path]
        ]
        said = "; ".join(differ[:4])
        return f"the cached rows of step {steps[-1]} were generated with other settings: {said}" if differ else None
    except Exception:
        return None
