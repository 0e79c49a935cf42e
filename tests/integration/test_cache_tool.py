"""``skipinject cache ...`` against caches written with the store (as the engine writes them), and
against damaged, partial, foreign (verl's own pickles) and hostile trees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from skipinject.cache_tool import main
from skipinject.cache_tool.scan import scan
from skipinject.store import StepStore
from skipinject.verl.codecs import DataProtoCodec, TensorDictCodec
from tests.integration.test_codecs_verl import tq_sample_result
from tests.reliability import helpers
from tests.reliability.helpers import as_dataproto, same_batch

EXP, PROJ = "exp", "proj"
LAYOUT = "GBS4_N2_in32_out16"
TQ_LAYOUT = "GBS1_N2_in32_out16"


def make_batch(rows: int, width: int = 16, *, seed: int = 0) -> Any:
    """The reliability suite's toy batch as verl's ``DataProto``: these tests cache it with ``DataProtoCodec``."""
    return as_dataproto(helpers.make_batch(rows, width, seed=seed))


def context(gbs: int = 4, experiment: str = EXP, project: str = PROJ) -> dict[str, Any]:
    return {
        "experiment_name": experiment,
        "project_name": project,
        "gbs": gbs,
        "n": 2,
        "prompt_length": 32,
        "response_length": 16,
    }


def tq_payload(step: int, prompts: int = 2) -> dict[str, Any]:
    td, keys, tags = tq_sample_result(prompts=prompts, n=2, step=step)
    return {"tensordict": td, "keys": keys, "tags": tags, "global_steps": step}


def write_dump(root: Path) -> dict[str, Path]:
    """A dump dir like real runs leave it: rollout steps 1-3, a user role, rollout_tq with 2 parts."""
    layout = root / f"{EXP}_{PROJ}" / LAYOUT
    rollout = StepStore(layout, "rollout", context())
    for step in (1, 2, 3):
        batch = make_batch(8, seed=step)
        rollout.save(step, DataProtoCodec().encode(batch), {"inputs": [f"fp{step}-{i}" for i in range(8)]})
    reward = StepStore(layout / "reward", "reward", context())
    reward.save(1, DataProtoCodec().encode(make_batch(8, seed=10)), {"inputs": None})
    tq_layout = root / f"{EXP}_{PROJ}" / TQ_LAYOUT
    tq = StepStore(tq_layout, "rollout_tq", context(gbs=1))
    torch.manual_seed(0)
    writer = tq.begin(1)
    for part in range(2):
        writer.add_part(TensorDictCodec().encode(tq_payload(1)), part=str(part))
    writer.commit({"parameter_sync_step": 2, "trajectories": 8})
    return {"layout": layout, "tq_layout": tq_layout, "project": root / f"{EXP}_{PROJ}"}


@pytest.fixture
def dump(tmp_path: Path) -> Path:
    root = tmp_path / "dump"
    write_dump(root)
    return root


def run(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: Any) -> tuple[int, dict[str, Any]]:
    code, out, _ = run(capsys, *argv, "--json")
    return code, json.loads(out)


def age(path: Path, seconds: float) -> None:
    """Make every file under ``path`` look ``seconds`` old."""
    then = time.time() - seconds
    for folder, _, names in os.walk(path):
        for name in names:
            os.utime(Path(folder) / name, (then, then))


# ---------------------------------------------------------------- ls


def test_ls_lists_projects_layouts_roles_step_ranges_rows_size_writer_state(dump: Path, capsys):
    code, out, err = run(capsys, "ls", dump)
    assert code == 0 and not err
    lines = out.splitlines()
    heads = ["PROJECT", "LAYOUT", "ROLE", "STEPS", "ROWS", "SIZE", "CREATED", "LAST", "SERVED", "HITS"]
    assert lines[0].split() == [*heads, "WRITTEN", "BY", "STATE"]
    rollout = next(line for line in lines if " rollout " in line)
    assert f"{EXP}_{PROJ}" in rollout and LAYOUT in rollout and " 1-3 " in rollout and " 24 " in rollout
    assert "complete" in rollout and "skipinject" in rollout and "torch" in rollout and "KiB" in rollout
    assert any(" reward " in line and " 1 " in line for line in lines)
    assert any(" rollout_tq " in line and TQ_LAYOUT in line for line in lines)
    assert lines[-1].startswith("5 step(s), ")

    code, doc = run_json(capsys, "ls", dump)
    assert code == 0 and doc["schema"] == "skipinject.cache.ls/1"
    steps = {(s["role"], s["step"]): s for s in doc["steps"]}
    assert set(steps) == {("rollout", 1), ("rollout", 2), ("rollout", 3), ("reward", 1), ("rollout_tq", 1)}
    assert steps[("rollout_tq", 1)]["parts"] == 2 and steps[("rollout_tq", 1)]["rows"] == 8
    assert all(s["state"] == "complete" and s["size"] > 0 and s["writer"]["torch"] for s in steps.values())
    assert {g["steps"] for g in doc["groups"] if g["role"] == "rollout"} == {"1-3"}

    code, out, _ = run(capsys, "ls", "-l", dump)
    assert code == 0 and len(out.splitlines()) == 7 and out.splitlines()[-1].startswith("5 step(s), ")


def test_ls_default_dump_dir_and_bad_paths(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    code, out, _ = run(capsys, "ls")
    assert code == 0 and "rollout_dump" in out and "does not exist" in out
    write_dump(tmp_path / ".verl" / "rollout_dump")
    code, doc = run_json(capsys, "ls")
    assert code == 0 and len(doc["steps"]) == 5
    code, out, err = run(capsys, "ls", tmp_path / "nope")
    assert code == 2 and not out and len(err.strip().splitlines()) == 1 and "no such directory" in err
    (tmp_path / "file").write_text("x")
    code, _, err = run(capsys, "verify", tmp_path / "file")
    assert code == 2 and "not a directory" in err
    code, _, err = run(capsys, "frobnicate")
    assert code == 2 and "unknown command 'frobnicate'" in err


def _damage(dump: Path) -> dict[str, Path]:
    layout = dump / f"{EXP}_{PROJ}" / LAYOUT
    step2 = layout / "2"
    data = next(step2.glob("tensors-*.bin"))
    with open(data, "r+b") as handle:  # same size, other bytes: only a checksum sees it
        handle.seek(100)
        handle.write(b"\xff\xfe\xfd")
    meta3 = layout / "3" / "meta.json"
    record = json.loads(meta3.read_text())
    record["rows"] = 999  # edited without the self-checksum
    meta3.write_text(json.dumps(record))
    partial = layout / "4"  # an interrupted save: data files, no meta.json
    partial.mkdir()
    (partial / "tensors-1-2-abc.bin").write_bytes(b"x" * 100)
    (partial / "objects-1-2-abc.json").write_text("{}")
    return {"checksum": step2, "edited": step2.parent / "3", "partial": partial}


def test_ls_and_verify_report_damaged_and_partial(dump: Path, capsys):
    where = _damage(dump)
    code, doc = run_json(capsys, "ls", dump)
    states = {(s["role"], s["step"]): s["state"] for s in doc["steps"]}
    assert states[("rollout", 2)] == "complete", "ls reads meta.json only: a checksum needs verify"
    assert states[("rollout", 3)] == "damaged" and states[("-", 4)] == "partial"

    code, out, _ = run(capsys, "verify", dump)
    assert code == 1
    lines = out.splitlines()
    assert any(line.startswith("DAMAGED: ") and "checksum mismatch" in line and "/2/" in line for line in lines)
    assert any(line.startswith("DAMAGED: ") and "meta.json was edited" in line for line in lines)
    assert any(line.startswith("PARTIAL: ") and str(where["partial"]) in line for line in lines)
    assert lines[-1].startswith("verified 6 step(s)") and "3 ok, 2 damaged, 1 partial" in lines[-1]

    code, doc = run_json(capsys, "verify", dump)
    assert code == 1 and doc["schema"] == "skipinject.cache.verify/1" and doc["ok"] is False
    status = {(s["role"], s["step"]): s["status"] for s in doc["steps"]}
    assert status[("rollout", 1)] == "ok" and status[("rollout", 2)] == "damaged"
    assert status[("rollout_tq", 1)] == "ok" and status[("reward", 1)] == "ok"

    # A clean subtree verifies clean: exit status 0.
    code, out, _ = run(capsys, "verify", dump / f"{EXP}_{PROJ}" / TQ_LAYOUT, dump / f"{EXP}_{PROJ}" / LAYOUT / "1")
    assert code == 0 and "2 ok, 0 damaged" in out


def test_verify_truncated_and_missing_files(dump: Path, capsys):
    layout = dump / f"{EXP}_{PROJ}" / LAYOUT
    data = next((layout / "1").glob("tensors-*.bin"))
    os.truncate(data, data.stat().st_size - 10)
    next((dump / f"{EXP}_{PROJ}" / TQ_LAYOUT / "1" / "1").glob("objects-*.json")).unlink()
    code, out, _ = run(capsys, "verify", dump)
    assert code == 1
    assert any("truncated" in line for line in out.splitlines())
    assert any("missing (named by meta.json)" in line for line in out.splitlines())


def test_hostile_tree_fifo_symlinks_junk_never_crash_and_never_leave_the_tree(dump: Path, tmp_path: Path, capsys):
    layout = dump / f"{EXP}_{PROJ}" / LAYOUT
    outside = tmp_path / "outside"
    write_dump(outside)
    (layout / "reward" / "7").symlink_to(outside / f"{EXP}_{PROJ}" / LAYOUT / "1", target_is_directory=True)
    (dump / "linked_project").symlink_to(outside / f"{EXP}_{PROJ}", target_is_directory=True)
    fifo_step = layout / "8"
    fifo_step.mkdir()
    os.mkfifo(fifo_step / "meta.json")
    step1 = layout / "1"
    data = next(step1.glob("objects-*.json"))
    data.unlink()
    os.mkfifo(data)  # a FIFO where a data file should be: opening it would block
    junk = layout / "9"
    junk.mkdir()
    (junk / "meta.json").write_bytes(b"\x00\xff not json")
    linked_meta = layout / "10"
    linked_meta.mkdir()
    (linked_meta / "meta.json").symlink_to(layout / "2" / "meta.json")
    (layout / "11").mkdir()
    (layout / "11" / "meta.json").write_text(json.dumps({"format": "skipinject", "role": ["x"], "context": 3}))

    code, doc = run_json(capsys, "ls", dump)
    assert code == 0
    paths = {s["path"] for s in doc["steps"]}
    assert not any(str(outside) in p or "linked_project" in p or "/reward/7" in p for p in paths)
    states = {s["step"]: s["state"] for s in doc["steps"] if s["layout"] == LAYOUT and s["role"] != "reward"}
    assert states[1] == "damaged" and states[8] == "damaged" and states[9] == "damaged"
    assert states[10] == "damaged" and states[11] == "damaged" and states[2] == "complete"

    code, out, err = run(capsys, "verify", dump)
    assert code == 1 and "Traceback" not in out + err
    assert any("not a regular file" in line and "/1/" in line for line in out.splitlines())
    # prune never follows the links out of the dump dir
    code, _, _ = run(capsys, "prune", dump, "--keep-last", "0", "--damaged")
    assert code == 0
    assert len(scan(outside)) == 5 and all(i.state == "complete" for i in scan(outside))


# ---------------------------------------------------------------- show


def test_show_fields_rows_fingerprint_and_text(dump: Path, capsys):
    step = dump / f"{EXP}_{PROJ}" / LAYOUT / "2"
    code, out, _ = run(capsys, "show", step)
    assert code == 0
    assert "role rollout, step 2, 8 rows in 1 part(s)" in out
    assert "input fingerprint: 8 rows, first fp2-0, fp2-1, fp2-2" in out
    assert "batch.responses" in out and "int64" in out and "(8, 16)" in out
    assert "non_tensor_batch.raw_prompt" in out and "question 2-0" in out
    code, doc = run_json(capsys, "show", step, "--rows", "1")
    assert doc["schema"] == "skipinject.cache.show/1" and doc["rows"] == 8 and doc["codec"] == "DataProto"
    by_name = {f["name"]: f for f in doc["fields"]}
    assert by_name["batch.rollout_log_probs"]["dtype"] == "float32"
    assert by_name["batch.rollout_log_probs"]["shape"] == "(8, 16)"
    assert by_name["non_tensor_batch.uid"]["kind"] == "array"
    assert doc["inputs"] == {"rows": 8, "first": ["fp2-0"]}
    assert len(doc["text"]["non_tensor_batch.raw_prompt"]) == 1

    tq = dump / f"{EXP}_{PROJ}" / TQ_LAYOUT / "1"
    code, doc = run_json(capsys, "show", tq)
    assert code == 0 and doc["codec"] == "TensorDict" and doc["parts"] == ["0", "1"]
    by_name = {f["name"]: f for f in doc["fields"]}
    assert by_name["tensordict.responses"]["kind"] == "jagged" and by_name["tensordict.responses"]["rows"] == 8
    assert by_name["keys"]["rows"] == 8
    assert doc["inputs"] is None


def test_show_refuses_what_is_not_a_good_step(dump: Path, capsys):
    layout = dump / f"{EXP}_{PROJ}" / LAYOUT
    code, _, err = run(capsys, "show", layout)
    assert code == 2 and "not a step directory" in err
    _damage(dump)
    code, _, err = run(capsys, "show", layout / "2")
    assert code == 2 and "checksum mismatch" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- diff


def test_diff_two_steps_fields_rows_and_amounts(tmp_path: Path, capsys):
    a_store = StepStore(tmp_path / "a" / LAYOUT, "rollout", context())
    b_store = StepStore(tmp_path / "b" / LAYOUT, "rollout", context())
    batch = make_batch(8, seed=1)
    a_store.save(1, DataProtoCodec().encode(batch), {"inputs": [str(i) for i in range(8)]})
    changed = make_batch(8, seed=1)
    changed.batch["rollout_log_probs"][2:4] += 0.5
    changed.non_tensor_batch["uid"][0] = "other"
    del changed.non_tensor_batch["data_source"]
    b_store.save(1, DataProtoCodec().encode(changed), {"inputs": ["x", *[str(i) for i in range(1, 8)]]})
    a, b = a_store.step_dir(1), b_store.step_dir(1)

    code, out, _ = run(capsys, "diff", a, a)
    assert code == 0 and "no differences" in out
    code, out, _ = run(capsys, "diff", a, b)
    assert code == 1 and "inputs: 1 row(s)" in out
    line = next(x for x in out.splitlines() if x.startswith("batch.rollout_log_probs"))
    assert "differs" in line and "2/8" in line and "0.5" in line
    assert any(x.startswith("non_tensor_batch.uid") and "1/8" in x for x in out.splitlines())
    assert any(x.startswith("non_tensor_batch.data_source") and "only-a" in x for x in out.splitlines())
    code, doc = run_json(capsys, "diff", a, b)
    assert doc["schema"] == "skipinject.cache.diff/1" and doc["differs"] is True
    fields = {f["name"]: f for f in doc["steps"][0]["fields"]}
    assert fields["batch.responses"]["status"] == "same"
    assert fields["batch.rollout_log_probs"]["rows_differing"] == 2
    assert fields["batch.rollout_log_probs"]["max_abs_diff"] == pytest.approx(0.5)


def test_diff_two_runs_project_dirs(tmp_path: Path, capsys):
    one, two = write_dump(tmp_path / "one"), write_dump(tmp_path / "two")
    code, out, _ = run(capsys, "diff", one["project"], two["project"])
    assert code == 0 and "no differences" in out and out.count("field(s) identical") == 5
    StepStore(two["layout"], "rollout", context()).save(4, DataProtoCodec().encode(make_batch(4)))
    code, doc = run_json(capsys, "diff", one["project"], two["project"])
    assert code == 1 and doc["only"] == [{"side": "b", "step": f"{LAYOUT}/4"}]


# ---------------------------------------------------------------- import


def _upstream_v0(layout: Path, step: int, seed: int) -> Any:
    """verl 0.9.1's own V0 dump: ``{step}/gen_batch.dp`` by DataProto.save_to_disk, meta.json beside it."""
    directory = layout / str(step)
    directory.mkdir(parents=True)
    batch = make_batch(8, seed=seed)
    batch.save_to_disk(directory / "gen_batch.dp")
    (directory / "meta.json").write_text(json.dumps({"global_steps": step}))
    return batch


