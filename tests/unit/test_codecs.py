"""Codecs without verl: TensorDict layouts, tagged JSON, columns; importing them stays cheap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from skipinject.codecs import TensorSink, decode_column, encode_column, from_jsonable, to_jsonable
from skipinject.errors import CodecError
from skipinject.store import StepStore
from skipinject.verl.codecs import TensorDictCodec
from skipinject.verl.tensordicts import non_tensor_items
from tests.codec_checks import assert_td_equal, round_trip, same
from tests.conftest import ROOT


@pytest.fixture
def store(tmp_path: Path) -> StepStore:
    return StepStore(tmp_path / "cache", "rollout", {"gbs": 2})


# ---------------------------------------------------------------- TensorDict (V1 / TransferQueue)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_tensordict_layouts(store: StepStore) -> None:
    ragged2 = torch.nested.as_nested_tensor([torch.ones(3, 2), torch.zeros(3, 5)], layout=torch.jagged)
    assert ragged2._ragged_idx == 2
    base = torch.nested.nested_tensor_from_jagged(torch.arange(10.0), offsets=torch.tensor([0, 4, 10]))
    with_lengths = torch.nested.narrow(
        base.values().view(2, 5), 1, torch.tensor([0, 1]), torch.tensor([2, 3]), layout=torch.jagged
    )
    strided = torch.nested.as_nested_tensor([torch.ones(3, 2), torch.zeros(4, 5)], layout=torch.strided)
    td = TensorDict(
        {
            "ragged2": ragged2,
            "with_lengths": with_lengths,
            "strided": strided,
            "dense": torch.arange(6).reshape(2, 3),
            "scalar_per_row": torch.tensor([1.5, 2.5]),
            "sub": TensorDict({"x": torch.ones(2, 2), "tag": NonTensorStack("a", "b")}, batch_size=2),
            "grid": NonTensorStack(NonTensorStack("a", "b"), NonTensorStack("c", "d")),
            "mixed": NonTensorStack(torch.arange(3), None),
        },
        batch_size=2,
    )
    td["meta"] = NonTensorData({"validate": False, "global_steps": 3})
    decoded = round_trip(store, 6, TensorDictCodec(), td)
    assert_td_equal(td, decoded)
    assert decoded.get("with_lengths").lengths().tolist() == [2, 3]
    assert decoded.get("grid").batch_size == (2, 2)


def test_fast_non_tensor_items_match_the_constructor() -> None:
    rows = ["a", {"k": [1]}, None, [{"role": "user"}], torch.arange(2), 3.5]
    fast = non_tensor_items(rows)
    slow = [NonTensorData(row) for row in rows]
    for f, s in zip(fast, slow, strict=True):
        assert type(f) is type(s) and set(f.__dict__) == set(s.__dict__)
        assert f._non_tensordict.keys() == s._non_tensordict.keys() and f.data is s.data
        assert f._tensordict.batch_size == s._tensordict.batch_size and f._tensordict.device == s._tensordict.device
    assert len({id(item._tensordict) for item in fast}) == len(rows)
    stack = NonTensorStack(*fast)
    assert stack.tolist()[:4] == rows[:4] and stack.batch_size == (len(rows),)


# ---------------------------------------------------------------- tagged JSON


def test_columns_dedupe_by_identity_and_scalar_value() -> None:
    shared = {"a": [1, 2]}
    equal_but_distinct = {"a": [1, 2]}
    rows = [shared, shared, equal_but_distinct, "x", "x", 1, True, 1.0]
    column = encode_column(rows, "col")
    assert len(column["u"]) == 6
    decoded = decode_column(json.loads(json.dumps(column)))
    assert same(decoded, rows)
    assert decoded[0] is decoded[1] and decoded[0] is not decoded[2]


def test_large_values_go_to_tensors_small_ones_inline() -> None:
    sink = TensorSink()
    value = {"big": np.arange(5000, dtype=np.uint16), "small": np.arange(3.0), "t": torch.ones(2, dtype=torch.bfloat16)}
    encoded = to_jsonable(value, "v", sink=sink)
    assert len(sink.tensors) == 1 and encoded["big"]["__si__"] == "ndt"
    assert same(from_jsonable(json.loads(json.dumps(encoded)), sink.tensors), value)
    with pytest.raises(CodecError, match="cannot cache v"):
        to_jsonable(torch.ones(5000), "v")  # without a tensor file, big tensors are refused


keys = st.one_of(
    st.text(max_size=5), st.integers(), st.none(), st.booleans(), st.tuples(st.integers(), st.text(max_size=2))
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(),
    st.binary(max_size=8),
    st.integers(-(2**31), 2**31 - 1).map(np.int32),
    st.floats(width=32).map(np.float32),
    st.booleans().map(np.bool_),
)
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=6), children, max_size=4),
        st.dictionaries(keys, children, max_size=3),
        st.dictionaries(st.just("__si__"), children, max_size=1),
        st.frozensets(st.integers(), max_size=3),
        st.lists(st.integers(-5, 5), max_size=6).map(lambda xs: np.array(xs, dtype=np.int64)),
        st.lists(children, max_size=3).map(lambda xs: np.fromiter(xs, dtype=object, count=len(xs))),
    ),
    max_leaves=12,
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees)
def test_jsonable_round_trip(value: Any) -> None:
    encoded = to_jsonable(value, "value")
    text = json.dumps(encoded, allow_nan=True)  # what the store writes
    assert same(from_jsonable(json.loads(text)), value)


def test_import_is_cheap() -> None:
    code = (
        "import sys, skipinject.codecs\n"
        "print(sorted(m for m in ('torch', 'numpy', 'verl', 'tensordict') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
