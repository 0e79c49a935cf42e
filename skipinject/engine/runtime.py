"""A role in this process, the engine's side of :class:`~skipinject.roles.PhaseContext`: its settings,
codec, fingerprints, one-time lines and stores (one per project directory, checked once); it finds a
call's step and hands the rest to its replay, recorder and matcher."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from skipinject.config import RoleConfig
from skipinject.engine.book import StepBook
from skipinject.engine.matching import Found, RowMatcher, row_keys
from skipinject.engine.record import Recorder
from skipinject.engine.replay import Replay
from skipinject.engine.steps import Steps
from skipinject.report.start import dump_dir_problem, said_at_start
from skipinject.roles import Call, Codec, Loaded, Role
from skipinject.store import HitMemory, StepStore, compression_for
from skipinject.verl.compat import STEP_KEY
from skipinject.verl.layout import other_batch_sizes, project_dir

logger = logging.getLogger("skipinject")


class RoleRuntime:
    """A role with its settings and the plugin that provides it, in this process."""

    def __init__(
        self, role: Role, settings: RoleConfig, owner: str, *, open_steps: dict[Any, Any] | None = None
    ) -> None:
        self.role = role
        self.name = role.name
        self.subdir = role.name if role.cache_subdir is None else role.cache_subdir
        self.settings = settings
        self.owner = owner
        self._lock = threading.Lock()
        self._warned: set[Any] = set()
        #: The memory this role's compressed hits decode into, kept between hits (``reuse_hit_memory``).
        self.hit_memory = HitMemory(settings.reuse_hit_memory)
        self._stores: dict[Path, StepStore] = {}  # a RemotePath stands in for a Path
        self._unusable: dict[Path, str | None] = {}
        self._stores_lock = threading.Lock()
        self.book = StepBook(clocked=bool(role.clocks), open_steps=open_steps)
        self.replay = Replay(self, self.book)
        self.recorder = Recorder(self, self.replay, self.book)
        #: ``action=match`` (and the row keys every recording of a keyed role saves).
        self.matcher = RowMatcher(self, self.recorder)
        self.steps = Steps(self, self.book, self.replay, self.recorder, self.matcher)
        # PhaseContext (see skipinject.roles), and the run's end (``fit`` returned, the engine stops, exit)
        self.plan = self.replay.plan
        self.record = self.recorder.record_part
        self.in_background = self.recorder.in_background
        self.row_keys = functools.partial(row_keys, role)
        self.close_all = self.recorder.close_all

    @functools.cached_property
    def codec(self) -> Codec:
        if self.role.codec is not None:
            return self.role.codec
        from skipinject.verl.codecs import DataProtoCodec

        return DataProtoCodec()

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
        """The role's ``record_meta`` fields for a result of ``call`` (none when it fails: one warning) and
        its ``match_settings`` values (a later miss names those that differ)."""
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

    def deliver(self, call: Call, result: Any) -> Any:
        """A served (or merged) result as the caller's own kind, after the role's hooks saw it: the codec's
        ``served`` (the DataProto codec: the class of the call's batch, verl's NeoProto on its data plane)."""
        served = getattr(self.codec, "served", None)
        return result if served is None else served(result, call)

    def store_for(self, call: Call) -> StepStore:
        """The store of this run (directory named by the run's verl config, like upstream)."""
        return self.store_of(call.run_config)

    def store_of(self, config: Any) -> StepStore:
        """The store of the run whose verl config is ``config`` (``None``: none seen)."""
        project, context = project_dir(self.settings.root, config, self.subdir)
        with self._stores_lock:
            store = self._stores.get(project)
            if store is None:
                store = self._stores[project] = self.open(project, context)
                problem = self._unusable[project] = store.unusable()
                if config is None and problem is None:
                    logger.info("%s: no verl trainer config seen; caching under %s", self.name, project)
                if problem is not None:
                    unusable = f"cache directory unusable ({problem}); this run neither loads nor saves caches there"
                    # said once at start in this process already (the driver): not again
                    level = logging.DEBUG if said_at_start(self.settings) else logging.WARNING
                    logger.log(level, f"{self.name}: {unusable}")
            return store

    @functools.cached_property
    def unwritable_root(self) -> bool:
        """Whether this role's ``dump_dir`` cannot hold what this run saves (checked once per process): a failed
        save is then said once for the run, not at every step."""
        if not self.settings.save:
            return False
        try:
            return dump_dir_problem(self.name, self.settings) is not None
        except Exception:
            return False

    def unusable(self, store: StepStore) -> str | None:
        """Why ``store`` cannot be used at all this run (logged once, when it was opened)."""
        return self._unusable.get(store.project_dir)

    def batch_size_stores(self, store: StepStore, limit: int) -> list[StepStore]:
        """This role's usable stores in the layouts that differ from ``store``'s in the batch size only
        (at most ``limit``, the nearest first), where ``action=match`` looks rows up too. Never raises."""
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
        with self._stores_lock:
            return list(self._stores.values())

    def applicable_step(self, call: Call, *, any_step: bool = False) -> int | None:
        """The call's step if this role may act on it, else ``None`` (the original runs); ``any_step``:
        also steps outside ``skip.<role>.steps`` (targets declared ``every_step``)."""
        try:
            if self.role.bypass(call):
                return None
        except Exception as exc:
            message = f"{self.name}: validation check failed ({exc}); not skipping"
            self.once(("bypass", type(exc)), logging.WARNING, message)
            return None
        try:
            step = self.role.step.resolve(call)
        except Exception as exc:  # a plugin's step extractor must not break the user's call
            message = f"{self.name}: finding the step of {call.target} failed ({type(exc).__name__}: {exc})"
            self.once(("step", type(exc)), logging.WARNING, message + "; not skipping")
            return None
        if step is None:
            message = f"{self.name}: no training step found for {call.target} (looked at {self.role.step.describe()})"
            self.once("nostep", logging.WARNING, message + "; not skipping")
            return None
        self.recorder.moved_to(step)
        self.replay.read_ahead.moved_to(step)
        if not any_step and not self.settings.allows(step):
            return None
        return step

    # the rest of PhaseContext

    def load(self, call: Call, step: int, prepare: Callable[[Loaded], Any] | None = None) -> Loaded | None:
        return self.replay.load(self.recorder.step(call, step), call, prepare)

    def served(self, call: Call, step: int) -> bool | None:
        record = self.book.find(self.store_for(call).project_dir, step)
        return None if record is None or record.plan is None else record.plan.serves

    def notes(self, call: Call, step: int) -> dict[str, Any]:
        return self.recorder.step(call, step).notes

    def commit(
        self, call: Call, step: int, meta: Mapping[str, Any] | None = None, *, unit: str = "rows", note: str = ""
    ) -> None:
        record = self.recorder.step(call, step)
        with record.lock:
            record.phase_meta, record.unit, record.note = dict(meta or {}), unit, note
        self.recorder.commit(record)

    def match_rows(self, call: Call, keys: list[str], group: int = 1) -> Found:
        return self.matcher.find(self.store_for(call), call, keys, group)

    def record_rows(self, call: Call, step: int, result: Any, keys: Sequence[str]) -> None:
        self.matcher.save_rows(self.store_for(call), call, step, result, keys)
