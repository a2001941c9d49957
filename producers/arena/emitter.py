"""Transactional emission: every Step of an episode and its Rollout (a whole episode tree for
hierarchical episodes) are written in ONE Kafka transaction.

A crash mid-episode (or mid-transaction) leaves nothing visible to ``read_committed`` readers: the
broker aborts the open transaction when the next producer with the same ``transactional_id``
initialises (or when ``transaction.timeout.ms`` expires).

    async with KafkaEmitter(settings.client_kwargs(), transactional_id="arena-<run>-0") as em:
        await em.emit(result)        # returns once the transaction holding it has committed

Group commit: aiokafka allows one open transaction per producer, so transactions are serialized;
episodes finishing while one commits queue up and the next transaction carries all of them (up to
``max_episodes_per_txn``). An episode is never split across transactions. ``emit`` raises when the
transaction carrying its episode fails (``EmissionError``): nothing is dropped silently.

Keys (``streams.serde``): Steps and Rollouts by ``root_group_id``, so an episode tree and its group
land on the same partition number of the steps and rollouts topics, in call order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from producers.environments.episodes import GenerateResult
from schemas.envelope import Event
from schemas.events import Rollout, Step
from streams import aiokafka_internals, serde, topics
from streams.settings import MAX_MESSAGE_BYTES

log = logging.getLogger("rollout.arena")


class EmissionError(Exception):
    """A transaction carrying an episode could not be committed (the episode is NOT on the log)."""


def messages_for(result: GenerateResult) -> list[Event]:
    """Steps then Rollout for every rollout of the tree (children before their parent)."""
    out: list[Event] = []
    for r in result.walk():
        out.extend(r.steps)
        out.append(r.rollout)
    return out


@dataclass
class EmitterStats:
    transactions: int = 0
    episodes: int = 0
    messages: int = 0
    bytes: int = 0
    commit_s: float = 0.0
    aborted: int = 0
    producers: int = 0  # opened: the first, and one after each failed transaction
    by_topic: dict[str, int] = field(default_factory=dict)


class Emitter:
    """Interface: ``await emit(result)`` returns when the episode is durably on the log."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def emit(self, result: GenerateResult) -> None:
        raise NotImplementedError

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()


class MemoryEmitter(Emitter):
    """Keeps the episode trees in memory (unit tests, dry runs). No Kafka."""

    def __init__(self) -> None:
        self.results: list[GenerateResult] = []
        self.events: list[Event] = []

    async def emit(self, result: GenerateResult) -> None:
        self.results.append(result)
        self.events.extend(messages_for(result))

    @property
    def rollouts(self) -> list[Rollout]:
        return [e for e in self.events if isinstance(e, Rollout)]

    @property
    def steps(self) -> list[Step]:
        return [e for e in self.events if isinstance(e, Step)]


