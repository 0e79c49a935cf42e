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
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
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
#: Largest reward file digested whole (a larger one is named by its size and modification time).
MAX_DIGESTED_BYTES = 64 << 20


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
            if str(key) in NOT_DECIDING:
                continue
            yield from _leaves(f"{prefix}.{key}", value[key])
        return
    yield prefix, _json_safe(value)


def _json_safe(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    return repr(value)


def file_digest(path: str) -> str:
    """A short digest of a file's content (size and time for a huge one); ``""`` when unreadable."""
    try:
        stat = os.stat(path)
        if stat.st_size > MAX_DIGESTED_BYTES:
            return f"size{stat.st_size}-mtime{stat.st_mtime_ns}"
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        return digest.hexdigest()[:16]
    except OSError:
        return ""


def _is_file_setting(key: str, value: Any) -> bool:
    leaf = key.rsplit(".", 1)[-1]
    return (leaf == "path" or leaf.endswith("_path")) and isinstance(value, str) and os.path.isfile(value)


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
    files = {
        key: {"path": value, "sha256": file_digest(value)}
        for key, value in settings.items()
        if _is_file_setting(key, value)
    }
    deciding = {key: value for key, value in settings.items() if key not in files}
    deciding.update({key: {"sha256": entry["sha256"]} for key, entry in files.items()})
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


def describe_difference(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    """What differs between two identities, briefly: ``custom_reward_function … digest a1b2 → c3d4``."""
    old_files = _mapping(recorded.get("files"))
    new_files = _mapping(current.get("files"))
    for key in sorted(set(old_files) | set(new_files)):
        old, new = _mapping(old_files.get(key)), _mapping(new_files.get(key))
        old_sha = old.get("sha256")
        if old_sha != new.get("sha256"):
            return (
                f"another {key.rsplit('.', 1)[0]}: {_short(old.get('path'))} "
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
        return f"another {key}: {_short(old_settings.get(key))} → {_short(new_settings.get(key))}{more}"
    return f"another reward (digest {str(recorded.get('digest'))[:8]} → {str(current.get('digest'))[:8]})"


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 60 else "…" + text[-57:]
