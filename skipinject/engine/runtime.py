"""A role with its settings in this process: the engine's side of :class:`~skipinject.roles.PhaseContext`.

It finds the call's step, names the call's store, serves a planned entry (decode, compare the
inputs' fingerprints, ``on_hit``) and saves fresh results; failures of the cache never reach the
training call, except with ``action=strict`` or ``on_mismatch=fail``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from skipinject.config import Action, MismatchPolicy, RoleConfig
from skipinject.engine.background import WRITER
from skipinject.engine.decision import Plan, plan_step
from skipinject.engine.layout import project_dir
from skipinject.errors import CacheMissError, CorruptCacheError, PromptMismatchError
from skipinject.roles import Call, Codec, HitInfo, Role, StepCache
from skipinject.store import Payload, StepStore
from skipinject.store.remote import RemotePath, RemoteStepStore, open_remote, split_dump_dir

logger = logging.getLogger("skipinject")

#: Returned by :meth:`RoleRuntime.serve` when the target must run after all.
REGENERATE = object()


class RoleRuntime:
    """A role with its settings in this process: finds, serves and saves its cache entries."""

    def __init__(self, role: Role, settings: RoleConfig, owner: str) -> None:
        self.role = role
        self.settings = settings
        self.owner = owner
        self._stores: dict[Path | RemotePath, StepStore] = {}
        self._lock = threading.Lock()
        self._warned: set[Any] = set()
        self._default_codec: Codec | None = None

    # ------------------------------------------------------------ helpers for phases

    @property
    def name(self) -> str:
        return self.role.name

    @property
    def codec(self) -> Codec:
        if self.role.codec is not None:
            return self.role.codec
        if self._default_codec is None:
            from skipinject.codecs import DataProtoCodec

            self._default_codec = DataProtoCodec()
        return self._default_codec

    def once(self, key: Any, level: int, message: str, *args: Any) -> None:
        """Log ``message`` the first time ``key`` is seen."""
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        logger.log(level, message, *args)

    def applicable_step(self, call: Call, *, any_step: bool = False) -> int | None:
        """The call's step if this role may act on it, else ``None`` (the original runs).

        ``any_step``: also steps outside ``skip.<role>.steps`` (targets declared ``every_step``).
        """
        try:
            if self.role.bypass(call):
                return None
        except Exception as exc:
            self.once(
                ("bypass", type(exc)), logging.WARNING, "%s: validation check failed (%s); not skipping", self.name, exc
            )
            return None
        try:
            step = self.role.step.resolve(call)
        except Exception as exc:  # a plugin's step extractor must not break the user's call
            self.once(
                ("step", type(exc)),
                logging.WARNING,
                "%s: finding the step of %s failed (%s: %s); not skipping",
                self.name,
                call.target,
                type(exc).__name__,
                exc,
            )
            return None
        if step is None:
            self.once(
                "nostep",
                logging.WARNING,
                "%s: no training step found for %s (looked at %s); not skipping",
                self.name,
                call.target,
                self.role.step.describe(),
            )
            return None
        if not any_step and not self.settings.allows(step):
            return None
        return step

    def store_for(self, call: Call) -> StepStore:
        """The store of this run (directory named by the run's verl config, like upstream)."""
        config = call.run_config
        subdir = self.role.name if self.role.cache_subdir is None else self.role.cache_subdir
        project, context = project_dir(self.settings.dump_dir, config, subdir)
        with self._lock:
            store = self._stores.get(project)
            if store is None:
                store = self._stores[project] = self._open_store(project, context)
                if config is None:
                    logger.info("%s: no verl trainer config seen; caching under %s", self.name, project)
            return store

    def _open_store(self, project: Path | RemotePath, context: dict[str, Any]) -> StepStore:
        root = split_dump_dir(self.settings.dump_dir)
        if isinstance(project, RemotePath):
            fs, _ = open_remote(str(root))
            return RemoteStepStore(project, self.role.name, context, fs)
        return StepStore(
            project,
            self.role.name,
            context,
            trust_permissions=self.settings.trust_dir_permissions,
            dump_dir=root if isinstance(root, Path) else None,
        )

    # ------------------------------------------------------------ deciding

    def plan(self, call: Call, step: int) -> Plan:
        """See :func:`skipinject.engine.decision.plan_step` (after this project's pending saves)."""
        WRITER.flush(self.store_for(call).project_dir)
        return plan_step(self, call, step)

    # ------------------------------------------------------------ serving

    def serve(self, plan: Plan, call: Call) -> Any:
        """Load the planned entry and return the result, or ``REGENERATE`` to run the target."""
        started = time.perf_counter()
        try:
            if plan.upstream_file is not None:
                assert plan.upstream_format is not None
                result = plan.upstream_format.load(plan.upstream_file)
                source = str(plan.upstream_file)
            else:
                assert plan.entry is not None
                payloads = plan.store.load(plan.entry)
                result = self.decode(payloads, call)
                source = str(plan.entry.directory)
        except Exception as exc:  # whatever is wrong with the cache, it is not trained on
            if self.settings.action is Action.strict:
                if isinstance(exc, (CorruptCacheError, CacheMissError)):
                    raise
                where = plan.entry.directory if plan.entry else plan.upstream_file
                raise CorruptCacheError(
                    f"{self.name} step {plan.step}: cannot load {where} ({type(exc).__name__}: {exc})"
                ) from exc
            logger.warning(
                "%s step %d: cannot load %s (%s: %s); running the target instead",
                self.name,
                plan.step,
                plan.entry.directory if plan.entry else plan.upstream_file,
                type(exc).__name__,
                exc,
            )
            return REGENERATE
        elapsed = time.perf_counter() - started
        mismatched, compared = self._compare_inputs(plan, call)
        if mismatched:
            policy = self.settings.on_mismatch
            message = (
                f"{self.name} step {plan.step}: the cache served (step {plan.served_step}) was generated from "
                f"other inputs in {mismatched} of {compared} rows (changed data order, seed or step); "
            )
            if policy is MismatchPolicy.fail:
                raise PromptMismatchError(message + f"skip.{self.name}.on_mismatch=fail")
            if policy is MismatchPolicy.regenerate:
                logger.warning("%s", message + "regenerating (on_mismatch=regenerate)")
                return REGENERATE
            logger.warning("%s", message + "training on them anyway (on_mismatch=warn)")
        logger.info(
            "%s step %d: hit, served step %d (%s) from %s in %.3f s; target not called",
            self.name,
            plan.step,
            plan.served_step,
            plan.reason,
            source,
            elapsed,
        )
        if self.role.on_hit is not None:
            info = HitInfo(plan.step, plan.served_step, elapsed, mismatched, compared, source)
            result = self.role.on_hit(result, call, info)
        return result

    def decode(self, payloads: Sequence[Payload], call: Call) -> Any:
        if len(payloads) != 1:
            raise CorruptCacheError(f"{self.name}: expected one part, the cache has {len(payloads)}")
        return self.codec.decode(payloads[0], call)

    def fingerprint(self, call: Call) -> list[str] | None:
        if self.role.fingerprint is None:
            return None
        try:
            rows = self.role.fingerprint(call)
        except Exception as exc:
            self.once(
                ("fingerprint", type(exc)),
                logging.WARNING,
                "%s: cannot fingerprint the inputs (%s); mismatches will not be detected",
                self.name,
                exc,
            )
            return None
        return None if rows is None else [str(r) for r in rows]

    def _compare_inputs(self, plan: Plan, call: Call) -> tuple[int, int]:
        if plan.entry is None:
            return 0, 0
        stored = plan.entry.meta.get("inputs")
        if not isinstance(stored, list):
            return 0, 0
        current = self.fingerprint(call)
        if current is None:
            return 0, 0
        compared = max(len(stored), len(current))
        same = sum(1 for a, b in zip(stored, current, strict=False) if a == b)
        return compared - same, compared

    # ------------------------------------------------------------ saving

    def save(
        self, plan: Plan, call: Call, result: Any, inputs: Sequence[str] | None = None, *, background: bool = True
    ) -> None:
        """Save a freshly computed result for ``plan.step``; failures are logged, never raised.

        Encoding and a private copy happen now (the caller gets ``result`` afterwards and may change
        it); writing happens in the background writer when the engine knows where the run ends (the
        role has clocks: the trainer's ``fit`` returning waits for it; a Ray actor may be killed
        without running exit hooks), else here, as with ``background=False`` (callers already off
        the training thread). ``inputs``: the call's fingerprint taken before the target ran.
        """
        if result is None:
            return
        started = time.perf_counter()
        try:
            snapshot = self.codec.encode(result).private_copy()
            meta = {"inputs": list(inputs) if inputs is not None else self.fingerprint(call)}
        except Exception as exc:
            self._save_failed(plan, exc)
            return
        if background:
            self.in_background(plan.store, lambda: self._write(plan, snapshot, meta, started))
        else:
            self._write(plan, snapshot, meta, started)

    def in_background(self, store: StepCache, job: Callable[[], None]) -> None:
        """Run ``job`` (a write to ``store``) after the store's earlier jobs, off the calling thread.

        Only when the engine knows where the run ends (the role has clocks: the trainer's ``fit``
        returning waits for every job; a Ray actor may be killed without running exit hooks); else
        ``job`` runs now. A read of the store (:meth:`plan`) waits for its pending jobs first; at most
        :data:`~skipinject.engine.background.MAX_PENDING` jobs wait at once (the next call blocks).
        ``job`` must log its own failures.
        """
        if self.role.clocks:
            WRITER.submit(store.project_dir, job)
        else:
            job()

    def _write(self, plan: Plan, payload: Payload, meta: dict[str, Any], started: float) -> None:
        try:
            directory = plan.store.save(plan.step, payload, meta)
        except Exception as exc:
            self._save_failed(plan, exc)
            return
        logger.info(
            "%s step %d: saved %s rows to %s in %.3f s",
            self.name,
            plan.step,
            payload.rows if payload.rows is not None else "?",
            directory,
            time.perf_counter() - started,
        )

    def _save_failed(self, plan: Plan, exc: Exception) -> None:
        self.once(
            ("save", str(plan.store.project_dir), plan.step),
            logging.WARNING,
            "%s step %d: could not save the cache to %s (%s: %s); training goes on without it",
            self.name,
            plan.step,
            plan.store.step_dir(plan.step),
            type(exc).__name__,
            exc,
        )

    def after_miss(self, call: Call, result: Any) -> Any:
        if self.role.on_miss is None:
            return result
        return self.role.on_miss(result, call)
