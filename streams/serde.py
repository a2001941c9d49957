"""Events to Kafka messages and back: value, key and headers.

Keys decide co-location, so they are chosen here, once:

* Step, Rollout, RolloutScored and RolloutReferenced are keyed by ``root_group_id``: an episode's steps, its
  rollout, the rest of its group and its sub-episodes land on the same partition number of
  every such topic (all have the same partition count and the default murmur2 partitioner),
  so the verifier and credit assignment see a group whole from one partition.
* TrainingRecord by ``record_id``; PolicyRevision by family; TrainerBatch by target family;
  DeadLetter by the originating topic; the admissions ledger's events by ``claim_id``.

Headers repeat the event type and schema version so a consumer (or a person with
kafka-console-consumer) can route or refuse a message without decoding its body.
"""

from __future__ import annotations

from typing import Any

from schemas import codec
from schemas.admission import (AdmissionClaim, AdmissionDone, AdmissionRebase, AdmissionRefund, AdmissionRelease,
                              AdmissionRenew)
from schemas.envelope import Event
from schemas.errors import EventDecodeError
from schemas.events import DeadLetter, Rollout, RolloutReferenced, RolloutScored, Step, TrainerBatch, TrainingRecord
from schemas.policy import PolicyRevision

Headers = list[tuple[str, bytes]]


def key_for(event: Event) -> bytes:
    match event:
        case Step() | Rollout() | RolloutScored() | RolloutReferenced():
            key = event.root_group_id
        case TrainingRecord():
            key = event.record_id
        case PolicyRevision():
            key = event.family
        case TrainerBatch():
            key = event.family
        case DeadLetter():
            key = event.origin_topic
        case AdmissionClaim() | AdmissionDone() | AdmissionRenew() | AdmissionRelease():
            key = event.claim_id
        case AdmissionRefund():
            key = event.group_id
        case AdmissionRebase():
            key = event.family
        case _:
            raise TypeError(f"no partitioning key defined for {type(event).__name__}")
    return key.encode()


def headers_for(event: Event) -> Headers:
    return [("event_type", event.EVENT_TYPE.encode()), ("schema_version", str(event.SCHEMA_VERSION).encode()),
            ("run_id", event.run_id.encode())]


def to_message(event: Event) -> tuple[bytes, bytes, Headers]:
    """(key, value, headers) ready for ``producer.send(topic, value=..., key=..., headers=...)``."""
    return key_for(event), codec.encode(event), headers_for(event)


def from_message(value: bytes | None, expect: type[Event] | None = None) -> Event:
    """Decode a message value; raises ``EventDecodeError`` (dead-letter it) on anything malformed."""
    if value is None:
        raise EventDecodeError("message has no value (a tombstone?)")
    return codec.decode(value, expect)


def header(headers: Any, name: str) -> str | None:
    for k, v in headers or ():
        if k == name:
            return v.decode(errors="replace") if v is not None else None
    return None
