"""The one reader of the policy-revisions topic.

Every reader reads it whole, from the beginning, ``read_committed`` and without a consumer group: each
arena, batcher and trainer sees every revision the trainer committed, in order. Three uses, one consumer:

* ``RevisionFollower``: hands each revision of a family to a callback as it arrives (the arena);
* ``RevisionWatcher``: keeps the latest revision with a checkpoint per family (the batcher's side input);
* ``latest_revision``: reads to the end once (the trainer, at start);
* ``DroppedBatches``: the same reader on the dead letters: the batches the trainer will never train.

``publish`` writes a revision outside the trainer's transactions (revision 0 of a fresh log).

A message that does not decode as a ``PolicyRevision`` is skipped: it is nobody's revision to act on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

from schemas.errors import EventDecodeError
from schemas.events import DeadLetter
from schemas.policy import PolicyRevision
from streams import topics
from streams.aiokafka_internals import stop_consumer
from streams.poison import ProcessMustRestart
from streams.serde import from_message

POLL_MS = 200


def without_superseded(revs: list[PolicyRevision], skippable: Callable[[PolicyRevision], bool]
                       ) -> list[PolicyRevision]:
    """``revs`` in order, less each one that a newer revision of its family in ``revs`` supersedes and that
    ``skippable`` lets go."""
    newest: dict[str, int] = {}
    for rev in revs:
        newest[rev.family] = max(newest.get(rev.family, rev.revision), rev.revision)
    return [r for r in revs if r.revision >= newest[r.family] or not skippable(r)]


async def _hand(revs: list[PolicyRevision], on_revision: Callable[[PolicyRevision], Any],
                skippable: Callable[[PolicyRevision], bool] | None) -> None:
    """``revs`` to ``on_revision`` in order (awaited when it is a coroutine function), the superseded ones
    ``skippable`` lets go left out."""
    for rev in without_superseded(revs, skippable) if skippable is not None else revs:
        res = on_revision(rev)
        if asyncio.iscoroutine(res):
            await res


class RevisionFollower:
    """The revisions on the topic (default: the policy-revisions topic), of ``family`` only when given; or, with
    ``event``, the events of that type on ``topic`` (``DroppedBatches``: the dead letters)."""

    def __init__(self, client_kwargs: Mapping[str, Any], family: str | None = None, topic: str | None = None,
                 event: type = PolicyRevision) -> None:
        self.client_kwargs = dict(client_kwargs)
        self.family = family
        self.topic = topic or topics.POLICY_REVISIONS.name
        self.event = event
        self._consumer: Any = None

    async def start(self) -> None:
        """Assign every partition of the topic from its beginning; a topic just created may take a moment to show
        in the metadata, one that never shows is an error (nothing would ever arrive)."""
        from aiokafka import AIOKafkaConsumer, TopicPartition

        self._consumer = AIOKafkaConsumer(**self.client_kwargs, group_id=None, enable_auto_commit=False,
                                          isolation_level="read_committed", auto_offset_reset="earliest")
        await self._consumer.start()
        parts = None
        for _ in range(50):
            parts = (await topics.partitions_of(self._consumer._client, [self.topic])).get(self.topic)
            if parts:
                break
            await asyncio.sleep(0.1)
        if not parts:
            await self.stop()
            raise topics.TopicMissing(f"topic {self.topic!r} does not exist")
        tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)

    async def stop(self) -> None:
        if self._consumer is not None:
            await stop_consumer(self._consumer)
            self._consumer = None

    async def __aenter__(self) -> RevisionFollower:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    async def poll(self, timeout_ms: int = POLL_MS) -> tuple[list[PolicyRevision], bool]:
        """The next revisions in log order, and whether any record at all arrived (a skipped one counts)."""
        pairs, arrived = await self._poll(timeout_ms)
        return [rev for _, rev in pairs], arrived

    async def _poll(self, timeout_ms: int) -> tuple[list[tuple[Any, PolicyRevision]], bool]:
        got = await self._consumer.getmany(timeout_ms=timeout_ms)
        pairs = []
        for rec in (r for recs in got.values() for r in recs):
            try:
                rev = from_message(rec.value, self.event)
            except EventDecodeError:
                continue
            if self.family is None or getattr(rev, "family", None) == self.family:
                pairs.append((rec, rev))
        return pairs, bool(got)

    async def follow(self, on_revision: Callable[[PolicyRevision], Any], *,
                     skippable: Callable[[PolicyRevision], bool] | None = None) -> None:
        """Call ``on_revision`` (a function or a coroutine function) with every revision, forever. A revision
        followed in the same poll by a newer one of its family is left out when ``skippable`` says so: a reader
        that fell behind (an arena evaluating while a fast trainer publishes several) skips superseded revisions
        it has no use for (no evaluation due), whose checkpoints a trainer keeping only its newest may have
        pruned already."""
        while True:
            await _hand((await self.poll())[0], on_revision, skippable)

    async def catch_up(self, on_revision: Callable[[PolicyRevision], Any], *,
                       skippable: Callable[[PolicyRevision], bool] | None = None) -> None:
        """``follow``'s calls for the revisions on the topic now, made before this returns; ``follow`` then goes on
        after them. An arena starts on the newest revision (loaded, evaluated when due) before it admits any."""
        await _hand([rev for _, rev in await self.read_to_end()], on_revision, skippable)

    async def scan(self, revision: int | None = None, *, idle_polls: int = 2) -> PolicyRevision | None:
        """Read to the end of the topic as it is now: the newest revision, or the given ``revision`` number
        (the first one carrying it); None when there is none."""
        found: PolicyRevision | None = None
        for _, rev in await self.read_to_end(idle_polls=idle_polls):
            if revision is not None:
                if rev.revision == revision and found is None:
                    found = rev
            elif found is None or rev.revision > found.revision:
                found = rev
        return found

    async def read_to_end(self, *, idle_polls: int = 2) -> list[tuple[Any, PolicyRevision]]:
        """Every revision from here to the end of the topic as it is now, with its record (where it sits)."""
        tps = list(self._consumer.assignment())
        end = await self._consumer.end_offsets(tps)
        out: list[tuple[Any, PolicyRevision]] = []
        idle = 0

        async def behind() -> bool:
            return any([await self._consumer.position(tp) < end[tp] for tp in tps])

        # a trailing transaction marker can keep the position just short of the end: stop when idle too
        while idle < idle_polls and await behind():
            pairs, arrived = await self._poll(500)
            idle = 0 if arrived else idle + 1
            out.extend(pairs)
        return out


class SideInput:
    """A topic every instance of a service reads whole, without a group (``Service.side_inputs``), folded by
    ``_see`` in a background task between ``start`` and ``stop``. ``check`` raises ``ProcessMustRestart`` once
    that task has died (a missing READ permission, a broker error it cannot ride out): the service stops loudly
    for its supervisor instead of computing on with what it saw last."""

    name = "side-input"

    def __init__(self, follower: RevisionFollower) -> None:
        self._follower = follower
        self._task: asyncio.Task | None = None

    def _see(self, event: Any) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        await self._follower.start()
        self._task = asyncio.create_task(self._follower.follow(self._see), name=self.name)

    def check(self) -> None:
        t = self._task
        if t is not None and t.done() and not t.cancelled() and (e := t.exception()) is not None:
            raise ProcessMustRestart(f"the {self.name} side input stopped reading {self._follower.topic}: "
                                     f"{type(e).__name__}: {e}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._follower.stop()


class DroppedBatches(SideInput):
    """Side input: the trainer batches the trainer dead-lettered (poison, past the run's last revision, refused
    whole; not those it trained without some stale records), each of which will never become a revision. A derived
    run's batcher paces itself on the trainer's revisions (``consumers.batching.HISTORY_AHEAD``) and counts these as
    gone, not as still ahead of the trainer."""

    name = "dropped-batches"

    def __init__(self, client_kwargs: Mapping[str, Any]) -> None:
        super().__init__(RevisionFollower(client_kwargs, topic=topics.DEAD_LETTERS.name, event=DeadLetter))
        self.seen: set[tuple[int, int]] = set()  # (partition, offset) of each dropped batch

    @property
    def count(self) -> int:
        return len(self.seen)

    def _see(self, letter: DeadLetter) -> None:
        # a partial refusal (stale records of a batch that trained) is not a dropped batch: its revision counts it
        if letter.origin_topic == topics.TRAINER_BATCHES.name and not letter.partial:
            self.seen.add((letter.origin_partition, letter.origin_offset))


async def latest_revision(client_kwargs: Mapping[str, Any], family: str, *, idle_polls: int = 2,
                          revision: int | None = None) -> PolicyRevision | None:
    """The newest committed PolicyRevision of ``family`` on the log, or the given ``revision`` of it (None if
    the log has none)."""
    async with RevisionFollower(client_kwargs, family) as follower:
        return await follower.scan(revision, idle_polls=idle_polls)


async def publish(client_kwargs: Mapping[str, Any], revision: PolicyRevision) -> None:
    """Write one revision (idempotent producer, acknowledged by all in-sync replicas)."""
    from aiokafka import AIOKafkaProducer

    from streams.serde import to_message

    producer = AIOKafkaProducer(**client_kwargs, enable_idempotence=True)
    await producer.start()
    try:
        key, value, headers = to_message(revision)
        await producer.send_and_wait(topics.POLICY_REVISIONS.name, value, key=key, headers=headers)
    finally:
        await producer.stop()


class RevisionWatcher(SideInput):
    """Side input: ``latest`` holds the newest revision with a checkpoint of each family."""

    name = "revision-watcher"

    def __init__(self, client_kwargs: Mapping[str, Any]) -> None:
        super().__init__(RevisionFollower(client_kwargs))
        self.latest: dict[str, PolicyRevision] = {}

    def _see(self, rev: PolicyRevision) -> None:
        cur = self.latest.get(rev.family)
        if rev.checkpoint is not None and (cur is None or rev.revision > cur.revision):
            self.latest[rev.family] = rev
