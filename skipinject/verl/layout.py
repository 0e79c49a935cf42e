"""Where a role's steps live: upstream's directory names (docs/cache-format.md), derived from the run's verl
config: ``{experiment}_{project}/GBS{gbs}_N{n}_in{prompt_len}_out{response_len}/[{role}/]{step}/``."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from skipinject.dump_root import DumpRoot
from skipinject.verl.compat import select

#: The project directory of calls made without a verl trainer config in sight.
DEFAULT_PROJECT = "skipinject_default"
#: verl's defaults for ``trainer.experiment_name`` and ``trainer.project_name``.
VERL_EXPERIMENT, VERL_PROJECT = "default_experiment_name", "default_project_name"
#: The verl settings naming each field of a layout directory (:func:`layout_of` reads them).
LAYOUT_SETTINGS = {
    "gbs": "the batch size (data.gen_batch_size, else data.train_batch_size)",
    "n": "actor_rollout_ref.rollout.n",
    "prompt_length": "data.max_prompt_length",
    "response_length": "data.max_response_length",
}
#: The trainer settings naming a run's directory (``{experiment}_{project}``).
RUN_SETTINGS = ("experiment_name", "project_name")
#: A layout directory's name, as any writer may have made it (:func:`layout_values` reads it).
LAYOUT_RE = re.compile(r"^GBS(-?[0-9]+)_N(-?[0-9]+)_in(-?[0-9]+)_out(-?[0-9]+)$")


def path_safe(name: str) -> str:
    """A directory name from config text that cannot leave its parent."""
    cleaned = str(name).replace("/", "_").replace("\\", "_").replace("\x00", "_")
    return "_" if cleaned in ("", ".", "..") else cleaned


def layout_of(config: Any, before_trainer: bool = False) -> tuple[str, dict[str, Any]]:
    """Upstream's ``{experiment}_{project}/GBS{gbs}_N{n}_in{p}_out{r}`` and the values naming it;
    ``before_trainer``: ``config`` is the driver's (:func:`trainer_batch_size`)."""
    gbs = trainer_batch_size(config) if before_trainer else None
    if gbs is None:
        gbs = select(config, "data.gen_batch_size")
    if gbs is None:
        gbs = select(config, "data.train_batch_size", 0)
    context: dict[str, Any] = {
        "experiment_name": str(select(config, "trainer.experiment_name", VERL_EXPERIMENT)),
        "project_name": str(select(config, "trainer.project_name", VERL_PROJECT)),
        "gbs": int(gbs),
        "n": int(select(config, "actor_rollout_ref.rollout.n", 0)),
        "prompt_length": int(select(config, "data.max_prompt_length", 0)),
        "response_length": int(select(config, "data.max_response_length", 0)),
    }
    relative = f"{path_safe(context['experiment_name'] + '_' + context['project_name'])}/{layout_name(context)}"
    return relative, context


def trainer_batch_size(config: Any) -> int | None:
    """The ``data.gen_batch_size`` verl's V1 trainer sets at start (not yet in the driver's config): 1 whenever
    refills must be exact (``trainer_mode`` not ``sync``, group filtering, ``sync_refill_failed_groups``);
    ``None``: the config's own value stands (V0, older verls)."""
    if select(config, "trainer.use_v1") is not True:
        return None
    asynchronous = select(config, "trainer.v1.trainer_mode", "sync") != "sync"
    filtering = bool(select(config, "algorithm.filter_groups.enable", False))
    refilling = bool(select(config, "trainer.v1.sampler.sync_refill_failed_groups", False))
    return 1 if asynchronous or filtering or refilling else None


def layout_name(context: Mapping[str, Any]) -> str:
    """``GBS{gbs}_N{n}_in{prompt_length}_out{response_length}`` of a layout's values."""
    return f"GBS{context['gbs']}_N{context['n']}_in{context['prompt_length']}_out{context['response_length']}"


def layout_label(context: Mapping[str, Any], fallback: str) -> str:
    """The layout a trainer context names (``GBS8_N2_in32_out16``), or ``fallback`` without one."""
    try:
        return layout_name(context)
    except KeyError:
        return fallback


def layout_values(name: str) -> dict[str, int] | None:
    """The values a layout directory's ``name`` gives (:func:`layout_name`'s inverse), or ``None``."""
    match = LAYOUT_RE.match(name)
    if match is None:
        return None
    return dict(zip(("gbs", "n", "prompt_length", "response_length"), map(int, match.groups()), strict=True))


def run_names(name: str) -> tuple[str, str] | None:
    """``(experiment_name, project_name)`` of a run directory ``{experiment}_{project}``, where the
    name alone tells them apart (one ``_``, or one of verl's default names), else ``None``."""
    if name.count("_") == 1:
        experiment, project = name.split("_")
        return experiment, project
    if name.startswith(f"{VERL_EXPERIMENT}_"):
        return VERL_EXPERIMENT, name[len(VERL_EXPERIMENT) + 1 :]
    if name.endswith(f"_{VERL_PROJECT}"):
        return name[: -len(VERL_PROJECT) - 1], VERL_PROJECT
    return None


#: A layout directory's batch size (the rest of the name is compared whole).
_GBS = re.compile(r"GBS(-?(?:0|[1-9][0-9]{0,11}))_")


def batch_size_layouts(names: Iterable[str], context: Mapping[str, Any]) -> list[tuple[str, int]]:
    """The layouts among ``names`` that differ from ``context``'s in the batch size only, as
    ``(name, gbs)`` sorted by batch size (``action=match`` looks rows up there too)."""
    found = []
    for name in names:
        match = _GBS.match(name)
        if match is None:
            continue
        gbs = int(match.group(1))
        if gbs != context.get("gbs") and name == layout_name({**context, "gbs": gbs}):
            found.append((name, gbs))
    return sorted(found, key=lambda item: item[1])


def other_batch_sizes(
    project: Path, context: Mapping[str, Any], subdir: str, names_above: Callable[[int], Iterable[str]]
) -> list[tuple[Path, dict[str, Any]]]:
    """The project directories (and values) of the layouts beside ``project``'s differing in the batch size
    only, nearest first; ``names_above(levels)`` lists the experiment's directory, once."""
    if not {"gbs", "n", "prompt_length", "response_length"} <= set(context):
        return []
    subdir = path_safe(subdir) if subdir else ""
    layout = project.parent if subdir else project
    if layout.name != layout_name(context) or (subdir and project.name != subdir):
        return []
    found = batch_size_layouts(names_above(2 if subdir else 1), context)
    found.sort(key=lambda item: abs(item[1] - int(context["gbs"])))
    return [
        (layout.parent / name / subdir if subdir else layout.parent / name, {**context, "gbs": gbs})
        for name, gbs in found
    ]


def project_dir(
    root: DumpRoot, config: Any, subdir: str, *, before_trainer: bool = False
) -> tuple[Path, dict[str, Any]]:
    """The directory (a ``Path`` or ``RemotePath``) of one role's steps for a run with ``config`` (``None``: no
    trainer seen); ``before_trainer``: ``config`` is the driver's."""
    relative, context = (DEFAULT_PROJECT, {}) if config is None else layout_of(config, before_trainer)
    if subdir:
        relative = f"{relative}/{path_safe(subdir)}"
    location = root.location()
    for piece in relative.split("/"):
        location = location / piece
    return location, context
