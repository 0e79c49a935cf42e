"""``skipinject cache`` on hostile caches (issue 23): names and values printed escaped, forged
``meta.json`` files ending as damaged entries (never "internal error", exit 3), under a strict
UTF-8 stdout too. No verl: the steps are written by the store itself, as the engine writes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from skipinject.cache_tool import main
from skipinject.payload import Payload
from skipinject.store import StepStore
from skipinject.store.format import meta_digest

LAYOUT = "GBS4_N2_in32_out16"
EVIL = "evil\x1b]0;owned\x07\x1b[2J\nPROJ  FORGED ROW"


def context(project: str = "e_p") -> dict[str, Any]:
    return {
        "experiment_name": project,
        "project_name": "p",
        "gbs": 4,
        "n": 2,
        "prompt_length": 32,
        "response_length": 16,
    }


def save(project_dir: Path, step: int, role: str = "tool_test", value: int = 1) -> Path:
    store = StepStore(project_dir, role, context())
    payload = Payload(tensors={"x": torch.full((2, 3), value)}, objects={"value": [value, value]}, rows=2)
    return store.save(step, payload, {"inputs": None})


def rewrite_meta(step_dir: Path, edit: Any) -> None:
    """Edit a step's meta.json and re-seal it (the checksum is a crc32: anyone can forge it)."""
    meta = json.loads((step_dir / "meta.json").read_text())
    edit(meta)
    meta["meta_checksum"] = meta_digest(meta)
    (step_dir / "meta.json").write_text(json.dumps(meta))


