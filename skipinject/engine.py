"""The one place where a call is served from the cache or run and saved.

For each enabled role the engine patches the role's targets and clocks. A patched call goes:

1. validation batches (and calls without a step) run the original, untouched;
2. steps not in ``skip.<role>.steps`` run the original;
3. the role's phase decides; for the default :class:`WholeCall` phase:
   * ``cache``: the step's own verified cache → served, the target is not called;
     otherwise the target runs and its result is saved for this step;
   * ``repeat``: the exact step, else the largest cached step below, else the smallest above;
   * ``strict``: like ``cache``, but a missing or unusable cache stops the run.

Every decision is one line on the ``skipinject`` logger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skipinject.config import Config, RoleConfig
from skipinject.errors import (
    CacheMissError,
    ConfigError,
    CorruptCacheError,
    PromptMismatchError,
)
from skipinject.injector import INJECTOR, Injector
from skipinject.roles import CLOCK, Call, Codec, HitInfo, Phase, Role, Target
from skipinject.store import Payload, StepEntry, StepStore

logger = logging.getLogger("skipinject")

BUILTIN_SKIP_INIT = "verl.utils.skip.skip_manager:SkipManager.init"


# ---------------------------------------------------------------- run layout


def select(config: Any, dotted: str, default: Any = None) -> Any:
    """``config.a.b`` for OmegaConf, dicts or objects; ``default`` when any part is missing."""
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


def run_config_of(call: Call) -> Any:
    """The verl config of the run: the bound instance's, else the clock trainer's."""
    for owner in (call.instance, CLOCK.instance):
        candidate = getattr(owner, "config", None)
        if is_run_config(candidate):
            return candidate
    return None


def _path_safe(name: str) -> str:
    """A directory name from config text that cannot leave its parent."""
    cleaned = str(name).replace("/", "_").replace("\\", "_").replace("\x00", "_")
    return "_" if cleaned in ("", ".", "..") else cleaned


def layout_of(config: Any) -> tuple[str, dict[str, Any]]:
    """Upstream's ``{experiment}_{project}/GBS{gbs}_N{n}_in{p}_out{r}`` and the values naming it."""
    gbs = select(config, "data.gen_batch_size")
    if gbs is None:
        gbs = select(config, "data.train_batch_size", 0)
    context = {
        "experiment_name": str(select(config, "trainer.experiment_name", "default_experiment_name")),
        "project_name": str(select(config, "trainer.project_name", "default_project_name")),
        "gbs": int(gbs),
        "n": int(select(config, "actor_rollout_ref.rollout.n", 0)),
        "prompt_length": int(select(config, "data.max_prompt_length", 0)),
        "response_length": int(select(config, "data.max_response_length", 0)),
    }
    relative = (
        f"{_path_safe(context['experiment_name'] + '_' + context['project_name'])}/"
        f"GBS{context['gbs']}_N{context['n']}_in{context['prompt_length']}_out{context['response_length']}"
    )
    return relative, context


# ---------------------------------------------------------------- plans


@dataclass
class Plan:
    """What the engine decided for one call."""

    store: StepStore
    step: int
    entry: StepEntry | None = None
    upstream_file: Path | None = None
    reason: str = ""

    @property
    def served_step(self) -> int:
        return self.entry.step if self.entry else self.step


_REGENERATE = object()


