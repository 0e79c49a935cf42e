"""The DataProto codec on verl's NeoProto data plane (``verl.experimental.neoproto``, verl's ``neo`` tree):
a NeoProto batch is recorded in the one cache format (its referenced columns materialised, in its view's row
order), and a served step reaches the trainer as its own class, whichever class recorded it.

Needs the neo tree: run with its environment's python (``docs/verl-versions.md``),
``.venvs/verl-neo/bin/python -m pytest tests/integration/test_neoproto_codec.py``. NeoProto's columns
live in an in-process storage engine here (verl's own tests do the same): no Ray is started.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

neoproto = pytest.importorskip(
    "verl.experimental.neoproto", reason="verl's neo tree (verl.experimental.neoproto) is not installed here"
)

from verl.protocol import DataProto  # noqa: E402

from skipinject import Role, StepSource, Target  # noqa: E402
from skipinject.roles import Call  # noqa: E402
from skipinject.store import StepStore  # noqa: E402
from skipinject.testing import RoleRun, ToyTrainer  # noqa: E402
from skipinject.verl.codecs import DataProtoCodec, classic_dataproto  # noqa: E402
from tests.codec_checks import assert_td_equal, same  # noqa: E402
from tests.integration.test_codecs_verl import grpo_dataproto  # noqa: E402

pytestmark = pytest.mark.integration

NeoDataProto = neoproto.DataProto


@pytest.fixture(autouse=True)
def in_memory_storage() -> Iterator[None]:
    neoproto.set_default_storage_engine(neoproto.InMemoryStorageEngine())
    yield
    neoproto.set_default_storage_engine(None)


def classic_batch() -> DataProto:
    """A generated V0 batch: 2 prompts x 4 rows, every kind of column verl's agent loop returns (token
    widths of at least the rows: NeoProto's constructor slices a tensor by its row shape)."""
    return grpo_dataproto(prompts=2, n=4, prompt_len=9, response_len=11)


def as_generated(batch: DataProto) -> Any:
    """``batch`` as verl's agent loop builds a batch on the NeoProto data plane (its constructor)."""
    return NeoDataProto(
        batch=batch.batch.clone(), non_tensor_batch=dict(batch.non_tensor_batch), meta_info=dict(batch.meta_info)
    )


def assert_same_columns(a: Any, b: Any) -> None:
    """Every column and ``meta_info`` of two batches equal, bit for bit, whatever their classes."""
    a, b = classic_dataproto(a), classic_dataproto(b)
    assert_td_equal(a.batch, b.batch)
    assert list(a.non_tensor_batch) == list(b.non_tensor_batch) or set(a.non_tensor_batch) == set(b.non_tensor_batch)
    for key, column in a.non_tensor_batch.items():
        other = b.non_tensor_batch[key]
        assert column.dtype == other.dtype and column.shape == other.shape, key
        assert same(column.tolist(), other.tolist()), key
    assert same(dict(a.meta_info), dict(b.meta_info))


def call_with(batch: Any) -> Call:
    """A call of a generator with ``batch`` (the trainer's prompts)."""
    return Call("tests:generate", lambda prompts: prompts, None, (batch,), {})


def store_at(tmp_path: Path) -> StepStore:
    return StepStore(tmp_path / "cache", "rollout", {})


def test_a_neoproto_batch_records_as_its_classic_form(tmp_path: Path) -> None:
    classic = classic_batch()
    order = [5, 0, 7, 2, 1, 6, 3, 4]
    neo = as_generated(classic).select_idxs(order)  # a view: its rows are references, reordered
    codec = DataProtoCodec()
    recorded, expected = codec.encode(neo), codec.encode(classic.select_idxs(order))
    assert recorded.rows == expected.rows == 8
    assert same(recorded.objects["meta_info"], expected.objects["meta_info"])
    assert recorded.objects["non_tensor_batch"].keys() == expected.objects["non_tensor_batch"].keys()
    assert sorted(recorded.objects["batch"]["fields"]) == sorted(expected.objects["batch"]["fields"])
    store = store_at(tmp_path)
    store.save(1, recorded, {})
    [payload] = store.load(store.verified(1))
    assert_same_columns(codec.decode(payload), classic.select_idxs(order))
    assert len(neo) == 8 and type(neo) is NeoDataProto, "recording leaves the trainer's batch as it was"


def test_a_classic_recording_serves_a_neoproto_trainer(tmp_path: Path) -> None:
    classic = classic_batch()
    store, codec = store_at(tmp_path), DataProtoCodec()
    store.save(1, codec.encode(classic), {})
    [payload] = store.load(store.verified(1))
    prompts = NeoDataProto.from_single_dict(
        {"uid": classic.non_tensor_batch["uid"][::4].copy(), "raw_ids": classic.batch["prompts"][::4].clone()}
    )
    served = codec.served(codec.decode(payload, call_with(prompts)), call_with(prompts))
    assert type(served) is NeoDataProto
    assert_same_columns(served, classic)
    # What the V0 trainer does next with a generated batch: repeat its own batch, union, slice, read columns.
    trained = prompts.repeat(repeat_times=4, interleave=True).union(served)
    assert type(trained) is NeoDataProto and len(trained) == 8
    assert torch.equal(trained.batch["responses"], classic.batch["responses"])
    assert list(trained.non_tensor_batch["uid"]) == list(classic.non_tensor_batch["uid"])
    assert torch.equal(served.slice(0, 4).batch["prompts"], classic.batch["prompts"][:4])


