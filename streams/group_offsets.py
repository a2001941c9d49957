"""A consumer group's committed offsets, where "none committed" never stands in for an error.

aiokafka 0.14's ``AIOKafkaConsumer.committed()`` reads the partitions of an OffsetFetch (v2+) response but not
its top-level error code. A group coordinator that is shutting down, moving or still loading its offsets
after a restart answers with that error and no partitions, and ``committed()`` returns None, "no commit",
for every partition. A new owner that trusts it starts from the beginning and does again what the previous
owner committed: seen as 120 doubled scores when a broker restarted right as a verifier took partitions over
(tests/test_eos_kill.py). Here the whole answer is checked and a retriable error is asked again.

The fetch is OffsetFetch v7 with ``require_stable`` (KIP-447): while another member's transaction that commits
offsets of these partitions is still open, the coordinator answers UNSTABLE_OFFSET_COMMIT and the fetch asks
again, so a new owner starts where the previous owner's last transaction, committed or aborted, left off.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka import errors as Errors
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Boolean, CompactArray, CompactString, Int16, Int32, Int64, Schema, TaggedFields

UNSTABLE_OFFSET_COMMIT = 88  # aiokafka 0.14 does not know it


class Unstable(Errors.KafkaError):
    """Offsets of these partitions are pending in an open transaction: ask again once it ends."""

    retriable = True


def per_topic(partitions: Any) -> CompactArray:
    """The flexible-version ``topics`` array of the group APIs: each topic's name, its ``partitions`` (a field
    type: the per-partition struct, or the partition numbers alone) and tagged fields."""
    return CompactArray(("name", CompactString("utf-8")), ("partitions", partitions), ("tags", TaggedFields))


def partition_struct(*fields: tuple[str, Any]) -> CompactArray:
    """A flexible-version array of per-partition structs: ``fields``, then tagged fields."""
    return CompactArray(*fields, ("tags", TaggedFields))


class OffsetFetchResponse_v7(Response):
    API_KEY = 9
    API_VERSION = 7
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("topics", per_topic(partition_struct(
            ("partition_index", Int32), ("committed_offset", Int64), ("committed_leader_epoch", Int32),
            ("metadata", CompactString("utf-8")), ("error_code", Int16)))),
        ("error_code", Int16),
        ("tags", TaggedFields),
    )


class OffsetFetchRequest_v7(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 9
    API_VERSION = 7
    RESPONSE_TYPE = OffsetFetchResponse_v7
    SCHEMA = Schema(
        ("group_id", CompactString("utf-8")),
        ("topics", per_topic(CompactArray(Int32))),
        ("require_stable", Boolean),
        ("tags", TaggedFields),
    )


class OffsetFetchRequest(Request[OffsetFetchRequest_v7]):
    API_KEY = 9

    def __init__(self, group_id: str, topics: list[tuple[str, list[int]]], require_stable: bool) -> None:
        self.args = (group_id, [(t, ps, {}) for t, ps in topics], require_stable, {})

    def build(self, request_struct_class: type[OffsetFetchRequest_v7]) -> OffsetFetchRequest_v7:
        return request_struct_class(*self.args)


# the coordinator is elsewhere, or not ready: find it again and ask again
_MOVED = (Errors.NotCoordinatorForGroupError, Errors.GroupCoordinatorNotAvailableError)


async def committed(consumer: AIOKafkaConsumer, tps: list[TopicPartition], *, timeout_s: float = 120.0,
                    stable: bool = True) -> dict[TopicPartition, int | None]:
    """Partition -> the group's committed offset (None: nothing committed), from an answer without errors.

    ``stable``: wait while a transaction holds offsets of these partitions (a new owner must); without it, the
    offsets of committed transactions only (a check that must not wait on a transaction it is looking for)."""
    coordinator = consumer._coordinator  # aiokafka's group coordinator client: the group's connection
    by_topic: dict[str, list[int]] = defaultdict(list)
    for tp in tps:
        by_topic[tp.topic].append(tp.partition)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await coordinator.ensure_coordinator_known()
            response = await coordinator._send_req(OffsetFetchRequest(consumer._group_id, list(by_topic.items()),
                                                                      stable))
            return _parse(response)
        except Errors.KafkaError as e:
            if not e.retriable or time.monotonic() > deadline:
                raise
            if isinstance(e, _MOVED):
                coordinator.coordinator_dead()
            await asyncio.sleep(0.2)


def _error(code: int) -> Errors.KafkaError:
    return Unstable() if code == UNSTABLE_OFFSET_COMMIT else Errors.for_code(code)()


def _parse(response: OffsetFetchResponse_v7) -> dict[TopicPartition, int | None]:
    if response.error_code:  # a group-level error comes with no partitions
        raise _error(response.error_code)
    out: dict[TopicPartition, int | None] = {}
    for topic, partitions, _ in response.topics:
        for partition, offset, _epoch, _metadata, error_code, _ in partitions:
            if error_code:
                raise _error(error_code)
            out[TopicPartition(topic, partition)] = None if offset < 0 else offset
    return out
