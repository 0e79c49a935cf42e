"""``action=match``: rows served by their prompts from any cached step, only the others generated.

A toy trainer generates with real verl ``DataProto`` batches like the V0 trainer: prompts repeated
``n`` times before generation (verl >= 0.5) or by the generator after it (verl 0.4), a generator
that splits the batch among 2 workers (a size not divisible by 2 is refused, as verl's ``chunk``
does), responses that depend on the prompt and a fresh token per generation (so a served row shows
where it came from). Run 1 records steps 1-3 with ``cache``; later runs see other prompts.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from skipinject_rollout.common import GENERATION_SETTINGS, mark_match, prompt_key, workers_of
from verl.protocol import DataProto

from skipinject import DataProtoCodec, Role, StepSource, Target
from skipinject.config import Config, RoleConfig
from skipinject.engine import Engine
from skipinject.errors import ConfigError
from skipinject.testing import ToyTrainer

pytestmark = pytest.mark.unit

MODULE = "si_match_targets"
PROMPT, RESPONSE, N = 6, 4, 2
_tokens = itertools.count(100)
#: Every generator call: the prompt ids (first token of each row) it was asked to generate.
GENERATED: list[list[int]] = []
#: The dtype of the generator's log-probs (a test changes it between runs).
LOG_PROBS = [torch.float32]


def prompts(ids: list[int], n: int = N, *, before: bool = True) -> DataProto:
    """A batch of prompts (``ids`` name them), left-padded like verl's dataset, repeated ``n`` times
    (interleaved) when ``before`` (verl >= 0.5)."""
    rows = []
    for prompt in ids:
        length = 2 + prompt % 3
        row = [0] * (PROMPT - length) + [prompt] * length
        rows.append(row)
    input_ids = torch.tensor(rows, dtype=torch.long)
    mask = (input_ids != 0).long()
    batch = DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": mask, "position_ids": torch.cumsum(mask, 1)},
        non_tensors={
            "raw_prompt": np.array([[{"role": "user", "content": f"p{p}"}] for p in ids] + [None], dtype=object)[:-1],
            "uid": np.array([f"uid-{p}-{next(_tokens)}" for p in ids], dtype=object),
        },
        meta_info={"global_steps": 0, "eos_token_id": 1},
    )
    return batch.repeat(n, interleave=True) if before and n > 1 else batch


class Workers:
    agent_loop_workers = [object(), object()]


class Trainer(ToyTrainer):
    """Generates once per step (:meth:`ToyTrainer.fit`) the prompts of that step (``schedule[step]``)."""

    def __init__(self, schedule: dict[int, list[int]], *, before: bool = True) -> None:
        super().__init__(n=N, prompt_length=PROMPT, response_length=RESPONSE)
        self.config["actor_rollout_ref"] = {"model": {"path": "/m"}, "rollout": {"n": N, "temperature": 1.0}}
        self.schedule = schedule
        self.before = before
        self.manager = Manager(before)

    def fit(self) -> dict[int, DataProto]:  # type: ignore[override]
        return dict(zip(sorted(self.schedule), super().fit(sorted(self.schedule)), strict=True))

    def generate(self, *args: Any) -> tuple[DataProto, DataProto]:
        batch = prompts(self.schedule[self.global_steps], before=self.before)
        batch.meta_info["global_steps"] = self.global_steps
        return batch, self.manager.generate_sequences(batch)


class Manager(Workers):
    def __init__(self, before: bool) -> None:
        self.before = before

    def generate_sequences(self, batch: DataProto) -> DataProto:
        assert len(batch) % len(self.agent_loop_workers) == 0, f"only support equal chunk, got {len(batch)}"
        GENERATED.append([int(row[-1]) for row in batch.batch["input_ids"]])
        if not self.before:
            batch = batch.repeat(N, interleave=True)
        token = next(_tokens)
        prompt_ids = batch.batch["input_ids"]
        responses = torch.stack([torch.tensor([int(row[-1]), token, 7, 0]) for row in prompt_ids])
        response_mask = (responses != 0).long()
        out = DataProto.from_dict(
            tensors={
                "prompts": prompt_ids,
                "responses": responses,
                "response_mask": response_mask,
                "input_ids": torch.cat([prompt_ids, responses], 1),
                "attention_mask": torch.cat([batch.batch["attention_mask"], response_mask], 1),
                "rollout_log_probs": torch.rand(len(batch), RESPONSE, dtype=LOG_PROBS[0]),
            },
            non_tensors={"uid": batch.non_tensor_batch["uid"].copy(), "__num_turns__": np.full(len(batch), 2)},
            meta_info={"timing": {"generate_sequences": 0.5}},
        )
        return out


@pytest.fixture
def targets() -> Iterator[Any]:
    module = type(sys)(MODULE)
    module.Trainer = type("Trainer", (Trainer,), {})  # type: ignore[attr-defined]
    module.Manager = Manager  # type: ignore[attr-defined]
    sys.modules[MODULE] = module
    GENERATED.clear()
    yield module
    del sys.modules[MODULE]


def make_role(**changes: Any) -> Role:
    fields: dict[str, Any] = {
        "name": "gen",
        "targets": [Target(f"{MODULE}:Manager.generate_sequences")],
        "step": StepSource.meta("global_steps"),
        "codec": DataProtoCodec(divisor=workers_of),
        "clocks": [f"{MODULE}:Trainer.fit"],
        "row_key": prompt_key,
        "match_settings": GENERATION_SETTINGS,
        "on_match": mark_match,
    }
    fields.update(changes)
    return Role(**fields)


def run(targets: Any, dump: Path | str, schedule: dict[int, list[int]], action: str = "cache", **kwargs: Any) -> Any:
    role = kwargs.pop("role", None) or make_role()
    config = Config(roles={"gen": RoleConfig(enable=True, dump_dir=str(dump), steps=(1, 2, 3), action=action)})
    engine = Engine(config, {"gen": (role, "test")})
    engine.start()
    try:
        trainer = targets.Trainer(schedule, **kwargs)
        return trainer.fit()
    finally:
        engine.stop()


def responses(out: DataProto) -> list[tuple[int, int]]:
    """Each row's (prompt id, generation token)."""
    return [(int(r[0]), int(r[1])) for r in out.batch["responses"]]


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "skipinject"]


def project(dump: Path) -> Path:
    return next(dump.glob("e_p/GBS4_*")) / "gen"


FIRST = {1: [1, 2, 3, 4], 2: [5, 6, 7, 8], 3: [9, 10, 11, 12]}


