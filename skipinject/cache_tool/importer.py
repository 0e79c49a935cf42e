"""``import``: verl's own pickled caches, converted into skipinject's format beside them (``--trust`` only).

The declaring role's loader (:class:`~skipinject.roles.UpstreamFormat`) reads a cache, a role whose format
``claims`` the value takes it, its codec encodes it; verl's files are left where they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from skipinject.cache_tool.common import FOUND, OK, USAGE, CommandError, Progress, emit_json, mutable_root, say
from skipinject.cache_tool.plugins import InstalledRoles, Upstream
from skipinject.cache_tool.scan import Item, scan
from skipinject.errors import CorruptCacheError
from skipinject.roles import Call
from skipinject.store import META_NAME, STEP_NAME, StepMeta, StepStore, local_kind, read_json, read_record
from skipinject.verl.compat import STEP_KEY
from skipinject.verl.layout import layout_values, path_safe, run_names

WARNING = (
    "verl's caches are pickles: loading one runs whatever code it holds. "
    "Import only caches you wrote yourself or otherwise trust, with --trust."
)


def context_for(layout_dir: Path, experiment: str | None, project: str | None) -> dict[str, Any]:
    """The trainer context naming ``layout_dir`` (what the engine's ``layout_of`` gives for that run)."""
    values = layout_values(layout_dir.name)
    if values is None:
        raise CommandError(f"{layout_dir}: not a GBS.._N.._in.._out.. layout directory")
    name = layout_dir.parent.name
    if experiment is None or project is None:
        known = [i.meta.context for i in scan(layout_dir.parent) if i.kind == "skipinject" and i.meta]
        named = [c for c in known if isinstance(c, dict) and {"experiment_name", "project_name"} <= set(c)]
        # the names a skipinject step already cached here records, else the directory's
        found = (str(named[0]["experiment_name"]), str(named[0]["project_name"])) if named else run_names(name)
        if found is None:
            raise CommandError(
                f"{layout_dir.parent}: cannot tell the experiment name from the project name in {name!r}; "
                "give --experiment and --project (trainer.experiment_name, trainer.project_name)"
            )
        experiment, project = found
    if path_safe(f"{experiment}_{project}") != name:
        raise CommandError(f"--experiment {experiment!r} --project {project!r} do not name the directory {name!r}")
    return {"experiment_name": experiment, "project_name": project, **values}


def _owner(roles: InstalledRoles, upstream: Upstream, value: Any) -> str:
    """The first role whose declaration of the same file ``claims`` the value, else the declaring one."""
    key = (upstream.format.directory, upstream.format.file_name)
    for other in roles.upstreams():
        claims = other.format.claims
        if (other.format.directory, other.format.file_name) == key and claims is not None and claims(value):
            return other.role
    return upstream.role


def _fingerprint(roles: InstalledRoles, upstream: Upstream, input_path: Path, role_name: str) -> list[str] | None:
    """The importing role's input fingerprint of the input batch verl kept beside (``inputs_file``)."""
    role = roles.role(role_name)
    if role is None or role.fingerprint is None:
        return None
    batch = upstream.format.load(input_path)  # trusted: --trust; the roles read it as ``call.batch``
    call = Call(target="skipinject cache import", function=_fingerprint, instance=None, args=(batch,), kwargs={})
    rows = role.fingerprint(call)
    return None if rows is None else [str(r) for r in rows]


def import_item(
    item: Item,
    *,
    role: str | None,
    experiment: str | None,
    project: str | None,
    roles: InstalledRoles,
    root: Path | None = None,
) -> dict[str, Any]:
    """Convert one upstream step with the loader and codec the installed plugins declare (into a tree trusted
    from ``root`` down, as a run's dump directory); its report record."""
    upstream = item.upstream
    if upstream is None:
        raise CommandError(f"{item.path}: no installed plugin declares this cache")
    layout_dir, step, key = item.path.parent, item.step or 0, upstream.format.step_key
    with contextlib.suppress(Exception):  # the step the engine reads it as
        step = step if key is None else int(read_json(item.path / META_NAME).get(key, step))
    if not STEP_NAME.fullmatch(str(step)):  # a directory no reader lists, nor prune removes
        raise CorruptCacheError(f"{item.path}: {META_NAME} records {key} {str(step)[:40]}, no step number")
    context = context_for(layout_dir, experiment, project)
    record: dict[str, Any] = {"source": str(item.path), "kind": item.kind, "step": step}
    value = upstream.format.load(item.files[0])  # trusted: --trust
    role_name = role or _owner(roles, upstream, value)
    codec = roles.codec(role_name)
    if codec is None:
        raise CommandError(f"no installed plugin provides role {role_name!r} (give --role an installed role)")
    plugin = roles.plugin_of(role_name)
    store = StepStore(layout_dir, role_name, context, plugin=plugin, step_aliases=(STEP_KEY,), dump_dir=root)
    with contextlib.suppress(CorruptCacheError, FileNotFoundError):
        if read_record(store.step_dir(step)) is not None and store.verified(step):
            return {**record, "role": role_name, "status": "already", "path": str(store.step_dir(step))}
    parts = list(value) if upstream.per_part else [value]  # the loader, handed part 0, reads every part
    if len(parts) != len(item.files) and upstream.per_part:
        raise CorruptCacheError(f"{item.path}: {len(parts)} parts loaded, {len(item.files)} found")
    meta: dict[str, Any] = {"imported_from": str(item.path if upstream.per_part else item.files[0])}
    if not upstream.per_part:
        inputs = item.path / upstream.format.inputs_file if upstream.format.inputs_file else None
        found = _fingerprint(roles, upstream, inputs, role_name) if inputs in item.files and inputs else None
        meta = StepMeta.build(inputs=found, calls=None, extra=meta)
    writer = store.begin(step)
    try:
        for index, part in enumerate(parts):
            writer.add_part(codec.encode(part), part=str(index) if upstream.per_part else "")
        directory = writer.commit(meta)
    except BaseException:
        writer.abort()
        raise
    store.verified(step)  # what the engine will check before serving it
    return {**record, "role": role_name, "status": "imported", "path": str(directory)}


def cmd_import(
    paths: Sequence[Path], *, trust: bool, role: str | None, experiment: str | None, project: str | None, as_json: bool
) -> int:
    items: list[tuple[Item, Path]] = []
    roles = InstalledRoles()
    for path in paths:
        if local_kind(path) == "link":  # the path given is read, never a link's target
            raise CommandError(f"{path}: a symbolic link; give the directory it points to if you trust it")
        mutable_root(path, "import")
        items += [(i, path) for i in scan(path, roles=roles) if i.state == "foreign"]
    if not trust:
        if as_json:
            emit_json("import", {"trusted": False, "found": [i.record() for i, _ in items]})
        else:
            for item, _ in items:
                say(f"found {item.kind} {item.path}")
            say(f"{len(items)} verl cache step(s) found, none imported. {WARNING}")
        return USAGE if items else OK
    results = []
    with Progress(sum(i.size for i, _ in items), "import") as bar:
        for item, root in items:
            try:
                found = import_item(item, role=role, experiment=experiment, project=project, roles=roles, root=root)
                results.append(found)
            except Exception as exc:  # a broken pickle must not stop the others
                error = str(exc) if isinstance(exc, CommandError) else f"{type(exc).__name__}: {exc}"
                results.append({"source": str(item.path), "kind": item.kind, "status": "failed", "error": error})
            bar.update(item.size, f"step {item.step}")
    failed = [r for r in results if r["status"] == "failed"]
    if as_json:
        emit_json("import", {"trusted": True, "steps": results})
    else:
        for r in results:
            if r["status"] == "failed":
                say(f"FAILED {r['source']}: {r['error']}")
            else:
                verb = "imported" if r["status"] == "imported" else "already imported"
                say(f"{verb} {r['source']} -> {r['path']} (role {r['role']}, step {r['step']})")
        done = sum(r["status"] == "imported" for r in results)
        say(f"{done} step(s) imported, {len(results) - done - len(failed)} already there, {len(failed)} failed")
    return FOUND if failed else OK
