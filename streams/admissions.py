"""The admissions ledger's clients: the arenas' one shared admission bound, kept on the log itself.

``KafkaLedger`` reads the admissions topic whole (one partition, read_committed, no consumer group) and folds it
into a ``schemas.admission.AdmissionBook``; ``append`` writes an event and, for a claim, reads up to the claim's own
offset, so the book then says whether it was granted. ``MemoryLedger`` is the same book over a list, for an arena
without Kafka (one process, nobody to share the bound with). No coordinator: every arena folds the same records
in the same order to the same grants; a claim's log timestamp (the broker's: LogAppendTime) times its lease.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from schemas import codec
from schemas.admission import ADMISSION_EVENTS, AdmissionBook, AdmissionClaim, AdmissionRenew
from schemas.envelope import Event
from schemas.errors import EventDecodeError
from streams import topics
from streams.aiokafka_internals import stop_consumer
from streams.serde import to_message


LOG_APPEND_TIME = 1  # a record's timestamp type when the broker stamped it (RecordMetadata.timestamp_type)


class NotBrokerTimed(RuntimeError):
    """The admissions topic does not stamp records with the broker's time: leases cannot be trusted."""


class MemoryLedger:
    """The book over an in-process list (its clock: this process's)."""

    def __init__(self) -> None:
        self.book = AdmissionBook()
        self._appended = asyncio.Event()

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def sync(self) -> None: ...

    async def append(self, event: Event) -> None:
        self.book.apply(event, self.now())
        self._appended.set()

    async def wait(self, timeout_s: float) -> None:
        """Until something is appended or ``timeout_s`` passed."""
        self._appended.clear()
        try:
            await asyncio.wait_for(self._appended.wait(), timeout_s)
        except TimeoutError:
            pass

    def now(self) -> float:
        return time.time()


class KafkaLedger(MemoryLedger):
    """The book folded from the admissions topic (default: ``topics.ADMISSIONS``)."""

    def __init__(self, client_kwargs: Mapping[str, Any], topic: str | None = None) -> None:
        super().__init__()
        self.client_kwargs = dict(client_kwargs)
        self.topic = topic or topics.ADMISSIONS.name
        self._producer: Any = None
        self._consumer: Any = None
        self._ends: Any = None
        self._tp: Any = None
        self._read = asyncio.Lock()  # one reader of the consumer at a time

    async def start(self) -> None:
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

        self._producer = AIOKafkaProducer(**self.client_kwargs, enable_idempotence=True, acks="all")
        self._consumer = AIOKafkaConsumer(**self.client_kwargs, group_id=None, enable_auto_commit=False,
                                          isolation_level="read_committed", auto_offset_reset="earliest")
        # the log's end is asked on a connection of its own: a broker answers a connection's requests one at a
        # time, so on the reader's the lookup of each ``sync`` waited behind its idle fetch (fetch_max_wait_ms,
        # 500 ms), and an arena admitted the groups of one batch half a second apart (1.5 s of every demo revision)
        self._ends = AIOKafkaConsumer(**self.client_kwargs, group_id=None, enable_auto_commit=False,
                                      isolation_level="read_committed")
        await self._producer.start()
        await self._consumer.start()
        await self._ends.start()
        self._tp = TopicPartition(self.topic, 0)
        self._consumer.assign([self._tp])
        await self._consumer.seek_to_beginning(self._tp)
        await self.sync()

    async def stop(self) -> None:
        if self._producer is not None:
            await self._producer.stop()
        for client in (self._consumer, self._ends):
            if client is not None:
                await stop_consumer(client)
        self._producer = self._consumer = self._ends = None

    async def sync(self, through: int | None = None) -> None:
        """Fold every record up to the end of the log as it is now (or through offset ``through``)."""
        async with self._read:
            end = (await self._ends.end_offsets([self._tp]))[self._tp] if through is None else through + 1
            while await self._consumer.position(self._tp) < end:
                await self._poll(500)

    async def append(self, event: Event) -> None:
        key, value, headers = to_message(event)
        meta = await self._producer.send_and_wait(self.topic, value, key=key, headers=headers)
        if meta.timestamp_type != LOG_APPEND_TIME:
            raise NotBrokerTimed(
                f"topic {self.topic} keeps the producers' timestamps (message.timestamp.type=CreateTime): leases "
                "would be timed by each arena's own clock. It was created before rollout-log set LogAppendTime, or "
                "by hand. Fix it once: kafka-configs.sh --bootstrap-server HOST:PORT --alter --entity-type topics "
                f"--entity-name {self.topic} --add-config message.timestamp.type=LogAppendTime")
        if isinstance(event, (AdmissionClaim, AdmissionRenew)):  # its fate is decided by what precedes it
            await self.sync(through=meta.offset)

    async def wait(self, timeout_s: float) -> None:
        async with self._read:
            await self._poll(int(timeout_s * 1000))

    async def _poll(self, timeout_ms: int) -> None:
        got = await self._consumer.getmany(self._tp, timeout_ms=timeout_ms)
        for rec in got.get(self._tp, []):
            try:
                event = codec.decode(rec.value)
            except EventDecodeError:
                continue  # nobody's admission to act on
            if isinstance(event, ADMISSION_EVENTS):
                self.book.apply(event, rec.timestamp / 1000)
        if got:
            self._appended.set()