def _upstream_v1(layout: Path, step: int, parts: int) -> list[dict[str, Any]]:
    """verl 0.9.1's V1 dump: ``{step}/{k}/tq_batch.pt`` by torch.save, meta.json per part."""
    payloads = []
    for k in range(parts):
        directory = layout / str(step) / str(k)
        directory.mkdir(parents=True)
        payload = tq_payload(step, prompts=1 + k)
        torch.save(payload, directory / "tq_batch.pt")
        (directory / "meta.json").write_text(json.dumps({"global_steps": step, "num_trajectories": 2 + 2 * k}))
        payloads.append(payload)
    return payloads


def _upstream_v08(layout: Path, gen_step: int, global_step: int) -> Any:
    """verl 0.8's dump: ``genstep_{gen:06d}/{new_batch,gen_batch}.dp`` and meta.json with the steps."""
    directory = layout / f"genstep_{gen_step:06d}"
    directory.mkdir(parents=True)
    batch = make_batch(8, seed=gen_step)
    make_batch(8, seed=gen_step).save_to_disk(directory / "new_batch.dp")
    batch.save_to_disk(directory / "gen_batch.dp")
    (directory / "meta.json").write_text(json.dumps({"global_steps": global_step, "gen_steps": gen_step}))
    return batch


def test_foreign_caches_are_listed_never_loaded_and_import_needs_trust(tmp_path: Path, capsys, monkeypatch):
    dump = tmp_path / "dump"
    layout = dump / "my_exp_proj" / LAYOUT  # ambiguous name: experiment/project split needs flags
    _upstream_v0(layout, 1, 1)
    _upstream_v1(dump / "my_exp_proj" / TQ_LAYOUT, 2, 2)
    import pickle

    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("a pickle was loaded"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    code, doc = run_json(capsys, "ls", dump)
    assert code == 0
    found = {(s["role"], s["step"]): s for s in doc["steps"]}
    assert found[("rollout", 1)]["state"] == "foreign" and found[("rollout", 1)]["kind"] == "verl-v0"
    assert found[("rollout_tq", 2)]["kind"] == "verl-v1" and found[("rollout_tq", 2)]["parts"] == 2
    assert found[("rollout_tq", 2)]["rows"] == 6
    code, out, _ = run(capsys, "verify", dump)
    assert code == 0 and "2 foreign" in out
    code, out, _ = run(capsys, "import", dump)
    assert code == 2 and "runs whatever code" in out and "--trust" in out
    assert not list(dump.rglob("tensors-*"))


def test_import_v0_v1_and_v08_then_the_engine_store_verifies_and_loads_them(tmp_path: Path, capsys):
    dump = tmp_path / "dump"
    layout = dump / f"{EXP}_{PROJ}" / LAYOUT
    tq_layout = dump / f"{EXP}_{PROJ}" / TQ_LAYOUT
    v0 = _upstream_v0(layout, 1, 1)
    v1 = _upstream_v1(tq_layout, 2, 2)
    v08 = _upstream_v08(dump / f"{EXP}_{PROJ}" / "GBS4_N2_in32_out16", 5, 3)

    code, out, _ = run(capsys, "import", dump, "--trust")
    assert code == 0, out
    assert "3 step(s) imported" in out

    store = StepStore(layout, "rollout", context())  # what the engine builds for this run's config
    loaded = DataProtoCodec().decode(store.load(store.verified(1))[0])
    assert same_batch(loaded, v0)
    assert (layout / "1" / "gen_batch.dp").is_file(), "verl's file stays"
    assert same_batch(DataProtoCodec().decode(store.load(store.verified(3))[0]), v08)
    assert len(store.read_meta(3)["inputs"]) == 8, "verl 0.8 kept the input batch: fingerprinted"

    tq_store = StepStore(tq_layout, "rollout_tq", context(gbs=1))
    parts = tq_store.load(tq_store.verified(2))
    assert len(parts) == 2
    decoded = [TensorDictCodec().decode(p) for p in parts]
    assert [d["keys"] for d in decoded] == [p["keys"] for p in v1]
    assert torch.equal(decoded[1]["tensordict"]["input_ids"].values(), v1[1]["tensordict"]["input_ids"].values())

    code, out, _ = run(capsys, "import", dump, "--trust")
    assert code == 0 and "0 step(s) imported, 3 already there" in out
    code, out, _ = run(capsys, "verify", dump)
    assert code == 0 and "3 ok" in out


def test_import_needs_names_for_ambiguous_project_dirs_and_detects_async(tmp_path: Path, capsys):
    import numpy as np

    dump = tmp_path / "dump"
    layout = dump / "my_exp_my_proj" / "GBS1_N2_in32_out16"
    batch = _upstream_v0(layout, 4, 1)
    batch.non_tensor_batch["uid"] = np.array(["uid_sample_0_4"] * len(batch), dtype=object)
    batch.save_to_disk(layout / "4" / "gen_batch.dp")
    code, out, _ = run(capsys, "import", dump, "--trust")
    assert code == 1 and "FAILED" in out and "--experiment" in out
    code, out, _ = run(capsys, "import", dump, "--trust", "--experiment", "my_exp", "--project", "my_proj")
    assert code == 0 and "role async_rollout" in out
    ctx = {**context(gbs=1, experiment="my_exp", project="my_proj")}
    StepStore(layout, "async_rollout", ctx).verified(4)


def test_import_of_verl_08_steps_recording_no_step_number_writes_nothing(tmp_path: Path, capsys):
    """A ``global_steps`` no step directory can have (negative, 13 digits and more): that step fails in one
    line, never imported into a directory no reader lists (nor ``prune`` removes)."""
    layout = tmp_path / "dump" / f"{EXP}_{PROJ}" / "GBS4_N2_in32_out16"
    for gen_step, recorded in enumerate((-3, 10**13, 10**20, 2), start=1):
        _upstream_v08(layout, gen_step, recorded)
    code, out, _ = run(capsys, "import", tmp_path / "dump", "--trust")
    assert code == 1 and "1 step(s) imported, 0 already there, 3 failed" in out, out
    assert len([line for line in out.splitlines() if line.startswith("FAILED") and "no step number" in line]) == 3
    assert sorted(p.name for p in layout.iterdir() if not p.name.startswith("genstep_")) == ["2"]


def test_import_never_writes_below_a_directory_others_can_write(tmp_path: Path, capsys):
    """A world-writable experiment directory above the layout: a run neither loads nor saves there, and
    ``import`` does not write there either (one FAILED line naming the fix)."""
    dump = tmp_path / "dump"
    layout = dump / f"{EXP}_{PROJ}" / LAYOUT
    _upstream_v0(layout, 1, 1)
    os.chmod(dump / f"{EXP}_{PROJ}", 0o777)
    before = sorted(p.relative_to(dump) for p in dump.rglob("*"))
    code, out, _ = run(capsys, "import", dump, "--trust")
    assert code == 1 and "FAILED" in out and "writable by group and others" in out, out
    assert sorted(p.relative_to(dump) for p in dump.rglob("*")) == before


# ---------------------------------------------------------------- prune


def test_prune_keep_last_older_than_partial_dry_run(dump: Path, capsys):
    layout = dump / f"{EXP}_{PROJ}" / LAYOUT
    where = _damage(dump)
    age(where["partial"], 3600)
    code, doc = run_json(capsys, "prune", dump, "--damaged")
    assert doc["removed"] == [] and "a save may still be writing it" in doc["skipped"][0]["reason"]
    age(where["edited"], 3600)  # a damaged step is regenerated by the next run: new files mean a save
    code, _, err = run(capsys, "prune", dump)
    assert code == 2 and "nothing to prune" in err

    code, out, _ = run(capsys, "prune", dump, "--keep-last", "1", "--dry-run")
    assert code == 0 and "would remove" in out and (layout / "1" / "meta.json").exists()
    code, doc = run_json(capsys, "prune", dump, "--keep-last", "1")
    removed = {Path(r["path"]).relative_to(dump).as_posix() for r in doc["removed"]}
    assert removed == {f"{EXP}_{PROJ}/{LAYOUT}/1"}, "only complete steps count; 2 is kept as the last"
    assert not (layout / "1").exists()
    assert doc["bytes"] > 0

    code, doc = run_json(capsys, "prune", dump, "--partial", "--damaged")
    removed = {Path(r["path"]).name for r in doc["removed"]}
    assert removed == {"3", "4"} and not (layout / "4").exists() and not (layout / "3").exists()

    code, doc = run_json(capsys, "prune", dump, "--older-than", "1h")
    assert doc["removed"] == []
    age(dump, 7200)
    code, doc = run_json(capsys, "prune", dump, "--older-than", "1h")  # created is in meta.json: still new
    assert doc["removed"] == []
    code, _, err = run(capsys, "prune", dump, "--older-than", "soon")
    assert code == 2 and "bad age" in err


def test_prune_damaged_removes_the_steps_verify_calls_damaged(dump: Path, capsys):
    """A data file changed in place (same size, other bytes: only its checksum tells) makes a step
    that ``verify`` calls DAMAGED; ``prune --damaged`` asks the store the same question and removes it."""
    where = _damage(dump)
    age(dump, 3600)
    code, out, _ = run(capsys, "verify", where["checksum"])
    assert code == 1 and "DAMAGED: " in out and "checksum mismatch" in out
    code, out, _ = run(capsys, "prune", dump, "--damaged", "--dry-run")
    assert f"would remove {where['checksum']} (damaged" in out and (where["checksum"] / "meta.json").exists()
    code, doc = run_json(capsys, "prune", dump, "--damaged")
    assert {Path(r["path"]).name for r in doc["removed"]} == {"2", "3"} and not where["checksum"].exists()
    code, out, _ = run(capsys, "verify", dump)
    assert code == 0 and "0 damaged, 1 partial" in out, "what remains verifies (the partial save is --partial's)"


def test_prune_never_touches_a_running_save_nor_verls_pickles(tmp_path: Path, capsys):
    dump = tmp_path / "dump"
    layout = dump / f"{EXP}_{PROJ}" / LAYOUT
    _upstream_v0(layout, 1, 1)
    running = layout / "2"
    running.mkdir()
    (running / ".tensors-1-2-abc.bin.tmp-1234").write_bytes(b"x" * 10)  # being written right now
    StepStore(layout, "rollout", context()).save(1, DataProtoCodec().encode(make_batch(4)))
    code, doc = run_json(capsys, "prune", dump, "--keep-last", "0", "--partial")
    assert code == 0
    assert [Path(s["path"]).name for s in doc["skipped"]] == ["2"]
    assert (running / ".tensors-1-2-abc.bin.tmp-1234").exists()
    assert (layout / "1" / "gen_batch.dp").is_file(), "verl's pickle is never deleted"
    assert (
        not (layout / "1" / "meta.json").exists()
        or json.loads((layout / "1" / "meta.json").read_text()).get("format") != "skipinject"
    )
    assert not list((layout / "1").glob("tensors-*"))


# ---------------------------------------------------------------- runner, progress


def test_runner_dispatches_cache_subcommands(dump: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "skipinject", "cache", "ls", str(dump), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["schema"] == "skipinject.cache.ls/1"
    proc = subprocess.run(
        [sys.executable, "-m", "skipinject", "cache", "verify", str(dump / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_progress_bar_only_on_a_terminal():
    import io

    from skipinject.cache_tool.common import Progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    quiet = io.StringIO()
    with Progress(100, "verify", stream=quiet, delay=0) as bar:
        bar.update(50)
    assert quiet.getvalue() == ""
    tty = Tty()
    with Progress(100, "verify", stream=tty, delay=0) as bar:
        bar.update(50)
        assert "verify:  50%|" in tty.getvalue()


# ---------------------------------------------------------------- real runs' caches (tests/e2e calls this)


def check_real_dump(
    dump: Path,
    roles: set[str],
    scratch: Path,
    tokenizer: Path | None = None,
    *,
    in_process: bool = False,
    one_process: bool = False,
) -> None:
    """Every command on a dump dir a real verl run wrote (through ``python -m skipinject cache``, or
    in this process with ``in_process``); then on a damaged copy of it.

    ``one_process``: every command in one new interpreter, one after another -- a fresh process finds
    the roles' codecs as a user's ``skipinject cache`` does, for one start-up (most of a command's
    time: ``show`` and ``diff`` import torch and verl) instead of one per command."""
    if one_process:
        args = json.dumps([str(dump), sorted(roles), str(scratch), str(tokenizer) if tokenizer else None])
        code = (
            "import json, sys; from pathlib import Path; from tests.integration.test_cache_tool import check_real_dump;"
            "dump, roles, scratch, tokenizer = json.loads(sys.argv[1]);"
            "check_real_dump(Path(dump), set(roles), Path(scratch), tokenizer and Path(tokenizer), in_process=True)"
        )
        root = Path(__file__).resolve().parents[2]
        proc = subprocess.run([sys.executable, "-c", code, args], cwd=root, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        return
    import contextlib
    import io
    import shutil

    def cli(*argv: Any) -> subprocess.CompletedProcess[str]:
        if in_process:
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main([str(a) for a in argv])
            return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
        command = [sys.executable, "-m", "skipinject", "cache", *map(str, argv)]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    proc = cli("ls", dump, "--json")
    assert proc.returncode == 0, proc.stderr
    steps = json.loads(proc.stdout)["steps"]
    assert {s["role"] for s in steps} == roles, steps
    assert all(s["state"] == "complete" and s["rows"] and s["writer"].get("verl") for s in steps), steps
    assert cli("ls", dump).returncode == 0
    proc = cli("verify", dump)
    assert proc.returncode == 0 and " 0 damaged" in proc.stdout, proc.stdout + proc.stderr
    by_role: dict[str, list[dict[str, Any]]] = {}
    for step in steps:
        by_role.setdefault(step["role"], []).append(step)
    for role, found in by_role.items():
        found.sort(key=lambda s: s["step"])
        proc = cli("show", found[0]["path"], "--json")
        assert proc.returncode == 0, proc.stderr
        shown = json.loads(proc.stdout)
        assert shown["role"] == role and shown["rows"] == found[0]["rows"] and shown["fields"], shown
        if role == "rollout":  # rows: prompt, response, score, length
            samples = shown["samples"]
            assert samples and samples["rows"] == found[0]["rows"] and samples["mean_length"], shown
        if tokenizer is not None and role == "rollout":
            proc = cli("show", found[0]["path"], "--tokenizer", tokenizer, "--rows", "2")
            assert proc.returncode == 0 and f"decoded by {tokenizer};" in proc.stdout, proc.stdout + proc.stderr
        if len(found) > 1:
            proc = cli("diff", found[0]["path"], found[1]["path"], "--json")
            assert proc.returncode in (0, 1), proc.stderr
            assert json.loads(proc.stdout)["steps"][0]["fields"]
    proc = cli("diff", dump, dump)
    assert proc.returncode == 0 and "no differences" in proc.stdout, proc.stdout + proc.stderr

    copy = scratch / "damaged-copy"
    shutil.copytree(dump, copy, symlinks=True)
    victim = next(copy.rglob("tensors-*.bin"))
    with open(victim, "r+b") as handle:
        handle.seek(victim.stat().st_size // 2)
        byte = handle.read(1)
        handle.seek(-1, 1)
        handle.write(bytes([byte[0] ^ 0xFF]))
    proc = cli("verify", copy)
    assert proc.returncode == 1 and "checksum mismatch" in proc.stdout, proc.stdout + proc.stderr
    proc = cli("prune", copy, "--keep-last", "1", "--dry-run", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["dry_run"] is True


def test_check_real_dump_helper_on_a_store_written_dump(dump: Path, tmp_path: Path):
    check_real_dump(dump, {"rollout", "reward", "rollout_tq"}, tmp_path, in_process=True)


def test_foreign_file_that_is_no_pickle_is_damaged_and_a_bad_tokenizer_is_one_line(dump: Path, tmp_path, capsys):
    layout = dump / f"{EXP}_{PROJ}" / LAYOUT
    (layout / "6").mkdir()
    (layout / "6" / "gen_batch.dp").write_bytes(b"garbage that is no pickle")
    (layout / "6" / "meta.json").write_text(json.dumps({"global_steps": 6}))
    code, out, _ = run(capsys, "verify", layout / "6")
    assert code == 1 and "not a pickle or torch.save file" in out
    code, _, err = run(capsys, "show", layout / "1", "--tokenizer", tmp_path / "no-model")
    assert code == 2 and "cannot load a tokenizer" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "show", layout / "6")
    assert code == 2 and "import --trust" in err


def test_prune_partial_removes_abandoned_leftovers_only(dump: Path, capsys):
    """Files no meta.json names: removed when the store's garbage rule calls them abandoned (old and their
    writer gone), kept while their writer process lives."""
    step = dump / f"{EXP}_{PROJ}" / LAYOUT / "1"
    old = int(time.time()) - 7200
    dead = step / f"tensors-{old}-999999999-0123abcd.bin"
    alive = step / f"objects-{old}-{os.getppid()}-4567abcd.json"
    dead.write_bytes(b"x" * 1000)
    alive.write_text("{}")
    age(step, 3600)
    code, doc = run_json(capsys, "prune", dump, "--partial", "--dry-run")
    assert code == 0 and doc["leftovers"] == {"files": 1, "bytes": 1000} and dead.exists()
    code, doc = run_json(capsys, "prune", dump, "--partial")
    assert doc["leftovers"]["files"] == 1 and not dead.exists() and alive.exists()
    assert run(capsys, "verify", dump)[0] == 0


def test_import_context_from_verls_default_names(tmp_path: Path, capsys):
    dump = tmp_path / "dump"
    layout = dump / "default_experiment_name_my_proj" / LAYOUT
    batch = _upstream_v0(layout, 2, 2)
    code, out, _ = run(capsys, "import", layout / "2", "--trust")
    assert code == 0, out
    store = StepStore(layout, "rollout", context(experiment="default_experiment_name", project="my_proj"))
    assert same_batch(DataProtoCodec().decode(store.load(store.verified(2))[0]), batch)