class RoleRuntime:
    """A role with its settings in this process: finds, serves and saves its cache entries."""

    def __init__(self, role: Role, settings: RoleConfig, owner: str) -> None:
        self.role = role
        self.settings = settings
        self.owner = owner
        self._stores: dict[Path, StepStore] = {}
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
        root = Path(self.settings.dump_dir).expanduser().resolve()
        config = run_config_of(call)
        if config is not None:
            relative, context = layout_of(config)
        else:
            relative, context = "skipinject_default", {}
        project = root / relative
        subdir = self.role.name if self.role.cache_subdir is None else self.role.cache_subdir
        if subdir:
            project = project / _path_safe(subdir)
        with self._lock:
            store = self._stores.get(project)
            if store is None:
                store = self._stores[project] = StepStore(project, self.role.name, context)
                if config is None:
                    logger.info("%s: no verl trainer config seen; caching under %s", self.name, project)
            return store

    # ------------------------------------------------------------ deciding

    def plan(self, call: Call, step: int) -> Plan:
        """Find the entry to serve (verified), or explain why there is none. Logs the decision in one line.

        A cache that cannot be used (damaged, foreign, unreadable) is never loaded: the run regenerates
        the step, or stops with :class:`CacheMissError` for ``action=strict``.
        """
        store = self.store_for(call)
        action = self.settings.action
        problems: list[str] = []
        upstream: Path | None = None
        try:
            candidates = self._repeat_order(store, step) if action == "repeat" else [step]
            for candidate in candidates:
                try:
                    entry = store.verified(candidate)
                except FileNotFoundError:
                    continue
                except CorruptCacheError as exc:
                    problems.append(str(exc))
                    continue
                for problem in problems:
                    logger.warning("%s step %d: cache unusable, not loaded: %s", self.name, step, problem)
                if candidate == step:
                    reason = "own cache"
                elif candidate < step:
                    reason = f"repeat: largest cached step below {step}"
                else:
                    reason = f"repeat: no cached step below {step}, smallest above"
                return Plan(store, step, entry=entry, reason=reason)
            upstream = self._upstream_file(store, step)
        except OSError as exc:
            problems.append(f"cannot read the cache directory {store.project_dir} ({type(exc).__name__}: {exc})")
        if upstream is not None:
            if self.settings.trust_upstream:
                return Plan(store, step, upstream_file=upstream, reason="trusted upstream cache")
            self.once(
                ("untrusted", str(upstream)),
                logging.WARNING,
                "%s step %d: found verl's own cache %s but did not load it: it is a pickle, which runs code "
                "when loaded. Set skip.%s.trust_upstream=true if you trust it; generating again and caching "
                "in skipinject's format beside it",
                self.name,
                step,
                upstream,
                self.name,
            )
        where = store.step_dir(step)
        if not problems and _interrupted_save(where):
            problems.append(f"{where} holds data files but no meta.json (an earlier save was interrupted)")
        if action == "strict":
            detail = "; ".join(problems) or f"no cache at {where}"
            raise CacheMissError(f"{self.name} step {step}: skip.{self.name}.action=strict and {detail}")
        if problems:
            logger.warning(
                "%s step %d: cache unusable, not loaded: %s; running the target and saving its result",
                self.name,
                step,
                "; ".join(problems),
            )
            return Plan(store, step, reason="cache unusable")
        reason = f"no cached step in {store.project_dir}" if action == "repeat" else f"no cache at {where}"
        logger.info("%s step %d: miss (%s); running the target and saving its result", self.name, step, reason)
        return Plan(store, step, reason=reason)

    def _repeat_order(self, store: StepStore, step: int) -> list[int]:
        available = store.steps_on_disk()
        below = sorted((s for s in available if s < step), reverse=True)
        above = sorted(s for s in available if s > step)
        return [step, *below, *above]

    def _upstream_file(self, store: StepStore, step: int) -> Path | None:
        if self.role.upstream is None:
            return None
        path = store.step_dir(step) / self.role.upstream.file_name
        return path if path.is_file() else None

    # ------------------------------------------------------------ serving

    def serve(self, plan: Plan, call: Call) -> Any:
        """Load the planned entry and return the result, or ``_REGENERATE`` to run the target."""
        started = time.perf_counter()
        try:
            if plan.upstream_file is not None:
                assert self.role.upstream is not None
                result = self.role.upstream.load(plan.upstream_file)
                source = str(plan.upstream_file)
            else:
                assert plan.entry is not None
                payloads = plan.store.load(plan.entry)
                result = self.decode(payloads, call)
                source = str(plan.entry.directory)
        except Exception as exc:  # whatever is wrong with the cache, it is not trained on
            if self.settings.action == "strict":
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
            return _REGENERATE
        elapsed = time.perf_counter() - started
        mismatched, compared = self._compare_inputs(plan, call)
        if mismatched:
            policy = self.settings.on_mismatch
            message = (
                f"{self.name} step {plan.step}: the cache served (step {plan.served_step}) was generated from "
                f"other inputs in {mismatched} of {compared} rows (changed data order, seed or step); "
            )
            if policy == "fail":
                raise PromptMismatchError(message + f"skip.{self.name}.on_mismatch=fail")
            if policy == "regenerate":
                logger.warning("%s", message + "regenerating (on_mismatch=regenerate)")
                return _REGENERATE
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

    def save(self, plan: Plan, call: Call, result: Any, inputs: Sequence[str] | None = None) -> None:
        """Save a freshly computed result for ``plan.step``; failures are logged, never raised.

        ``inputs``: the call's fingerprint taken before the target ran (else taken now).
        """
        if result is None:
            return
        started = time.perf_counter()
        try:
            payload = self.codec.encode(result)
            directory = plan.store.save(
                plan.step, payload, {"inputs": list(inputs) if inputs is not None else self.fingerprint(call)}
            )
        except Exception as exc:
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
            return
        logger.info(
            "%s step %d: saved %s rows to %s in %.3f s",
            self.name,
            plan.step,
            payload.rows if payload.rows is not None else "?",
            directory,
            time.perf_counter() - started,
        )

    def after_miss(self, call: Call, result: Any) -> Any:
        if self.role.on_miss is None:
            return result
        return self.role.on_miss(result, call)


