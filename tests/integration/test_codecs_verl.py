"""Codecs on verl's types: real DataProto / TensorDict results survive the store unchanged, and never change it.

The verl-free codec tests are in ``tests/unit/test_codecs.py``."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import NonTensorStack, TensorDict
from verl.protocol import DataProto
from verl.utils import tensordict_utils as tu

from skipinject.errors import CodecError, CorruptCacheError
from skipinject.store import Payload, StepStore
from skipinject.verl.codecs import CONCATS, DataProtoCodec, TensorDictCodec
from tests.codec_checks import assert_td_equal, round_trip, same

# ---------------------------------------------------------------- fixtures


def grpo_dataproto(prompts: int = 6, n: int = 4, prompt_len: int = 5, response_len: int = 7) -> DataProto:
    """Shaped like AgentLoopManager.generate_sequences output: prompts repeated n times, interleaved."""
    rows = prompts * n
    gen = torch.Generator().manual_seed(1)
    per_prompt = DataProto.from_dict(
        non_tensors={
            "uid": np.array([f"uid{i}" for i in range(prompts)], dtype=object),
            "data_source": np.array(["openai/gsm8k"] * prompts, dtype=object),
            # Same-length message lists: np.array() would make this 2-D; it must stay 1-D.
            "raw_prompt": np.fromiter(
                (
                    [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}?"}]
                    for i in range(prompts)
                ),
                dtype=object,
                count=prompts,
            ),
            "reward_model": np.fromiter(
                ({"style": "rule", "ground_truth": str(i)} for i in range(prompts)), dtype=object, count=prompts
            ),
        }
    )
    non_tensors = dict(per_prompt.repeat(repeat_times=n, interleave=True).non_tensor_batch)
    non_tensors["__num_turns__"] = np.full(rows, 2, dtype=np.int32)
    non_tensors["acc"] = np.linspace(0, 1, rows)  # reward_extra_info: a float64 array
    non_tensors["pred"] = np.array([f"{i % 3}" for i in range(rows)])  # a '<U1' array
    non_tensors["multi_modal_inputs"] = np.fromiter(
        ({"pixel_values": torch.full((2, 3), float(i)), "grid": torch.arange(2000)} for i in range(rows)),
        dtype=object,
        count=rows,
    )
    non_tensors["tool_rewards"] = np.fromiter(
        ([] if i % 2 else [0.5, None] for i in range(rows)), dtype=object, count=rows
    )
    non_tensors["extras"] = np.fromiter(
        ((i, {1: "one", (2, 3): b"\x00\xff"}, np.float32(0.5), float("nan")) for i in range(rows)),
        dtype=object,
        count=rows,
    )
    return DataProto.from_dict(
        tensors={
            "prompts": torch.randint(0, 1000, (rows, prompt_len), generator=gen),
            "responses": torch.randint(0, 1000, (rows, response_len), generator=gen),
            "response_mask": torch.ones(rows, response_len, dtype=torch.int64),
            "attention_mask": torch.ones(rows, prompt_len + response_len, dtype=torch.int64),
            "rollout_log_probs": -torch.rand(rows, response_len, generator=gen),
            "rm_scores": torch.zeros(rows, response_len, dtype=torch.bfloat16),
            "done": torch.zeros(rows, dtype=torch.bool),
        },
        non_tensors=non_tensors,
        meta_info={
            "global_steps": 3,
            "timing": {"generate_sequences": 1.25, "inf": math.inf},
            "metrics": [{"num_preempted": -1, "generate_sequences": 0.5}],
            "reward_extra_keys": ["acc", "pred"],
            "eos": (151643, 151645),
            "temperature": np.float64(1.0),
        },
    )


def tq_sample_result(prompts: int = 3, n: int = 2, step: int = 3) -> tuple[TensorDict, list[str], list[dict]]:
    """What ReplayBuffer.sample's keys fetch with tq.kv_batch_get: one row per trajectory.

    Each trajectory is built as verl 0.9.1's AgentLoopWorkerTQ._agent_loop_postprocess builds it
    (AgentLoopOutput.as_dict() + the prompt's fields, one list_of_dict_to_tensordict per put), then
    transfer_queue's storage repacks each field across rows with its own ``_pack_field_values``
    (tensors of differing lengths -> jagged NestedTensor, anything else -> NonTensorStack).
    """
    from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager

    puts, keys, tags = [], [], []
    for p in range(prompts):
        uid = f"{p:08x}a1b2c3d4"
        for session in range(n):
            prompt_len, response_len = 3 + p, 2 + (p * n + session) % 4
            prompt_ids = torch.arange(prompt_len) + 100
            response_ids = torch.arange(response_len) + 200 + session
            reward = float(session % 2)
            rm_scores = torch.zeros(response_len)
            rm_scores[-1] = reward
            field: dict[str, Any] = {
                "num_turns": 2,
                "metrics": {"generate_sequences": 0.25, "tool_calls": 0.0, "num_preempted": -1},
                "extra_fields": {"turn_scores": [], "min_global_steps": step, "max_global_steps": step},
                "prompts": prompt_ids,
                "responses": response_ids,
                "response_mask": torch.ones(response_len, dtype=torch.int64),
                "rollout_log_probs": -torch.rand(response_len),
                "rm_scores": rm_scores,
                # the prompt's own fields (kwargs)
                "raw_prompt": [{"role": "user", "content": f"question {p}"}],
                "data_source": "openai/gsm8k",
                "reward_model": {"style": "rule", "ground_truth": str(p)},
                "extra_info": {"index": p, "split": "train"},
                "index": p,
                "uid": uid,
                "tools_kwargs": {},
                "agent_name": "single_turn_agent",
                "global_steps": step,
                "session_id": session,
            }
            field["loss_mask"] = field["response_mask"]
            field["input_ids"] = torch.cat([prompt_ids, response_ids])
            field["position_ids"] = torch.arange(prompt_len + response_len)
            field["multi_modal_inputs"] = {}
            puts.append(tu.list_of_dict_to_tensordict([field]))
            keys.append(f"{uid}_{session}_0")
            tags.append(
                {"status": "success", "prompt_len": prompt_len, "response_len": response_len, "global_steps": step}
            )
    columns: dict[str, Any] = {}
    for name in puts[0].keys():
        rows = []
        for put in puts:
            value = put.get(name)
            rows.append(value.tolist()[0] if isinstance(value, NonTensorStack) else value[0])
        columns[name] = AsyncSimpleStorageManager._pack_field_values(rows)
    return TensorDict(columns, batch_size=len(puts)), keys, tags


# ---------------------------------------------------------------- comparisons


def assert_dataproto_equal(a: DataProto, b: DataProto) -> None:
    assert (a.batch is None) == (b.batch is None)
    if a.batch is not None:
        assert list(a.batch.keys()) == list(b.batch.keys())
        assert a.batch.batch_size == b.batch.batch_size
        for key in a.batch.keys():
            assert same(a.batch[key], b.batch[key]), key
    assert list(a.non_tensor_batch) == list(b.non_tensor_batch)
    for key, value in a.non_tensor_batch.items():
        other = b.non_tensor_batch[key]
        assert isinstance(other, np.ndarray) and other.shape == value.shape and other.dtype == value.dtype, key
        assert same(value, other), key
    assert same(a.meta_info, b.meta_info)


@pytest.fixture
def store(tmp_path: Path) -> StepStore:
    return StepStore(tmp_path / "cache", "rollout", {"gbs": 2})


# ---------------------------------------------------------------- DataProto


def test_dataproto_round_trip(store: StepStore) -> None:
    original = grpo_dataproto()
    decoded = round_trip(store, 1, DataProtoCodec(), original)
    assert isinstance(decoded, DataProto)
    assert_dataproto_equal(original, decoded)
    raw = decoded.non_tensor_batch["raw_prompt"]
    assert raw.ndim == 1 and len(raw) == len(original) and raw[0][1] == {"role": "user", "content": "q0?"}
    assert decoded.non_tensor_batch["multi_modal_inputs"][3]["pixel_values"].shape == (2, 3)
    # Rows repeated by DataProto.repeat share one object, in the original and after decoding.
    for array in (original.non_tensor_batch["raw_prompt"], raw):
        assert array[0] is array[3] and array[0] is not array[4]
    # The decoded batch is usable like the original.
    assert len(decoded.select_idxs([0, 5])) == 2
    assert len(DataProto.concat([decoded, decoded])) == 2 * len(original)


def test_dataproto_names_input_ids_as_prompts_then_responses() -> None:
    """The codec tells the store which tensor may be two others side by side (the store checks it)."""
    batch = grpo_dataproto()
    assert DataProtoCodec().encode(batch).concats == {}  # no input_ids
    batch.batch["input_ids"] = torch.cat([batch.batch["prompts"], batch.batch["responses"]], dim=1)
    payload = DataProtoCodec().encode(batch)
    names = {key: next(n for n in payload.tensors if n.endswith(f"[{key!r}]")) for key in CONCATS["input_ids"]}
    whole = next(n for n in payload.tensors if n.endswith("['input_ids']"))
    assert payload.concats == {whole: (names["prompts"], names["responses"])}


def test_dataproto_repeats_are_stored_once() -> None:
    payload = DataProtoCodec().encode(grpo_dataproto(prompts=6, n=4))
    column = payload.objects["non_tensor_batch"]["raw_prompt"]["column"]
    assert len(column["u"]) == 6 and len(column["i"]) == 24
    assert len(payload.objects["non_tensor_batch"]["data_source"]["column"]["u"]) == 1
    # Numeric non-tensor arrays travel as tensors, not JSON lists.
    assert payload.objects["non_tensor_batch"]["acc"]["v"]["__si__"] in ("nd", "ndt")


def test_dataproto_without_tensors(store: StepStore) -> None:
    original = DataProto.from_dict(non_tensors={"uid": np.array(["a", "b"], dtype=object)}, meta_info={"k": 1})
    assert_dataproto_equal(original, round_trip(store, 2, DataProtoCodec(), original))


def test_views_are_stored_compactly(store: StepStore) -> None:
    base = torch.arange(100_000, dtype=torch.int64).reshape(1000, 100)
    original = DataProto.from_dict(tensors={"part": base[2:6], "strided": base[:4, ::2]})
    assert_dataproto_equal(original, round_trip(store, 3, DataProtoCodec(), original))
    [tensor_file] = store.step_dir(3).glob("tensors-*")
    assert tensor_file.stat().st_size < 400 * 8 + 200 * 8 + 1024


def test_shared_tensors_stay_shared(store: StepStore) -> None:
    offsets = torch.tensor([0, 2, 5])
    td = TensorDict(
        {
            "responses": torch.nested.nested_tensor_from_jagged(torch.arange(5.0), offsets=offsets),
            "response_mask": torch.nested.nested_tensor_from_jagged(torch.ones(5), offsets=offsets),
        },
        batch_size=2,
    )
    mask = torch.ones(2, 3)
    dp = DataProto.from_dict(tensors={"response_mask": mask, "loss_mask": mask})
    payload = TensorDictCodec().encode(td)
    assert len(payload.tensors) == 3
    decoded = round_trip(store, 10, TensorDictCodec(), td)
    masked = decoded.get("responses") * decoded.get("response_mask")  # same ragged dim, as before
    assert_td_equal(
        TensorDict({"m": td.get("responses") * td.get("response_mask")}, batch_size=2),
        TensorDict({"m": masked}, batch_size=2),
    )
    again = round_trip(store, 11, DataProtoCodec(), dp)
    assert again.batch["loss_mask"].data_ptr() == again.batch["response_mask"].data_ptr()


def test_contiguous_tensors_are_not_copied() -> None:
    original = grpo_dataproto()
    payload = DataProtoCodec().encode(original)
    stored = {t.data_ptr() for t in payload.tensors.values()}
    assert all(t.data_ptr() in stored for t in original.batch.values())


class Foo:
    pass


@pytest.mark.parametrize(
    ("where", "needle"),
    [
        ("non_tensor", "non_tensor_batch['foo'][1]"),
        ("meta", "meta_info['extra']['x']"),
        ("dtype", "non_tensor_batch['when']"),
    ],
)
def test_unsupported_values_name_the_field(where: str, needle: str) -> None:
    dp = DataProto.from_dict(tensors={"x": torch.zeros(2, 1)})
    if where == "non_tensor":
        dp.non_tensor_batch["foo"] = np.fromiter([1, Foo()], dtype=object, count=2)
    elif where == "meta":
        dp.meta_info["extra"] = {"x": Foo()}
    else:
        dp.non_tensor_batch["when"] = np.array(["2024-01-01", "2024-01-02"], dtype="datetime64[D]")
    with pytest.raises(CodecError) as info:
        DataProtoCodec().encode(dp)
    message = str(info.value)
    assert needle in message and "is not supported" in message
    if where != "dtype":
        assert "Foo" in message


def test_wrong_codec_or_version_is_refused() -> None:
    payload = DataProtoCodec().encode(grpo_dataproto(prompts=1, n=2))
    with pytest.raises(CodecError, match="codec 'DataProto', expected 'TensorDict'"):
        TensorDictCodec().decode(payload)
    payload.objects["codec_version"] = 99
    with pytest.raises(CodecError, match="version 99"):
        DataProtoCodec().decode(payload)


def test_tq_sample_round_trip_select_and_concat(store: StepStore) -> None:
    original, _, _ = tq_sample_result()
    assert original.get("responses").layout == torch.jagged
    assert isinstance(original.get("raw_prompt"), NonTensorStack)
    decoded = round_trip(store, 4, TensorDictCodec(), original)
    assert_td_equal(original, decoded)
    tu.assert_tensordict_eq(original, decoded)

    # What the rollout_tq submit phase does on a hit: select rows (jagged fields too), then concat parts.
    indices = [5, 0, 0, 3]
    assert_td_equal(tu.index_select_tensor_dict(original, indices), tu.index_select_tensor_dict(decoded, indices))
    assert_td_equal(tu.concat_tensordict([original, original]), tu.concat_tensordict([decoded, decoded]))
    assert_td_equal(tu.concat_tensordict([original, original]), TensorDictCodec().merge([decoded, decoded]))


def test_upstream_shaped_payload_round_trip(store: StepStore) -> None:
    td, keys, tags = tq_sample_result(prompts=2, n=2)
    original = {"tensordict": td, "tags": tags, "keys": keys, "global_steps": 3}
    decoded = round_trip(store, 5, TensorDictCodec(), original)
    assert list(decoded) == list(original)
    assert_td_equal(td, decoded["tensordict"])
    assert decoded["tags"] == tags and decoded["keys"] == keys and decoded["global_steps"] == 3
    merged = TensorDictCodec().merge([decoded, decoded])
    assert merged["keys"] == keys + keys and len(merged["tensordict"]) == 2 * len(td)


# ---------------------------------------------------------------- in-place safety


def file_digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_in_place_changes_never_reach_the_cache(store: StepStore) -> None:
    original = grpo_dataproto()
    store.save(7, DataProtoCodec().encode(original), {})
    before = file_digests(store.step_dir(7))

    [payload] = store.load(store.verified(7))
    dp = DataProtoCodec().decode(payload)
    dp.batch["responses"][0, 0] = 7
    dp.batch["rollout_log_probs"] += 1
    dp.batch["attention_mask"].zero_()
    dp.non_tensor_batch["__num_turns__"][:] = 99
    dp.non_tensor_batch["acc"] *= 2
    dp.non_tensor_batch["multi_modal_inputs"][0]["grid"].fill_(-1)
    dp.non_tensor_batch["raw_prompt"][0].append({"role": "assistant", "content": "changed"})

    assert file_digests(store.step_dir(7)) == before
    [again] = store.load(store.verified(7))
    assert_dataproto_equal(original, DataProtoCodec().decode(again))

    td, _, _ = tq_sample_result(prompts=2, n=2)
    store.save(8, TensorDictCodec().encode(td), {})
    before = file_digests(store.step_dir(8))
    [payload] = store.load(store.verified(8))
    decoded = TensorDictCodec().decode(payload)
    decoded.get("responses").values().add_(1000)
    decoded["rollout_log_probs"].values()[0] = 5.0
    assert file_digests(store.step_dir(8)) == before
    store.verified(8)


def test_damaged_tensor_file_is_detected(store: StepStore) -> None:
    store.save(9, DataProtoCodec().encode(grpo_dataproto(prompts=2, n=2)), {})
    [tensor_file] = store.step_dir(9).glob("tensors-*")
    data = bytearray(tensor_file.read_bytes())
    data[-10] ^= 0xFF
    tensor_file.write_bytes(bytes(data))
    with pytest.raises(CorruptCacheError, match="checksum mismatch"):
        store.verified(9)


def test_payload_is_what_the_store_takes() -> None:
    payload = DataProtoCodec().encode(grpo_dataproto(prompts=1, n=2))
    assert isinstance(payload, Payload) and payload.rows == 2
    json.dumps(payload.objects, allow_nan=True)