def test_a_neoproto_recording_serves_a_classic_trainer(tmp_path: Path) -> None:
    classic = classic_batch()
    store, codec = store_at(tmp_path), DataProtoCodec()
    store.save(1, codec.encode(as_generated(classic)), {})
    [payload] = store.load(store.verified(1))
    prompts = DataProto.from_single_dict(
        {"uid": classic.non_tensor_batch["uid"][::4].copy(), "raw_ids": classic.batch["prompts"][::4].clone()}
    )
    served = codec.served(codec.decode(payload, call_with(prompts)), call_with(prompts))
    assert type(served) is DataProto
    assert_same_columns(served, classic)
    trained = prompts.repeat(repeat_times=4, interleave=True).union(served)
    assert torch.equal(trained.batch["rollout_log_probs"], classic.batch["rollout_log_probs"])


def test_a_classic_batch_for_a_classic_trainer_is_served_as_it_is() -> None:
    classic = classic_batch()
    prompts = DataProto.from_single_dict({"uid": classic.non_tensor_batch["uid"][::4].copy()})
    assert DataProtoCodec().served(classic, call_with(prompts)) is classic
    assert classic_dataproto(classic) is classic


def test_rows_of_a_neoproto_call_are_cut_and_merged_in_its_class() -> None:
    classic = classic_batch()
    neo = as_generated(classic)
    codec = DataProtoCodec()
    picked = codec.select_rows(neo, [6, 1])
    assert type(picked) is DataProto and torch.equal(picked.batch["responses"], classic.batch["responses"][[6, 1]])
    merged = codec.merge_rows([neo, classic], list(range(15, -1, -2)), call_with(neo))
    assert len(merged) == 8
    args, _, padding = codec.with_rows(call_with(neo), [3, 2])
    assert type(args[0]) is NeoDataProto and padding == 0
    assert torch.equal(args[0].batch["prompts"], classic.batch["prompts"][[3, 2]])


# ---------------------------------------------------------------- through the engine


GENERATED: list[int] = []


class NeoTrainer(ToyTrainer):
    """A V0 trainer on the NeoProto plane: its generator gets and returns NeoProto batches."""

    def generate(self, index: int) -> Any:
        prompts = NeoDataProto.from_single_dict(
            {"uid": np.array([f"p{i}" for i in range(2)], dtype=object)}, meta_info={"global_steps": self.global_steps}
        )
        rollout = self.rollout(prompts)
        return prompts.repeat(repeat_times=4, interleave=True).union(rollout)

    def rollout(self, prompts: Any) -> Any:
        GENERATED.append(self.global_steps)
        generated = classic_batch()
        generated.non_tensor_batch["uid"] = np.repeat(prompts.non_tensor_batch["uid"], 4)
        generated.batch["responses"] += self.global_steps
        generated.meta_info["global_steps"] = self.global_steps
        return as_generated(generated)


def neo_role() -> Role:
    return Role(
        name="neo_rollout",
        targets=[Target(f"{__name__}:NeoTrainer.rollout")],
        step=StepSource.meta("global_steps"),
        codec=DataProtoCodec(),
        cache_subdir="",
    )


def test_the_engine_serves_a_recorded_step_to_a_neoproto_trainer(tmp_path: Path) -> None:
    GENERATED.clear()
    with RoleRun(neo_role(), tmp_path, [1, 2]) as first:
        generated = NeoTrainer().fit(2)
    assert GENERATED == [1, 2] and len(first.misses()) == 2
    with RoleRun(neo_role(), tmp_path, [1, 2]) as second:
        served = NeoTrainer().fit(2)
    assert GENERATED == [1, 2], "run 2 calls no generator"
    second.assert_hit(1)
    second.assert_hit(2)
    for was, now in zip(generated, served, strict=True):
        assert type(now) is NeoDataProto
        assert_same_columns(now, was)


def test_rollout_tq_on_the_neo_tree_says_there_is_no_v1_trainer_and_points_to_skip_rollout(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf
    from skipinject_rollout_tq.plugin import cannot_fire

    from skipinject.report.start import layout_lines

    for use_v1 in (True, False):
        reason = cannot_fire(OmegaConf.create({"trainer": {"use_v1": use_v1}}))
        assert reason is not None and "has no V1 TransferQueue trainer" in reason and "use skip.rollout" in reason
    with initialize_config_module("verl.trainer.config", version_base=None):
        run_config = compose("ppo_trainer")  # the trainer's own config, as run_ppo gets it
    with RoleRun("rollout_tq", tmp_path, [1]) as run:
        assert run.engine is not None and run.engine.check_targets() == [], "no line about the version"
        warned = [line for level, line in layout_lines(run.config, run.plugins.roles, run_config) if level >= 30]
    assert len(warned) == 1 and "skip.rollout_tq is enabled but cannot act" in warned[0], warned
    assert "no V1 TransferQueue trainer" in warned[0] and "use skip.rollout" in warned[0]