def run(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def cli(*argv: Any, encoding: str = "utf-8:strict") -> subprocess.CompletedProcess[bytes]:
    """The tool in a child whose stdout and stderr are strict UTF-8 (a name that is not UTF-8 can
    only be printed escaped)."""
    env = {**os.environ, "PYTHONIOENCODING": encoding}
    args = [os.fsencode(a) if isinstance(a, (str, Path)) else a for a in argv]
    return subprocess.run(
        [sys.executable.encode(), b"-m", b"skipinject", b"cache", *args], capture_output=True, env=env, timeout=120
    )


# ---------------------------------------------------------------- one escaping function


def test_shown_escapes_controls_escapes_newlines_and_undecodable_bytes() -> None:
    from skipinject.cache_tool.common import shown

    assert shown("plain name 日本 1-2") == "plain name 日本 1-2"
    assert shown("a\nb\tc\rd\x1b[2Je\x07f\x7f\u202eg\\h") == r"a\nb\tc\rd\e[2Je\x07f\x7f\u202eg\\h"
    assert shown(os.fsdecode(b"caf\xe9")) == "caf\\xe9"


def test_ls_and_verify_print_a_hostile_project_name_escaped_and_json_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "dump"
    save(root / EVIL / LAYOUT, 1)
    for argv in (("ls", root), ("ls", "-l", root), ("verify", root)):
        code, out, err = run(capsys, *argv)
        assert code == 0, err
        assert "\x1b" not in out + err and "\x07" not in out + err
        assert "FORGED ROW" not in "\n".join(line for line in out.splitlines() if line.startswith("PROJ  "))
        assert "evil\\e]0;owned\\x07\\e[2J\\nPROJ  FORGED ROW" in out or argv[0] == "verify"
    code, out, _ = run(capsys, "ls", root)
    assert len(out.splitlines()) == 3  # header, one row, the summary: no forged row
    code, out, _ = run(capsys, "ls", root, "--json")
    (step,) = json.loads(out)["steps"]
    assert step["project"] == EVIL and step["path"] == str(root / EVIL / LAYOUT / "1")


def test_meta_json_values_and_one_line_errors_are_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "dump"
    good = save(root / "e_p" / LAYOUT, 1)
    rewrite_meta(good, lambda meta: meta["writer"].update(skipinject="0.1\x1b[2J\nFORGED"))
    damaged = save(root / "e_p" / LAYOUT / ("role\x1b[31m\n"), 2)
    (damaged / "meta.json").write_text((damaged / "meta.json").read_text().replace('"rows"', '"rowz"'))
    code, out, err = run(capsys, "ls", root)
    assert "\x1b" not in out + err and "0.1\\e[2J\\nFORGED" in out
    assert len(err.splitlines()) == 1 and err.startswith("damaged: ") and "role\\e[31m\\n" in err
    code, out, err = run(capsys, "verify", root)
    assert code == 1 and "\x1b" not in out + err
    assert [line for line in out.splitlines() if line.startswith("DAMAGED:")] == [
        line for line in out.splitlines() if "role\\e[31m\\n" in line
    ]
    code, out, err = run(capsys, "show", damaged)
    assert code == 2 and "\x1b" not in err and len(err.splitlines()) == 1
    code, out, _ = run(capsys, "show", good)
    assert code == 0 and "\x1b" not in out and "0.1\\e[2J\\nFORGED" in out
    code, out, _ = run(capsys, "show", good, "--json")
    assert json.loads(out)["writer"]["skipinject"] == "0.1\x1b[2J\nFORGED"


# ---------------------------------------------------------------- forged meta.json: damaged, never exit 3


def deep_meta(step_dir: Path, depth: int = 100_000) -> None:
    step_dir.mkdir(parents=True, exist_ok=True)
    (step_dir / "meta.json").write_text('{"format": "skipinject", "x": ' + "[" * depth + "]" * depth + "}")


@pytest.mark.parametrize("depth", [100_000, 900])
def test_show_and_diff_of_a_deeply_nested_meta_json_is_a_damaged_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], depth: int
) -> None:
    good = save(tmp_path / "e_p" / LAYOUT, 1)
    forged = tmp_path / "e_p" / LAYOUT / "2"
    deep_meta(forged, depth)
    code, _, err = run(capsys, "show", forged)
    assert code == 2 and "internal error" not in err and len(err.splitlines()) == 1, err
    assert "nested" in err
    code, out, err = run(capsys, "diff", good, forged)
    assert code == 1 and "internal error" not in err and "cannot compare" in out and "nested" in out, out + err
    code, out, err = run(capsys, "diff", good, forged, "--json")
    assert code == 1 and json.loads(out)["steps"][0]["problems"]
    code, out, err = run(capsys, "ls", tmp_path, "--json")
    states = {s["step"]: s["state"] for s in json.loads(out)["steps"]}
    assert code == 0 and states == {1: "complete", 2: "damaged"}


HUGE = int("9" * 4300)  # as many digits as Python converts; adding the other steps' rows gives one more


def forge_rows(step_dir: Path) -> None:
    rewrite_meta(step_dir, lambda meta: meta.update(rows=HUGE))


