"""Records read back by their offsets: what a service committed once and needs again (a trainer's take-over
re-trains the batches committed after its last training state).

Read ``read_committed`` and without a consumer group, so an aborted transaction's records are never returned and
no group's offsets move.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

POLL_MS = 500


async def records_at(client_kwargs: Mapping[str, Any], topic: str, partition: int, offsets: list[int], *,
                     timeout_s: float = 60.0) -> list[Any]:
    """The records of ``topic[partition]`` at ``offsets``, in the order given; those no longer there (removed by
    retention, or never committed) are left out, so a caller compares the count."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    if not offsets:
        return []
    wanted, last = set(offsets), max(offsets)
    tp = TopicPartition(topic, partition)
    consumer = AIOKafkaConsumer(**client_kwargs, group_id=None, enable_auto_commit=False,
                                isolation_level="read_committed", auto_offset_reset="earliest")
    await consumer.start()
    found: dict[int, Any] = {}
    try:
        consumer.assign([tp])
        consumer.seek(tp, min(offsets))
        end = (await consumer.end_offsets([tp]))[tp]
        deadline = asyncio.get_running_loop().time() + timeout_s
        while await consumer.position(tp) <= min(last, end - 1):
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{topic}[{partition}]: offsets up to {last} not read in {timeout_s:.0f}s")
            for recs in (await consumer.getmany(tp, timeout_ms=POLL_MS)).values():
                found.update((r.offset, r) for r in recs if r.offset in wanted)
    finally:
        await consumer.stop()
    return [found[o] for o in offsets if o in found]
