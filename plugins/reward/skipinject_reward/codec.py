"""How the trainer's reward of a step is cached: ``(reward_tensor, reward_extra_infos_dict)``.

That pair is what verl's reward functions return to ``RayPPOTrainer.fit`` (``extract_reward`` from
0.7.1 on, ``compute_reward`` before). The tensor goes to the tensor file; the extra infos (numpy
arrays or lists per key) to skipinject's tagged JSON, so loading never runs code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skipinject import (
    Call,
    CodecError,
    CodecHeader,
    Payload,
    TensorSink,
    decode_tensor,
    encode_tensor,
    from_jsonable,
    to_jsonable,
)

CODEC = "skipinject_reward"
CODEC_VERSION = 1
HEADER = CodecHeader(CODEC, CODEC_VERSION)


def batch_of(call: Call) -> Any:
    """The batch argument (``batch`` of extract_reward, ``data`` of compute_reward)."""
    for name in ("batch", "data"):
        value = call.argument(name)
        if value is not None:
            return value
    return call.batch


class RewardCodec:
    """``(tensor, dict)`` to a payload and back; a loaded reward must fit the call's batch."""

    name = CODEC

    def encode(self, result: Any) -> Payload:
        if not isinstance(result, tuple) or len(result) != 2 or not isinstance(result[1], Mapping):
            raise CodecError(f"expected (reward_tensor, reward_extra_infos_dict), got {type(result).__qualname__}")
        reward, extra = result
        sink = TensorSink()
        objects = {
            **HEADER.fields(),
            "reward": encode_tensor(reward, "reward_tensor", sink),
            "extra": to_jsonable(dict(extra), "reward_extra_infos_dict", sink=sink),
        }
        return Payload(tensors=sink.tensors, objects=objects, rows=int(reward.shape[0]) if reward.dim() else None)

    def decode(self, payload: Payload, call: Call) -> tuple[Any, dict[str, Any]]:
        objects = payload.objects
        HEADER.check(objects)
        reward = decode_tensor(objects["reward"], payload.tensors)
        extra = from_jsonable(objects["extra"], payload.tensors)
        if not isinstance(extra, dict):
            raise CodecError("cached reward extra infos are not a dict")
        expected = _expected_shape(batch_of(call))
        if expected is not None and tuple(reward.shape) != expected:
            raise CodecError(
                f"cached reward tensor has shape {tuple(reward.shape)}, this step's responses are {expected} "
                "(other batch size or response length)"
            )
        return reward, extra


def _expected_shape(batch: Any) -> tuple[int, ...] | None:
    tensors = getattr(batch, "batch", None)
    if tensors is None:
        return None
    keys = tensors.keys()
    for name in ("rm_scores", "responses", "response_mask"):
        if name in keys:
            return tuple(tensors[name].shape)
    return None
