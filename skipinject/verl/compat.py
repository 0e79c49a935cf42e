"""verl's runs: its version, the run config, the step, validation (in the plugin API). Nothing here imports verl."""

from __future__ import annotations

import functools
import importlib.machinery
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from skipinject.clock import CLOCK

#: The trainer's name for the training step (``trainer.global_steps``, ``meta_info["global_steps"]``),
#: also written into each step's ``meta.json`` beside ``step``.
STEP_KEY = "global_steps"


def select(config: Any, dotted: str, default: Any = None) -> Any:
    """``config.a.b`` for OmegaConf, dicts or objects; ``default`` when any part is missing or ``None``."""
    node = config
    for part in dotted.split("."):
        if node is None:
            return default
        try:
            node = node.get(part) if isinstance(node, Mapping) or hasattr(node, "get") else getattr(node, part)
        except Exception:
            try:
                node = getattr(node, part)
            except Exception:
                return default
    return default if node is None else node


def is_run_config(candidate: Any) -> bool:
    """A verl trainer config (it has a ``trainer`` section)."""
    return candidate is not None and select(candidate, "trainer") is not None


def run_config_of(call: Any) -> Any:
    """The verl config of the run a call belongs to: the bound instance's, else the trainer clock's."""
    for owner in (getattr(call, "instance", None), CLOCK.instance):
        candidate = getattr(owner, "config", None)
        if is_run_config(candidate):
            return candidate
    return None


def default_bypass(call: Any) -> bool:
    """Validation batches (``validate=True`` in the batch's meta or non-tensor data) always run the original."""
    batch = call.batch
    meta = getattr(batch, "meta_info", None)
    if isinstance(meta, Mapping) and meta.get("validate"):
        return True
    non_tensor = getattr(batch, "non_tensor_data", None)
    if isinstance(non_tensor, Mapping):
        try:
            return bool(non_tensor.get("validate", False))
        except Exception:
            return False
    return False


def attended_tokens(tensors: Any) -> list[Any] | None:
    """Each row's ``input_ids`` where ``attention_mask`` is set (padding left out), or ``None`` when
    the batch's tensors (a TensorDict) have no ``input_ids``."""
    keys = () if tensors is None else tensors.keys()  # TensorDict refuses ``in`` on itself
    if "input_ids" not in keys:
        return None
    ids = tensors["input_ids"]
    mask = tensors["attention_mask"] if "attention_mask" in keys else None
    return [ids[index] if mask is None else ids[index][mask[index].bool()] for index in range(ids.shape[0])]


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (its metadata: nothing is imported), or ``None``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def verl_version() -> str | None:
    """The installed verl's version, or ``None`` when verl is not installed."""
    return installed_version("verl")


def version_matches(specifier: str | None, version: str | None) -> bool:
    """Whether ``version`` is in ``specifier`` (``">=0.8,<0.9"``; none matches everything); development
    builds (``0.9.2.dev0+abc``) count as the release they lead to."""
    if not specifier:
        return True
    if version is None:
        return False
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    if parsed.is_prerelease:  # 0.9.1.dev0, 0.9.2rc1: the release they lead to (not below it)
        parsed = Version(parsed.base_version)
    return SpecifierSet(specifier).contains(parsed)


def installed_verl_matches(spec: str) -> bool:
    """Whether the installed verl is in ``spec`` (``">=0.9"``); ``True`` without verl (for clocks and checks)."""
    installed = verl_version()
    return installed is None or version_matches(spec, installed)


def settings_values(config: Any, paths: Sequence[str]) -> dict[str, Any]:
    """The run config's values at ``paths`` (dotted), as plain data: OmegaConf subtrees resolved."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    values = {path: select(config, path) for path in paths}
    return {
        path: OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value
        for path, value in values.items()
    }


def module_exists(dotted: str) -> bool:
    """Whether module ``dotted`` can be found, without importing it or its packages (file system only)."""
    if dotted in sys.modules:
        return True
    parts = dotted.split(".")
    search: list[str] | None = None
    for index in range(len(parts)):
        name = ".".join(parts[: index + 1])
        loaded = sys.modules.get(name)
        if loaded is not None:
            spec = getattr(loaded, "__spec__", None)
        else:
            try:
                spec = importlib.machinery.PathFinder.find_spec(name, search)
            except (ImportError, ValueError):
                return False
        if spec is None:
            return False
        locations = getattr(spec, "submodule_search_locations", None)
        search = list(locations) if locations is not None else None
        if search is None and index < len(parts) - 1:
            return False
    return True