class KafkaEmitter(Emitter):
    def __init__(self, client_kwargs: dict[str, Any], transactional_id: str, *, steps_topic: str | None = None,
                 rollouts_topic: str | None = None, max_episodes_per_txn: int = 64,
                 transaction_timeout_ms: int = 60000, linger_ms: int = 0,
                 before_commit: Callable[[list[GenerateResult]], Awaitable[None]] | None = None) -> None:
        self.client_kwargs = dict(client_kwargs)
        self.transactional_id = transactional_id
        self.steps_topic = steps_topic or topics.STEPS.name
        self.rollouts_topic = rollouts_topic or topics.ROLLOUTS.name
        self.max_episodes_per_txn = max(1, max_episodes_per_txn)
        self.transaction_timeout_ms = transaction_timeout_ms
        self.linger_ms = linger_ms
        self.before_commit = before_commit  # test hook: runs inside the open transaction
        self.stats = EmitterStats()
        self._producer: Any = None
        self._queue: asyncio.Queue[tuple[GenerateResult, asyncio.Future]] | None = None
        self._loop_task: asyncio.Task | None = None
        self._failed: BaseException | None = None

    def topic_for(self, event: Event) -> str:
        if isinstance(event, Step):
            return self.steps_topic
        if isinstance(event, Rollout):
            return self.rollouts_topic
        raise TypeError(f"the arena emits Steps and Rollouts only, not {type(event).__name__}")

    async def _open_producer(self) -> Any:
        from aiokafka import AIOKafkaProducer

        producer = AIOKafkaProducer(
            **self.client_kwargs, transactional_id=self.transactional_id, enable_idempotence=True, acks="all",
            transaction_timeout_ms=self.transaction_timeout_ms, max_request_size=MAX_MESSAGE_BYTES,
            linger_ms=self.linger_ms)
        await producer.start()  # init_transactions: fences and aborts a predecessor's open transaction
        self.stats.producers += 1
        return producer

    async def _replace_producer(self) -> None:
        """After a failed transaction: a fresh producer with the same transactional id, whose InitProducerId
        aborts on the broker whatever the failed one left open. aiokafka's own abort after some errors is local
        only (it forgets the transaction's partitions and sends no EndTxn), and the next commit would then
        commit the failed episodes' records too; the services discard their producer for the same reason."""
        old, self._producer = self._producer, None
        try:
            await asyncio.wait_for(old.stop(), 10)
        except BaseException as e:  # noqa: BLE001 - a failed producer may complain on close
            log.debug("emitter: closing the failed producer: %s", e)
        try:
            self._producer = await self._open_producer()
        except Exception as e:  # noqa: BLE001 - every later emit says why
            self._failed = e

    async def start(self) -> None:
        aiokafka_internals.check()
        self._producer = await self._open_producer()
        self._queue = asyncio.Queue()
        self._loop_task = asyncio.create_task(self._commit_loop(), name=f"emitter-{self.transactional_id}")

    async def stop(self) -> None:
        if self._loop_task is not None:
            if self._queue is not None:
                await self._queue.join()
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def emit(self, result: GenerateResult) -> None:
        if self._failed is not None:
            raise EmissionError(f"emitter {self.transactional_id} is broken: {self._failed!r}")
        if self._queue is None:
            raise RuntimeError("KafkaEmitter.start() first")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        await self._queue.put((result, fut))
        await fut

    def encode(self, result: GenerateResult) -> list[tuple[str, bytes, bytes, list]]:
        """(topic, key, value, headers) of every message of an episode tree; raises EmissionError when
        one cannot be written (too large for a request), so only that episode fails, not its batch."""
        out = []
        for event in messages_for(result):
            key, value, headers = serde.to_message(event)
            size = len(key) + len(value) + sum(len(k) + len(v) for k, v in headers)
            if size > MAX_MESSAGE_BYTES - 1024:
                raise EmissionError(f"{type(event).__name__} {getattr(event, 'step_id', None) or result.rollout.rollout_id} "
                                    f"is {size} bytes, over the {MAX_MESSAGE_BYTES}-byte request limit: "
                                    "episode not emitted")
            out.append((self.topic_for(event), key, value, headers))
        return out

    async def _commit_loop(self) -> None:
        assert self._queue is not None
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self.max_episodes_per_txn and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                ready, ready_results = [], []
                for result, fut in batch:
                    try:
                        ready.append((self.encode(result), fut))
                        ready_results.append(result)
                    except Exception as e:  # noqa: BLE001 - this episode fails alone
                        fut.set_exception(e if isinstance(e, EmissionError) else
                                          EmissionError(f"cannot encode episode: {type(e).__name__}: {e}"))
                if ready:
                    try:
                        await self._transaction([m for m, _ in ready], ready_results)
                    except BaseException as e:  # noqa: BLE001 - every waiter must hear about it
                        err = e if isinstance(e, EmissionError) else EmissionError(
                            f"transaction of {len(ready)} episode(s) failed: {type(e).__name__}: {e}")
                        for _, fut in ready:
                            if not fut.done():
                                fut.set_exception(err)
                        if not isinstance(e, Exception):
                            raise
                    else:
                        for _, fut in ready:
                            if not fut.done():
                                fut.set_result(None)
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _transaction(self, episodes: list[list[tuple[str, bytes, bytes, list]]],
                           results: list[GenerateResult]) -> None:
        from aiokafka.errors import ProducerFenced

        producer = self._producer
        t0 = time.perf_counter()
        await producer.begin_transaction()
        try:
            futures = []
            n_bytes = 0
            n_msgs = 0
            for messages in episodes:
                for topic, key, value, headers in messages:
                    futures.append(await producer.send(topic, value=value, key=key, headers=headers))
                    n_bytes += len(value) + len(key)
                    n_msgs += 1
            await asyncio.gather(*futures)  # a delivery error surfaces here, before commit
            if self.before_commit is not None:
                await self.before_commit(results)
            await producer.commit_transaction()
        except ProducerFenced as e:
            self._failed = e
            raise EmissionError(f"producer {self.transactional_id} was fenced by a newer instance: {e}") from e
        except Exception:
            self.stats.aborted += 1
            await self._replace_producer()
            raise
        self.stats.transactions += 1
        self.stats.episodes += len(episodes)
        self.stats.messages += n_msgs
        self.stats.bytes += n_bytes
        for messages in episodes:
            for topic, *_ in messages:
                self.stats.by_topic[topic] = self.stats.by_topic.get(topic, 0) + 1
        self.stats.commit_s += time.perf_counter() - t0