def test_ls_of_a_meta_json_with_a_4300_digit_number_lists_everything_else(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "dump"
    for step in (1, 2, 3):
        save(root / "e_p" / LAYOUT, step)
    forge_rows(root / "e_p" / LAYOUT / "2")
    for argv in (("ls", root), ("ls", "-l", root)):
        code, out, err = run(capsys, *argv)
        assert code == 0 and "internal error" not in err, err
        assert "complete" in out and "damaged" in out and "rows" in err
    code, out, err = run(capsys, "ls", root, "--json")
    assert code == 0, err
    steps = {s["step"]: s["state"] for s in json.loads(out)["steps"]}
    assert steps == {1: "complete", 2: "damaged", 3: "complete"}
    code, out, err = run(capsys, "verify", root)
    assert code == 1 and "internal error" not in err and "2 ok, 1 damaged" in out, out + err


def test_ls_of_a_remote_store_with_a_4300_digit_number_lists_everything_else(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fsspec = pytest.importorskip("fsspec")
    local = tmp_path / "dump"
    for step in (1, 2):
        save(local / "e_p" / LAYOUT, step)
    forge_rows(local / "e_p" / LAYOUT / "2")
    memory = fsspec.filesystem("memory")
    path = f"/hostile-{os.getpid()}-{tmp_path.name}"
    memory.put(str(local), path, recursive=True)
    try:
        code, out, err = run(capsys, "ls", f"memory://{path}", "--json")
        assert code == 0, err
        steps = {s["step"]: s["state"] for s in json.loads(out)["steps"]}
        assert steps == {1: "complete", 2: "damaged"}
        code, out, err = run(capsys, "ls", f"memory://{path}")
        assert code == 0 and "internal error" not in err and "complete" in out, err
    finally:
        memory.rm(path, recursive=True)


def test_prune_and_verify_agree_on_a_damaged_step_in_a_memory_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A data file changed in place in an object store: ``verify`` says DAMAGED, and ``prune``'s
    choice of damaged steps (the same store check) picks that step, only it."""
    fsspec = pytest.importorskip("fsspec")
    from skipinject.cache_tool.prune import select
    from skipinject.cache_tool.scan import scan

    local = tmp_path / "dump"
    for step in (1, 2):
        save(local / "e_p" / LAYOUT, step)
    memory = fsspec.filesystem("memory")
    path = f"/agree-{os.getpid()}-{tmp_path.name}"
    memory.put(str(local), path, recursive=True)
    try:
        (tensors,) = [p for p in memory.find(path) if "/2/tensors-" in p]
        data = memory.cat_file(tensors)
        memory.pipe_file(tensors, data[:-1] + bytes([data[-1] ^ 0xFF]))
        code, out, _ = run(capsys, "verify", f"memory://{path}")
        assert code == 1 and "DAMAGED: " in out and "checksum mismatch" in out and "1 ok, 1 damaged" in out
        items = scan(f"memory://{path}", [])
        chosen = select(items, keep_last=None, older_than=None, partial=False, damaged=True, now=0.0)
        assert [(item.step, reason) for item, reason in chosen] == [(2, "damaged")]
    finally:
        memory.rm(path, recursive=True)


# ---------------------------------------------------------------- names that are not UTF-8


def test_ls_and_verify_of_a_non_utf8_name_under_a_strict_utf8_stdout(tmp_path: Path) -> None:
    root = tmp_path / "dump"
    project = os.fsdecode(b"caf\xe9\xff")
    save(root / project / LAYOUT, 1)
    damaged = save(root / project / LAYOUT, 2)
    next(damaged.glob("objects-*.json")).write_text("{}")
    done = cli("ls", root)
    assert done.returncode == 0, done.stderr
    assert b"caf\\xe9\\xff" in done.stdout and b"\xe9" not in done.stdout
    done = cli("verify", root)
    assert done.returncode == 1, done.stderr
    assert b"caf\\xe9\\xff" in done.stdout and b"internal error" not in done.stderr
    done = cli("ls", root, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert [os.fsencode(s["path"]) for s in doc["steps"]] == [
        os.fsencode(root / project / LAYOUT / str(step)) for step in (1, 2)
    ]  # lossless: the undecodable bytes as U+DC80..U+DCFF (surrogateescape), os.fsencode restores them


@pytest.mark.parametrize("run_filter", [False, True], ids=["alone", "with-a-run's-line-filter"])
def test_log_lines_of_a_command_are_escaped_too(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    run_filter: bool,
) -> None:
    """A warning the store or a plugin logs while a command runs (naming a cache file) is escaped, once, also
    in a process whose runs' line filter is installed."""
    import logging

    from skipinject import bootstrap
    from skipinject.cache_tool import ls

    logger = logging.getLogger("skipinject")
    monkeypatch.setattr(logger, "filters", list(logger.filters))  # restored afterwards
    if run_filter:
        bootstrap.bound_log_lines()

    def logging_scan(root: Path | str, problems: list[str]) -> list[Any]:
        logging.getLogger("skipinject").warning("leftover %s removed", f"{root}/{EVIL}")
        return []

    monkeypatch.setattr(ls, "scan", logging_scan)
    with caplog.at_level(logging.WARNING, logger="skipinject"):
        assert main(["ls", str(tmp_path)]) == 0
    (line,) = [record.getMessage() for record in caplog.records]
    assert "\x1b" not in line and "\n" not in line and "evil\\e]0;owned" in line
    capsys.readouterr()


# ---------------------------------------------------------------- sizes and bounds (issue 37)


def save_compressed(project_dir: Path, step: int) -> Path:
    from skipinject.store.compression import Compression

    store = StepStore(project_dir, "tool_test", context(), compression=Compression())
    payload = Payload(tensors={"x": torch.full((2, 3), step)}, objects={"value": [step, step]}, rows=2)
    return store.save(step, payload, {"inputs": None})


def forge_objects(step_dir: Path, meta: dict[str, Any], frames: int) -> None:
    """The objects file replaced by ``frames`` frames of 128 bytes, each claiming a whole frame decoded
    (64 GiB for 16384: within zstd's ratio, beyond this machine's memory), checksum recomputed."""
    from skipinject.store.checksums import _digest
    from skipinject.store.format import FRAME_BYTES

    spec = meta["parts"][0]["files"]["objects"]
    data = bytes(128 * frames)
    (step_dir / spec["name"]).write_bytes(data)
    spec.update(size=len(data), checksum=_digest(data, meta["checksum_algo"]), frames=[128] * frames)
    spec["decoded_size"] = FRAME_BYTES * frames


@pytest.mark.parametrize("command", ["ls", "ls -l", "verify", "show"])
def test_an_absurd_size_in_meta_json_is_a_damaged_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """A decoded size of 4000 digits (a sum of it does not convert to a float) and one beyond memory:
    each a DAMAGED step, never an internal OverflowError or MemoryError."""
    root = tmp_path / "dump"
    save_compressed(root / "e_p" / LAYOUT, 1)
    huge = save_compressed(root / "e_p" / LAYOUT, 2)
    rewrite_meta(huge, lambda meta: meta["parts"][0]["files"]["tensors"].update(decoded_size=int("9" * 4000)))
    beyond_memory = save_compressed(root / "e_p" / LAYOUT, 3)
    rewrite_meta(beyond_memory, lambda meta: forge_objects(beyond_memory, meta, 16384))
    words = command.split()
    targets = [root / "e_p" / LAYOUT / "2", root / "e_p" / LAYOUT / "3"] if command == "show" else [root]
    for target in targets:
        code, out, err = run(capsys, *words, target)
        assert "internal error" not in err and "Error" not in err.replace("CorruptCacheError", ""), err
        assert code in (0, 1, 2), (code, out, err)
        if command == "verify":
            assert code == 1 and "1 ok, 2 damaged" in out, out
        if command in ("ls", "ls -l"):
            assert "damaged" in out, out


def age(path: Path, seconds: float = 3600) -> None:
    """Every file and directory under ``path`` last changed ``seconds`` ago (no save could still be writing)."""
    for found in [path, *path.rglob("*")]:
        os.utime(found, (found.stat().st_atime, found.stat().st_mtime - seconds), follow_symlinks=False)


@pytest.mark.parametrize(
    "forge",
    [
        lambda part: part.update(rows="2"),
        lambda part: part["files"].pop("objects"),
        lambda part: part["files"]["tensors"].update(size=float("inf")),
        lambda part: part["files"]["tensors"].update(name="../x"),
    ],
    ids=["rows", "no-objects", "size", "name"],
)
def test_prune_and_rm_remove_a_step_whose_parts_are_malformed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], forge: Any
) -> None:
    """verify calls such a step DAMAGED; prune --damaged and rm remove it (and the rest), never stop at it."""
    root = tmp_path / "dump"
    layout = root / "e_p" / LAYOUT
    for step in (1, 2, 3):
        save(layout, step)
    for step in (2, 3):
        rewrite_meta(layout / str(step), lambda meta: forge(meta["parts"][0]))
    age(root)
    code, out, err = run(capsys, "verify", root)
    assert code == 1 and "1 ok, 2 damaged" in out, out + err
    code, out, err = run(capsys, "rm", layout / "3")
    assert code == 0 and err == "" and "removed 1 step(s), 3 file(s)" in out, out + err
    code, out, err = run(capsys, "prune", "--damaged", root)
    assert code == 0 and err == "" and "removed 1 step(s), 3 file(s)" in out, out + err
    assert sorted(p.name for p in layout.iterdir()) == ["1"]


