"""Comparisons shared by the codec tests of both tiers (no verl here)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from skipinject.store import StepStore


def same(a: Any, b: Any) -> bool:
    """Deep equality that also requires equal types (tuple is not list) and treats nan as nan."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float | np.floating):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, set | frozenset):
        return a == b
    if isinstance(a, np.ndarray):
        return (
            a.dtype == b.dtype and a.shape == b.shape and all(same(x, y) for x, y in zip(a.flat, b.flat, strict=True))
        )
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def assert_td_equal(a: TensorDict, b: TensorDict) -> None:
    assert type(b) is TensorDict and a.batch_size == b.batch_size
    assert sorted(a.keys()) == sorted(b.keys())
    for key in a.keys():
        x, y = a.get(key), b.get(key)
        assert type(x) is type(y), key
        if isinstance(x, NonTensorStack):
            assert x.batch_size == y.batch_size and same(x.tolist(), y.tolist()), key
        elif isinstance(x, NonTensorData):
            assert same(x.data, y.data) and x.batch_size == y.batch_size, key
        elif isinstance(x, TensorDict):
            assert_td_equal(x, y)
        elif x.is_nested:
            assert y.is_nested and x.layout == y.layout and x.dtype == y.dtype, key
            assert getattr(x, "_ragged_idx", None) == getattr(y, "_ragged_idx", None), key
            xs, ys = x.unbind(), y.unbind()
            assert len(xs) == len(ys) and all(same(p, q) for p, q in zip(xs, ys, strict=True)), key
        else:
            assert same(x, y), key


def round_trip(store: StepStore, step: int, codec: Any, result: Any) -> Any:
    store.save(step, codec.encode(result), {})
    [payload] = store.load(store.verified(step))
    return codec.decode(payload)
