"""A hit's NonTensorStacks make their per-row NonTensorData on first use (issue 13): the mechanism.

Decoding builds one ``NonTensorStack`` per column with no row objects; the first read or change of
its ``tensordicts`` makes every row (as the constructor would) and the list is a plain-behaving list
from then on. These tests assert that structure and that every list operation sees the rows.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from skipinject.errors import CodecError, CorruptCacheError
from skipinject.store import StepStore
from skipinject.verl import tensordicts as tds
from skipinject.verl.codecs import TensorDictCodec
from skipinject.verl.tensordicts import LazyRows, non_tensor_stack
from tests.codec_checks import assert_td_equal, same

ROWS: list[Any] = [{"a": 1}, "s", None, [1, 2], 3, 2.5, True, (1, "t"), torch.arange(2), {"a": 1}]


def batch(rows: int = 40) -> TensorDict:
    shared = {"style": "rule"}
    return TensorDict(
        {
            "ids": torch.arange(rows * 2).reshape(rows, 2),
            "uid": NonTensorStack(*[f"u{i // 4}" for i in range(rows)]),
            "reward_model": NonTensorStack(*[shared if i % 2 else {"n": i} for i in range(rows)]),
            "odd": NonTensorStack(*[ROWS[i % len(ROWS)] for i in range(rows)]),
        },
        batch_size=rows,
    )


def decoded(tmp_path: Path, td: TensorDict) -> TensorDict:
    store = StepStore(tmp_path / "cache", "rollout_tq", {})
    store.save(1, TensorDictCodec().encode(td), {})
    [payload] = store.load(store.verified(1))
    return TensorDictCodec().decode(payload)


def is_pending(stack: Any) -> bool:
    rows = stack.tensordicts
    return type(rows) is LazyRows and list.__len__(rows) == 0 and rows._pending is not None


def live_non_tensor_data() -> int:
    gc.collect()
    return sum(type(o) is NonTensorData for o in gc.get_objects())


def test_decode_makes_no_row_objects(tmp_path: Path) -> None:
    original = batch(200)
    before = live_non_tensor_data()
    td = decoded(tmp_path, original)
    assert live_non_tensor_data() - before < 10  # the encode/decode left no per-row objects (3 x 200 rows)
    for key in ("uid", "reward_model", "odd"):
        stack = td.get(key)
        assert type(stack) is NonTensorStack and stack.batch_size == (200,) and stack.stack_dim == 0
        assert is_pending(stack), key
        assert len(stack.tensordicts) == 200 and is_pending(stack)  # len() answers without making rows
    assert type(td) is TensorDict and td.batch_size == (200,)
    assert set(td.__dict__) <= set(original.__dict__)
    td.get("uid").tolist()  # the first read makes that column's rows, and only that column's
    assert type(td.get("uid").tensordicts) is tds._Rows and is_pending(td.get("odd"))
    assert live_non_tensor_data() - before >= 200
    assert_td_equal(original, td)


def test_rows_made_on_first_use_are_the_constructors() -> None:
    stack = non_tensor_stack(ROWS)
    reference = NonTensorStack(*[NonTensorData(row) for row in ROWS])
    assert list(stack.__dict__) == list(reference.__dict__)  # the constructor's attributes, in its order
    assert stack.batch_size == reference.batch_size and is_pending(stack)
    items = stack.tensordicts
    first = items[0]
    assert type(items) is tds._Rows and list.__len__(items) == len(ROWS) and items._pending is None
    assert items[0] is first  # made once
    for fast, slow in zip(items, reference.tensordicts, strict=True):
        assert type(fast) is type(slow) and list(fast.__dict__) == list(slow.__dict__)  # same keys, same order
        assert list(fast._tensordict.__dict__) == list(slow._tensordict.__dict__)
        assert type(fast._tensordict._tensordict) is type(slow._tensordict._tensordict)
        assert list(fast._non_tensordict) == list(slow._non_tensordict)
        assert fast.batch_size == slow.batch_size == torch.Size([]) and same(fast.data, slow.data)
    assert len({id(item._tensordict) for item in items}) == len(ROWS)  # rows stay independent
    items[1]._tensordict["x"] = torch.ones(())
    assert all("x" not in item._tensordict.keys() for item in items if item is not items[1])


OPERATIONS: dict[str, Callable[[list[Any]], Any]] = {
    "iter": lambda x: list(iter(x)),
    "getitem": lambda x: x[3],
    "slice": lambda x: x[1:7:2],
    "negative": lambda x: x[-1],
    "reversed": lambda x: list(reversed(x)),
    "contains": lambda x: x[0] in x,
    "eq_plain": lambda x: x == list(x),
    "plain_eq": lambda x: list(x) == x,
    "lt": lambda x: x < x + [1],  # noqa: RUF005  # list concatenation is what is tested
    "add": lambda x: x + [None],  # noqa: RUF005
    "radd": lambda x: [None] + x,  # noqa: RUF005
    "mul": lambda x: x * 2,
    "rmul": lambda x: 2 * x,
    "iadd": lambda x: x.__iadd__([None]),
    "tuple": tuple,
    "list": list,
    "star": lambda x: (lambda *a: a)(*x),
    "extend_into": lambda x: [0, *x],
    "zip": lambda x: list(zip(x, range(100), strict=False)),
    "enumerate": lambda x: list(enumerate(x)),
    "count": lambda x: x.count(x[2]),
    "index": lambda x: x.index(x[4]),
    "copy": lambda x: x.copy(),
    "copy.copy": copy.copy,
    "pop": lambda x: (x.pop(), list(x)),
    "append": lambda x: (x.append(None), list(x)),
    "insert": lambda x: (x.insert(0, None), list(x)),
    "remove": lambda x: (x.remove(x[1]), list(x)),
    "reverse": lambda x: (x.reverse(), list(x)),
    "setitem": lambda x: (x.__setitem__(0, None), list(x)),
    "delitem": lambda x: (x.__delitem__(slice(0, 2)), list(x)),
    "clear": lambda x: (x.clear(), list(x)),
    "sort": lambda x: (x.sort(key=lambda item: repr(item.data)), list(x)),
    "bool": bool,
    "len": len,
}


def normalise(value: Any) -> Any:
    """Items replaced by their data (the two sides hold different but equal NonTensorData)."""
    if isinstance(value, NonTensorData):
        return ("ntd", repr(value.data))
    if isinstance(value, (list, tuple)):  # a list subclass (the lazy list itself, from +=) as a list
        return isinstance(value, list), [normalise(v) for v in value]
    return value


@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_every_list_operation_sees_the_rows(name: str) -> None:
    lazy = non_tensor_stack(ROWS).tensordicts
    plain = [NonTensorData(row) for row in ROWS]
    assert type(lazy) is LazyRows
    got, want = OPERATIONS[name](lazy), OPERATIONS[name](plain)
    assert normalise(got) == normalise(want)
    if name not in ("len", "bool"):
        assert type(lazy) is tds._Rows and normalise(list(lazy)) == normalise(list(plain))


@pytest.mark.parametrize(
    "clone", [copy.copy, copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))], ids=["copy", "deepcopy", "pickle"]
)
def test_copies_and_pickles_are_plain_lists(clone: Callable[[Any], Any]) -> None:
    unread, read = non_tensor_stack(ROWS).tensordicts, non_tensor_stack(ROWS).tensordicts
    read.index(read[0])  # reading makes the rows
    assert type(unread) is LazyRows and type(read) is tds._Rows
    for rows in (unread, read):
        out = clone(rows)
        assert type(out) is list and [normalise(i) for i in out] == [normalise(NonTensorData(r)) for r in ROWS]


def test_torch_save_of_a_hit_holds_no_skipinject_type(tmp_path: Path) -> None:
    td = decoded(tmp_path, batch())
    buffer = io.BytesIO()
    torch.save(td, buffer)
    assert b"skipinject" not in buffer.getvalue()
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert type(loaded.get("uid").tensordicts) is list
    assert_td_equal(batch(), loaded)


def test_concurrent_first_reads_make_the_rows_once() -> None:
    stack = non_tensor_stack([{"i": i} for i in range(2000)])
    seen: list[list[int]] = []
    barrier = threading.Barrier(4)

    def read() -> None:
        barrier.wait()
        seen.append([id(item) for item in stack.tensordicts])

    threads = [threading.Thread(target=read) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 4 and all(ids == seen[0] for ids in seen) and len(set(seen[0])) == 2000


def test_saving_an_unread_hit_reuses_the_decoded_rows(tmp_path: Path) -> None:
    original = batch()
    td = decoded(tmp_path, original)
    again = TensorDictCodec().encode(td)
    assert all(is_pending(td.get(key)) for key in ("uid", "reward_model", "odd"))  # no rows were made
    assert again.objects == TensorDictCodec().encode(original).objects


def test_a_column_that_disagrees_with_the_batch_size_is_refused(tmp_path: Path) -> None:
    """Skipping the constructor's validation never lets a forged batch size through."""
    payload = TensorDictCodec().encode(batch(8))
    payload.objects["td"]["batch_size"] = [9]
    with pytest.raises((CodecError, CorruptCacheError, RuntimeError)):
        TensorDictCodec().decode(payload)
    payload = TensorDictCodec().encode(TensorDict({"uid": NonTensorStack(*"abcd")}, batch_size=4))
    payload.objects["td"]["batch_size"] = [3]
    with pytest.raises((CodecError, CorruptCacheError, RuntimeError)):
        TensorDictCodec().decode(payload)