@pytest.mark.parametrize("value", [["x"], {"name": "x"}, 3])
def test_show_and_diff_of_a_step_whose_objects_name_no_codec_as_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: Any
) -> None:
    """A role (its plugin not installed here) whose objects hold a "codec" that is no name: shown raw."""
    layout = tmp_path / "e_p" / LAYOUT
    store = StepStore(layout, "tool_test", context())
    payload = Payload(tensors={"x": torch.zeros(2, 3)}, objects={"codec": value, "value": [1, 2]}, rows=2)
    step = store.save(1, payload, {"inputs": None})
    other = save(layout, 2)
    code, out, err = run(capsys, "show", step)
    assert code == 0 and err == "" and "codec raw" in out, out + err
    code, out, err = run(capsys, "diff", step, other)
    assert code == 1 and err == "", out + err


@pytest.mark.parametrize("writer", ["skipinject 0.1", ["skipinject"], None])
def test_show_of_a_step_whose_writer_is_no_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], writer: Any
) -> None:
    step = save(tmp_path / "e_p" / LAYOUT, 1)
    rewrite_meta(step, lambda meta: meta.update(writer=writer))
    code, out, err = run(capsys, "show", step)
    assert code == 0 and err == "" and " by -" in out, out + err
    code, out, err = run(capsys, "show", step, "--json")
    assert code == 0 and json.loads(out)["writer"] == writer


