"""The binary frame every event travels in.

Layout (all integers little-endian)::

    b"RLEV"            magic
    u8   frame version (1)
    u8   len(event_type), then event_type as ASCII
    u16  schema_version
    u32  len(header)
    header             JSON of the event; arrays appear as {"$blob": [offset, count]}
    pad                zero bytes up to an 8-byte boundary
    blobs              the arrays' raw bytes, each 8-byte aligned

Type and version sit before the JSON so a reader can route, refuse a future version, or
upcast an old one without parsing the body. Arrays decode as zero-copy read-only views of
the frame: an 8,192-token step costs two ``numpy.frombuffer`` calls, not 16,384 floats parsed.
"""

from __future__ import annotations

import json
import struct

from pydantic import ValidationError

from schemas.arrays import BlobWriter
from schemas.envelope import Event
from schemas.errors import EventDecodeError, UnknownEventTypeError, UnknownSchemaVersionError
from schemas.events import EVENTS_BY_TYPE

MAGIC = b"RLEV"
FRAME_VERSION = 1
_HEAD = struct.Struct("<4sBB")
_VERSION_AND_LEN = struct.Struct("<HI")


def encode(event: Event) -> bytes:
    writer = BlobWriter()
    header = event.model_dump_json(context={"blob_writer": writer}).encode()
    kind = event.EVENT_TYPE.encode("ascii")
    prefix = _HEAD.pack(MAGIC, FRAME_VERSION, len(kind)) + kind + _VERSION_AND_LEN.pack(event.SCHEMA_VERSION, len(header))
    pad = -(len(prefix) + len(header)) % 8
    return b"".join([prefix, header, b"\0" * pad, *writer.parts])


def peek(frame: bytes | memoryview) -> tuple[str, int]:
    """Event type and schema version of a frame, without decoding its body."""
    event_type, version, _, _ = _split(memoryview(frame))
    return event_type, version


def header(frame: bytes | memoryview) -> dict:
    """A frame's JSON, not validated, arrays left as blob references: for readers that only need ids (a
    benchmark counting records); anything that acts on an event decodes it."""
    try:
        return json.loads(bytes(_split(memoryview(frame))[2]))
    except ValueError as exc:
        raise EventDecodeError(f"frame header is not JSON: {exc}") from None


def decode(frame: bytes | memoryview, expect: type[Event] | None = None) -> Event:
    """Decode a frame; raise an ``EventDecodeError`` subclass (never anything else) on bad input.

    Arrays are zero-copy views of an immutable frame (``bytes``, as Kafka delivers it). A mutable
    buffer (``bytearray``...) is copied first, so later writes to it cannot change a frozen event.
    """
    view = memoryview(frame)
    if not view.readonly:
        view = memoryview(view.tobytes())
    event_type, version, header, blobs = _split(view)
    cls = EVENTS_BY_TYPE.get(event_type)
    if cls is None:
        raise UnknownEventTypeError(f"unknown event type {event_type!r}; known: {sorted(EVENTS_BY_TYPE)}")
    if expect is not None and cls is not expect:
        raise EventDecodeError(f"expected a {expect.EVENT_TYPE} event, got {event_type!r}")
    if version > cls.SCHEMA_VERSION:
        raise UnknownSchemaVersionError(
            f"{event_type} schema version {version} is newer than this reader's {cls.SCHEMA_VERSION}; "
            "upgrade rollout-log on this service")
    if version < 1:
        raise EventDecodeError(f"{event_type} schema version {version} is not a valid version")
    context = {"blobs": blobs}
    try:
        if version == cls.SCHEMA_VERSION:
            return cls.model_validate_json(bytes(header), context=context)
        body = json.loads(bytes(header))
        for v in range(version, cls.SCHEMA_VERSION):
            upcast = cls.UPCASTERS.get(v)
            if upcast is None:
                raise EventDecodeError(f"no upcaster for {event_type} v{v} -> v{v + 1}")
            body = upcast(body)
        body["schema_version"] = cls.SCHEMA_VERSION
        return cls.model_validate(body, context=context)
    except ValidationError as exc:
        raise EventDecodeError(f"invalid {event_type} v{version}: {_summarise(exc)}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise EventDecodeError(f"invalid {event_type} v{version}: {exc}") from None


def _split(view: memoryview) -> tuple[str, int, memoryview, memoryview]:
    try:
        magic, frame_version, type_len = _HEAD.unpack_from(view, 0)
        if magic != MAGIC:
            raise EventDecodeError(f"not a rollout-log event frame (magic {bytes(magic)!r})")
        if frame_version != FRAME_VERSION:
            raise UnknownSchemaVersionError(f"frame version {frame_version} is not supported (this reader: {FRAME_VERSION})")
        pos = _HEAD.size
        event_type = bytes(view[pos:pos + type_len]).decode("ascii")
        pos += type_len
        version, header_len = _VERSION_AND_LEN.unpack_from(view, pos)
        pos += _VERSION_AND_LEN.size
    except (struct.error, UnicodeDecodeError) as exc:
        raise EventDecodeError(f"truncated or corrupt frame header: {exc}") from None
    if pos + header_len > len(view):
        raise EventDecodeError(f"frame header claims {header_len} bytes of JSON but only {len(view) - pos} remain")
    header = view[pos:pos + header_len]
    blob_start = pos + header_len + (-(pos + header_len) % 8)
    return event_type, version, header, view[blob_start:]


def _summarise(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    shown = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in errors[:3])
    return shown + (f" (+{len(errors) - 3} more)" if len(errors) > 3 else "")
