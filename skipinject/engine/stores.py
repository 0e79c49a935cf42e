"""A role with its settings in this process, as every part of the engine sees it: its codec,
fingerprints, one-time lines and the registry of its stores (one per project directory, checked once)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from skipinject.config import RoleConfig
from skipinject.roles import Call, Codec, Role
from skipinject.store import StepStore
from skipinject.store.compression import compression_for
from skipinject.store.hit_memory import HitMemory
from skipinject.verl.compat import STEP_KEY
from skipinject.verl.layout import other_batch_sizes, project_dir

logger = logging.getLogger("skipinject")


class RoleContext:
    """The role, its settings and the plugin that provides it; its codec, fingerprints, one-time lines,
    and its stores: the run's (named by its verl config), their siblings, other batch-size layouts."""

    def __init__(self, role: Role, settings: RoleConfig, owner: str) -> None:
        self.role = role
        self.settings = settings
        self.owner = owner
        self._lock = threading.Lock()
        self._warned: set[Any] = set()
        self._default_codec: Codec | None = None
        #: The memory this role's compressed hits decode into, kept between hits (``reuse_hit_memory``).
        self.hit_memory = HitMemory(settings.reuse_hit_memory)
        self._stores: dict[Path, StepStore] = {}  # a RemotePath stands in for a Path
        self._unusable: dict[Path, str | None] = {}
        self._stores_lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.role.name

    @property
    def subdir(self) -> str:
        return self.role.name if self.role.cache_subdir is None else self.role.cache_subdir

    @property
    def codec(self) -> Codec:
        if self.role.codec is not None:
            return self.role.codec
        if self._default_codec is None:
            from skipinject.verl.codecs import DataProtoCodec

            self._default_codec = DataProtoCodec()
        return self._default_codec

    def once(self, key: Any, level: int, message: str, *args: Any) -> None:
        """Log ``message`` the first time ``key`` is seen."""
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        logger.log(level, message, *args)

    def fingerprint(self, call: Call) -> list[str] | None:
        """The role's per-row digests of the call's inputs, or ``None`` (one warning when it fails)."""
        if self.role.fingerprint is None:
            return None
        try:
            rows = self.role.fingerprint(call)
        except Exception as exc:
            message = f"{self.name}: cannot fingerprint the inputs ({exc}); mismatches will not be detected"
            self.once(("fingerprint", type(exc)), logging.WARNING, message)
            return None
        return None if rows is None else [str(r) for r in rows]

    def extra_meta(self, call: Call) -> dict[str, Any]:
        """The role's ``record_meta`` fields for a result of ``call`` (none when it fails: one warning), and
        the values of its ``match_settings`` (a later miss names those that differ)."""
        recorded: dict[str, Any] = {}
        if self.role.match_settings:
            from skipinject.report.misses import SETTINGS_KEY, recorded_settings

            try:
                recorded[SETTINGS_KEY] = recorded_settings(self.role.match_settings, call.run_config)
            except Exception:  # only the explanation of a later miss depends on it
                pass
        if self.role.record_meta is None:
            return recorded
        try:
            return {**recorded, **dict(self.role.record_meta(call) or {})}
        except Exception as exc:
            message = f"{self.name}: cannot describe the result for meta.json ({type(exc).__name__}: {exc})"
            self.once(("record_meta", type(exc)), logging.WARNING, message + "; saved without it")
            return {}

    def after_miss(self, call: Call, result: Any) -> Any:
        return result if self.role.on_miss is None else self.role.on_miss(result, call)

    def store_for(self, call: Call) -> StepStore:
        """The store of this run (directory named by the run's verl config, like upstream)."""
        config = call.run_config
        project, context = project_dir(self.settings.root, config, self.subdir)
        with self._stores_lock:
            store = self._stores.get(project)
            if store is None:
                store = self._stores[project] = self.open(project, context)
                if config is None:
                    logger.info("%s: no verl trainer config seen; caching under %s", self.name, project)
                problem = self._unusable[project] = store.unusable()
                if problem is not None:
                    unusable = f"cache directory unusable ({problem}); this run neither loads nor saves caches there"
                    logger.warning(f"{self.name}: {unusable}")
            return store

    def unusable(self, store: StepStore) -> str | None:
        """Why ``store`` cannot be used at all this run (found once, logged once when it was opened)."""
        return self._unusable.get(store.project_dir)

    def batch_size_stores(self, store: StepStore, limit: int) -> list[StepStore]:
        """This role's usable stores in the layouts that differ from ``store``'s in the batch size only
        (at most ``limit``, the nearest first): ``action=match`` looks rows up there too. Never raises."""
        if self.unusable(store) is not None:
            return []
        subdir = self.subdir
        try:
            found = other_batch_sizes(store.project_dir, store.context, subdir, store.names_above)
        except Exception:
            return []
        if len(found) > limit:
            experiment = store.project_dir.parent.parent if subdir else store.project_dir.parent
            message = f"{self.name}: {experiment} holds {len(found)} other batch-size layouts; match looks rows up"
            self.once(("layouts", str(experiment)), logging.INFO, f"{message} in the {limit} nearest")
        stores = [self.open(directory, context) for directory, context in found[:limit]]
        return [sibling for sibling in stores if sibling.unusable() is None]

    def open(self, project: Path, context: dict[str, Any]) -> StepStore:
        """One store class for every ``dump_dir``; the backend (local files or fsspec) comes from its root."""
        root, trust = self.settings.root, self.settings.trust_dir_permissions
        return StepStore(
            project,
            self.name,
            context,
            trust_permissions=trust,
            dump_dir=root.path,
            plugin=self.owner,
            backend=root.backend(trust_permissions=trust),
            compression=compression_for(self.settings.compression, root.location()),
            memory=self.hit_memory,
            step_aliases=(STEP_KEY,),
            siblings=self.role.match_reads,
        )

    def opened(self) -> list[StepStore]:
        """The stores this role opened for its runs."""
        with self._stores_lock:
            return list(self._stores.values())
