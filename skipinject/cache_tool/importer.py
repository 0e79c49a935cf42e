"""``import``: verl's own pickled caches, converted into skipinject's format beside them (``--trust`` only).

verl writes ``{layout}/{step}/gen_batch.dp`` (a pickled DataProto; V0 trainer and fully async),
``{layout}/{step}/{k}/tq_batch.pt`` (``torch.save`` of a TransferQueue mini-batch; V1 trainer), and
before 0.9 ``{layout}/genstep_{gen_step:06d}/{gen_batch,new_batch}.dp`` with ``meta.json`` holding
``global_steps``. Loading any of them runs code from the file, so nothing is loaded without
``--trust``. The converted step is written by the store's :class:`~skipinject.store.StepWriter`
with the role's codec, under the role name and trainer context the engine looks for, so the next
run hits it; verl's files are left where they are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from skipinject.cache_tool.commands import FOUND, OK, USAGE, CommandError, existing_dir
from skipinject.cache_tool.plugins import InstalledRoles
from skipinject.cache_tool.progress import Progress
from skipinject.cache_tool.render import emit_json, schema
from skipinject.cache_tool.scan import (
    LAYOUT_RE,
    V0_FILE,
    V0_INPUT_FILE,
    V1_FILE,
    Item,
    load_meta_json,
    read_bounded,
    scan,
)
from skipinject.errors import CorruptCacheError
from skipinject.roles import Call, Role, UpstreamFormat
from skipinject.store import META_NAME, StepStore

#: verl's defaults for trainer.experiment_name / trainer.project_name (``layout_of`` uses them too).
DEFAULT_EXPERIMENT, DEFAULT_PROJECT = "default_experiment_name", "default_project_name"
_SAMPLE_ID = re.compile(r"(?:uid_)?sample_[0-9]{1,18}_[0-9]{1,18}")
WARNING = (
    "verl's caches are pickles (gen_batch.dp, tq_batch.pt): loading one runs whatever code it holds. "
    "Import only caches you wrote yourself or otherwise trust, with --trust."
)


def context_for(layout_dir: Path, experiment: str | None, project: str | None) -> dict[str, Any]:
    """The trainer context naming ``layout_dir`` (what the engine's ``layout_of`` gives for that run)."""
    match = LAYOUT_RE.match(layout_dir.name)
    if not match:
        raise CommandError(f"{layout_dir}: not a GBS.._N.._in.._out.. layout directory")
    gbs, n, prompt, response = (int(g) for g in match.groups())
    name = layout_dir.parent.name
    if experiment is None or project is None:
        found = _known_names(layout_dir.parent)
        if found is not None:
            experiment, project = found
        elif name.count("_") == 1:
            experiment, project = name.split("_")
        elif name.startswith(f"{DEFAULT_EXPERIMENT}_"):
            experiment, project = DEFAULT_EXPERIMENT, name[len(DEFAULT_EXPERIMENT) + 1 :]
        elif name.endswith(f"_{DEFAULT_PROJECT}"):
            experiment, project = name[: -len(DEFAULT_PROJECT) - 1], DEFAULT_PROJECT
        else:
            raise CommandError(
                f"{layout_dir.parent}: cannot tell the experiment name from the project name in {name!r}; "
                "give --experiment and --project (trainer.experiment_name, trainer.project_name)"
            )
    if f"{experiment}_{project}".replace("/", "_").replace("\\", "_") != name:
        raise CommandError(f"--experiment {experiment!r} --project {project!r} do not name the directory {name!r}")
    return {
        "experiment_name": experiment,
        "project_name": project,
        "gbs": gbs,
        "n": n,
        "prompt_length": prompt,
        "response_length": response,
    }


def _known_names(project_dir: Path) -> tuple[str, str] | None:
    """Experiment and project names from any skipinject step already cached for this project."""
    for item in scan(project_dir):
        context = (item.meta or {}).get("context") if item.kind == "skipinject" else None
        if isinstance(context, dict) and {"experiment_name", "project_name"} <= set(context):
            return str(context["experiment_name"]), str(context["project_name"])
    return None


def _target(item: Item) -> tuple[Path, int]:
    """(layout directory, step) the engine reads this upstream step from."""
    if item.kind == "verl-0.8":
        step = item.step or 0
        try:
            record = json.loads(read_bounded(item.path / META_NAME, 1 << 16))
            step = int(record.get("global_steps", step))
        except Exception:
            pass
        return item.path.parent, step
    return item.path.parent, int(item.path.name)


def guess_role(batch: Any) -> str:
    """``async_rollout`` for a fully async sample (uid ``[uid_]sample_<epoch>_<index>``), else ``rollout``."""
    uids = getattr(batch, "non_tensor_batch", {}).get("uid")
    if uids is not None and len(uids) and _SAMPLE_ID.fullmatch(str(uids[0])):
        return "async_rollout"
    return "rollout"


def _upstream(roles: InstalledRoles, file_name: str) -> tuple[Role, UpstreamFormat]:
    """The installed plugin's declaration of verl's cache file ``file_name`` (no plugin is imported by name)."""
    found = roles.upstream(file_name)
    if found is None:
        raise CommandError(
            f"importing {file_name.rsplit('/', 1)[-1]} needs the plugin whose role declares it installed "
            "(an UpstreamFormat; plugins/rollout and plugins/rollout_tq for verl's own caches)"
        )
    return found


def _load_dataproto(roles: InstalledRoles, path: Path) -> Any:
    """verl's pickled DataProto, by the loader its plugin declares (what ``trust_upstream`` uses).

    Unpickling stays in the plugins that own verl's formats; nothing in ``skipinject/`` unpickles.
    """
    return _upstream(roles, V0_FILE)[1].load(path)  # trusted: --trust


def _load_tq_parts(roles: InstalledRoles, step_dir: Path) -> list[dict[str, Any]]:
    """verl's ``{step}/{k}/tq_batch.pt`` parts, by the loader their plugin declares (``trust_upstream``):
    handed part 0, it reads every part of the step."""
    parts = _upstream(roles, f"0/{V1_FILE}")[1].load(step_dir / "0" / V1_FILE)  # trusted: --trust
    return list(parts)


def _fingerprint(roles: InstalledRoles, input_path: Path, role_name: str) -> list[str] | None:
    """verl < 0.9 kept the input batch (``new_batch.dp``): the importing role's input fingerprint of it."""
    role = roles.role(role_name)
    if role is None or role.fingerprint is None:
        return None
    batch = _load_dataproto(roles, input_path)
    # The roles read ``call.batch``: the first argument of the call they intercepted.
    call = Call(target="skipinject cache import", function=_fingerprint, instance=None, args=(batch,), kwargs={})
    rows = role.fingerprint(call)
    return None if rows is None else [str(r) for r in rows]


def import_item(
    item: Item,
    *,
    role: str | None,
    experiment: str | None,
    project: str | None,
    roles: InstalledRoles | None = None,
) -> dict[str, Any]:
    """Convert one upstream step with the loaders the installed plugins declare; returns its report record."""
    roles = roles or InstalledRoles()
    layout_dir, step = _target(item)
    context = context_for(layout_dir, experiment, project)
    record: dict[str, Any] = {"source": str(item.path), "kind": item.kind, "step": step}
    if item.kind == "verl-v1":
        from skipinject.codecs import TensorDictCodec

        role_name = role or "rollout_tq"
        store = StepStore(layout_dir, role_name, context)
        if _already(store, step):
            return {**record, "role": role_name, "status": "already", "path": str(store.step_dir(step))}
        codec = TensorDictCodec()
        writer = store.begin(step)
        rows = 0
        try:
            values = _load_tq_parts(roles, item.path)
            if len(values) != len(item.files):
                raise CorruptCacheError(f"{item.path}: {len(values)} parts loaded, {len(item.files)} found")
            for index, (path, value) in enumerate(zip(item.files, values, strict=True)):
                if not {"tensordict", "keys", "tags"} <= set(value):
                    raise CorruptCacheError(f"{path}: not a TransferQueue batch payload")
                payload = codec.encode(dict(value))
                rows += payload.rows or 0
                writer.add_part(payload, part=str(index))
            directory = writer.commit(
                {"parameter_sync_step": len(item.files), "trajectories": rows, "imported_from": str(item.path)}
            )
        except BaseException:
            writer.abort()
            raise
    else:
        from skipinject.codecs import DataProtoCodec

        source = item.path / V0_FILE
        batch = _load_dataproto(roles, source)
        role_name = role or guess_role(batch)
        store = StepStore(layout_dir, role_name, context)
        if _already(store, step):
            return {**record, "role": role_name, "status": "already", "path": str(store.step_dir(step))}
        inputs = (
            _fingerprint(roles, item.path / V0_INPUT_FILE, role_name) if (item.path / V0_INPUT_FILE).is_file() else None
        )
        payload = DataProtoCodec().encode(batch)
        directory = store.save(step, payload, {"inputs": inputs, "imported_from": str(source)})
    store.verified(step)  # what the engine will check before serving it
    return {**record, "role": role_name, "status": "imported", "path": str(directory)}


def _already(store: StepStore, step: int) -> bool:
    try:
        meta = load_meta_json(store.step_dir(step) / META_NAME)
    except (CorruptCacheError, FileNotFoundError):
        return False
    if meta is None:
        return False
    try:
        store.verified(step)
    except (CorruptCacheError, FileNotFoundError):
        return False
    return True


def cmd_import(
    paths: Sequence[Path],
    *,
    trust: bool,
    role: str | None,
    experiment: str | None,
    project: str | None,
    as_json: bool,
) -> int:
    items: list[Item] = []
    for path in paths:
        if path.is_symlink():  # as show and verify: the path given is read, never a link's target
            raise CommandError(f"{path}: a symbolic link; give the directory it points to if you trust it")
        existing_dir(path)
        items += [i for i in scan(path) if i.state == "foreign"]
    if not trust:
        if as_json:
            emit_json({"schema": schema("import"), "trusted": False, "found": [i.record() for i in items]})
        else:
            for item in items:
                print(f"found {item.kind} {item.path}")
            print(f"{len(items)} verl cache step(s) found, none imported. {WARNING}")
        return USAGE if items else OK
    results = []
    roles = InstalledRoles()
    with Progress(sum(i.size for i in items), "import") as bar:
        for item in items:
            try:
                results.append(import_item(item, role=role, experiment=experiment, project=project, roles=roles))
            except CommandError as exc:
                results.append({"source": str(item.path), "kind": item.kind, "status": "failed", "error": str(exc)})
            except Exception as exc:  # a broken pickle must not stop the others
                error = f"{type(exc).__name__}: {exc}"
                results.append({"source": str(item.path), "kind": item.kind, "status": "failed", "error": error})
            bar.update(item.size, f"step {item.step}")
    failed = [r for r in results if r["status"] == "failed"]
    if as_json:
        emit_json({"schema": schema("import"), "trusted": True, "steps": results})
    else:
        for r in results:
            if r["status"] == "failed":
                print(f"FAILED {r['source']}: {r['error']}")
            else:
                verb = "imported" if r["status"] == "imported" else "already imported"
                print(f"{verb} {r['source']} -> {r['path']} (role {r['role']}, step {r['step']})")
        done = sum(r["status"] == "imported" for r in results)
        print(f"{done} step(s) imported, {len(results) - done - len(failed)} already there, {len(failed)} failed")
    return FOUND if failed else OK
