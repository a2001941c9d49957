"""A consumer group's committed offsets, where "none committed" never stands in for an error.

aiokafka 0.14's ``AIOKafkaConsumer.committed()`` reads the partitions of an OffsetFetch (v2+) response but not
its top-level error code. A group coordinator that is shutting down, moving or still loading its offsets
after a restart answers with that error and no partitions, and ``committed()`` returns None, "no commit",
for every partition. A new owner that trusts it starts from the beginning and does again what the previous
owner committed: seen as 120 doubled scores when a broker restarted right as a verifier took partitions over
(tests/test_eos_kill.py). Here the whole answer is checked and a retriable error is asked again.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka import errors as Errors
from aiokafka.protocol.commit import OffsetFetchRequest

# the coordinator is elsewhere, or not ready: find it again and ask again
_MOVED = (Errors.NotCoordinatorForGroupError, Errors.GroupCoordinatorNotAvailableError)


async def committed(consumer: AIOKafkaConsumer, tps: list[TopicPartition], *, timeout_s: float = 120.0
                    ) -> dict[TopicPartition, int | None]:
    """Partition -> the group's committed offset (None: nothing committed), from an answer without errors."""
    coordinator = consumer._coordinator  # aiokafka's group coordinator client: the group's connection
    by_topic: dict[str, list[int]] = defaultdict(list)
    for tp in tps:
        by_topic[tp.topic].append(tp.partition)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await coordinator.ensure_coordinator_known()
            response = await coordinator._send_req(OffsetFetchRequest(consumer._group_id, list(by_topic.items())))
            return _parse(response)
        except Errors.KafkaError as e:
            if not e.retriable or time.monotonic() > deadline:
                raise
            if isinstance(e, _MOVED):
                coordinator.coordinator_dead()
            await asyncio.sleep(0.2)


def _parse(response) -> dict[TopicPartition, int | None]:
    top = getattr(response, "error_code", 0)  # v2+: a group-level error comes with no partitions
    if top:
        raise Errors.for_code(top)()
    out: dict[TopicPartition, int | None] = {}
    for topic, partitions in response.topics:
        for partition, offset, _metadata, error_code in partitions:
            if error_code:
                raise Errors.for_code(error_code)()
            out[TopicPartition(topic, partition)] = None if offset < 0 else offset
    return out