def test_match_serves_seen_prompts_and_generates_exactly_the_others(targets: Any, tmp_path: Path, caplog) -> None:
    recorded = run(targets, tmp_path, FIRST)
    rows_of = {}
    for _, (_batch, out) in recorded.items():
        for index, key in enumerate(responses(out)):
            rows_of.setdefault(key[0], []).append(
                (out.batch["responses"][index], out.batch["rollout_log_probs"][index])
            )
    GENERATED.clear()
    caplog.set_level(logging.INFO, "skipinject")
    second = {1: [7, 2, 13, 9], 2: [14, 15, 16, 17], 3: [3, 4, 5, 6]}
    out = run(targets, tmp_path, second, action="match")
    # step 1: 7, 2, 9 served (from steps 2, 1, 3), 13 generated; padded to the 2 workers (13 twice, N=2 -> 2 rows)
    assert GENERATED[0] == [13, 13], GENERATED
    assert GENERATED[1] == [14, 14, 15, 15, 16, 16, 17, 17], "nothing cached: the call runs whole"
    assert len(GENERATED) == 2, "all cached at step 3: no generator call"
    for step, ids in second.items():
        batch, result = out[step]
        assert [p for p, _ in responses(result)] == [p for p in ids for _ in range(N)], "rows in the call's order"
        assert list(result.non_tensor_batch["uid"]) == list(batch.non_tensor_batch["uid"]), "this run's uids"
        assert result.batch["responses"].dtype == torch.long and result.batch["responses"].shape == (8, RESPONSE)
        assert result.batch["rollout_log_probs"].dtype == torch.float32
    # served rows are bit-identical to the recorded ones, sample k of a prompt to its recorded sample k
    for step in (1, 3):
        _, result = out[step]
        for index, (prompt, _) in enumerate(responses(result)):
            if prompt in rows_of:
                recorded_response, recorded_log_probs = rows_of[prompt][index % N]
                assert torch.equal(result.batch["responses"][index], recorded_response)
                assert torch.equal(result.batch["rollout_log_probs"][index], recorded_log_probs)
    lines = messages(caplog)
    assert any("gen step 1: match: 6 of 8 rows served from" in line and "2 generated" in line for line in lines), lines
    assert any("gen step 3: match: 8 of 8 rows served" in line and "target not called" in line for line in lines)
    timing = out[3][1].meta_info["timing"]
    assert timing["skipinject/match_served_rows"] == 8.0 and timing["skipinject/match_generated_rows"] == 0.0
    assert "generate_sequences" not in timing, "all served: not the old run's generation timing"
    assert out[1][1].meta_info["timing"]["skipinject/match_generated_rows"] == 2.0


def test_new_rows_are_saved_and_served_by_a_later_match_run(targets: Any, tmp_path: Path) -> None:
    run(targets, tmp_path, {1: [1, 2, 3, 4]})
    run(targets, tmp_path, {1: [1, 20, 3, 21], 2: [22, 23, 24, 25]}, action="match")
    layout = project(tmp_path)
    step1 = json.loads((layout / "1" / "meta.json").read_text())
    assert step1["rows"] == 8, "the committed step 1 is not rewritten"
    assert (layout / "rows" / "1" / "meta.json").is_file(), "step 1's new rows kept as a rows record"
    assert json.loads((layout / "2" / "meta.json").read_text())["row_keys"], "an absent step is saved whole"
    GENERATED.clear()
    out = run(targets, tmp_path, {3: [21, 25, 1, 20]}, action="match")
    assert GENERATED == [], "rows from step 1, the rows record and step 2 all served"
    assert [p for p, _ in responses(out[3][1])] == [21, 21, 25, 25, 1, 1, 20, 20]


def test_match_with_nothing_cached_behaves_like_cache(targets: Any, tmp_path: Path) -> None:
    matched = tmp_path / "match"
    run(targets, matched, FIRST, action="match")
    assert len(GENERATED) == 3 and [len(g) for g in GENERATED] == [8, 8, 8], "each call runs whole"
    for step in (1, 2, 3):
        meta = json.loads((project(matched) / str(step) / "meta.json").read_text())
        assert meta["rows"] == 8 and len(meta["row_keys"][0]) == 8 and meta["rows_per_input"] == [1]
    GENERATED.clear()
    run(targets, matched, FIRST, action="cache")
    assert GENERATED == [], "what match saved is an ordinary step: cache serves it"


def test_a_generator_repeating_after_generation_maps_each_prompt_to_its_n_samples(targets: Any, tmp_path: Path) -> None:
    first = run(targets, tmp_path, {1: [1, 2, 3, 4]}, before=False)
    GENERATED.clear()
    out = run(targets, tmp_path, {2: [3, 30, 1, 31]}, action="match", before=False)
    assert GENERATED == [[30, 31]], "only the new prompts, once each (the generator repeats them)"
    result = out[2][1]
    assert [p for p, _ in responses(result)] == [3, 3, 30, 30, 1, 1, 31, 31]
    recorded = first[1][1].batch["responses"]
    assert torch.equal(result.batch["responses"][0:2], recorded[4:6]) and torch.equal(
        result.batch["responses"][4:6], recorded[0:2]
    )
    assert list(result.non_tensor_batch["uid"]) == list(np.repeat(out[2][0].non_tensor_batch["uid"], N))