def _interrupted_save(step_dir: Path) -> bool:
    """Data files but no ``meta.json`` in a step directory: a save there was interrupted."""
    try:
        folders = [step_dir, *(p for p in step_dir.iterdir() if p.is_dir())]
        return any(f.name.startswith(("tensors-", "objects-")) for folder in folders for f in folder.iterdir())
    except OSError:
        return False


# ---------------------------------------------------------------- phases


class WholeCall:
    """One call is one unit: serve it from the cache, or run it and save what it returned."""

    def run(self, role: RoleRuntime, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        plan = role.plan(call, step)
        if plan.entry is not None or plan.upstream_file is not None:
            result = role.serve(plan, call)
            if result is not _REGENERATE:
                return result
        inputs = role.fingerprint(call)  # before the target runs: it may change its inputs
        result = proceed()
        role.save(plan, call, result, inputs)
        return role.after_miss(call, result)

    async def run_async(self, role: RoleRuntime, call: Call, step: int, proceed: Callable[[], Any]) -> Any:
        plan = await asyncio.to_thread(role.plan, call, step)
        if plan.entry is not None or plan.upstream_file is not None:
            result = await asyncio.to_thread(role.serve, plan, call)
            if result is not _REGENERATE:
                return result
        inputs = role.fingerprint(call)
        result = await proceed()
        await asyncio.to_thread(role.save, plan, call, result, inputs)
        return role.after_miss(call, result)


WHOLE_CALL = WholeCall()


class TargetInterceptor:
    """Connects one patched target to its role's phase (see :class:`skipinject.injector.Interceptor`)."""

    def __init__(self, runtime: RoleRuntime, target: Target) -> None:
        self.runtime = runtime
        self.phase: Phase = target.phase or WHOLE_CALL
        self.every_step = target.every_step

    def sync(self, call: Call, proceed: Callable[[], Any]) -> Any:
        step = self.runtime.applicable_step(call, any_step=self.every_step)
        if step is None:
            return proceed()
        return self.phase.run(self.runtime, call, step, proceed)

    async def run_async(self, call: Call, proceed: Callable[[], Any]) -> Any:
        step = self.runtime.applicable_step(call, any_step=self.every_step)
        if step is None:
            return await proceed()
        return await self.phase.run_async(self.runtime, call, step, proceed)


class ClockInterceptor:
    """Records the trainer entering ``fit`` (the clock) and checks each role against its config once."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def sync(self, call: Call, proceed: Callable[[], Any]) -> Any:
        self._enter(call)
        return proceed()

    async def run_async(self, call: Call, proceed: Callable[[], Any]) -> Any:
        self._enter(call)
        return await proceed()

    def _enter(self, call: Call) -> None:
        if call.instance is not None:
            CLOCK.enter(call.instance)
            self.engine.observe_config(getattr(call.instance, "config", None))


class BuiltinGuard:
    """After verl's ``SkipManager.init``, turns off built-in roles that skipinject handles."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def sync(self, call: Call, proceed: Callable[[], Any]) -> Any:
        result = proceed()
        manager = call.instance
        config = call.argument("config") if call.args or call.kwargs else None
        self.engine.observe_config(config)
        instances = getattr(manager, "skip_instances", None)
        if isinstance(instances, dict):
            for runtime in self.engine.runtimes.values():
                builtin = runtime.role.builtin
                instance = instances.get(builtin) if builtin else None
                if instance is not None and getattr(instance, "enable", False):
                    instances.pop(builtin)
                    runtime.once(
                        "builtin",
                        logging.WARNING,
                        "verl's built-in skip.%s is enabled in the trainer config and skipinject's %s role is on: "
                        "skipinject handles it, the built-in one is turned off for this run",
                        builtin,
                        runtime.name,
                    )
        return result

    async def run_async(self, call: Call, proceed: Callable[[], Any]) -> Any:  # pragma: no cover - init is sync
        return self.sync(call, proceed)


# ---------------------------------------------------------------- engine


def _verl_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verl")
    except PackageNotFoundError:
        return None


def target_applies(target: Target, verl_version: str | None) -> bool:
    """Whether ``target`` is meant for the installed verl (its ``verl`` range, if any)."""
    if not target.verl:
        return True
    if verl_version is None:
        return False
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    # A development or pre-release build (``0.10.0.dev0``, from verl's git) counts as its release;
    # ``in`` alone would exclude it from every range.
    return SpecifierSet(target.verl).contains(Version(verl_version), prereleases=True)


class Engine:
    """Patches the targets of the enabled roles and holds their runtimes."""

    def __init__(self, config: Config, roles: Mapping[str, tuple[Role, str]], injector: Injector = INJECTOR) -> None:
        self.config = config
        self.roles = dict(roles)
        self.injector = injector
        self.runtimes: dict[str, RoleRuntime] = {}
        self._paths: list[str] = []
        self._seen_configs: set[int] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        unknown = [name for name in self.config.enabled_roles if name not in self.roles]
        if unknown:
            raise ConfigError(f"skip.{unknown[0]}: no loaded plugin provides role {unknown[0]!r}")
        verl_version = None
        clocks: list[str] = []
        for name in self.config.enabled_roles:
            role, owner = self.roles[name]
            runtime = RoleRuntime(role, self.config.role(name), owner)
            self.runtimes[name] = runtime
            for target in role.targets:
                if target.verl and verl_version is None:
                    verl_version = _verl_version()
                if not target_applies(target, verl_version):
                    logger.debug(
                        "%s: target %s is for verl %s, installed %s; skipped",
                        name,
                        target.path,
                        target.verl,
                        verl_version,
                    )
                    continue
                self._instrument(target.path, TargetInterceptor(runtime, target), f"{owner}/{name}")
            clocks.extend(c for c in role.clocks if c not in clocks)
        clock = ClockInterceptor(self)
        for path in clocks:
            self._instrument(path, clock, "skipinject/clock")
        if any(rt.role.builtin for rt in self.runtimes.values()):
            self._instrument(BUILTIN_SKIP_INIT, BuiltinGuard(self), "skipinject/builtin-guard")
        if self.runtimes:
            logger.debug("skipinject active for %s", ", ".join(self.runtimes))

    def stop(self) -> None:
        for path in self._paths:
            self.injector.uninstrument(path)
        self._paths.clear()
        self.runtimes.clear()

    def _instrument(self, path: str, interceptor: Any, owner: str) -> None:
        self.injector.instrument(path, interceptor, owner=owner)
        self._paths.append(path)

    def observe_config(self, config: Any) -> None:
        """Run every enabled role's ``check`` against a run config once; warn when it cannot fire."""
        if not is_run_config(config):
            return
        with self._lock:
            if id(config) in self._seen_configs:
                return
            self._seen_configs.add(id(config))
        for runtime in self.runtimes.values():
            if runtime.role.check is None:
                continue
            with contextlib.suppress(Exception):
                reason = runtime.role.check(config)
                if reason:
                    runtime.once(
                        ("check", reason),
                        logging.WARNING,
                        "skip.%s is enabled but cannot act in this run: %s",
                        runtime.name,
                        reason,
                    )


__all__ = [
    "ClockInterceptor",
    "Engine",
    "Plan",
    "RoleRuntime",
    "TargetInterceptor",
    "WholeCall",
    "layout_of",
    "run_config_of",
    "select",
]
