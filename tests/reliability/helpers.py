"""Shared pieces of the reliability suite: realistic batches, a toy role, child-process writers.

Everything a child process runs lives here (module level, importable), so ``fork``,
``forkserver`` and ``spawn`` children can all find it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from skipinject import testing
from skipinject.config import RoleConfig
from skipinject.engine import RoleRuntime, TargetInterceptor
from skipinject.roles import Call, Role, StepSource, Target, UpstreamFormat
from skipinject.store import META_NAME, Payload, StepStore
from skipinject.store.format import meta_digest

CONTEXT = {
    "experiment_name": "exp",
    "project_name": "proj",
    "gbs": 4,
    "n": 2,
    "prompt_length": 8,
    "response_length": 8,
}
TOY_TARGET = "si_reliability_toy:generate"


# ---------------------------------------------------------------- batches


def make_batch(rows: int, width: int = 16, *, seed: int = 0, step: int = 1) -> Any:
    """A rollout result shaped like a GRPO ``DataProto`` (tensors, chat prompts, dict rows), without verl."""
    return testing.toy_batch(rows, width, seed=seed, step=step)


same_batch = testing.same_batch


def same_payload(a: Payload, b: Payload) -> bool:
    """Two payloads hold the same tensors (bit-exact) and objects."""
    if sorted(a.tensors) != sorted(b.tensors) or a.objects != b.objects or a.rows != b.rows:
        return False
    return all(a.tensors[k].dtype == b.tensors[k].dtype and torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def codec_payload(rows: int, width: int = 16, *, seed: int = 0) -> Payload:
    """What the engine would save for a batch of this size (the toy role's codec, no pickle)."""
    from skipinject.verl.codecs import TensorDictCodec

    return TensorDictCodec().encode(make_batch(rows, width, seed=seed))


def plain_payload(numel: int, value: float, *, tag: str = "") -> Payload:
    """A payload whose every byte is derived from ``value`` (so a torn mix is detectable): flat tensors,
    no rows (its size is bounded by the memory budget only, not by a row count)."""
    return Payload(
        tensors={"x": torch.full((numel,), float(value)), "y": torch.full((numel // 4 + 1,), int(value))},
        objects={"value": value, "tag": tag, "rows": [value] * 8},
        rows=None,
    )


def payload_consistent(payload: Payload) -> float | None:
    """The writer value a payload was made from, or ``None`` when its pieces disagree (torn)."""
    value = payload.objects.get("value")
    x, y = payload.tensors.get("x"), payload.tensors.get("y")
    if x is None or y is None or not isinstance(value, (int, float)):
        return None
    if not bool((x == float(value)).all()) or not bool((y == int(value)).all()):
        return None
    if payload.objects.get("rows") != [value] * 8:
        return None
    return float(value)


# ---------------------------------------------------------------- meta.json surgery


def meta_path(store: StepStore, step: int) -> Path:
    return store.step_dir(step) / META_NAME


def read_meta_raw(store: StepStore, step: int) -> dict[str, Any]:
    return json.loads(meta_path(store, step).read_text())


def write_meta_raw(store: StepStore, step: int, meta: Any, *, rechecksum: bool = True) -> None:
    """Replace ``meta.json``; with ``rechecksum`` its self-checksum is made valid again (a forged edit)."""
    if rechecksum and isinstance(meta, dict):
        meta["meta_checksum"] = meta_digest(meta)
    meta_path(store, step).write_text(json.dumps(meta))


def data_files(store: StepStore, step: int) -> dict[str, Path]:
    """The data files named by a step's meta.json, by kind (``tensors``/``objects``, parts prefixed)."""
    meta = read_meta_raw(store, step)
    out = {}
    for part in meta["parts"]:
        base = store.step_dir(step) / part["dir"] if part["dir"] else store.step_dir(step)
        for kind, spec in part["files"].items():
            out[f"{part['dir']}/{kind}" if part["dir"] else kind] = base / spec["name"]
    return out


def regular_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


# ---------------------------------------------------------------- a toy role on a toy function


@dataclass
class ToyTarget:
    """The function a toy role patches: counts its calls and returns a deterministic batch."""

    rows: int = 4
    width: int = 8
    calls: list[int] = field(default_factory=list)
    #: Return verl's ``DataProto`` (for a verl role's codec: integration tier) instead of the toy batch.
    dataproto: bool = False

    def __call__(self, batch: Any) -> Any:
        step = int(batch.meta_info["global_steps"])
        self.calls.append(step)
        result = make_batch(self.rows, self.width, seed=1000 + step, step=step)
        return as_dataproto(result) if self.dataproto else result


def as_dataproto(batch: dict[str, Any]) -> Any:
    """A :func:`make_batch` batch as verl's ``DataProto`` (needs verl)."""
    from verl.protocol import DataProto

    return DataProto(batch=batch["batch"], non_tensor_batch=batch["non_tensor_batch"], meta_info=batch["meta_info"])


class Batch:
    """The smallest batch a role's step source and validation check understand."""

    def __init__(self, step: int, *, validate: bool = False) -> None:
        self.meta_info = {"global_steps": step, "validate": validate}


def toy_trainer(experiment: str = "exp", project: str = "proj") -> testing.ToyTrainer:
    """Stands in for the trainer instance whose ``config`` names the cache directory."""
    return testing.ToyTrainer(experiment=experiment, project=project)


def toy_role(name: str = "toy", *, upstream: UpstreamFormat | None = None, step: StepSource | None = None) -> Role:
    from skipinject.verl.codecs import TensorDictCodec

    return Role(
        name=name,
        targets=[Target(TOY_TARGET)],
        step=step or StepSource.meta("global_steps"),
        codec=TensorDictCodec(),
        upstream=upstream,
        cache_subdir="",
    )


def runtime(
    dump_dir: Path | str,
    *,
    role: Role | None = None,
    action: str = "cache",
    steps: Sequence[int] = tuple(range(0, 64)),
    trust_upstream: bool = False,
) -> RoleRuntime:
    settings = RoleConfig(
        enable=True, dump_dir=str(dump_dir), steps=tuple(steps), action=action, trust_upstream=trust_upstream
    )
    return RoleRuntime(role or toy_role(), settings, owner="reliability-tests")


def call(rt: RoleRuntime, target: Callable[[Any], Any], step: int, *, trainer: Any = None) -> Any:
    """One call of the patched target at ``step``, through the engine's interceptor (plan/serve/save)."""
    batch = Batch(step)
    interceptor = TargetInterceptor(rt, rt.role.targets[0])
    invocation = Call(TOY_TARGET, target, trainer if trainer is not None else toy_trainer(), (batch,), {})
    return interceptor.sync(invocation, lambda: target(batch))


def end_run(rt: RoleRuntime) -> None:
    """The run ends (the trainer's fit returns): every open step of ``rt`` is committed, every write done."""
    from skipinject.engine.background import WRITER

    rt.close_all()
    WRITER.flush()


def project_dir(rt: RoleRuntime, trainer: Any = None) -> Path:
    invocation = Call(TOY_TARGET, lambda b: b, trainer if trainer is not None else toy_trainer(), (Batch(0),), {})
    return rt.store_for(invocation).project_dir


def store_of(rt: RoleRuntime, trainer: Any = None) -> StepStore:
    invocation = Call(TOY_TARGET, lambda b: b, trainer if trainer is not None else toy_trainer(), (Batch(0),), {})
    return rt.store_for(invocation)


def records(caplog: Any, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "skipinject" and r.levelno >= level]


# ---------------------------------------------------------------- child processes


def _install_kill_switch(kill_at: int | None, progress: Any) -> None:
    """Count the store's durable operations (fsync, rename); SIGKILL this process at number ``kill_at``."""
    import skipinject.store.writer as store_module

    real_fsync, real_replace = os.fsync, os.replace
    count = {"n": 0}

    def tick() -> None:
        if kill_at is not None and count["n"] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        count["n"] += 1
        if progress is not None:
            progress.value = count["n"]

    def fsync(fd: int) -> None:
        tick()
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        tick()
        real_replace(src, dst)

    store_module.os.fsync = fsync  # type: ignore[attr-defined]
    store_module.os.replace = replace  # type: ignore[attr-defined]


def dump_child(
    project: str,
    step: int,
    payloads: Sequence[Payload],
    parts: Sequence[str],
    kill_at: int | None,
    conn: Any,
    progress: Any = None,
) -> None:
    """Child process: save one step (one or several parts); optionally die at a chosen operation."""
    _install_kill_switch(kill_at, progress)
    store = open_store(project)
    conn.send("ready")
    if parts == ("",) or list(parts) == [""]:
        store.save(step, payloads[0], {"inputs": None})
    else:
        writer = store.begin(step)
        for part, payload in zip(parts, payloads, strict=True):
            writer.add_part(payload, part)
        writer.commit({"inputs": None})
    conn.send("done")
    conn.close()


def open_store(project: str, env: dict[str, str] | None = None) -> StepStore:
    """The store of ``project``: a local directory, or a remote store's URL (``env``: how to reach it)."""
    if "://" not in project:
        return StepStore(Path(project), "toy", CONTEXT)
    import os

    os.environ.update(env or {})
    from skipinject.store import RemoteStepStore
    from skipinject.store.remote import open_remote

    fs, location = open_remote(project)
    return RemoteStepStore(location, "toy", CONTEXT, fs)


def writer_proc(
    project: str, step: int, writer: int, rounds: int, numel: int, parts: int, out: Any, env: Any = None
) -> None:
    """Concurrency: save the same step ``rounds`` times with this writer's values."""
    store = open_store(project, env)
    written = []
    for r in range(rounds):
        value = float(writer * 1000 + r)
        if parts == 1:
            store.save(step, plain_payload(numel, value, tag=f"w{writer}"))
        else:
            w = store.begin(step)
            for p in range(parts):
                w.add_part(plain_payload(numel, value, tag=f"w{writer}"), str(p))
            w.commit({})
        written.append(value)
    out.put(("writer", writer, written))


def reader_proc(project: str, step: int, reader: int, stop: Any, out: Any, env: Any = None) -> None:
    """Concurrency: verify and load the step until told to stop; classify every attempt."""
    from skipinject.errors import CacheError

    store = open_store(project, env)
    counts = {"hit": 0, "miss": 0, "miss_after_hit": 0, "torn": 0, "error": 0}
    seen: set[float] = set()
    errors: list[str] = []
    while not store.is_committed(step):  # do not starve the writers before their first commit
        time.sleep(0.005)
    while not stop.is_set() or counts["hit"] == 0:
        try:
            entry = store.verified(step)
            loaded = store.load(entry)
        except (FileNotFoundError, CacheError):
            counts["miss_after_hit" if counts["hit"] else "miss"] += 1
            continue
        except Exception as exc:  # anything else is a bug
            counts["error"] += 1
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        values = {payload_consistent(p) for p in loaded}
        if None in values or len(values) != 1:
            counts["torn"] += 1
            continue
        counts["hit"] += 1
        seen.update(v for v in values if v is not None)
    out.put(("reader", reader, counts, sorted(seen), errors[:3]))


@dataclass
class Contention:
    """What writers and readers of one step did (see :func:`writers_and_readers`)."""

    written: dict[int, list[float]]  # values each writer committed, in order
    totals: dict[str, int]  # reads: hit, miss, miss_after_hit, torn, error
    seen: list[list[float]]  # values each reader loaded
    errors: list[str]
    exit_codes: list[int | None]

    @property
    def last_values(self) -> set[float]:
        return {values[-1] for values in self.written.values()}

    @property
    def foreign(self) -> int:
        """Values readers loaded that no writer wrote."""
        every = {v for values in self.written.values() for v in values}
        return sum(len(set(values) - every) for values in self.seen)


def writers_and_readers(
    ctx: Any, project: str, step: int, parts: Sequence[int], readers: int, rounds: int, numel: int,
    env: dict[str, str] | None = None, timeout: float = 300,
) -> Contention:  # fmt: skip
    """Writer ``w`` saves ``step`` ``rounds`` times in ``parts[w]`` parts while ``readers`` processes
    load it in a loop; every process is of ``ctx``."""
    out = ctx.Queue()
    stop = ctx.Event()
    reader_procs = [ctx.Process(target=reader_proc, args=(project, step, r, stop, out, env)) for r in range(readers)]
    writer_procs = [
        ctx.Process(target=writer_proc, args=(project, step, w, rounds, numel, n, out, env))
        for w, n in enumerate(parts)
    ]
    for proc in reader_procs + writer_procs:
        proc.start()
    results = [out.get(timeout=timeout) for _ in writer_procs]
    stop.set()
    results += [out.get(timeout=timeout) for _ in reader_procs]
    for proc in reader_procs + writer_procs:
        proc.join(60)
    totals = {"hit": 0, "miss": 0, "miss_after_hit": 0, "torn": 0, "error": 0}
    seen, errors = [], []
    for _, _, counts, values, errs in (r for r in results if r[0] == "reader"):
        for key in totals:
            totals[key] += counts[key]
        seen.append(values)
        errors += errs
    written = {r[1]: r[2] for r in results if r[0] == "writer"}
    return Contention(written, totals, seen, errors, [p.exitcode for p in reader_procs + writer_procs])


def iter_dirs(root: Path) -> Iterator[Path]:
    yield root
    yield from (p for p in root.rglob("*") if p.is_dir())


STORE_MODULES = ("writer", "local", "step_store", "checksums", "tensorfile")


def patch_store_open(monkeypatch: Any, replacement: Any) -> None:
    """Make every module of the store call ``replacement`` instead of the builtin ``open``."""
    import importlib

    for name in STORE_MODULES:
        monkeypatch.setattr(importlib.import_module(f"skipinject.store.{name}"), "open", replacement, raising=False)