def test_other_generation_settings_never_match(targets: Any, tmp_path: Path, monkeypatch, caplog) -> None:
    run(targets, tmp_path, {1: [1, 2, 3, 4]})
    GENERATED.clear()
    original = targets.Trainer.__init__

    def hotter(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.config["actor_rollout_ref"]["rollout"]["temperature"] = 0.7

    monkeypatch.setattr(targets.Trainer, "__init__", hotter)
    with caplog.at_level(logging.INFO, "skipinject"):
        run(targets, tmp_path, {2: [1, 2, 3, 4]}, action="match")
    assert GENERATED == [[1, 1, 2, 2, 3, 3, 4, 4]], "another temperature: everything generated"
    said = [m for m in messages(caplog) if "match: no row of this call cached" in m]
    assert said == [
        "gen step 2: match: no row of this call cached (8 rows; the cached rows of step 1 were generated with other "
        "settings: actor_rollout_ref.rollout.temperature is 1.0 there, 0.7 here); running the target"
    ], "the settings that differ are named, never digests"


def test_a_forged_or_damaged_source_only_causes_a_miss(targets: Any, tmp_path: Path) -> None:
    first = run(targets, tmp_path, {1: [1, 2, 3, 4]})
    layout = project(tmp_path)
    tensors = next((layout / "1").glob("tensors-*.bin"))
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF
    tensors.write_bytes(bytes(data))
    GENERATED.clear()
    out = run(targets, tmp_path, {2: [1, 2, 3, 4]}, action="match")
    assert GENERATED == [[1, 1, 2, 2, 3, 3, 4, 4]], "a step that does not verify serves nothing"
    assert not torch.equal(out[2][1].batch["responses"], first[1][1].batch["responses"])


def test_a_forged_index_is_never_trusted(targets: Any, tmp_path: Path) -> None:
    run(targets, tmp_path, {1: [1, 2, 3, 4]})
    run(targets, tmp_path, {2: [5, 6, 7, 8]})
    layout = project(tmp_path)
    run(targets, tmp_path, {3: [1, 5]}, action="match")  # builds the index
    index = layout / "row-index.npz"
    assert index.is_file()
    with np.load(index) as saved:
        arrays = {name: saved[name].copy() for name in saved.files}
    arrays["number"][:] = np.where(arrays["number"] == 1, 2, 1)  # every row points at the other step
    np.savez(index, **arrays)
    GENERATED.clear()
    out = run(targets, tmp_path, {3: [2, 6, 3, 7]}, action="match")
    assert [p for p, _ in responses(out[3][1])] == [2, 2, 6, 6, 3, 3, 7, 7], "never another prompt's rows"
    assert sum(len(g) for g in GENERATED) <= 8
    for damage in (b"not an npz", _deflated(arrays)):
        index.write_bytes(damage)
        GENERATED.clear()
        run(targets, tmp_path, {3: [2, 6, 3, 7]}, action="match")
        assert GENERATED == [], "a damaged or compressed (a possible bomb) index is rebuilt from the steps"


def test_a_forged_index_costs_one_line_per_run(targets: Any, tmp_path: Path, caplog) -> None:
    """Every entry of a forged index names a call its step does not hold: the index is dropped and
    rebuilt from the steps in one line, not one line per record it names."""
    for step, ids in FIRST.items():
        run(targets, tmp_path, {step: ids})
    run(targets, tmp_path, {3: [1, 5, 9]}, action="match")  # builds the index
    index = project(tmp_path) / "row-index.npz"
    with np.load(index) as saved:
        arrays = {name: saved[name].copy() for name in saved.files}
    arrays["call"][:] = 7
    np.savez(index, **arrays)
    GENERATED.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="skipinject"):
        out = run(targets, tmp_path, {3: [2, 6, 10, 3]}, action="match")
    warnings = [r.getMessage() for r in caplog.records if r.name == "skipinject" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "row index" in warnings[0], warnings
    assert [p for p, _ in responses(out[3][1])] == [2, 2, 6, 6, 10, 10, 3, 3], "never another prompt's rows"
    GENERATED.clear()
    run(targets, tmp_path, {3: [2, 6, 10, 3]}, action="match")
    assert GENERATED == [], "the rebuilt index serves every row"


@pytest.mark.parametrize("names", ["a record no step has", "a record of another step"])
def test_forged_entries_are_gone_from_the_file_once_the_run_says_it_rebuilds_the_index(
    targets: Any, tmp_path: Path, caplog, names: str
) -> None:
    """16 forged entries shadowing cached prompts (the newest copy, looked up first): the run that finds them
    says it rebuilds the index, and the file it leaves holds none of them; the runs after serve every row."""
    run(targets, tmp_path, {1: [1, 2, 3, 4]})
    run(targets, tmp_path, {2: [5, 6, 7, 8]})
    run(targets, tmp_path, {3: [1]}, action="match")  # builds the index
    index = project(tmp_path) / "row-index.npz"
    with np.load(index) as saved:
        arrays = {name: saved[name].copy() for name in saved.files}
    count = len(arrays["keys"])
    forged_number = 50 if names == "a record no step has" else 2
    picks = np.resize(np.arange(count), 16)
    forged = {
        "keys": arrays["keys"][picks],
        "source": np.zeros(16, dtype=np.uint8),
        "number": np.full(16, forged_number, dtype=np.int64),
        "call": np.full(16, 9, dtype=np.uint32),  # no call 9: never what the step holds
        "row": np.zeros(16, dtype=np.uint32),
    }
    for name, column in forged.items():
        arrays[name] = np.concatenate([column, arrays[name]])
    order = np.lexsort((-arrays["number"], arrays["keys"]))
    for name in forged:
        arrays[name] = arrays[name][order]
    np.savez(index, **arrays)
    with caplog.at_level(logging.INFO, logger="skipinject"):
        run(targets, tmp_path, {3: [1, 2, 5, 6]}, action="match")
    with np.load(index) as saved:
        assert not bool(np.any(saved["call"] == 9)), "the forged entries are still in the file"
    for _ in range(2):
        GENERATED.clear()
        out = run(targets, tmp_path, {3: [1, 2, 5, 6]}, action="match")
        assert GENERATED == [], "every later run serves the cached prompts"
        assert [p for p, _ in responses(out[3][1])] == [1, 1, 2, 2, 5, 5, 6, 6]


@pytest.mark.parametrize("forged", ["seen_number", "number"])
def test_an_index_naming_record_numbers_no_step_has_is_rebuilt(
    targets: Any, tmp_path: Path, caplog, forged: str
) -> None:
    """A record number past any step's (2^63 - 1, no 12-digit step name) makes the index malformed:
    rebuilt from the steps, every cached row served, not every lookup of every run failing."""
    run(targets, tmp_path, {1: [1, 2, 3, 4]})
    run(targets, tmp_path, {3: [1]}, action="match")  # builds the index
    index = project(tmp_path) / "row-index.npz"
    with np.load(index) as saved:
        arrays = {name: saved[name].copy() for name in saved.files}
    arrays[f"{forged.removesuffix('number')}source"][:] = 1
    arrays[forged][:] = np.iinfo(np.int64).max
    np.savez(index, **arrays)
    GENERATED.clear()
    with caplog.at_level(logging.INFO, logger="skipinject"):
        out = run(targets, tmp_path, {3: [2, 3]}, action="match")
    assert GENERATED == [], messages(caplog)
    assert [p for p, _ in responses(out[3][1])] == [2, 2, 3, 3]
    assert not [line for line in messages(caplog) if "cannot look rows up" in line]


def test_an_index_of_many_members_is_refused_before_its_directory_is_read() -> None:
    """A zip of 100,000 tiny members (a few MB) is refused from its end record, at no cost."""
    import io
    import time
    import tracemalloc
    import zipfile

    from skipinject.engine.row_index import _check_members
    from skipinject.errors import CorruptCacheError

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for number in range(100_000):
            archive.writestr(f"{number}.npy", b"")
    data = buffer.getvalue()
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(CorruptCacheError, match="members"):
            _check_members(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < 0.1 and peak < 1 << 20, (time.perf_counter() - started, peak)


def test_a_stray_huge_record_number_is_never_followed(targets: Any, tmp_path: Path, capsys) -> None:
    """A rows directory numbered 999999999999 (a dead claim, or forged): the next rows record is not
    numbered after it (13 digits: a name no reader lists), but after the records in use."""
    run(targets, tmp_path, {1: [1, 2, 3, 4]})
    rows = project(tmp_path) / "rows"
    (rows / "999999999999").mkdir(parents=True)
    run(targets, tmp_path, {1: [1, 50]}, action="match")
    assert sorted(p.name for p in rows.iterdir()) == ["1", "999999999999"]
    GENERATED.clear()
    run(targets, tmp_path, {2: [50]}, action="match")
    assert GENERATED == [], "the new rows are listed, indexed and served"


def test_dead_claims_cost_a_bounded_look_per_refresh(targets: Any, tmp_path: Path, monkeypatch) -> None:
    """Thousands of empty rows directories (claims never written): a refresh of the row index looks at a
    bounded number of them, and not at the same ones again at once."""
    from skipinject.engine.row_index import MAX_UNREADABLE_LOOKS, RowIndex
    from skipinject.store import StepStore

    run(targets, tmp_path, {1: [1, 2, 3, 4]})
    layout = project(tmp_path)
    for number in range(1, 5001):
        (layout / "rows" / str(number)).mkdir(parents=True)
    context = json.loads((layout / "1" / "meta.json").read_text())["context"]
    steps, rows = StepStore(layout, "gen", context), StepStore(layout / "rows", "gen", context)
    looked: list[int] = []
    read_meta = StepStore.read_meta
    monkeypatch.setattr(
        StepStore, "read_meta", lambda self, n, **kw: (self is rows and looked.append(n)) or read_meta(self, n, **kw)
    )
    index = RowIndex(steps, rows)
    assert index.lookup(["0" * 16]) == [[]]
    assert len(looked) == MAX_UNREADABLE_LOOKS and looked[0] == 5000, "the newest first"
    looked.clear()
    index.lookup(["0" * 16])
    assert len(looked) == MAX_UNREADABLE_LOOKS and not set(looked) & set(range(4745, 5001))


def _deflated(arrays: dict[str, Any]) -> bytes:
    import io

    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def test_a_role_that_cannot_match_is_refused_at_start(targets: Any, tmp_path: Path) -> None:
    from skipinject_rollout_tq.plugin import ROLLOUT_TQ

    config = Config(roles={"gen": RoleConfig(enable=True, dump_dir=str(tmp_path), steps=(1,), action="match")})
    engine = Engine(config, {"gen": (make_role(row_key=None), "test")})
    with pytest.raises(ConfigError, match=r"skip.gen.action=match: role 'gen' cannot serve part of a call"):
        engine.start()
    # rollout_tq keys and serves its prompts in its phases: it starts.
    config = Config(roles={"rollout_tq": RoleConfig(enable=True, dump_dir=str(tmp_path), steps=(1,), action="match")})
    engine = Engine(config, {"rollout_tq": (ROLLOUT_TQ, "rollout_tq")})
    engine.start()
    engine.stop()


def test_rows_records_are_listed_verified_and_pruned_by_the_cache_tool(targets: Any, tmp_path: Path, capsys) -> None:
    from skipinject.cache_tool import main

    run(targets, tmp_path, {1: [1, 2, 3, 4]})
    run(targets, tmp_path, {1: [1, 20, 3, 21]}, action="match")
    capsys.readouterr()
    assert main(["ls", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    layouts = sorted({(item["layout"], item["step"], item["rows"]) for item in listed["steps"]})
    assert layouts == [("GBS4_N2_in6_out4", 1, 8), ("GBS4_N2_in6_out4/rows", 1, 4)], layouts
    assert main(["verify", str(tmp_path)]) == 0
    capsys.readouterr()
    rows_record = project(tmp_path) / "rows" / "1"
    assert main(["prune", str(tmp_path), "--keep-last", "0"]) == 0
    assert not rows_record.exists() and not (project(tmp_path) / "1").exists()
    GENERATED.clear()
    run(targets, tmp_path, {2: [1, 20]}, action="match")
    assert GENERATED == [[1, 1, 20, 20]], "the pruned records left the index: nothing served from them"


def test_an_index_written_before_a_step_was_recorded_anew_reads_that_step_again(targets: Any, tmp_path: Path) -> None:
    run(targets, tmp_path, {1: [1, 2, 3, 4]})
    run(targets, tmp_path, {2: [1]}, action="match")  # writes the index
    shutil.rmtree(project(tmp_path) / "1")
    run(targets, tmp_path, {1: [40, 41, 42, 43]})  # step 1 again, other prompts
    GENERATED.clear()
    out = run(targets, tmp_path, {3: [40, 41]}, action="match")
    assert GENERATED == [], "the re-recorded step 1's rows are found"
    assert [p for p, _ in responses(out[3][1])] == [40, 40, 41, 41]


class AsyncManager(Manager):
    """One sample per call, awaited (the fully async Rollouter's ``generate_sequences_single``)."""

    agent_loop_workers = [object()]

    async def generate_single(self, batch: DataProto) -> DataProto:
        return self.generate_sequences(batch)


def test_awaited_per_sample_calls_are_served_by_their_prompt(targets: Any, tmp_path: Path) -> None:
    import asyncio

    targets.AsyncManager = AsyncManager
    role = make_role(
        targets=[Target(f"{MODULE}:AsyncManager.generate_single")],
        step=StepSource.meta("sample"),
        clocks=[],
        on_match=None,
    )

    def feed(action: str, samples: list[tuple[int, int]]) -> list[DataProto]:
        config = Config(roles={"gen": RoleConfig(enable=True, dump_dir=str(tmp_path), steps=(1, 2, 3), action=action)})
        engine = Engine(config, {"gen": (role, "test")})
        engine.start()
        try:
            manager = targets.AsyncManager(True)

            async def main() -> list[DataProto]:
                calls = []
                for index, prompt in samples:
                    batch = prompts([prompt])
                    batch.meta_info["sample"] = index
                    calls.append(manager.generate_single(batch))
                return list(await asyncio.gather(*calls))

            return asyncio.run(main())
        finally:
            engine.stop()

    feed("cache", [(1, 1), (2, 2)])
    GENERATED.clear()
    out = feed("match", [(1, 2), (2, 5), (3, 1)])  # sample ids no longer line up with the prompts
    assert sorted(GENERATED) == [[5, 5]], "only the new prompt is generated"
    assert [[p for p, _ in responses(o)] for o in out] == [[2, 2], [5, 5], [1, 1]]


def test_a_subset_is_padded_to_the_workers_like_verl_and_the_padding_dropped(targets: Any, tmp_path: Path) -> None:
    run(targets, tmp_path, {1: [1, 2, 3, 4]})
    GENERATED.clear()
    Manager.agent_loop_workers = [object()] * 4  # 2 new rows (one prompt, n=2) go out as 4
    try:
        out = run(targets, tmp_path, {2: [1, 2, 50, 3]}, action="match")
    finally:
        Manager.agent_loop_workers = [object(), object()]
    assert GENERATED == [[50, 50, 50, 50]], "padded by repeating the subset's first rows (pad_dataproto_to_divisor)"
    result = out[2][1]
    assert len(result) == 8 and [p for p, _ in responses(result)] == [1, 1, 2, 2, 50, 50, 3, 3]


def test_cache_show_match_counts_the_prompts_of_a_dataset_that_are_cached(targets: Any, tmp_path: Path, capsys) -> None:
    import pandas as pd
    from skipinject_rollout.common import prompt_fingerprint

    from skipinject.cache_tool import main

    role = make_role(fingerprint=prompt_fingerprint)
    dump = tmp_path / "dump"
    run(targets, dump, {1: [1, 2, 3, 4]}, role=role)
    run(targets, dump, {1: [5, 1]}, role=role, action="match")  # prompt 5: a rows record
    dataset = tmp_path / "train.parquet"
    pd.DataFrame({"prompt": [[{"role": "user", "content": f"p{p}"}] for p in (1, 2, 5, 6, 7)]}).to_parquet(dataset)
    capsys.readouterr()
    assert main(["show", str(dump), "--match", str(dataset), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["rows"], report["cached_rows"], report["steps_read"]) == (5, 3, 2), report
    assert main(["show", str(project(dump)), "--match", str(dataset)]) == 0
    assert "3 of 5 rows of" in capsys.readouterr().out


class WorkerGroup:
    """verl < 0.7's sync rollout: ``generate_sequences`` bound on the worker group instance."""

    world_size = 4

    def __init__(self) -> None:
        manager = Manager(before=False)
        manager.agent_loop_workers = [object()] * self.world_size
        self.generate_sequences = manager.generate_sequences


class WorkerGroupTrainer(Trainer):
    def init_workers(self) -> None:
        self.actor_rollout_wg = WorkerGroup()

    def fit(self) -> dict[int, DataProto]:
        out = {}
        for step, ids in sorted(self.schedule.items()):
            self.global_steps = step
            batch = prompts(ids, before=False)
            batch.meta_info["global_steps"] = step
            out[step] = (batch, self.actor_rollout_wg.generate_sequences(batch))
        return out


def test_the_worker_group_path_pads_to_its_world_size(targets: Any, tmp_path: Path) -> None:
    targets.Trainer = WorkerGroupTrainer
    role = make_role(
        targets=[Target(f"{MODULE}:Trainer.init_workers", attribute="actor_rollout_wg.generate_sequences")]
    )

    def fit(action: str, schedule: dict[int, list[int]]) -> Any:
        config = Config(roles={"gen": RoleConfig(enable=True, dump_dir=str(tmp_path), steps=(1, 2), action=action)})
        engine = Engine(config, {"gen": (role, "test")})
        engine.start()
        try:
            trainer = targets.Trainer(schedule, before=False)
            trainer.init_workers()
            return trainer.fit()
        finally:
            engine.stop()

    fit("cache", {1: [1, 2, 3, 4]})
    GENERATED.clear()
    out = fit("match", {2: [4, 60, 2, 61]})
    assert GENERATED == [[60, 61, 60, 61]], "two new prompts padded to the world size 4 (verl repeats after)"
    assert [p for p, _ in responses(out[2][1])] == [4, 4, 60, 60, 2, 2, 61, 61]


def test_rows_that_do_not_fit_together_are_not_merged_the_call_runs_whole(targets: Any, tmp_path: Path, caplog) -> None:
    run(targets, tmp_path, {1: [1, 2, 3, 4]})
    GENERATED.clear()
    LOG_PROBS[0] = torch.float64  # this run's generator returns another dtype than the cached rows
    caplog.set_level(logging.INFO, "skipinject")
    try:
        out = run(targets, tmp_path, {2: [1, 2, 70, 3]}, action="match")
    finally:
        LOG_PROBS[0] = torch.float32
    assert GENERATED == [[70, 70], [1, 1, 2, 2, 70, 70, 3, 3]], "the subset, then (not mergeable) the whole call"
    result = out[2][1]
    assert [p for p, _ in responses(result)] == [1, 1, 2, 2, 70, 70, 3, 3]
    assert result.batch["rollout_log_probs"].dtype == torch.float64, "what the target returned, not a mixture"
    assert any("cannot merge the cached and generated rows" in m and "rollout_log_probs" in m for m in messages(caplog))


def test_the_runner_refuses_match_for_a_role_that_cannot_in_one_line_before_the_program_runs(tmp_path: Path) -> None:
    import subprocess

    pytest.importorskip("skipinject_reward")
    settings = [
        "skip.reward.enable=True",
        "skip.reward.steps=[1]",
        "skip.reward.action=match",
        f"skip.reward.dump_dir={tmp_path}",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "skipinject", "-c", "print('the program ran')", *settings],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "the program ran" not in proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "skipinject: error: skip.reward.action=match: role 'reward' cannot serve part of a call "
        "(declares no row_key: it has no row selector and merger, plugin API 1.2); use action=cache, repeat or strict"
    ]


def _with_batch_size(targets: Any, monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """This run's ``data.train_batch_size`` (its layout directory is ``GBS{size}_...``)."""
    original = targets.Trainer.__init__

    def resized(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.config["data"]["train_batch_size"] = size

    monkeypatch.setattr(targets.Trainer, "__init__", resized)


def test_another_batch_size_is_served_from_the_project_s_other_layouts(
    targets: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    first = run(targets, tmp_path, {1: [1, 2, 3, 4], 2: [5, 6, 7, 8]})
    recorded = first[1][1].batch["responses"]
    GENERATED.clear()
    _with_batch_size(targets, monkeypatch, 2)
    caplog.set_level(logging.INFO, "skipinject")
    out = run(targets, tmp_path, {1: [3, 30], 2: [2, 1]}, action="match")
    assert GENERATED == [[30, 30]], "prompts 3, 2 and 1 served from the batch-size-4 layout; only 30 generated"
    assert [p for p, _ in responses(out[1][1])] == [3, 3, 30, 30]
    assert torch.equal(out[1][1].batch["responses"][0:2], recorded[4:6]), "prompt 3's recorded samples"
    assert torch.equal(out[2][1].batch["responses"], torch.cat([recorded[2:4], recorded[0:2]]))
    assert list(out[2][1].non_tensor_batch["uid"]) == list(out[2][0].non_tensor_batch["uid"]), "this run's uids"
    assert any("served from step 1 of GBS4_N2_in6_out4" in m for m in messages(caplog)), messages(caplog)
    own = tmp_path / "e_p" / "GBS2_N2_in6_out4" / "gen"
    assert sorted(p.name for p in own.iterdir() if p.name.isdigit()) == ["1", "2"], "saved in this run's layout"
    assert not (project(tmp_path) / "rows").exists(), "nothing written into the other layout"
    assert json.loads((project(tmp_path) / "1" / "meta.json").read_text())["rows"] == 8

    GENERATED.clear()
    out = run(targets, tmp_path, {3: [30, 5]}, action="match")
    assert GENERATED == [], "30 from this layout's step 1, 5 from the other layout's step 2"
    assert [p for p, _ in responses(out[3][1])] == [30, 30, 5, 5]

    tensors = next((project(tmp_path) / "2").glob("tensors-*.bin"))
    damaged = bytearray(tensors.read_bytes())
    damaged[-1] ^= 0xFF
    tensors.write_bytes(bytes(damaged))
    GENERATED.clear()
    out = run(targets, tmp_path, {3: [6, 30]}, action="match")
    assert GENERATED == [[6, 6]], "a step of the other layout that does not verify serves nothing"
    assert [p for p, _ in responses(out[3][1])] == [6, 6, 30, 30]


def test_only_layouts_differing_in_the_batch_size_are_looked_at() -> None:
    from skipinject.verl.layout import batch_size_layouts

    context = {"gbs": 4, "n": 2, "prompt_length": 6, "response_length": 4}
    names = [
        "GBS8_N2_in6_out4",
        "GBS2_N2_in6_out4",
        "GBS4_N2_in6_out4",  # this run's own
        "GBS08_N2_in6_out4",  # not the name of batch size 8
        "GBS8_N3_in6_out4",  # another n: other generations
        "GBS8_N2_in6_out5",
        "GBS8_N2_in6_out4\n",
        "GBS99999999999999_N2_in6_out4",
    ]
    assert batch_size_layouts(names, context) == [("GBS2_N2_in6_out4", 2), ("GBS8_N2_in6_out4", 8)]


def test_a_key_whose_latest_copy_does_not_serve_falls_back_to_an_older_copy(targets: Any, tmp_path: Path) -> None:
    first = run(targets, tmp_path, {1: [1, 2, 3, 4]})
    run(targets, tmp_path, {2: [1, 2, 5, 6]})  # a later copy of prompts 1 and 2
    tensors = next((project(tmp_path) / "2").glob("tensors-*.bin"))
    damaged = bytearray(tensors.read_bytes())
    damaged[-1] ^= 0xFF
    tensors.write_bytes(bytes(damaged))
    GENERATED.clear()
    out = run(targets, tmp_path, {3: [2, 1, 4, 3]}, action="match")
    assert GENERATED == [], "prompts 1 and 2 served from step 1 once step 2 did not verify"
    recorded = first[1][1].batch["responses"]
    expected = torch.cat([recorded[2:4], recorded[0:2], recorded[6:8], recorded[4:6]])
    assert torch.equal(out[3][1].batch["responses"], expected), "each prompt's recorded samples"


def test_a_copy_whose_step_no_longer_records_the_key_falls_back(targets: Any, tmp_path: Path) -> None:
    run(targets, tmp_path, {1: [1, 2, 3, 4]})
    run(targets, tmp_path, {2: [1, 2, 5, 6]})
    index = project(tmp_path) / "row-index.npz"
    run(targets, tmp_path, {3: [5]}, action="match")  # writes the index
    with np.load(index) as saved:
        arrays = {name: saved[name].copy() for name in saved.files}
    at_step_2 = arrays["number"] == 2
    arrays["row"][at_step_2] = (arrays["row"][at_step_2] + 2) % 8  # step 2's copies point at other rows
    np.savez(index, **arrays)
    GENERATED.clear()
    out = run(targets, tmp_path, {3: [1, 2]}, action="match")
    assert GENERATED == [], "step 2 does not record those keys where the index says: step 1's copies serve"
    assert [p for p, _ in responses(out[3][1])] == [1, 1, 2, 2]


def test_two_runs_saving_new_rows_at_once_both_keep_their_records(
    targets: Any, tmp_path: Path, monkeypatch, capsys
) -> None:
    """Two runs (forked processes) save new rows of the committed step 1 at the same moment: each
    takes its own rows record number (both wait, number chosen, until the other chose too)."""
    import multiprocessing

    from skipinject.store import StepStore

    run(targets, tmp_path, {1: [1, 2, 3, 4]})
    context = multiprocessing.get_context("fork")
    both_chose = context.Barrier(2, timeout=60)
    save = StepStore.save

    def racing_save(self: StepStore, step: int, *args: Any, **kwargs: Any) -> Path:
        if self.project_dir.name == "rows":
            both_chose.wait()  # each run has its number: neither has written yet
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(StepStore, "save", racing_save)

    def child(prompt: int) -> None:
        try:
            run(targets, tmp_path, {1: [1, prompt]}, action="match")
        except BaseException:
            os._exit(1)
        os._exit(0)

    children = [context.Process(target=child, args=(prompt,)) for prompt in (80, 81)]
    for process in children:
        process.start()
    for process in children:
        process.join(120)
        assert process.exitcode == 0
    rows = project(tmp_path) / "rows"
    assert sorted(p.name for p in rows.iterdir()) == ["1", "2"], "two records, neither replaced"
    from skipinject.cache_tool import main

    capsys.readouterr()
    assert main(["ls", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["steps"]
    assert sorted((i["layout"], i["step"], i["state"]) for i in listed if i["layout"].endswith("/rows")) == [
        ("GBS4_N2_in6_out4/rows", 1, "complete"),
        ("GBS4_N2_in6_out4/rows", 2, "complete"),
    ]
    assert main(["verify", str(tmp_path)]) == 0
    monkeypatch.setattr(StepStore, "save", save)
    GENERATED.clear()
    out = run(targets, tmp_path, {2: [80, 81]}, action="match")
    assert GENERATED == [], "both runs' new rows are served"
    assert [p for p, _ in responses(out[2][1])] == [80, 80, 81, 81]


def test_the_match_snippet_serves_the_rows_it_saw_and_generates_only_the_others(tmp_path: Path) -> None:
    """The guide's "Opting a role into ``action=match``" role, as printed, on a toy generator of real
    ``DataProto`` batches split among 2 workers: run 1 caches step 1, run 2 (``match``) at step 2
    gets two prompts it saw and one it did not: only that one is generated (padded to the workers)."""
    from tests.unit.test_readme_snippet import ROOT, snippets

    generated: list[list[str]] = []

    class Generator:
        workers = (object(), object())

        def generate(self, batch: DataProto) -> DataProto:
            prompts = [str(p[0]["content"]) for p in batch.non_tensor_batch["raw_prompt"]]
            generated.append(prompts)
            responses = torch.tensor([[len(p), len(generated)] for p in prompts])
            return DataProto.from_dict(
                tensors={"responses": responses}, non_tensors={"prompt": np.array(prompts, dtype=object)}
            )

    module = type(sys)("my_pkg.gen")
    module.Generator = Generator  # type: ignore[attr-defined]
    package = type(sys)("my_pkg")
    package.gen = module  # type: ignore[attr-defined]
    sys.modules.update({"my_pkg": package, "my_pkg.gen": module})
    namespace: dict[str, object] = {}
    try:
        exec(compile(snippets(ROOT / "docs" / "plugins.md")["match-role"], "my_gen.py", "exec"), namespace)
        role = namespace["ROLE"]

        def step(action: str, number: int, prompts: list[str]) -> DataProto:
            settings = RoleConfig(enable=True, dump_dir=str(tmp_path), steps=(1, 2), action=action)
            engine = Engine(Config(roles={"my_gen": settings}), {"my_gen": (role, "readme")})
            engine.start()
            try:
                chats = np.empty(len(prompts), dtype=object)
                chats[:] = [[{"role": "user", "content": p}] for p in prompts]
                batch = DataProto.from_dict(
                    tensors={"ids": torch.arange(len(prompts))}, non_tensors={"raw_prompt": chats}
                )
                batch.meta_info["global_steps"] = number
                return Generator().generate(batch)
            finally:
                engine.stop()

        step("cache", 1, ["a", "bb", "ccc", "dddd"])
        out = step("match", 2, ["ccc", "eeeee", "a", "bb"])
    finally:
        for name in ("my_pkg", "my_pkg.gen"):
            sys.modules.pop(name)
    assert generated == [["a", "bb", "ccc", "dddd"], ["eeeee", "eeeee"]], "only the new prompt, padded to 2 workers"
    assert list(out.non_tensor_batch["prompt"]) == ["ccc", "eeeee", "a", "bb"], "merged in the call's order"
    assert out.batch["responses"].tolist() == [[3, 1], [5, 2], [1, 1], [2, 1]], "served rows are run 1's"


def test_a_lookup_looks_at_most_at_the_nearest_batch_sizes_usable_layouts(tmp_path: Path, caplog) -> None:
    from skipinject.engine.matching import MAX_LAYOUTS
    from skipinject.engine.runtime import RoleRuntime

    settings = RoleConfig(enable=True, dump_dir=str(tmp_path), steps=(1,), action="match")
    runtime = RoleRuntime(make_role(), settings, "test")
    experiment = tmp_path / "e_p"
    for gbs in range(1, 31):
        (experiment / f"GBS{gbs}_N2_in6_out4" / "gen").mkdir(parents=True)
    (experiment / "GBS16_N3_in6_out4" / "gen").mkdir(parents=True)  # another n: never looked at
    (experiment / "GBS17_N2_in6_out4").chmod(0o777)  # another user could write it: not trusted
    context = {"experiment_name": "e", "project_name": "p", "gbs": 16, "n": 2, "prompt_length": 6, "response_length": 4}
    store = runtime.open(experiment / "GBS16_N2_in6_out4" / "gen", context)
    caplog.set_level(logging.INFO, "skipinject")
    found = runtime.batch_size_stores(store, MAX_LAYOUTS)
    assert MAX_LAYOUTS == 8
    assert sorted(s.context["gbs"] for s in found) == [12, 13, 14, 15, 18, 19, 20], "the 8 nearest, one untrusted"
    assert all(s.project_dir == experiment / f"GBS{s.context['gbs']}_N2_in6_out4" / "gen" for s in found)
    assert any("holds 29 other batch-size layouts; match looks rows up in the 8 nearest" in m for m in messages(caplog))


def test_match_in_an_object_store_serves_another_batch_size_and_keeps_the_index_there(
    targets: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import uuid

    from skipinject.store.remote import open_remote

    url = f"memory://skipinject-tests/{uuid.uuid4().hex}"
    run(targets, url, {1: [1, 2, 3, 4]})
    GENERATED.clear()
    _with_batch_size(targets, monkeypatch, 2)
    out = run(targets, url, {1: [3, 30], 2: [2, 1]}, action="match")
    assert GENERATED == [[30, 30]], "served from the batch-size-4 layout in the store"
    assert [p for p, _ in responses(out[2][1])] == [2, 2, 1, 1]
    fs, root = open_remote(url)
    layouts = f"{root.path}/e_p"
    assert fs.exists(f"{layouts}/GBS4_N2_in6_out4/gen/row-index.npz"), "the index is an object of the store"
    assert fs.exists(f"{layouts}/GBS2_N2_in6_out4/gen/2/meta.json"), "saved in this run's layout"
    assert not fs.exists(f"{layouts}/GBS4_N2_in6_out4/gen/rows"), "nothing saved into the other layout"


def test_record_meta_is_saved_with_steps_and_rows_and_on_match_sees_each_sources_rows_and_meta(
    targets: Any, tmp_path: Path
) -> None:
    """A role's ``record_meta`` (e.g. what scored a rollout) is in every record it saves, and ``on_match``
    gets, per source, the merged result's rows it served and its ``meta.json``."""
    seen: list[Any] = []
    label = {"now": "first"}

    def record_meta(call: Any) -> dict[str, Any]:
        return {"made_by": label["now"]}

    def on_match(result: Any, call: Any, info: Any) -> Any:
        seen.append(info)
        return result

    role = make_role(record_meta=record_meta, on_match=on_match)
    run(targets, tmp_path, {1: [1, 2, 3, 4]}, role=role)
    label["now"] = "second"
    run(targets, tmp_path, {1: [1, 20, 3, 21]}, action="match", role=role)
    layout = project(tmp_path)
    assert json.loads((layout / "1" / "meta.json").read_text())["made_by"] == "first"
    assert json.loads((layout / "rows" / "1" / "meta.json").read_text())["made_by"] == "second"
    [info] = seen
    assert dict(info.served) == {"step 1": [0, 1, 4, 5]}, "prompts 1 and 3, n=2 rows each, in the call's order"
    assert info.source_meta["step 1"]["made_by"] == "first"
    assert info.settings is not None and info.settings.action.value == "match"


def test_on_hit_sees_the_served_steps_meta_and_the_roles_settings(targets: Any, tmp_path: Path) -> None:
    hits: list[Any] = []

    def on_hit(result: Any, call: Any, info: Any) -> Any:
        hits.append(info)
        return result

    role = make_role(record_meta=lambda call: {"made_by": "run 1"}, on_hit=on_hit)
    run(targets, tmp_path, {1: [1, 2, 3, 4]}, role=role)
    assert hits == []
    run(targets, tmp_path, {1: [1, 2, 3, 4]}, role=role)
    [info] = hits
    assert info.meta["made_by"] == "run 1" and info.meta["calls"] == 1
    assert info.settings is not None and info.settings.rescore.value == "auto"


def test_cache_show_match_reads_a_bounded_dataset_and_names_a_fifo(tmp_path: Path, capsys) -> None:
    """A small parquet file of a long repeated prompt (dictionary-encoded: a few KB for gigabytes of
    rows) is refused as it is read, in one line; a FIFO named as the dataset is named a FIFO."""
    import time

    import pyarrow as pa
    import pyarrow.parquet as pq

    from skipinject.cache_tool import main

    dump = tmp_path / "dump"
    dump.mkdir()
    bomb = tmp_path / "bomb.parquet"
    prompt = "x" * 100_000
    values = pa.DictionaryArray.from_arrays(pa.array(np.zeros(200_000, dtype=np.int32)), pa.array([prompt]))
    pq.write_table(pa.table({"prompt": values}), bomb, row_group_size=200_000)
    assert bomb.stat().st_size < 1 << 20
    started = time.perf_counter()
    assert main(["show", str(dump), "--match", str(bomb)]) == 2
    err = capsys.readouterr().err
    assert "decodes to more than" in err and len(err.splitlines()) == 1, err
    assert time.perf_counter() - started < 30
    fifo = tmp_path / "train.parquet"
    os.mkfifo(fifo)
    assert main(["show", str(dump), "--match", str(fifo)]) == 2
    err = capsys.readouterr().err
    assert "is a pipe, not a parquet file" in err and len(err.splitlines()) == 1, err


def test_a_step_serving_rows_to_match_counts_the_hit(targets: Any, tmp_path: Path) -> None:
    """``action=match``'s sources are hits too: their usage records say when they last served
    (``cache ls``, ``prune --max-size`` go by it)."""
    from skipinject.store import StepStore

    run(targets, tmp_path, FIRST)
    store = StepStore(project(tmp_path), "gen", {})
    assert store.usage(1) is None and store.usage(2) is None
    run(targets, tmp_path, {1: [5, 1, 2, 13]}, action="match")  # rows from steps 1 and 2, one generated
    assert store.usage(1) is not None and store.usage(1).hits == 1  # type: ignore[union-attr]
    assert store.usage(2) is not None and store.usage(3) is None


def test_a_refreshed_step_serves_its_new_rows_never_the_old_index_entries(targets: Any, tmp_path: Path) -> None:
    """``action=refresh`` records a step anew: the saved row index's entries of the old commit are dropped
    (its ``meta.json`` changed), so a later ``match`` serves the refreshed rows."""
    schedule = {1: [1, 2, 3, 4]}
    recorded = responses(run(targets, tmp_path, schedule)[1][1])
    assert responses(run(targets, tmp_path, schedule, action="match")[1][1]) == recorded  # the index is saved
    assert (project(tmp_path) / "row-index.npz").is_file()
    GENERATED.clear()
    refreshed = responses(run(targets, tmp_path, schedule, action="refresh")[1][1])
    assert GENERATED == [[1, 1, 2, 2, 3, 3, 4, 4]] and refreshed != recorded
    GENERATED.clear()
    assert responses(run(targets, tmp_path, schedule, action="match")[1][1]) == refreshed
    assert GENERATED == [], "every row served, from the refreshed commit"


def test_rows_served_count_their_share_of_the_recorded_generation_time(targets: Any, tmp_path: Path) -> None:
    """The summary of a ``match`` run: rows served and generated, and for each source step the share of its
    recorded ``generation_s`` that the served rows stand for."""
    from skipinject.report.tally import TALLY

    run(targets, tmp_path, {1: [1, 2, 3, 4]})
    recorded = json.loads((project(tmp_path) / "1" / "meta.json").read_text())["generation_s"]
    assert recorded > 0
    TALLY.clear()
    run(targets, tmp_path, {2: [1, 2, 9, 10]}, action="match")
    counts = TALLY.roles["gen"]
    assert (counts["served_rows"], counts["generated_rows"]) == (4, 4)  # 2 prompts x n=2 each
    assert counts["generation_s_saved"] == pytest.approx(recorded / 2)
    meta = json.loads((project(tmp_path) / "2" / "meta.json").read_text())
    assert meta["generation_s"] > 0, "the merged call records the time of the rows it generated"
    TALLY.clear()


def test_a_calls_sources_are_read_one_ahead_of_the_one_being_merged(
    targets: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows cached in two steps: the second step is read while the first is (its read waits until the
    second's has begun: read one after the other, it would wait in vain)."""
    from skipinject.engine.matching import RowMatcher

    run(targets, tmp_path, {1: [1, 2, 3, 4], 2: [5, 6, 7, 8]})
    load_rows = RowMatcher._load_rows
    began: dict[int, threading.Event] = {1: threading.Event(), 2: threading.Event()}
    overlapped: list[bool] = []

    def slow_first(self: Any, store: Any, number: int, *args: Any) -> Any:
        began[number].set()
        if number == 1:
            overlapped.append(began[2].wait(30))
        return load_rows(self, store, number, *args)

    monkeypatch.setattr(RowMatcher, "_load_rows", slow_first)
    GENERATED.clear()
    out = run(targets, tmp_path, {3: [1, 5, 2, 6]}, action="match")
    assert overlapped == [True]
    assert GENERATED == []  # every row served, from both steps
    assert [prompt for prompt, _ in responses(out[3][1])] == [1, 1, 5, 5, 2, 2, 6, 6]
