"""Integrity: every kind of damaged or foreign cache is detected, reported in one line and never loaded.

Each case damages a step saved by a first run. A second run (``action=cache``) must report the
problem in exactly one WARNING line, run the target and cache the step again; a third run with
``action=strict`` must stop with CacheMissError/CorruptCacheError without loading anything and
without deleting the damaged files. Forged edits recompute meta.json's own checksum (and the data
files' sizes/checksums where needed), so they test the checks behind it, not just the checksum.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skipinject.errors import CacheError, CacheMissError, CorruptCacheError
from skipinject.store import FORMAT_VERSION, StepStore
from skipinject.store.checksums import _digest
from skipinject.store.format import PLAIN_FORMAT_VERSION
from tests.reliability import helpers as h

STEP = 1


def _expected(step: int = STEP) -> Any:
    return h.make_batch(4, 8, seed=1000 + step, step=step)


def _set_file(store: StepStore, step: int, kind: str, data: bytes, *, forge: bool) -> None:
    """Replace a data file's bytes; with ``forge`` meta.json's size, checksum and self-checksum follow."""
    path = h.data_files(store, step)[kind]
    path.write_bytes(data)
    if forge:
        meta = h.read_meta_raw(store, step)
        spec = meta["parts"][0]["files"][kind]
        spec["size"], spec["checksum"] = len(data), _digest(data, meta["checksum_algo"])
        h.write_meta_raw(store, step, meta)


def _truncate(kind: str) -> Callable[[StepStore], None]:
    def go(store: StepStore) -> None:
        path = h.data_files(store, STEP)[kind]
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])

    return go


def _flip(kind: str, where: float = 0.5) -> Callable[[StepStore], None]:
    def go(store: StepStore) -> None:
        path = h.data_files(store, STEP)[kind]
        data = bytearray(path.read_bytes())
        index = min(int(len(data) * where), len(data) - 1)
        data[index] ^= 0x5A
        path.write_bytes(bytes(data))

    return go


def _edit_meta(edit: Callable[[dict[str, Any]], Any], *, forge: bool = True) -> Callable[[StepStore], None]:
    def go(store: StepStore) -> None:
        meta = h.read_meta_raw(store, STEP)
        replaced = edit(meta)
        h.write_meta_raw(store, STEP, meta if replaced is None else replaced, rechecksum=forge)

    return go


def _objects(edit: Callable[[dict[str, Any]], Any]) -> Callable[[StepStore], None]:
    def go(store: StepStore) -> None:
        objects = json.loads(h.data_files(store, STEP)["objects"].read_bytes())
        edit(objects)
        _set_file(store, STEP, "objects", json.dumps(objects).encode(), forge=True)

    return go


class _Evil:
    """Unpickling this creates the marker file: proof that code from a cache ran."""

    marker = ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _pickled_tensors(marker: Path) -> Callable[[StepStore], None]:
    def go(store: StepStore) -> None:
        import io

        import torch

        evil = _Evil()
        evil.marker = str(marker)
        buffer = io.BytesIO()
        torch.save({"x": torch.zeros(2), "evil": evil}, buffer)
        _set_file(store, STEP, "tensors", buffer.getvalue(), forge=True)

    return go


def _file_is_a_directory(store: StepStore) -> None:
    meta = h.read_meta_raw(store, STEP)
    spec = meta["parts"][0]["files"]["tensors"]
    folder = store.step_dir(STEP) / "tensors-dir"
    folder.mkdir(exist_ok=True)
    spec["name"], spec["size"] = folder.name, folder.stat().st_size
    h.write_meta_raw(store, STEP, meta)


def _copy_meta_of_other_step(store: StepStore) -> None:
    other = StepStore(store.project_dir, "toy", h.CONTEXT)
    other.save(STEP + 1, h.codec_payload(4, 8, seed=7))
    shutil.copy(h.meta_path(other, STEP + 1), h.meta_path(store, STEP))


@dataclass
class Case:
    name: str
    tried: str
    fragments: tuple[str, ...]
    mutate: Callable[[StepStore], None] | None = None
    writer_role: str = "toy"
    writer_trainer: tuple[str, str] = ("exp", "proj")
    reader_trainer: tuple[str, str] = ("exp", "proj")


MARKER_NAME = "unpickled-marker"

CASES = [
    Case("truncated-tensors", "tensor file truncated to half", ("truncated?",), _truncate("tensors")),
    Case("truncated-objects", "objects file truncated to half", ("truncated?",), _truncate("objects")),
    Case(
        "empty-tensors",
        "tensor file emptied",
        ("truncated?",),
        lambda s: h.data_files(s, STEP)["tensors"].write_bytes(b""),
    ),
    Case("flip-tensors", "one byte flipped in the tensor data", ("checksum mismatch",), _flip("tensors", 0.9)),
    Case(
        "flip-tensors-head", "one byte flipped in the tensor file header", ("checksum mismatch",), _flip("tensors", 0.0)
    ),
    Case("flip-objects", "one byte flipped in the objects file", ("checksum mismatch",), _flip("objects")),
    Case(
        "meta-missing",
        "meta.json deleted (data files left)",
        ("no meta.json",),
        lambda s: h.meta_path(s, STEP).unlink(),
    ),
    Case(
        "meta-edited",
        "meta.json edited (rows changed, checksum not)",
        ("edited or damaged",),
        _edit_meta(lambda m: m.update(rows=99), forge=False),
    ),
    Case(
        "meta-truncated",
        "meta.json truncated",
        ("unreadable meta.json",),
        lambda s: h.meta_path(s, STEP).write_bytes(h.meta_path(s, STEP).read_bytes()[:40]),
    ),
    Case("meta-not-object", "meta.json is a JSON list", ("not a skipinject cache",), _edit_meta(lambda m: [m])),
    Case(
        "meta-other-format",
        "meta.json of another tool (format marker)",
        ("not a skipinject cache",),
        _edit_meta(lambda m: m.update(format="other")),
    ),
    Case(
        "format-newer",
        "written by a newer format version",
        ("format version",),
        _edit_meta(lambda m: m.update(format_version=FORMAT_VERSION + 1)),
    ),
    Case(
        "format-older",
        "written by an older format version",
        ("format version",),
        _edit_meta(lambda m: m.update(format_version=PLAIN_FORMAT_VERSION - 1)),
    ),
    Case(
        "role-forged",
        "meta.json says another role wrote it",
        ("written by role",),
        _edit_meta(lambda m: m.update(role="rollout")),
    ),
    Case(
        "role-other",
        "another role cached the same step in the same directory",
        ("written by role",),
        writer_role="other",
    ),
    Case(
        "context-forged",
        "meta.json records other trainer metadata (gbs)",
        ("other trainer metadata",),
        _edit_meta(lambda m: m["context"].update(gbs=8)),
    ),
    Case(
        "context-collision",
        "a run whose names map to the same directory (a/b vs a_b)",
        ("other trainer metadata",),
        writer_trainer=("a/b", "p"),
        reader_trainer=("a_b", "p"),
    ),
    Case("step-mismatch", "meta.json of step 2 copied into step 1", ("records step",), _copy_meta_of_other_step),
    Case(
        "data-missing",
        "tensor file named by meta.json deleted",
        ("missing (named by meta.json)",),
        lambda s: h.data_files(s, STEP)["tensors"].unlink(),
    ),
    Case(
        "size-forged",
        "meta.json size edited (forged checksum)",
        ("truncated?",),
        _edit_meta(lambda m: m["parts"][0]["files"]["tensors"].update(size=1)),
    ),
    Case("no-parts", "meta.json names no parts", ("names no parts",), _edit_meta(lambda m: m.update(parts=[]))),
    Case(
        "parts-garbage", "meta.json parts are not objects", ("malformed",), _edit_meta(lambda m: m.update(parts=["x"]))
    ),
    Case(
        "files-garbage",
        "meta.json file entries are not objects",
        ("unsafe file", "malformed"),
        _edit_meta(lambda m: m["parts"][0].update(files={"tensors": 1, "objects": 2})),
    ),
    Case(
        "algo-unknown",
        "unknown checksum algorithm",
        ("unknown checksum algorithm",),
        _edit_meta(lambda m: m.update(checksum_algo="md5")),
    ),
    Case(
        "algo-missing",
        "checksum algorithm removed",
        ("malformed", "checksum"),
        _edit_meta(lambda m: m.pop("checksum_algo") and None),
    ),
    Case(
        "context-garbage",
        "context is not a mapping",
        ("other trainer metadata", "malformed"),
        _edit_meta(lambda m: m.update(context=[1, 2])),
    ),
    Case(
        "file-is-dir",
        "a named data file is a directory",
        ("malformed", "cannot read", "truncated?"),
        _file_is_a_directory,
    ),
    Case(
        "pickle-tensors",
        "tensor file replaced by a pickle (forged sizes/checksums)",
        ("not a skipinject tensor file", "cannot load"),
        None,
    ),
    Case(
        "objects-not-json",
        "objects file is not JSON (forged)",
        ("cannot load",),
        lambda s: _set_file(s, STEP, "objects", b"\x80not json", forge=True),
    ),
    Case(
        "objects-other-codec",
        "objects file written by another codec (forged)",
        ("codec",),
        _objects(lambda o: o.update(codec="DataProto")),
    ),
    Case(
        "objects-missing-key",
        "objects file lacks a field (forged)",
        ("cannot load",),
        _objects(lambda o: o.pop("mapping")),
    ),
]


def _trainer(names: tuple[str, str]) -> Any:
    return h.toy_trainer(*names)


def _save_first(dump: Path, case: Case) -> None:
    role = h.toy_role(case.writer_role)
    h.call(h.runtime(dump, role=role), h.ToyTarget(), STEP, trainer=_trainer(case.writer_trainer))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_damage_is_detected_reported_once_and_regenerated(
    tmp_path: Path, case: Case, caplog: pytest.LogCaptureFixture, ledger: Any
) -> None:
    dump = tmp_path / "dump"
    marker = tmp_path / MARKER_NAME
    mutate = _pickled_tensors(marker) if case.name == "pickle-tensors" else case.mutate
    reader = _trainer(case.reader_trainer)
    lost = 0
    problems: list[str] = []

    _save_first(dump, case)
    store = h.store_of(h.runtime(dump), reader)
    if mutate is not None:
        mutate(store)

    # a new run with action=cache: one warning line, the target runs, the step is cached again
    target = h.ToyTarget()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="skipinject"):
        result = h.call(h.runtime(dump), target, STEP, trainer=reader)
    warnings = h.records(caplog)
    if target.calls != [STEP] or not h.same_batch(result, _expected()):
        lost += 1
        problems.append(f"not regenerated: calls={target.calls}")
    if len(warnings) != 1 or not any(f in warnings[0] for f in case.fragments):
        lost += 1
        problems.append(f"warnings={warnings}")
    try:
        h.store_of(h.runtime(dump), reader).verified(STEP)
    except (FileNotFoundError, CacheError) as exc:
        lost += 1
        problems.append(f"not cached again: {exc}")

    # damage the fresh cache the same way; a strict run stops and loads nothing, deletes nothing
    if mutate is not None and case.name not in ("role-other", "context-collision"):
        mutate(store)
    else:
        _save_first(dump, case)
    before = {p: p.stat().st_size for p in h.regular_files(store.step_dir(STEP))}
    strict_target = h.ToyTarget()
    with pytest.raises((CacheMissError, CorruptCacheError)) as stopped:
        h.call(h.runtime(dump, action="strict"), strict_target, STEP, trainer=reader)
    if strict_target.calls:
        lost += 1
    after = {p: p.stat().st_size for p in h.regular_files(store.step_dir(STEP))}
    if before != after:
        lost += 1
        problems.append("strict run changed the damaged files")
    if marker.exists():
        lost += 1
        problems.append("code from the cache ran")
    ledger("integrity", case.tried, 2, f"1 warning line, regenerated; strict: {type(stopped.value).__name__}", lost)
    assert lost == 0, problems


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from skipinject.engine.background import WRITER

    dump = tmp_path_factory.mktemp("pristine") / "dump"
    h.call(h.runtime(dump), h.ToyTarget(), STEP)
    WRITER.flush()  # module-scoped: built before the per-test inline-save fixture applies
    return dump


def _load_via_store(dump: Path) -> Any:
    """What a run would train on: verified, loaded and decoded, or a CacheError."""
    rt = h.runtime(dump)
    store = h.store_of(rt)
    entry = store.verified(STEP)
    payloads = store.load(entry)
    if len(payloads) != 1:
        raise CorruptCacheError(f"expected one part, the cache has {len(payloads)}")
    return rt.codec.decode(payloads[0], None)


_FUZZ: dict[str, int] = {"examples": 0, "rejected": 0, "identical": 0, "lost": 0}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    which=st.sampled_from(["meta", "tensors", "objects"]),
    where=st.floats(0, 1, exclude_max=True),
    xor=st.integers(1, 255),
)
def test_any_flipped_byte_is_rejected_or_harmless(
    pristine: Path, tmp_path_factory: pytest.TempPathFactory, which: str, where: float, xor: int
) -> None:
    dump = tmp_path_factory.mktemp("flip") / "dump"
    shutil.copytree(pristine, dump)
    store = h.store_of(h.runtime(dump))
    path = h.meta_path(store, STEP) if which == "meta" else h.data_files(store, STEP)[which]
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= xor
    path.write_bytes(bytes(data))
    _FUZZ["examples"] += 1
    try:
        result = _load_via_store(dump)
    except (FileNotFoundError, CacheError):
        _FUZZ["rejected"] += 1
        return
    same = h.same_batch(result, _expected())
    _FUZZ["identical" if same else "lost"] += 1
    assert same, f"a damaged cache loaded as different data ({which} byte {int(len(data) * where)} ^ {xor})"


@pytest.fixture(scope="module", autouse=True)
def _record_flips(module_ledger: Any) -> Iterator[None]:
    """After the module: the byte-flip fuzzing above in one ledger line (each flip fails on its own)."""
    _FUZZ.update(dict.fromkeys(_FUZZ, 0))
    yield
    if _FUZZ["examples"]:
        module_ledger(
            "integrity",
            "random single-byte flips anywhere in meta.json / tensor / objects file (hypothesis)",
            _FUZZ["examples"],
            f"rejected {_FUZZ['rejected']}, harmless (same data) {_FUZZ['identical']}",
            _FUZZ["lost"],
        )


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**12) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
_PATHS = [
    ("format",),
    ("format_version",),
    ("role",),
    ("step",),
    ("context",),
    ("checksum_algo",),
    ("parts",),
    ("rows",),
    ("parts", 0),
    ("parts", 0, "dir"),
    ("parts", 0, "files"),
    ("parts", 0, "files", "tensors"),
    ("parts", 0, "files", "tensors", "name"),
    ("parts", 0, "files", "tensors", "size"),
    ("parts", 0, "files", "objects", "checksum"),
    ("parts", 0, "rows"),
    ("created",),
    ("writer",),
]


def _forge_meta_fuzz(pristine: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """Random JSON at each key path of a valid meta.json, its own checksum recomputed (hypothesis):
    every outcome counted, a raw exception raised. Each test that needs the counts runs it itself."""
    counts = {"examples": 0, "rejected": 0, "accepted": 0, "raw": 0}

    @settings(max_examples=200, deadline=None)
    @given(path=st.sampled_from(_PATHS), value=_JSON, delete=st.booleans())
    def forge(path: tuple[Any, ...], value: Any, delete: bool) -> None:
        dump = tmp_path_factory.mktemp("forge") / "dump"
        shutil.copytree(pristine, dump)
        store = h.store_of(h.runtime(dump))
        meta = h.read_meta_raw(store, STEP)
        node = meta
        for key in path[:-1]:
            node = node[key]
        if delete and isinstance(node, dict):
            node.pop(path[-1], None)
        else:
            node[path[-1]] = value
        h.write_meta_raw(store, STEP, meta)
        counts["examples"] += 1
        try:
            entry = store.verified(STEP)
            store.load(entry)
        except (FileNotFoundError, CorruptCacheError):
            counts["rejected"] += 1
            return
        except Exception as exc:
            counts["raw"] += 1
            raise AssertionError(f"forged meta.json {path}={value!r} raised {type(exc).__name__}: {exc}") from exc
        counts["accepted"] += 1

    forge()
    return counts


def test_forged_meta_only_ever_gives_corrupt_cache_error(
    pristine: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    counts = _forge_meta_fuzz(pristine, tmp_path_factory)
    assert counts["examples"] > 0 and counts["raw"] == 0


def test_forged_meta_summary(pristine: Path, tmp_path_factory: pytest.TempPathFactory, ledger: Any) -> None:
    """Runs the fuzzing itself (alone it records real numbers, never another test's leftovers)."""
    counts = _forge_meta_fuzz(pristine, tmp_path_factory)
    ledger(
        "integrity",
        "forged meta.json: random JSON at 18 key paths, own checksum recomputed (hypothesis)",
        counts["examples"],
        f"CorruptCacheError {counts['rejected']}, harmless edits accepted {counts['accepted']}, "
        f"raw exceptions {counts['raw']}",
        counts["raw"],
    )
    assert counts["examples"] > 0 and counts["raw"] == 0
