"""A result as a store :class:`~skipinject.payload.Payload` and back, without pickle: the generic parts.

A payload is plain tensors (the store's tensor file) plus a JSON tree in which every value that is not
JSON-native carries an explicit tag (:func:`to_jsonable`): loading can only build the types listed
there, and anything else is refused, naming the field, when the cache is written. verl's types are
encoded on top of these by :mod:`skipinject.verl.codecs`. Nothing imports torch or numpy at module level.
"""

from skipinject.codecs.tagged_json import from_jsonable, to_jsonable
from skipinject.codecs.tensors import TensorSink, decode_tensor, encode_tensor

__all__ = ["TensorSink", "decode_tensor", "encode_tensor", "from_jsonable", "to_jsonable"]
