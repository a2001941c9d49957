"""Typed numeric arrays (token ids, logprobs, masks) inside pydantic events.

Completions run to tens of thousands of tokens, so the arrays never travel as JSON
number lists. Three representations, one type:

* in Python: a read-only little-endian ``numpy.ndarray`` of the declared dtype;
* on the wire (``schemas.codec``): a reference ``{"$blob": [offset, count]}`` into the
  frame's binary section, decoded zero-copy with ``numpy.frombuffer``;
* in plain JSON (fixtures, JSON Schema, debugging): base64 of the raw little-endian bytes.

The wire path is selected by a serialization/validation *context* carrying the blob
buffer, so the models themselves stay ignorant of the framing.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any

import numpy as np
from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

BLOB_KEY = "$blob"


class BlobWriter:
    """Collects arrays during serialization; hands back their offsets in the blob section."""

    def __init__(self) -> None:
        self.parts: list[bytes | np.ndarray] = []  # anything ``bytes.join`` takes: contiguous arrays as they are
        self.size = 0

    def add(self, arr: np.ndarray) -> list[int]:
        offset = self.size
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        self.parts.append(arr)
        self.size += arr.nbytes
        pad = -self.size % 8  # keep every array 8-byte aligned for fast zero-copy views
        if pad:
            self.parts.append(b"\0" * pad)
            self.size += pad
        return [offset, arr.shape[0]]


def _frozen(arr: np.ndarray) -> bool:
    """Read-only all the way down to immutable memory (``bytes``, or an array no one may write)."""
    if arr.flags.writeable:
        return False
    base = arr.base
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            return False
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base is None or isinstance(base, bytes)


class _ArrayAnnotation:
    def __init__(self, dtype: str, what: str) -> None:
        self.dtype = np.dtype(dtype)
        self.what = what

    def _coerce(self, value: Any, info: core_schema.ValidationInfo) -> np.ndarray:
        if isinstance(value, np.ndarray):
            arr = value
        elif isinstance(value, dict) and BLOB_KEY in value:
            blobs = (info.context or {}).get("blobs")
            if blobs is None:
                raise ValueError(f"{self.what}: blob reference outside a binary frame")
            offset, count = value[BLOB_KEY]
            end = offset + count * self.dtype.itemsize
            if offset < 0 or count < 0 or end > len(blobs):
                raise ValueError(f"{self.what}: blob reference [{offset}, {count}] outside the frame")
            return np.frombuffer(blobs, dtype=self.dtype, count=count, offset=offset)
        elif isinstance(value, str):
            try:
                raw = base64.b64decode(value, validate=True)
            except ValueError as exc:
                raise ValueError(f"{self.what}: not base64 ({exc})") from None
            if len(raw) % self.dtype.itemsize:
                raise ValueError(f"{self.what}: {len(raw)} bytes is not a whole number of {self.dtype}")
            return np.frombuffer(raw, dtype=self.dtype)
        elif isinstance(value, (list, tuple)):
            arr = np.asarray(value)
            if arr.size == 0:
                arr = arr.astype(self.dtype)
        else:
            raise ValueError(f"{self.what}: expected an array, list or base64 string, got {type(value).__name__}")
        if arr.ndim != 1:
            raise ValueError(f"{self.what}: expected a 1-D array, got shape {arr.shape}")
        if arr.dtype != self.dtype:
            if self.dtype.kind in "iu":
                if arr.size and arr.dtype.kind not in "iub":
                    raise ValueError(f"{self.what}: expected integers, got {arr.dtype}")
                info_ = np.iinfo(self.dtype)
                if arr.size and (arr.min() < info_.min or arr.max() > info_.max):
                    raise ValueError(f"{self.what}: values outside {self.dtype} range")
            arr = arr.astype(self.dtype)
        elif _frozen(arr):
            return arr  # another event's array, or a frame's view: nothing can change it, no copy needed
        else:
            arr = arr.copy()  # never alias a caller's mutable buffer
        arr.flags.writeable = False
        return arr

    def _serialize(self, arr: np.ndarray, info: core_schema.SerializationInfo) -> Any:
        if info.mode == "json":
            writer = (info.context or {}).get("blob_writer")
            if writer is not None:
                return {BLOB_KEY: writer.add(arr)}
            return base64.b64encode(np.ascontiguousarray(arr, dtype=self.dtype).tobytes()).decode("ascii")
        return arr

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.with_info_plain_validator_function(
            self._coerce,
            serialization=core_schema.plain_serializer_function_ser_schema(self._serialize, info_arg=True),
        )

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {
            "type": "string",
            "contentEncoding": "base64",
            "description": f"{self.what}: little-endian {self.dtype.name} array, base64 in JSON; "
            f"a {{'{BLOB_KEY}': [offset, count]}} reference in the binary frame",
        }


TokenIds = Annotated[np.ndarray, _ArrayAnnotation("<i4", "token ids")]
Logprobs = Annotated[np.ndarray, _ArrayAnnotation("<f4", "logprobs")]
Mask = Annotated[np.ndarray, _ArrayAnnotation("u1", "loss mask")]