@pytest.mark.parametrize("writable", ["project", "dump"])
def test_steps_below_a_directory_others_can_write_are_untrusted_as_a_run_sees_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], writable: str
) -> None:
    """A world-writable experiment directory (or dump directory given to the tool) above the layout: a run
    refuses its steps, so ``ls`` and ``verify`` call them untrusted and ``compact`` never writes there."""
    root = tmp_path / "dump"
    for step in (1, 2):
        save(root / "e_p" / LAYOUT, step)
    os.chmod(root / "e_p" if writable == "project" else root, 0o777)
    before = sorted(p.name for p in (root / "e_p" / LAYOUT / "1").iterdir())
    code, out, err = run(capsys, "ls", "--json", root)
    assert code == 0 and [s["state"] for s in json.loads(out)["steps"]] == ["untrusted", "untrusted"], out + err
    code, out, err = run(capsys, "verify", root)
    assert code == 0 and "0 ok, 0 damaged, 0 partial, 2 untrusted" in out, out + err
    code, out, err = run(capsys, "compact", root)
    assert code == 1 and "compacted 0 step(s)" in out, out + err
    assert sorted(p.name for p in (root / "e_p" / LAYOUT / "1").iterdir()) == before


# ---------------------------------------------------------------- one part listed many times


def repeat_part(step_dir: Path, copies: int) -> None:
    rewrite_meta(step_dir, lambda meta: meta.update(parts=meta["parts"] * copies, rows=meta["rows"] * copies))


def hard_link_parts(step_dir: Path, copies: int) -> None:
    """``copies`` distinct part directories, each of hard links to the step's one pair of data files."""

    def edit(meta: dict[str, Any]) -> None:
        part = meta["parts"][0]
        for i in range(copies):
            (step_dir / str(i)).mkdir(mode=0o700)
            for spec in part["files"].values():
                os.link(step_dir / spec["name"], step_dir / str(i) / spec["name"])
        meta.update(parts=[{**part, "dir": str(i)} for i in range(copies)], rows=meta["rows"] * copies)

    rewrite_meta(step_dir, edit)


