"""Trust: nothing from a cache directory runs code unless the user said so, and no path leaves dump_dir.

* A pickle planted where verl's own cache would be (``{step}/gen_batch.dp`` for ``rollout``,
  ``{step}/0/tq_batch.pt`` for ``rollout_tq``), whose unpickling creates a marker file, is not
  loaded without ``trust_upstream=true``: it is reported once, never deleted, and the step is
  generated again and cached beside it (the next run hits skipinject's own cache).
* ``dump_dir`` and everything skipinject creates under it is private to the user (0o700).
* Names from the run's config (experiment/project names with ``../``, absolute paths, NUL) and
  from meta.json (part directories and file names with ``..`` or ``/``) never reach outside.
* ``torch.load`` is only ever called with ``weights_only=True`` in skipinject/, nothing there
  unpickles, and a full save → load → decode cycle calls no unpickler at all.
"""

from __future__ import annotations

import ast
import copy
import io
import logging
import os
import pickle
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import skipinject
from skipinject.config import RoleConfig
from skipinject.engine import RoleRuntime
from skipinject.errors import CorruptCacheError
from skipinject.roles import Call, UpstreamFormat
from tests.reliability import helpers as h

PACKAGE = Path(skipinject.__file__).resolve().parent


class Evil:
    """Unpickling this creates ``marker``: proof that code from the cache ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def plant_pickle(path: Path, marker: Path) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = pickle.dumps(Evil(marker))
    path.write_bytes(data)
    return data


def plant_torch_save(path: Path, marker: Path) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save({"tensordict": Evil(marker), "keys": [], "tags": [], "global_steps": 3}, buffer)
    path.write_bytes(buffer.getvalue())
    return buffer.getvalue()


def _rollout_role() -> Any:
    from skipinject_rollout.rollout import ROLLOUT

    return ROLLOUT


@pytest.mark.parametrize(
    "kind", [pytest.param("rollout:gen_batch.dp", marks=pytest.mark.integration), "toy:0/tq_batch.pt"]
)  # the rollout role's codec takes verl's DataProto
def test_planted_upstream_pickle_is_reported_kept_and_regenerated_beside(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture, ledger: Any
) -> None:
    name, file_name = kind.split(":")
    marker = tmp_path / "code-ran"
    if name == "rollout":
        role = _rollout_role()
        plant = plant_pickle
    else:  # a role with rollout_tq's upstream layout, driven through the generic engine path
        role = h.toy_role(upstream=UpstreamFormat(file_name, lambda p: torch.load(p, weights_only=False)))
        plant = plant_torch_save
    dump = tmp_path / "dump"
    project = h.project_dir(h.runtime(dump, role=role))
    planted = project / "3" / file_name
    original = plant(planted, marker)
    caplog.set_level(logging.INFO, logger="skipinject")
    lost = 0

    rt = h.runtime(dump, role=role)
    target = h.ToyTarget(dataproto=name == "rollout")
    result = h.call(rt, target, 3)
    h.end_run(rt)
    reports = [m for m in h.records(caplog) if file_name.split("/")[-1] in m]
    lost += int(marker.exists()) + int(target.calls != [3]) + int(len(reports) != 1)
    lost += int("trust_upstream" not in (reports or [""])[0])
    lost += int(not h.same_batch(result, h.make_batch(4, 8, seed=1003, step=3)))
    lost += int(planted.read_bytes() != original)
    store = h.store_of(rt)
    store.verified(3)  # cached in skipinject's format beside the pickle

    # the same run meets the same file again (our cache removed): no second report
    for path in h.regular_files(store.step_dir(3)):
        if path != planted:
            path.unlink()
    caplog.clear()
    h.call(rt, target, 3)
    h.end_run(rt)
    lost += len([m for m in h.records(caplog) if file_name.split("/")[-1] in m])

    # the next run hits skipinject's own cache; the pickle is still not touched
    caplog.clear()
    again = h.ToyTarget(dataproto=name == "rollout")
    h.call(h.runtime(dump, role=role), again, 3)
    lost += int(again.calls != []) + len([m for m in h.records(caplog) if file_name.split("/")[-1] in m])
    lost += int(marker.exists()) + int(planted.read_bytes() != original)

    # the gate is the flag: trusted, the same kind of file is loaded (and its code runs)
    plant(project / "4" / file_name, marker)
    h.call(h.runtime(dump, role=role, trust_upstream=True), h.ToyTarget(dataproto=name == "rollout"), 4)
    trusted_ran = marker.exists()
    ledger(
        "trust",
        f"pickle planted as verl's `{{step}}/{file_name}` ({name} role), marker on unpickle",
        4,
        "not unpickled, reported in 1 line, kept byte-identical, step regenerated and cached beside it, next run "
        f"hits; with trust_upstream=true it is loaded: {trusted_ran}",
        lost,
    )
    assert lost == 0
    assert trusted_ran


def test_rollout_tq_role_reports_its_upstream_file_untrusted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, ledger: Any
) -> None:
    plugin = pytest.importorskip("skipinject_rollout_tq.plugin")
    role = plugin.make_role()
    assert role.upstream is not None and role.upstream.file_name == "0/tq_batch.pt"
    marker = tmp_path / "code-ran"
    trainer = h.toy_trainer()
    trainer.global_steps = 3  # type: ignore[attr-defined]
    settings_ = RoleConfig(enable=True, dump_dir=str(tmp_path / "dump"), steps=(3,))
    rt = RoleRuntime(role, settings_, owner="tests")
    invocation = Call("x:y", lambda *a: None, trainer, (), {})
    store = rt.store_for(invocation)
    planted = store.step_dir(3) / "0" / "tq_batch.pt"
    original = plant_torch_save(planted, marker)
    caplog.set_level(logging.WARNING, logger="skipinject")
    plan = rt.plan(invocation, 3)
    assert plan.entry is None and plan.upstream_file is None
    assert not marker.exists() and planted.read_bytes() == original
    lines = h.records(caplog)
    assert len(lines) == 1 and "tq_batch.pt" in lines[0] and "trust_upstream" in lines[0]
    trusted = RoleRuntime(
        role, RoleConfig(enable=True, dump_dir=settings_.dump_dir, steps=(3,), trust_upstream=True), owner="tests"
    )
    assert trusted.plan(invocation, 3).upstream_file == planted
    ledger(
        "trust",
        "pickle planted as `{step}/0/tq_batch.pt` for the real rollout_tq role (its plan)",
        2,
        "untrusted: not loaded, reported in 1 line, kept; trusted: planned for loading",
        0,
    )


def test_dump_dir_is_private(tmp_path: Path, ledger: Any) -> None:
    dump = tmp_path / "a" / "dump"
    old = os.umask(0)
    try:
        h.call(h.runtime(dump), h.ToyTarget(), 1)
    finally:
        os.umask(old)
    created = [p for p in h.iter_dirs(tmp_path / "a")]
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in created}
    wrong = {k: oct(v) for k, v in modes.items() if v != 0o700}
    ledger(
        "trust",
        "dump_dir created under umask 0: mode of every directory skipinject created",
        len(modes),
        f"0o700: {len(modes) - len(wrong)}/{len(modes)}",
        len(wrong),
    )
    assert not wrong, wrong


_NAMES = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["..", "../..", "../../escape", "/etc", "/", ".", "", "a/../../b", "\x00", "..\\..", "x" * 300]),
)
_ESCAPES = {"tried": 0, "escaped": 0, "failed_calls": 0}


def _never_loaded(path: Any) -> Any:
    raise AssertionError(f"untrusted upstream file {path} loaded")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(experiment=_NAMES, project=_NAMES, subdir=st.sampled_from([None, "", "../../up", "/abs", ".."]))
def test_names_from_the_run_config_stay_inside_dump_dir(experiment: str, project: str, subdir: str | None) -> None:
    with tempfile.TemporaryDirectory() as root_text:
        root = Path(root_text)
        dump = root / "inside" / "dump"
        dump.mkdir(parents=True)  # existing, so that over-long names reach the file system (ENAMETOOLONG)
        role = h.toy_role(upstream=UpstreamFormat("gen_batch.dp", _never_loaded))
        if subdir is not None:
            from dataclasses import replace

            role = replace(role, cache_subdir=subdir)
        trainer = h.toy_trainer(experiment, project)
        rt = h.runtime(dump, role=role)
        target = h.ToyTarget()
        _ESCAPES["tried"] += 1
        result = h.call(rt, target, 1, trainer=trainer)
        if target.calls != [1] or result is None:
            _ESCAPES["failed_calls"] += 1
        outside = [p for p in root.rglob("*") if not str(p).startswith(str(root / "inside"))]
        project_dir = h.store_of(rt, trainer).project_dir.resolve()
        if outside or not project_dir.is_relative_to(dump.resolve()):
            _ESCAPES["escaped"] += 1
        assert not outside and project_dir.is_relative_to(dump.resolve()), (experiment, project, subdir)
        assert target.calls == [1] and result is not None, ("the call failed", experiment, project, subdir)


@pytest.fixture(scope="module", autouse=True)
def _record_escapes(module_ledger: Any) -> Iterator[None]:
    """After the module: the config-name fuzzing above in one ledger line (each example fails on its own)."""
    _ESCAPES.update(dict.fromkeys(_ESCAPES, 0))
    yield
    if _ESCAPES["tried"]:
        module_ledger(
            "trust",
            "experiment/project names and role subdir with `../`, absolute paths, NUL, 300 chars "
            "(hypothesis), through a real save",
            _ESCAPES["tried"],
            f"paths outside dump_dir: {_ESCAPES['escaped']}; calls that failed: {_ESCAPES['failed_calls']}",
            _ESCAPES["escaped"] + _ESCAPES["failed_calls"],
        )


@pytest.fixture(scope="module")
def cached_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from skipinject.engine.background import WRITER

    dump = tmp_path_factory.mktemp("meta-names") / "dump"
    h.call(h.runtime(dump), h.ToyTarget(), 1)
    WRITER.flush()  # module-scoped: built before the per-test inline-save fixture applies
    return dump


_UNSAFE = st.one_of(
    st.sampled_from(["..", "../x", "../../outside.bin", "/etc/passwd", "a/b", ".", "./x", "x/..", "\\..\\x", "..."]),
    st.text(max_size=12).filter(lambda s: "/" in s or ".." in s or s.startswith(".") or s == ""),
)
_META_NAMES = {"tried": 0, "rejected": 0, "outside_opened": 0}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(["dir", "tensors", "objects"]), name=_UNSAFE)
def test_names_in_meta_json_never_leave_the_step(
    cached_step: Path, monkeypatch: pytest.MonkeyPatch, where: str, name: str
) -> None:
    assume(not (where == "dir" and name == ""))  # "": the part lives in the step directory itself
    store = h.store_of(h.runtime(cached_step))
    step_dir = store.step_dir(1)
    meta = h.read_meta_raw(store, 1)
    original = copy.deepcopy(meta)
    # an outside file that would pass the size and checksum checks if it were read
    outside = cached_step.parent / "outside.bin"
    tensors = h.data_files(store, 1)["tensors"]
    outside.write_bytes(tensors.read_bytes())
    part = meta["parts"][0]
    if where == "dir":
        part["dir"] = name
    else:
        part["files"][where]["name"] = name
    opened: list[str] = []
    real_open = open

    def spy(file: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    h.patch_store_open(monkeypatch, spy)
    h.write_meta_raw(store, 1, meta)
    _META_NAMES["tried"] += 1
    try:
        with pytest.raises(CorruptCacheError):
            store.load(store.verified(1))
        _META_NAMES["rejected"] += 1
    finally:
        h.write_meta_raw(store, 1, original, rechecksum=False)
    escaped = [p for p in opened if not Path(p).resolve().is_relative_to(step_dir.resolve())]
    _META_NAMES["outside_opened"] += len(escaped)
    assert not escaped, escaped


@pytest.fixture(scope="module", autouse=True)
def _record_meta_names(module_ledger: Any) -> Iterator[None]:
    """After the module: the meta.json-name fuzzing above in one ledger line (each example fails on its own)."""
    _META_NAMES.update(dict.fromkeys(_META_NAMES, 0))
    yield
    if _META_NAMES["tried"]:
        module_ledger(
            "trust",
            "meta.json part dir / file names with `..`, `/`, `.` (forged checksum; hypothesis)",
            _META_NAMES["tried"],
            f"CorruptCacheError: {_META_NAMES['rejected']}; files opened outside the step: "
            f"{_META_NAMES['outside_opened']}",
            _META_NAMES["tried"] - _META_NAMES["rejected"] + _META_NAMES["outside_opened"],
        )


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def test_source_never_unpickles(ledger: Any) -> None:
    """Every ``torch.load`` in skipinject/ passes ``weights_only=True`` and every ``np.load``
    ``allow_pickle=False`` (the match row index, a hint checked before use); no pickle/load_memmap at all."""
    bad: list[str] = []
    files = sorted(PACKAGE.rglob("*.py"))
    loads = 0
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                if any(n and n.split(".")[0] in ("pickle", "dill", "cloudpickle", "marshal", "shelve") for n in names):
                    bad.append(f"{path.name}:{node.lineno}: imports {names}")
                if isinstance(node, ast.ImportFrom) and node.module == "torch" and "load" in names:
                    bad.append(f"{path.name}:{node.lineno}: from torch import load")
        for call in _calls(tree):
            name = _dotted(call.func)
            where = f"{path.relative_to(PACKAGE.parent)}:{call.lineno}: {name}"
            if name.endswith("torch.load"):
                loads += 1
                flag = {k.arg: k.value for k in call.keywords}.get("weights_only")
                if not (isinstance(flag, ast.Constant) and flag.value is True):
                    bad.append(f"{where} without weights_only=True")
            if name.split(".")[-1] in ("load_memmap", "loads") and "json" not in name:
                bad.append(where)
            if name.endswith(("np.load", "numpy.load")):  # only as the torch.load rule: never unpickling
                flag = {k.arg: k.value for k in call.keywords}.get("allow_pickle")
                if not (isinstance(flag, ast.Constant) and flag.value is False):
                    bad.append(f"{where} without allow_pickle=False")
    ledger(
        "trust",
        f"source scan of skipinject/ ({len(files)} files): torch.load without weights_only=True, "
        "pickle/dill/marshal imports, np.load without allow_pickle=False, load_memmap",
        len(files),
        f"torch.load calls: {loads}, all weights_only=True; unpickling calls: {len(bad)}",
        len(bad),
    )
    assert not bad, bad


def test_a_save_load_cycle_calls_no_unpickler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    calls: list[str] = []
    real_torch_load = torch.load

    def torch_load(*args: Any, **kwargs: Any) -> Any:
        calls.append(f"torch.load weights_only={kwargs.get('weights_only')}")
        if kwargs.get("weights_only") is not True:
            raise AssertionError("torch.load without weights_only=True")
        return real_torch_load(*args, **kwargs)

    def refuse(name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} called while loading a skipinject cache")

        return fail

    target = h.ToyTarget()
    h.call(h.runtime(tmp_path), target, 1)  # imports done, cache written
    monkeypatch.setattr(torch, "load", torch_load)
    monkeypatch.setattr(pickle, "load", refuse("pickle.load"))
    monkeypatch.setattr(pickle, "loads", refuse("pickle.loads"))
    monkeypatch.setattr(pickle, "Unpickler", refuse("pickle.Unpickler"))
    monkeypatch.setattr(np, "load", refuse("np.load"))
    result = h.call(h.runtime(tmp_path), target, 1)
    assert target.calls == [1] and h.same_batch(result, h.make_batch(4, 8, seed=1001, step=1))
    assert all(c.startswith("torch.load weights_only=True") for c in calls), calls


# ---------------------------------------------------------------- a tokenizer directory's code

_TOKENIZER_IN_A_CHILD = """
import sys
from skipinject.cache_tool import fields
from skipinject.cache_tool.common import CommandError
given = sys.argv[1] or None
try:
    decode, source = fields.tokenizer(given, {"model": sys.argv[2]})
    print("loaded" if decode else "none")
