"""The V1 fast paths (bulk NonTensorData/NonTensorStack building, plain-column encoding) give training
code exactly what the original TensorDict gives, through verl's and the rollout_tq plugin's own code."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict
from verl.utils import tensordict_utils as tu

from skipinject.codecs import encode_column, to_jsonable
from skipinject.store import StepStore
from skipinject.verl import tensordicts as tds
from skipinject.verl.codecs import TensorDictCodec
from tests.codec_checks import assert_td_equal, same
from tests.integration.test_codecs_verl import file_digests, tq_sample_result

transfer = pytest.importorskip("skipinject_rollout_tq.transfer")

ODD_ROWS: list[Any] = [
    "text",
    {"k": [1, None, {"x": 1.5}]},
    None,
    [{"role": "user", "content": "q"}],
    3,
    2.5,
    True,
    (1, "tuple"),
    {1: "int key"},
    torch.arange(3),
    [],
    {},
    float("nan"),
    b"\x00bytes",
]


def odd_batch(rows: int = 28) -> TensorDict:
    """Jagged tensors plus non-tensor columns of every kind of value (strings, dicts, lists, None, ...)."""
    lengths = torch.tensor([1 + i % 5 for i in range(rows)])
    offsets = torch.zeros(rows + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    shared = {"style": "rule", "ground_truth": "7"}  # one object on many rows, as GRPO repeats build it
    fields: dict[str, Any] = {
        "responses": torch.nested.nested_tensor_from_jagged(torch.arange(int(offsets[-1])), offsets=offsets),
        "dense": torch.arange(rows * 2).reshape(rows, 2),
        "odd": NonTensorStack(*[ODD_ROWS[i % len(ODD_ROWS)] for i in range(rows)]),
        "uid": NonTensorStack(*[f"uid{i // 4}" for i in range(rows)]),
        "reward_model": NonTensorStack(*[shared if i % 2 else {"style": "rule", "n": i} for i in range(rows)]),
        "maybe": NonTensorStack(*[None if i % 3 else [i] for i in range(rows)]),
    }
    td = TensorDict(fields, batch_size=rows)
    td["meta"] = NonTensorData({"validate": False})
    return td


def round_trip(tmp_path: Path, result: Any, step: int = 1) -> tuple[StepStore, Any]:
    store = StepStore(tmp_path / "cache", "rollout_tq", {})
    codec = TensorDictCodec()
    store.save(step, codec.encode(result), {})
    [payload] = store.load(store.verified(step))
    return store, codec.decode(payload)


def rows_of(td: TensorDict, key: str) -> list[Any]:
    return tu.get(td, key)


@pytest.mark.parametrize("make", [odd_batch, lambda: tq_sample_result(prompts=3, n=4)[0]], ids=["odd", "tq_sample"])
def test_decoded_batch_behaves_like_the_original(tmp_path: Path, make: Any) -> None:
    original = make()
    _, decoded = round_trip(tmp_path, original)
    stacks = [key for key in original.keys() if isinstance(original.get(key), NonTensorStack)]
    assert stacks and all(type(decoded.get(key).tensordicts) is tds.LazyRows for key in stacks)  # rows not made yet
    assert_td_equal(original, decoded)
    if "odd" not in original.keys():  # verl's own check compares rows with ==: no tensors or nan in rows
        tu.assert_tensordict_eq(original, decoded)
    assert decoded.batch_size == original.batch_size
    for key in original.keys():
        value = original.get(key)
        if isinstance(value, NonTensorStack):
            got = decoded.get(key)
            assert type(got) is NonTensorStack and got.batch_size == value.batch_size
            assert same(rows_of(decoded, key), rows_of(original, key)), key
            assert same(decoded[key], original[key]), key  # td["key"] on a stack: the list of rows
            assert same(got.tolist(), value.tolist()), key
            for row in (0, len(original) - 1):
                assert same(decoded[row][key], original[row][key]), (key, row)
                assert same(got[row].data, value[row].data), (key, row)
                assert type(got[row]) is type(value[row]), (key, row)
        elif isinstance(value, NonTensorData):
            assert same(tu.get(decoded, key), tu.get(original, key))

    # Row selection (repeats, reversed) and concat of k parts, as the rollout_tq hit does them.
    indices = [len(original) - 1, 0, 0, 3, 2]
    assert_td_equal(tu.index_select_tensor_dict(original, indices), tu.index_select_tensor_dict(decoded, indices))
    for k in (2, 3):
        assert_td_equal(tu.concat_tensordict([original] * k), tu.concat_tensordict([decoded] * k))
        assert_td_equal(tu.concat_tensordict([original] * k), TensorDictCodec().merge([decoded] * k))
    # Chunks go through tensordict's lazy-stack indexing.
    for a, b in zip(tu.chunk_tensordict(original, 2), tu.chunk_tensordict(decoded, 2), strict=True):
        assert_td_equal(a, b)


def test_plugin_hit_path_gives_the_same_rows(tmp_path: Path) -> None:
    td, keys, tags = tq_sample_result(prompts=3, n=2)
    payload = {"tensordict": td, "keys": keys, "tags": tags, "global_steps": 3}
    store, _ = round_trip(tmp_path, payload)
    codec = TensorDictCodec()
    parts = [codec.decode(p) for p in store.load(store.verified(1))] * 2  # two parts, as parameter_sync_step=2
    loaded = transfer.CachedBatch.from_payloads(parts, codec.merge)
    expected = transfer.CachedBatch.from_payloads([payload, payload], codec.merge)
    assert loaded.keys == expected.keys and loaded.tags == expected.tags
    assert_td_equal(expected.data, loaded.data)
    fresh = transfer.prepare(loaded, ["u1", "u2", "u3", "u4"], 2, step=9)
    reference = transfer.prepare(expected, ["u1", "u2", "u3", "u4"], 2, step=9)
    assert fresh.plan == reference.plan
    assert_td_equal(reference.fields, fresh.fields)
    assert rows_of(fresh.fields, "uid") == ["u1", "u1", "u2", "u2", "u3", "u3", "u4", "u4"]


def test_mutating_a_loaded_batch_never_changes_the_cache(tmp_path: Path) -> None:
    original = odd_batch()
    store, decoded = round_trip(tmp_path, original)
    before = file_digests(store.step_dir(1))
    decoded.get("reward_model")[1].data["ground_truth"] = "changed"  # a shared row object, in place
    decoded.get("maybe")[0].data.append("more")
    decoded["uid"][0] = "replaced"
    decoded.get("responses").values().add_(1000)
    decoded["dense"].zero_()
    decoded["meta"] = NonTensorData({"validate": True})
    assert rows_of(decoded, "uid")[0] == "replaced" and rows_of(decoded, "uid")[1] == "uid0"
    assert file_digests(store.step_dir(1)) == before
    [payload] = store.load(store.verified(1))
    assert_td_equal(original, TensorDictCodec().decode(payload))


def test_rows_are_independent_objects_like_the_constructors() -> None:
    rows = [{"a": i} for i in range(50)] + ["s", None, torch.ones(2)]
    stack = tds.non_tensor_stack(rows)
    reference = NonTensorStack(*[NonTensorData(row) for row in rows])
    assert type(stack) is NonTensorStack and stack.batch_size == reference.batch_size
    assert set(stack.__dict__) == set(reference.__dict__) and stack.stack_dim == reference.stack_dim == 0
    for fast, slow in zip(stack.tensordicts, reference.tensordicts, strict=True):
        assert type(fast) is type(slow) and set(fast.__dict__) == set(slow.__dict__)
        assert set(fast._tensordict.__dict__) == set(slow._tensordict.__dict__)
        assert fast._tensordict.batch_size == slow._tensordict.batch_size == torch.Size([])
        assert fast.data is slow.data
    inner = {id(item._tensordict) for item in stack.tensordicts}
    keys = {id(item._tensordict._tensordict) for item in stack.tensordicts}
    assert len(inner) == len(keys) == len(rows)
    stack.tensordicts[0]._tensordict["x"] = torch.ones(())  # one row's inner dict changes, not the others'
    assert all("x" not in item._tensordict.keys() for item in stack.tensordicts[1:])


# ---------------------------------------------------------------- the regression check (mechanism, not time)


def test_decode_builds_rows_without_per_row_constructors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding N plain rows calls tensordict's validating constructors O(1) times per column, not N."""
    rows = 512
    columns = {f"c{i}": NonTensorStack(*[{"row": r % 64, "col": i} for r in range(rows)]) for i in range(4)}
    store = StepStore(tmp_path / "cache", "rollout_tq", {})
    store.save(1, TensorDictCodec().encode(TensorDict(columns, batch_size=rows)), {})
    [payload] = store.load(store.verified(1))

    calls = {"ntd": 0, "stack": 0}
    ntd_init, stack_init = NonTensorData.__init__, NonTensorStack.__init__

    def count_ntd(self: Any, *args: Any, **kwargs: Any) -> None:
        calls["ntd"] += 1
        ntd_init(self, *args, **kwargs)

    def count_stack(self: Any, *args: Any, **kwargs: Any) -> None:
        calls["stack"] += 1
        stack_init(self, *args, **kwargs)

    assert tds._stack_layout()  # checked once against the constructor before counting
    monkeypatch.setattr(NonTensorData, "__init__", count_ntd)
    monkeypatch.setattr(NonTensorStack, "__init__", count_stack)
    from skipinject.verl import codecs as results

    during: list[bool] = []
    real_decode = results.decode_tensordict
    monkeypatch.setattr(results, "decode_tensordict", lambda *a: during.append(gc.isenabled()) or real_decode(*a))
    assert gc.isenabled()
    decoded = TensorDictCodec().decode(payload)
    monkeypatch.undo()
    assert during == [False], "one GC pause covers the whole decode"
    assert gc.isenabled(), "the garbage collector is switched back on"
    assert calls["ntd"] <= len(columns) and calls["stack"] == 0, calls
    assert [row["row"] for row in tu.get(decoded, "c3")] == [r % 64 for r in range(rows)]