def same_file_twice(step_dir: Path) -> None:
    def edit(meta: dict[str, Any]) -> None:
        files = meta["parts"][0]["files"]
        files["objects"] = {**files["objects"], "name": files["tensors"]["name"]}

    rewrite_meta(step_dir, edit)


def too_many_parts(step_dir: Path) -> None:
    from skipinject.store.format import MAX_PARTS

    def edit(meta: dict[str, Any]) -> None:
        part = meta["parts"][0]
        meta.update(parts=[{**part, "dir": str(i)} for i in range(MAX_PARTS + 1)])

    rewrite_meta(step_dir, edit)


@pytest.mark.parametrize(
    ("forge", "listed", "why"),
    [
        (lambda d: repeat_part(d, 50), True, "part directory twice"),
        (lambda d: hard_link_parts(d, 3), False, "hard link"),
        (same_file_twice, True, "twice in part"),
        (too_many_parts, True, "parts, more than"),
    ],
    ids=["repeated-part", "hard-linked-parts", "same-file-twice", "too-many-parts"],
)
def test_a_step_naming_the_same_bytes_many_times_is_damaged_before_they_are_read_again(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    forge: Any,
    listed: bool,
    why: str,
) -> None:
    from skipinject.errors import CorruptCacheError
    from skipinject.store import local

    project = tmp_path / "e_p" / LAYOUT
    save(project, 1)
    forge(save(project, 2))
    opened: list[str] = []  # data files opened to be read
    real = local.open_regular
    monkeypatch.setattr(local, "open_regular", lambda name, *a: opened.append(name) or real(name, *a))
    store = StepStore(project, "tool_test", context())
    with pytest.raises(CorruptCacheError) as caught:
        store.load(store.verified(2))
    assert len(str(caught.value).splitlines()) == 1 and why in str(caught.value), caught.value
    assert len(opened) <= 3, opened  # at most the one pair of data files (and one link to them), never read again
    code, out, _ = run(capsys, "ls", tmp_path, "--json")
    states = {s["step"]: s["state"] for s in json.loads(out)["steps"]}
    if listed:  # a listing stats names only; the hard links are caught when read
        assert code == 0 and states == {1: "complete", 2: "damaged"}, out
    code, out, err = run(capsys, "verify", tmp_path)
    assert code == 1 and "1 ok, 1 damaged" in out, out + err


def test_hard_links_from_outside_the_step_are_no_forgery(tmp_path: Path) -> None:
    """``cp -al`` backups give every data file a link count of 2: still a good step."""
    project = tmp_path / "e_p" / LAYOUT
    step_dir = save(project, 1)
    backup = tmp_path / "backup"
    backup.mkdir()
    for name in os.listdir(step_dir):
        os.link(step_dir / name, backup / name)
    store = StepStore(project, "tool_test", context())
    (payload,) = store.load(store.verified(1))
    assert payload.objects["value"] == [1, 1]


# ---------------------------------------------------------------- an empty path is no working directory


@pytest.mark.parametrize(
    "argv",
    [
        ["prune", "", "--keep-last", "0"],
        ["prune", "file://", "--keep-last", "0"],
        ["rm", ""],
        ["ls", ""],
        ["verify", ""],
        ["compact", "", "--dry-run"],
        ["show", ""],
    ],
)
def test_an_empty_path_is_refused_not_taken_as_the_working_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    """``skipinject cache prune "$DUMP" --keep-last 0`` with ``DUMP`` unset prunes nothing in the directory it
    runs in."""
    project = tmp_path / "e_p" / LAYOUT
    save(project, 1)
    save(project, 2)
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "", out
    assert err.splitlines()[-1].endswith("an empty path (give a dump directory, or leave it out for the default)"), err
    assert sorted(os.listdir(project)) == ["1", "2"] and (project / "1" / "meta.json").exists()