except CommandError as exc:
    print("refused:", exc)
"""


def _evil_model_dir(root: Path, marker: Path) -> Path:
    """A model directory whose tokenizer and config name code of their own (``auto_map``), and whose
    ``config.json`` holds terminal escapes; its code, when run, creates ``marker``."""
    model = root / "model"
    model.mkdir()
    code = f"open({str(marker)!r}, 'w').write('ran')\nclass EvilTokenizer: pass\nclass EvilConfig: pass\n"
    (model / "tokenization_evil.py").write_text(code)
    (model / "configuration_evil.py").write_text(code)
    (model / "tokenizer_config.json").write_text(
        '{"auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", null]}, "tokenizer_class": "EvilTokenizer"}'
    )
    (model / "config.json").write_text(
        '{"model_type": "evil\\u001b]0;owned\\u0007", "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}}'
    )
    return model


@pytest.mark.parametrize("how", ["--tokenizer", "recorded model"])
def test_a_tokenizer_directory_never_runs_its_code_nor_asks(tmp_path: Path, how: str, ledger: Any) -> None:
    """``cache show``/``diff`` load a tokenizer named by a cache (or ``--tokenizer``) with
    ``trust_remote_code=False``: a directory with code of its own is refused in one line, even with a
    "y" waiting on stdin, and transformers' warnings quoting its ``config.json`` are not printed."""
    import subprocess
    import sys

    marker = tmp_path / "RAN"
    model = _evil_model_dir(tmp_path, marker)
    given = str(model) if how == "--tokenizer" else ""
    done = subprocess.run(
        [sys.executable, "-c", _TOKENIZER_IN_A_CHILD, given, str(model)],
        input="y\ny\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert not marker.exists(), "the tokenizer directory's code ran"
    assert "\x1b" not in done.stdout + done.stderr and "\x07" not in done.stdout + done.stderr, done.stderr
    assert "trust_remote_code" not in done.stderr and "[y/N]" not in done.stdout + done.stderr, "no prompt"
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and len(lines) == 1, (done.stdout, done.stderr)
    if how == "recorded model":
        assert lines[0] == "none", "a recorded directory that cannot be loaded: rows shown as token ids"
    if how == "--tokenizer":
        assert lines[0] == (
            f"refused: cannot load a tokenizer from {model}: it names code of its own (auto_map), which skipinject "
            "never runs; give --tokenizer a directory without it"
        )
    ledger("trust", f"a tokenizer directory with its own code, named by {how}, 'y' on stdin", 1, "refused", 0)


def test_a_nul_in_the_recorded_model_directory_is_one_line(caplog: pytest.LogCaptureFixture) -> None:
    from skipinject.cache_tool import fields

    with caplog.at_level(logging.WARNING, logger="skipinject"):
        assert fields.tokenizer(None, {"model": "/models/a\x00b"}) == (None, None)
    assert [r.getMessage() for r in caplog.records] == [
        "the recorded model directory '/models/a\\x00b' is no path (it holds a NUL character): rows shown as token ids"
    ]


# ---------------------------------------------------------------- SKIPINJECT_SUMMARY's file


def _summary_into(target: str, report_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> list[str]:
    """A run's end with ``SKIPINJECT_SUMMARY=target``: the warnings it says."""
    from skipinject.config.environment import ENV_SUMMARY
    from skipinject.report import tally

    report_dir.mkdir(mode=0o700)
    monkeypatch.setenv(ENV_SUMMARY, target)
    end = tally.RunEnd(report_dir, ["rollout"])
    caplog.clear()
    with caplog.at_level(logging.WARNING, "skipinject"):
        end.say()
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("kind", ["fifo", "character device", "link to a fifo", "directory"])
def test_the_summary_never_replaces_what_is_not_a_regular_file(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch, caplog: Any, ledger: Any
) -> None:
    target = tmp_path / "summary.json"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "character device":
        os.mknod(target, 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers (tests run as root)
    elif kind == "link to a fifo":
        os.mkfifo(tmp_path / "pipe")
        target.symlink_to(tmp_path / "pipe")
    else:
        target.mkdir()
    before = os.lstat(target)
    said = _summary_into(str(target), tmp_path / "run", monkeypatch, caplog)
    after = os.lstat(target)
    assert (after.st_ino, stat.S_IFMT(after.st_mode)) == (before.st_ino, stat.S_IFMT(before.st_mode)), "replaced"
    assert len(said) == 1 and "cannot write the summary there" in said[0] and "not a regular file" in said[0], said
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [], "a private copy left beside"
    ledger("trust", f"SKIPINJECT_SUMMARY naming a {kind}", 1, "refused in one line, left as it was", 0)


def test_the_summary_is_written_through_a_link_to_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    (tmp_path / "real.json").write_text("old")
    link = tmp_path / "summary.json"
    link.symlink_to(tmp_path / "real.json")
    assert _summary_into(str(link), tmp_path / "run", monkeypatch, caplog) == []
    assert link.is_symlink() and '"roles"' in (tmp_path / "real.json").read_text()


def test_the_summary_is_not_written_through_another_users_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any, ledger: Any
) -> None:
    """A link planted by someone else (e.g. in /tmp) never redirects the summary onto the user's own file."""
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    link = tmp_path / "summary.json"
    link.symlink_to(victim)
    os.lchown(link, 4242, 4242)  # tests run as root: the link now belongs to another user
    said = _summary_into(str(link), tmp_path / "run", monkeypatch, caplog)
    assert victim.read_text() == "keep me" and link.is_symlink()
    assert len(said) == 1 and "a symbolic link of another user (uid 4242)" in said[0], said
    ledger("trust", "SKIPINJECT_SUMMARY naming another user's link to the user's file", 1, "refused, file kept", 0)


_SUMMARY_TO_STDOUT = """
import os, sys
from pathlib import Path
from skipinject.report import tally
print("the run's own output", flush=True)
run = Path(sys.argv[1])
run.mkdir(mode=0o700)
tally.RunEnd(run, ["rollout"]).say()
"""


def test_a_summary_to_dev_stdout_is_appended_to_the_runs_output_file(tmp_path: Path, ledger: Any) -> None:
    """``SKIPINJECT_SUMMARY=/dev/stdout`` with the run's output redirected to a file: the summary is written
    at its end (the file a descriptor writes to), never in place of it, and nothing is made beside it."""
    import subprocess
    import sys

    log = tmp_path / "run.log"
    with log.open("w") as out:
        inode = os.fstat(out.fileno()).st_ino
        done = subprocess.run(
            [sys.executable, "-c", _SUMMARY_TO_STDOUT, str(tmp_path / "run")],
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "SKIPINJECT_SUMMARY": "/dev/stdout"},
            timeout=120,
        )
    assert done.returncode == 0, done.stderr
    text = log.read_text()
    assert log.stat().st_ino == inode and text.startswith("the run's own output\n") and '"roles"' in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.log"], "a file made beside the log"
    ledger("trust", "SKIPINJECT_SUMMARY=/dev/stdout, output redirected to a file", 1, "appended, file kept", 0)


def test_a_relative_summary_path_names_the_directory_the_command_started_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """As ``dump_dir``: the program may move (Hydra's ``chdir``) before the run ends."""
    from skipinject.config.environment import ENV_SUMMARY
    from skipinject.report import tally

    started, moved = tmp_path / "started", tmp_path / "moved"
    started.mkdir()
    moved.mkdir()
    monkeypatch.chdir(started)
    monkeypatch.setenv(ENV_SUMMARY, "out/summary.json")
    (started / "out").mkdir()
    (tmp_path / "run").mkdir(mode=0o700)
    end = tally.RunEnd(tmp_path / "run", ["rollout"])
    monkeypatch.chdir(moved)
    end.say()
    assert (started / "out" / "summary.json").is_file() and not any(moved.iterdir())
