"""How a ``compute_advantage`` result is cached: only the fields the call adds, never the batch.

``compute_advantage(data, ...)`` returns ``data`` itself with ``advantages`` and ``returns`` set.
The rest of the batch belongs to the current step (this run's uids, log-probs, metrics), so the
cache keeps just those two tensors; a hit puts them into *this* call's batch (see
:func:`skipinject_advantage.role.merge_into_batch`), after checking they fit it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from skipinject import Call, CodecError, CodecHeader, Payload, TensorSink, decode_tensor, encode_tensor

CODEC = "skipinject_advantage"
CODEC_VERSION = 1
HEADER = CodecHeader(CODEC, CODEC_VERSION)
#: What compute_advantage adds to the batch, whatever the estimator.
FIELDS = ("advantages", "returns")


def batch_of(call: Call) -> Any:
    """The ``data`` argument of a ``compute_advantage`` call."""
    data = call.argument("data")
    return call.batch if data is None else data


def response_mask_of(data: Any) -> Any:
    """The batch's response mask, computed as compute_advantage itself would when it is missing."""
    tensors = data.batch
    keys = tensors.keys()  # TensorDict refuses ``in`` on itself
    if "response_mask" in keys:
        return tensors["response_mask"]
    from verl.trainer.ppo.ray_trainer import compute_response_mask

    return compute_response_mask(data)


class AdvantageCodec:
    """Saves ``advantages``/``returns`` of the returned batch; loads them checked against the call's batch."""

    name = CODEC

    def encode(self, result: Any) -> Payload:
        tensors = getattr(result, "batch", None)
        keys = () if tensors is None else tensors.keys()
        missing = [f for f in FIELDS if f not in keys]
        if missing:
            raise CodecError(f"compute_advantage returned a batch without {', '.join(missing)}; nothing to cache")
        assert tensors is not None  # FIELDS is not empty: a result without a batch was refused above
        sink = TensorSink()
        fields = {name: encode_tensor(tensors[name], name, sink) for name in FIELDS}
        objects = {**HEADER.fields(), "fields": fields}
        return Payload(tensors=sink.tensors, objects=objects, rows=len(result))

    def decode(self, payload: Payload, call: Call) -> dict[str, Any]:
        """The cached fields, after checking they have the shape of this call's response mask."""
        objects = payload.objects
        HEADER.check(objects)
        fields = objects.get("fields")
        if not isinstance(fields, Mapping) or set(fields) != set(FIELDS):
            raise CodecError(f"cache does not hold exactly {FIELDS}")
        loaded = {name: decode_tensor(fields[name], payload.tensors) for name in FIELDS}
        data = batch_of(call)
        if getattr(data, "batch", None) is None:
            raise CodecError("compute_advantage was called without a tensor batch")
        expected = tuple(response_mask_of(data).shape)
        for name, tensor in loaded.items():
            if tuple(tensor.shape) != expected:
                raise CodecError(
                    f"cached {name} has shape {tuple(tensor.shape)}, this step's batch has {expected} "
                    "(other batch size or response length)"
                )
        return loaded
