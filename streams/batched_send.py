"""A transaction's messages sent a partition at a time: aiokafka's ``send_batch`` instead of ``send``.

``AIOKafkaProducer.send`` costs ~14 µs of CPU a record in a transaction (a future, the partitioner and the
accumulator, per record); appending to one ``BatchBuilder`` per output partition and sending each with
``send_batch`` costs ~9-10 µs (``python -m benchmarks send``, benchmarks/RESULTS.md). Same records in the same
partitions, in the same order within each: a keyed message goes where ``send`` puts it (murmur2 of the key
over the topic's partitions, the Java client's default partitioner), and a message larger than
``max_request_size`` is refused before anything is sent, with the error ``send`` raises.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.record.default_records import DefaultRecordBatchBuilder

_PARTITIONER = DefaultPartitioner()


@dataclass(frozen=True)
class Written:
    """Where a batch went: ``offset`` is the offset of its last record."""

    topic: str
    partition: int
    offset: int


class PartitionBatches:
    """``await add(...)`` every message, ``await send()``, then ``await written()`` for where they went (after
    whatever else the transaction does before its records must be acknowledged)."""

    def __init__(self, producer: AIOKafkaProducer, max_request_size: int) -> None:
        self.producer = producer
        self.max_request_size = max_request_size
        self._partitions: dict[str, list[int]] = {}
        self._by_key: dict[tuple[str, bytes], int] = {}
        self._open: dict[tuple[str, int], tuple[Any, int]] = {}  # (topic, partition) -> (builder, last offset)
        self._sent: list[tuple[asyncio.Future, str, int, int]] = []

    async def add(self, topic: str, value: bytes | None, *, key: bytes | None = None,
                  headers: list[tuple[str, bytes]] | None = None, partition: int | None = None) -> None:
        headers = [] if headers is None else headers  # the record builder takes a list, nothing else
        size = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers)
        if size > self.max_request_size:
            raise MessageSizeTooLargeError(
                f"The message is {size} bytes when serialized which is larger than the maximum request size you "
                "have configured with the max_request_size configuration")
        if partition is None:
            partition = await self._partition(topic, key)
        entry = self._open.get((topic, partition))
        builder = entry[0] if entry is not None else self.producer.create_batch()
        md = builder.append(key=key, value=value, timestamp=None, headers=headers)
        if md is None:  # full: it goes now, this message starts the next one (a first record always fits)
            await self._send(topic, partition, builder, entry[1])  # type: ignore[index]
            builder = self.producer.create_batch()
            md = builder.append(key=key, value=value, timestamp=None, headers=headers)
        self._open[topic, partition] = (builder, md.offset)

    async def _partition(self, topic: str, key: bytes | None) -> int:
        """Where ``send`` would put the record (for a key: once per transaction, a group's records share one)."""
        partition = self._by_key.get((topic, key))
        if partition is None:
            parts = self._partitions.get(topic)
            if parts is None:
                parts = self._partitions[topic] = sorted(await self.producer.partitions_for(topic))
            partition = _PARTITIONER(key, parts, parts)
            if key is not None:  # no key: a partition drawn at random each time, as send does
                self._by_key[topic, key] = partition
        return partition

    async def _send(self, topic: str, partition: int, builder: Any, last: int) -> None:
        fut = await self.producer.send_batch(builder, topic, partition=partition)
        self._sent.append((fut, topic, partition, last))

    async def send(self) -> None:
        for (topic, partition), (builder, last) in self._open.items():
            await self._send(topic, partition, builder, last)
        self._open.clear()

    async def written(self) -> list[Written]:
        """Once the broker has acknowledged every batch: one entry a batch, in the order they were sent (the
        last one of a partition holds its highest offset)."""
        metadata = await asyncio.gather(*(fut for fut, *_ in self._sent))
        return [Written(topic, partition, md.offset + last)
                for md, (_, topic, partition, last) in zip(metadata, self._sent)]
