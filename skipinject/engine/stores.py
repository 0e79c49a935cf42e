"""A role's stores in this process: one per project directory, opened once, checked once."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from skipinject.engine.context import RoleContext
from skipinject.roles import Call
from skipinject.store import StepStore
from skipinject.store.compression import compression_for
from skipinject.store.hit_memory import HitMemory
from skipinject.verl.compat import STEP_KEY
from skipinject.verl.layout import other_batch_sizes, project_dir

logger = logging.getLogger("skipinject")


class RoleStores:
    """The registry of one role's stores: the run's (named by its verl config), their siblings and
    the project's other batch-size layouts; each store is found usable or not once."""

    def __init__(self, runtime: RoleContext) -> None:
        self.runtime = runtime
        #: The memory this role's compressed hits decode into, kept between hits (``reuse_hit_memory``).
        self.hit_memory = HitMemory(runtime.settings.reuse_hit_memory)
        self._stores: dict[Path, StepStore] = {}  # a RemotePath stands in for a Path
        self._unusable: dict[Path, str | None] = {}
        self._lock = threading.Lock()

    def store_for(self, call: Call) -> StepStore:
        """The store of this run (directory named by the run's verl config, like upstream)."""
        role, config = self.runtime.role, call.run_config
        subdir = role.name if role.cache_subdir is None else role.cache_subdir
        project, context = project_dir(self.runtime.settings.root, config, subdir)
        with self._lock:
            store = self._stores.get(project)
            if store is None:
                store = self._stores[project] = self.open(project, context)
                if config is None:
                    logger.info("%s: no verl trainer config seen; caching under %s", role.name, project)
                problem = self._unusable[project] = store.unusable()
                if problem is not None:
                    logger.warning(
                        "%s: cache directory unusable (%s); this run neither loads nor saves caches there",
                        role.name,
                        problem,
                    )
            return store

    def unusable(self, store: StepStore) -> str | None:
        """Why ``store`` cannot be used at all this run (found once, logged once when it was opened)."""
        return self._unusable.get(store.project_dir)

    def batch_size_stores(self, store: StepStore, limit: int) -> list[StepStore]:
        """This role's usable stores in the project's layouts that differ from ``store``'s in the batch
        size only (at most ``limit``, the nearest batch sizes first): ``action=match`` looks rows up
        there too. Never raises."""
        role = self.runtime.role
        if self.unusable(store) is not None:
            return []
        subdir = role.name if role.cache_subdir is None else role.cache_subdir

        try:
            found = other_batch_sizes(store.project_dir, store.context, subdir, store.names_above)
        except Exception:
            return []
        if len(found) > limit:
            experiment = store.project_dir.parent.parent if subdir else store.project_dir.parent
            self.runtime.once(
                ("layouts", str(experiment)),
                logging.INFO,
                "%s: %s holds %d other batch-size layouts; match looks rows up in the %d nearest",
                role.name,
                experiment,
                len(found),
                limit,
            )
        stores = [self.open(directory, context) for directory, context in found[:limit]]
        return [sibling for sibling in stores if sibling.unusable() is None]

    def open(self, project: Path, context: dict[str, Any]) -> StepStore:
        """One store class for every ``dump_dir``; the backend (local files or fsspec) comes from its root."""
        settings = self.runtime.settings
        root, trust = settings.root, settings.trust_dir_permissions
        return StepStore(
            project,
            self.runtime.role.name,
            context,
            trust_permissions=trust,
            dump_dir=root.path,
            plugin=self.runtime.owner,
            backend=root.backend(trust_permissions=trust),
            compression=compression_for(settings.compression, root.location()),
            memory=self.hit_memory,
            step_aliases=(STEP_KEY,),
        )

    def opened(self) -> list[StepStore]:
        """The stores this role opened for its runs."""
        with self._lock:
            return list(self._stores.values())
