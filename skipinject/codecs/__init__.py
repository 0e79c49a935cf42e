"""A result as a store :class:`~skipinject.payload.Payload` and back, without pickle: the generic parts.

A payload is plain tensors (the store's raw tensor file, mapped copy-on-write when loaded) plus a
JSON tree. Everything that is not a plain tensor goes into the tree with explicit tags, so loading a
cache can only ever build the types listed here; anything else is refused with a :class:`CodecError`
naming the field when the cache is *written*, never guessed at when it is read.

Tagged JSON (see :func:`to_jsonable`): JSON-native values stay as they are; everything else is a
dict ``{"__si__": kind, ...}``. A plain dict that happens to use the key ``"__si__"`` is itself
tagged, so the encoding is unambiguous.

Per-row columns (numpy object arrays, ``NonTensorStack``) are stored as unique values plus an index
list when rows repeat: GRPO repeats every prompt ``n`` times, and ``np.repeat`` repeats the *same*
object, so deduplicating by identity (and by value for immutable scalars) shrinks the tree ~n-fold
and decodes to the same sharing the original had.

verl's result types (``DataProto``, TensorDicts) are encoded by :mod:`skipinject.verl.codecs` on top
of these. Nothing here imports torch, numpy, verl or tensordict at module level: ``import skipinject``
happens in every process verl starts and must stay cheap.
"""

from skipinject.codecs.tagged_json import from_jsonable, to_jsonable
from skipinject.codecs.tensors import TensorSink, decode_tensor, encode_tensor

__all__ = ["TensorSink", "decode_tensor", "encode_tensor", "from_jsonable", "to_jsonable"]
