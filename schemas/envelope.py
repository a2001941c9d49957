"""The envelope every event shares, and the base class that makes events immutable."""

from __future__ import annotations

import hashlib
import os
import random
from datetime import UTC, datetime
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

# Upcasters turn the JSON body of version N into version N+1, keyed by N. A reader of
# version V decodes any N <= V by applying them in order; N > V is refused, never guessed.
Upcaster = Any  # Callable[[dict[str, Any]], dict[str, Any]]


# Ids only need to be unique, not unpredictable: a Mersenne Twister seeded from the OS (again in every forked
# child) gives the same 32-hex-digit version-4 UUIDs as ``uuid.uuid4().hex`` at ~0.4 µs instead of ~1.5 µs
# (a getrandom system call each); every output event of every service draws one.
_ids = random.Random(os.urandom(32))
os.register_at_fork(after_in_child=lambda: _ids.seed(os.urandom(32)))
_UUID4_CLEAR = ~((0xF << 76) | (0x3 << 62))  # version and variant bits
_UUID4_SET = (0x4 << 76) | (0x2 << 62)


def new_id() -> str:
    return f"{_ids.getrandbits(128) & _UUID4_CLEAR | _UUID4_SET:032x}"


def utcnow() -> datetime:
    return datetime.now(UTC)


class Record(BaseModel):
    """A frozen value object that may hold numpy arrays (compared by content)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True,
                              ser_json_bytes="base64", val_json_bytes="base64")

    def __eq__(self, other: object) -> bool:
        if type(self) is not type(other):
            return NotImplemented
        return all(_same(getattr(self, k), getattr(other, k)) for k in type(self).model_fields)

    __hash__ = None  # type: ignore[assignment]  # arrays are not hashable; use ids


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and a.tobytes() == b.tobytes())  # bit-exact, NaN included
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


class Event(Record):
    """Envelope fields shared by every event on the log.

    ``event_type`` and ``schema_version`` are class constants written into every instance, so a
    reader can route and upcast without guessing. ``causation_id`` is the event this one was
    derived from (a score's rollout event, a batch's first record...), which is what lets a
    replay walk lineage backwards.
    """

    EVENT_TYPE: ClassVar[str] = ""
    SCHEMA_VERSION: ClassVar[int] = 1
    UPCASTERS: ClassVar[dict[int, Upcaster]] = {}

    event_id: str = Field(default_factory=new_id, min_length=1)
    event_type: str = ""
    schema_version: int = 0
    run_id: str = Field(min_length=1)
    producer: str = Field(min_length=1, description="service or process identity that wrote the event")
    created_at: datetime = Field(default_factory=utcnow)
    causation_id: str | None = None

    @model_validator(mode="after")
    def _stamp_type_and_version(self) -> Event:
        # Stamp the class constants; a value read from the wire must agree with them.
        if self.event_type == self.EVENT_TYPE and self.schema_version == self.SCHEMA_VERSION:
            return self  # what every decoded event carries: nothing to do
        for name, want in (("event_type", self.EVENT_TYPE), ("schema_version", self.SCHEMA_VERSION)):
            got = getattr(self, name)
            if got in ("", 0):
                object.__setattr__(self, name, want)
            elif got != want:
                raise ValueError(f"{type(self).__name__}.{name} is {got!r}, expected {want!r}")
        return self


class SourceEvent(Record):
    """An event of another run that a derived event was computed from (``schemas.history``): where it sits on
    the log, and its bytes' digest."""

    run_id: str = Field(min_length=1)
    topic: str = Field(min_length=1, description="the full topic name, source prefix included")
    partition: int = Field(ge=0)
    offset: int = Field(ge=0)
    digest: str = Field(description="sha256 of the record's value bytes as they sit on the log")

    @classmethod
    def of(cls, run_id: str, topic: str, partition: int, offset: int, value: bytes) -> SourceEvent:
        return cls(run_id=run_id, topic=topic, partition=partition, offset=offset,
                   digest=hashlib.sha256(value).hexdigest())
