"""What scored a rollout: the reward's identity, recorded with every saved rollout step.

verl >= 0.7 scores each trajectory inside the rollout (the agent loop's reward-loop workers), so a
cached rollout carries the recorded run's ``rm_scores``. To tell whether this run would have scored
the served responses alike, each saved step's ``meta.json`` holds, under ``"reward"``:

* ``settings``: every setting of the run config's reward subtrees that decides a score, flattened to
  dotted keys. Where those keys live depends on the verl version, so all of them are read:
  ``reward.*`` (verl >= 0.8: ``reward_manager.{name,source,module.*}``, ``custom_reward_function.*``,
  ``reward_model.*``, ``sandbox_fusion.*``), the older top-level ``reward_model.*`` (``enable``,
  ``model.path``, ``reward_manager``, ``reward_kwargs``, ``reward_loop_*`` …) and
  ``custom_reward_function.{path,name,reward_kwargs}`` (verl 0.4-0.8), and ``data.reward_fn_key``.
  Keys that only decide where or how fast a score is computed (worker counts, GPUs, batch sizes,
  engine tuning) are left out (:data:`NOT_DECIDING`).
* ``files``: for every ``path``/``*_path`` setting naming a file (the custom reward function, a
  custom reward manager module), its path and a digest of its content: the content decides, not
  where it lies.
* ``digest``: one digest of all that (file paths left out, file contents in): two runs score alike
  when their digests are equal.

What is in it, what is not, and why: docs/rescore.md ("The reward's identity").
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import stat as stat_kind
import sys
import sysconfig
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from skipinject import Call, select

#: The ``meta.json`` key holding the identity.
META_KEY = "reward"
#: Config subtrees read, in every supported verl (absent ones are skipped).
REWARD_TREES = ("reward", "reward_model", "custom_reward_function")
#: Single settings outside those subtrees that decide a score.
REWARD_SETTINGS = ("data.reward_fn_key",)
#: The policy's model directory (recorded beside the identity; it decides no reward).
MODEL_SETTING = "actor_rollout_ref.model.path"
#: Leaf names that decide where or how fast a score is computed, never its value.
NOT_DECIDING = frozenset(
    {
        "_target_",
        "num_workers",
        "enable_resource_pool",
        "n_gpus_per_node",
        "nnodes",
        "micro_batch_size",
        "micro_batch_size_per_gpu",
        "use_dynamic_bsz",
        "forward_max_token_len_per_gpu",
        "ulysses_sequence_parallel_size",
        "strategy",
        "fsdp_config",
        "profiler",
        "launch_reward_fn_async",
        "gpu_memory_utilization",
        "enforce_eager",
        "cudagraph_capture_sizes",
        "free_cache_engine",
        "data_parallel_size",
        "expert_parallel_size",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "max_num_batched_tokens",
        "max_num_seqs",
        "load_format",
        "layered_summon",
        "scheduling_policy",
        "enable_chunked_prefill",
        "enable_prefix_caching",
        "disable_log_stats",
        "multi_stage_wake_up",
        "max_concurrent",
        "disaggregation",
    }
)
#: Subtrees of tuning that decide no score (a mapping named in :data:`NOT_DECIDING` otherwise is read:
#: those names are scalars in every verl, so a mapping under one is a setting of the user's own).
TUNING_TREES = frozenset({"fsdp_config", "profiler", "disaggregation"})
#: Bytes read at a time when a file is digested (memory stays bounded whatever its size).
CHUNK_BYTES = 1 << 20
#: Files of local modules digested beside a reward file (its imports that live beside it), at most.
MAX_LOCAL_MODULES = 64
#: How deep a Python object in the config (a class, a function, a partial, their bound values) is followed.
MAX_OBJECT_DEPTH = 6
#: A file's digest when it cannot be read: never equal to a content's, and it forces re-scoring.
UNREADABLE = "unreadable"


def _plain(value: Any) -> Any:
    """An OmegaConf node as plain containers (resolved), else the value itself."""
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(value):
            return OmegaConf.to_container(value, resolve=True)
    except Exception:
        pass
    return value


def _leaves(prefix: str, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for key in sorted(value, key=str):
            name, item = str(key), value[key]
            if name in TUNING_TREES or (name in NOT_DECIDING and not isinstance(item, Mapping)):
                continue
            yield from _leaves(f"{prefix}.{key}", item)
        return
    yield prefix, _json_safe(value)


def _json_safe(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON that is equal across processes exactly when the value decides alike: a Python
    object in the config (a class, a function, a lambda, a ``partial``) by its code and bound values,
    never by its ``repr`` (an address, or a name that stays when the body changes)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > MAX_OBJECT_DEPTH:
        return {"object": _type_name(value), "beyond": MAX_OBJECT_DEPTH}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item, depth + 1) for item in value]
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):  # in an order no hash seed changes
        items = [_json_safe(item, depth + 1) for item in value]
        return {"set": sorted(items, key=lambda item: json.dumps(item, sort_keys=True, default=str))}
    if isinstance(value, functools.partial):
        return {
            "partial": _json_safe(value.func, depth + 1),
            "args": _json_safe(list(value.args), depth + 1),
            "keywords": _json_safe(dict(value.keywords), depth + 1),
        }
    if isinstance(value, types.MethodType):
        return {"method": _json_safe(value.__func__, depth + 1), "self": _json_safe(value.__self__, depth + 1)}
    if isinstance(value, types.FunctionType):
        return _function_identity(value, depth)
    if isinstance(value, type):
        return _class_identity(value, depth)
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": hashlib.sha256(value).hexdigest()[:16]}
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict):  # an instance (a class-based reward): its class and its attributes
        return {"instance": _class_identity(type(value), depth + 1), "state": _json_safe(state, depth + 1)}
    return {"object": _type_name(value), "repr": repr(value)}


def _type_name(value: Any) -> str:
    kind = value if isinstance(value, type) else type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def _installed(module: str) -> bool:
    """A module of the standard library or an installed package (identified by the environment's versions)."""
    if module in sys.builtin_module_names:
        return True
    where = getattr(sys.modules.get(module), "__file__", None)
    if not isinstance(where, str):  # loaded from a file by path (verl's load_module), or made at run time
        return False
    roots = {sysconfig.get_paths()[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    return any(os.path.realpath(where).startswith(os.path.realpath(root) + os.sep) for root in roots)


def _code_digest(code: types.CodeType) -> str:
    """What a code object does (its instructions, names and constants, nested code too), not where it lies."""
    digest = hashlib.sha256()
    parts: list[Any] = [code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_argcount]
    parts.append(code.co_kwonlyargcount)
    digest.update(repr(parts).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            digest.update(_code_digest(const).encode())
        elif isinstance(const, frozenset):  # ``x in {"a", "b"}``: its order follows the hash seed
            digest.update(repr(sorted(repr(item) for item in const)).encode())
        else:
            digest.update(repr(const).encode())
    return digest.hexdigest()[:16]


def _function_identity(function: types.FunctionType, depth: int) -> dict[str, Any]:
    cells = [cell.cell_contents for cell in function.__closure__ or () if _cell_filled(cell)]
    return {
        "function": f"{function.__module__}.{function.__qualname__}",
        "code": _code_digest(function.__code__),
        "defaults": _json_safe(list(function.__defaults__ or ()), depth + 1),
        "kwdefaults": _json_safe(dict(function.__kwdefaults__ or {}), depth + 1),
        "closure": _json_safe(cells, depth + 1),
    }


def _cell_filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _class_identity(kind: type, depth: int) -> dict[str, Any]:
    """A class by its name and, unless it is installed (the environment's versions name it), the code of its
    own methods and attributes and of its bases."""
    name = f"{kind.__module__}.{kind.__qualname__}"
    if _installed(kind.__module__):
        return {"class": name}
    body = {
        str(key): _json_safe(getattr(item, "__func__", item), depth + 1)
        for key, item in sorted(vars(kind).items())
        if not (str(key).startswith("__") and str(key).endswith("__")) or str(key) in ("__init__", "__call__")
    }
    return {"class": name, "body": body, "bases": [_json_safe(base, depth + 1) for base in kind.__bases__]}


def file_digest(path: str) -> str:
    """A short digest of a regular file's whole content, read in bounded chunks whatever its size;
    :data:`UNREADABLE` (with the reason) when it cannot be read or is no regular file."""
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        return f"{UNREADABLE}: {os.strerror(exc.errno) if exc.errno else type(exc).__name__}"
    try:
        if not stat_kind.S_ISREG(os.fstat(handle).st_mode):
            return f"{UNREADABLE}: not a regular file"
        digest = hashlib.sha256()
        while chunk := os.read(handle, CHUNK_BYTES):
            digest.update(chunk)
        return digest.hexdigest()[:16]
    except OSError as exc:
        return f"{UNREADABLE}: {os.strerror(exc.errno) if exc.errno else type(exc).__name__}"
    finally:
        os.close(handle)


def _file_of(value: str) -> str:
    """A ``file://`` setting as verl's ``load_module`` reads it: the path without the prefix."""
    return value[len("file://") :] if value.startswith("file://") else value


def _is_file_setting(key: str, value: Any) -> bool:
    leaf = key.rsplit(".", 1)[-1]
    return (
        (leaf == "path" or leaf.endswith("_path"))
        and isinstance(value, str)
        and bool(value)
        and not value.startswith("pkg://")
        and (value.endswith(".py") or (os.path.lexists(_file_of(value)) and not os.path.isdir(_file_of(value))))
    )


def local_modules(path: str) -> dict[str, str]:
    """The files of the modules a Python file imports that live beside it (its directory and below, its
    package's siblings by relative import), and theirs in turn: their digests by path relative to the file's
    directory, at most :data:`MAX_LOCAL_MODULES`. Installed packages and the standard library are not
    followed: the environment's versions identify them."""
    if not path.endswith(".py"):
        return {}
    base = Path(path).resolve().parent
    found: dict[str, str] = {}
    pending = [Path(path).resolve()]
    seen = set(pending)
    while pending and len(found) < MAX_LOCAL_MODULES:
        current = pending.pop(0)
        for module in _imported_files(current, base):
            if module not in seen and len(seen) <= MAX_LOCAL_MODULES:
                seen.add(module)
                pending.append(module)
                found[str(module.relative_to(base))] = file_digest(str(module))
    return dict(sorted(found.items()))


def _imported_files(source: Path, base: Path) -> list[Path]:
    try:
        if os.stat(source).st_size > 16 * CHUNK_BYTES:  # no module of a reward is 16 MiB of source
            return []
        tree = ast.parse(source.read_bytes())
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    names: list[tuple[Path, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend((base, alias.name.split(".")) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            up = source.parents
            if node.level > len(up):
                continue
            start = base if node.level == 0 else up[node.level - 1]
            dotted = (node.module or "").split(".") if node.module else []
            names.append((start, dotted))
            names.extend((start, [*dotted, alias.name]) for alias in node.names if alias.name != "*")
    files: list[Path] = []
    for start, parts in names:
        if not parts or not all(parts):
            continue
        for candidate in (start.joinpath(*parts).with_suffix(".py"), start.joinpath(*parts, "__init__.py")):
            if candidate.is_file() and candidate.resolve().is_relative_to(base):
                files.append(candidate.resolve())
                break
    return files


#: The last run configs asked about and their identities: a run asks at every saved and served step, and
#: resolving the reward subtrees costs ~10 ms a time; the reward's workers read its file once, at start.
_last: list[tuple[Any, dict[str, Any]]] = []
_REMEMBERED = 4


def reward_identity(config: Any) -> dict[str, Any] | None:
    """The reward identity of a run config (see the module's docstring); ``None`` without a config.
    Computed once per config object."""
    if config is None:
        return None
    for known, identity in _last:
        if known is config:
            return identity
    identity = _identity(config)
    _last[:] = [(config, identity), *_last[: _REMEMBERED - 1]]
    return identity


def _identity(config: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for tree in REWARD_TREES:
        node = _plain(select(config, tree))
        if node is not None:
            settings.update(_leaves(tree, node))
    for key in REWARD_SETTINGS:
        value = select(config, key)
        if value is not None:
            settings[key] = _json_safe(_plain(value))
    files: dict[str, dict[str, Any]] = {}
    for key, value in settings.items():
        if _is_file_setting(key, value):
            entry: dict[str, Any] = {"path": value, "sha256": file_digest(_file_of(value))}
            modules = local_modules(_file_of(value))
            if modules:
                entry["modules"] = modules
            files[key] = entry
    deciding = {key: value for key, value in settings.items() if key not in files}
    deciding.update({key: {k: v for k, v in entry.items() if k != "path"} for key, entry in files.items()})
    digest = hashlib.sha256(json.dumps(deciding, sort_keys=True, default=repr).encode()).hexdigest()[:16]
    return {"digest": digest, "settings": settings, "files": files}


def record_reward(call: Call) -> dict[str, Any] | None:
    """``Role.record_meta`` of the rollout roles: this run's reward identity under ``"reward"``."""
    identity = reward_identity(call.run_config)
    return None if identity is None else {META_KEY: identity}


def record_run(call: Call) -> dict[str, Any] | None:
    """``Role.record_meta`` of the rollout roles: :func:`record_reward`'s identity, and the model
    directory under ``"model"`` (``skipinject cache show`` decodes rows with its tokenizer)."""
    recorded = dict(record_reward(call) or {})
    model = select(call.run_config, MODEL_SETTING) if call.run_config is not None else None
    if isinstance(model, str) and model:
        recorded["model"] = model
    return recorded or None


def recorded_identity(meta: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The identity a ``meta.json`` records, or ``None`` (written before identities were, or not a mapping)."""
    identity = meta.get(META_KEY) if isinstance(meta, Mapping) else None
    if not isinstance(identity, Mapping) or not isinstance(identity.get("digest"), str):
        return None
    return identity


def unreadable_file(identity: Mapping[str, Any]) -> str | None:
    """The first file of an identity whose content could not be read (``path: reason``), else ``None``: such
    an identity equals no other, whatever its digest (a score it decides is unknown)."""
    for entry in _mapping(identity.get("files")).values():
        entry = _mapping(entry)
        digests = {str(entry.get("path")): entry.get("sha256")}
        digests.update({str(k): v for k, v in _mapping(entry.get("modules")).items()})
        for path, digest in digests.items():
            if not isinstance(digest, str) or not digest or digest.startswith(UNREADABLE):
                return f"{path}: {digest or UNREADABLE}"
    return None


def describe_difference(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    """What differs between two identities, briefly: ``custom_reward_function … digest a1b2 → c3d4``."""
    old_files = _mapping(recorded.get("files"))
    new_files = _mapping(current.get("files"))
    for key in sorted(set(old_files) | set(new_files)):
        old, new = _mapping(old_files.get(key)), _mapping(new_files.get(key))
        old_sha = old.get("sha256")
        old_modules, new_modules = _mapping(old.get("modules")), _mapping(new.get("modules"))
        for module in sorted(set(old_modules) | set(new_modules), key=str):
            if old_sha == new.get("sha256") and old_modules.get(module) != new_modules.get(module):
                return (
                    f"another {_short(key.rsplit('.', 1)[0])}: {_short(module)}, a module it imports, "
                    f"digest {str(old_modules.get(module))[:8]} → {str(new_modules.get(module))[:8]}"
                )
        if old_sha != new.get("sha256"):
            return (
                f"another {_short(key.rsplit('.', 1)[0])}: {_short(old.get('path'))} "
                f"digest {str(old_sha)[:8]} → {_short(new.get('path'))} digest {str(new.get('sha256'))[:8]}"
            )
    old_settings = _mapping(recorded.get("settings"))
    new_settings = _mapping(current.get("settings"))
    changed = [
        key
        for key in sorted(set(old_settings) | set(new_settings))
        if key not in new_files and key not in old_files and old_settings.get(key) != new_settings.get(key)
    ]
    if changed:
        key = changed[0]
        more = f" (and {len(changed) - 1} more settings)" if len(changed) > 1 else ""
        return f"another {_short(key)}: {_short(old_settings.get(key))} → {_short(new_settings.get(key))}{more}"
    return f"another reward (digest {str(recorded.get('digest'))[:8]} → {str(current.get('digest'))[:8]})"


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 60 else "…" + text[-57:]