def test_encode_runs_under_one_gc_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    """Collections over the batch's row objects while the JSON tree grows cost more than the encode itself."""
    from skipinject.verl import codecs as results

    td = TensorDict({"x": torch.arange(8), "s": NonTensorStack(*[f"r{i}" for i in range(8)])}, batch_size=[8])
    during: list[bool] = []
    real_encode = results.encode_tensordict
    monkeypatch.setattr(results, "encode_tensordict", lambda *a: during.append(gc.isenabled()) or real_encode(*a))
    assert gc.isenabled()
    payload = TensorDictCodec().encode({"tensordict": td, "keys": ["k"] * 8})
    assert during == [False], "the encode ran with the collector paused"
    assert gc.isenabled(), "the garbage collector is switched back on"
    assert payload.rows == 8


def test_encode_reads_rows_and_plain_values_without_the_slow_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Encoding reads each row's data from its state (no tensordict ``__getattr__``) and copies plain
    JSON rows without the tagged encoder; anything else still goes through it, same output."""
    from skipinject import codecs

    stack = NonTensorStack(*[{"row": i, "v": [i, None]} for i in range(64)])
    flat: list[Any] = []
    tds._flatten_stack(stack, "x", flat)
    assert flat == [{"row": i, "v": [i, None]} for i in range(64)]

    visited = []
    enc = codecs._Encoder.enc

    def spy(self: Any, value: Any, path: str) -> Any:
        visited.append(path)
        return enc(self, value, path)

    monkeypatch.setattr(codecs._Encoder, "enc", spy)
    column = encode_column(flat, "x")
    assert visited == [] and column["plain"] and column["u"] == flat and column["u"][0] is not flat[0]
    odd = [*ODD_ROWS[:9], {"__si__": "not a tag"}]
    column = encode_column(odd, "y")
    assert {path.split("]")[0] + "]" for path in visited} == {"y[7]", "y[8]", "y[9]"} and not column["plain"]
    monkeypatch.undo()
    assert column["u"] == [to_jsonable(v) for v in odd]
