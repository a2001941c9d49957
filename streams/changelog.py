"""State is never ahead of the log: each partition task's buffered input and small state, on a changelog.

A task may buffer input (a GRPO group, steps awaiting their rollout); each transaction of the processor
(``streams.transactions``) writes, atomically with its outputs and input offsets, a snapshot of that state
to a compacted changelog topic (key = partition number): which input offsets are still buffered plus small
JSON state (EMA baselines, Monte Carlo child outcomes). A new owner restores the last committed snapshot
and re-reads exactly the buffered offsets (``Restorer``). Input offsets always commit at the consumer
position, so nothing is re-processed and nothing buffered is lost.

A new owner reads the committed offsets only once no transaction holds them (``require_stable``), and the
snapshots only once no transaction is open on their changelog partitions: the previous owner's last
transaction may have committed offsets whose snapshot's commit marker is still on its way.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from streams import group_offsets
from streams.aiokafka_internals import stop_consumer
from streams.settings import MAX_MESSAGE_BYTES
from streams.topics import Topic

if TYPE_CHECKING:
    from streams.partition_task import PartitionTask


def changelog_topic(service: str, partitions: int) -> Topic:
    return Topic(f"{service}-changelog", partitions,
                 {"cleanup.policy": "compact", "segment.ms": "60000", "min.cleanable.dirty.ratio": "0.1",
                  "retention.ms": "-1", "max.message.bytes": str(MAX_MESSAGE_BYTES)},
                 doc=f"{service}: per-partition snapshot of buffered input offsets and small state")


def _ranges(offsets: Iterable[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for o in sorted(set(offsets)):
        if out and out[-1][1] == o - 1:
            out[-1][1] = o
        else:
            out.append([o, o])
    return out


def _unranges(ranges: list[list[int]]) -> set[int]:
    s: set[int] = set()
    for a, b in ranges:
        s.update(range(a, b + 1))
    return s


def encode_snapshot(buffered: dict[str, list[int]], state: dict[str, Any]) -> bytes:
    """Buffered offsets as ranges (a batch buffers runs of consecutive offsets), sorted keys: an unchanged
    state encodes to the same bytes, so the processor writes a snapshot only when it changed."""
    return json.dumps({"v": 1, "buffered": {t: _ranges(o) for t, o in buffered.items() if o}, "state": state},
                      sort_keys=True, separators=(",", ":")).encode()


def decode_snapshot(raw: bytes | None) -> tuple[dict[str, set[int]], dict[str, Any]]:
    if not raw:
        return {}, {}
    d = json.loads(raw)
    return {t: _unranges(r) for t, r in d.get("buffered", {}).items()}, d.get("state", {})


@dataclass
class Restored:
    """A partition as its last committed transaction left it."""

    task: PartitionTask
    committed: dict[str, int]  # input topic -> next offset to read
    snapshot: bytes  # the last committed snapshot (b"" when none)


class Restorer:
    """Rebuilds partition tasks from the changelog and the committed input offsets, with a consumer of its own
    (no group, read_committed: only what committed transactions wrote)."""

    def __init__(self, client_kwargs: dict[str, Any], changelog: str, inputs: list[str], *,
                 settle_s: float = 30.0) -> None:
        self.kw = client_kwargs
        self.changelog = changelog
        self.inputs = inputs
        self.settle_s = settle_s
        self.consumer: AIOKafkaConsumer | None = None
        self.uncommitted: AIOKafkaConsumer | None = None  # only asks for high watermarks
        self.lock = asyncio.Lock()  # one restore at a time: they share the consumer's assignment

    async def start(self) -> None:
        # a take-over waits on these clients: a short retry backoff, and the topics' metadata known up front
        # (a first offset lookup of an unknown topic otherwise costs a metadata round and a 100 ms backoff)
        self.consumer = AIOKafkaConsumer(**self.kw, group_id=None, enable_auto_commit=False,
                                         isolation_level="read_committed", auto_offset_reset="earliest",
                                         max_partition_fetch_bytes=MAX_MESSAGE_BYTES, fetch_max_wait_ms=20,
                                         retry_backoff_ms=20)
        self.uncommitted = AIOKafkaConsumer(**self.kw, group_id=None, enable_auto_commit=False,
                                            isolation_level="read_uncommitted", retry_backoff_ms=20)
        for c in (self.consumer, self.uncommitted):
            await c.start()
            await c._client.set_topics([self.changelog, *self.inputs])

    async def stop(self) -> None:
        for c in (self.consumer, self.uncommitted):
            if c is not None:
                await stop_consumer(c)
        self.consumer = self.uncommitted = None

    async def restore(self, ps: list[int], group: AIOKafkaConsumer,
                      make_task: Callable[[int], PartitionTask]) -> dict[int, Restored]:
        """Fresh tasks for ``ps`` from their last committed snapshots, re-fed exactly the input they buffered;
        ``group`` is the group's consumer, which knows the committed input offsets."""
        async with self.lock:
            return await self._restore(ps, group, make_task)

    async def _restore(self, ps: list[int], group: AIOKafkaConsumer,
                       make_task: Callable[[int], PartitionTask]) -> dict[int, Restored]:
        assert self.consumer is not None
        tps = [TopicPartition(t, p) for p in ps for t in self.inputs]
        beginnings = await self.consumer.beginning_offsets(tps)
        fetched = await group_offsets.committed(group, tps)
        committed = {tp: beginnings[tp] if fetched.get(tp) is None else fetched[tp] for tp in tps}
        snaps = await self._read_snapshots(ps)
        tasks = {p: make_task(p) for p in ps}
        want: dict[TopicPartition, set[int]] = {}
        for p in ps:
            buffered, state = decode_snapshot(snaps.get(p))
            tasks[p].load_state(state)
            for t in self.inputs:
                tp = TopicPartition(t, p)
                w = {o for o in buffered.get(t, ()) if o < committed[tp]}
                if w:
                    want[tp] = w
        if want:
            async for rec in self._read_ranges({tp: (min(w), committed[tp]) for tp, w in want.items()}):
                if rec.offset in want[TopicPartition(rec.topic, rec.partition)]:
                    tasks[rec.partition].restore(rec)
        return {p: Restored(tasks[p], {t: committed[TopicPartition(t, p)] for t in self.inputs}, snaps.get(p) or b"")
                for p in ps}

    async def _settled_ends(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        """The changelog partitions' ends once no transaction is open there (last stable offset = high
        watermark); a transaction that stays open longer than ``settle_s`` is an error (the take-over is tried
        again), never a reason to restore from an older snapshot."""
        deadline = time.monotonic() + self.settle_s
        while True:
            stable = await self.consumer.end_offsets(tps)
            high = await self.uncommitted.end_offsets(tps)
            if stable == high:
                return stable
            if time.monotonic() > deadline:
                raise TimeoutError(f"a transaction stays open on {self.changelog} partitions "
                                   f"{sorted(tp.partition for tp in tps if stable[tp] != high[tp])}")
            await asyncio.sleep(0.05)

    async def _read_snapshots(self, ps: list[int]) -> dict[int, bytes]:
        tps = [TopicPartition(self.changelog, p) for p in ps]
        ends = await self._settled_ends(tps)
        starts = await self.consumer.beginning_offsets(tps)
        last: dict[int, bytes] = {}
        ranges = {tp: (starts[tp], ends[tp]) for tp in tps if ends[tp] > starts[tp]}
        async for rec in self._read_ranges(ranges):
            last[rec.partition] = rec.value
        return last

    async def _read_ranges(self, ranges: dict[TopicPartition, tuple[int, int]]) -> AsyncIterator[Any]:
        """Records in [start, end) of each partition (read_committed; control records are skipped)."""
        if not ranges:
            return
        r = self.consumer
        r.assign(list(ranges))
        for tp, (start, _) in ranges.items():
            r.seek(tp, start)
        open_ = dict(ranges)
        while open_:
            for tp in list(open_):
                if await r.position(tp) >= open_[tp][1]:
                    del open_[tp]
            if not open_:
                break
            got = await r.getmany(*open_, timeout_ms=200, max_records=10000)
            for tp, recs in got.items():
                end = ranges[tp][1]
                for rec in recs:
                    if rec.offset < end:
                        yield rec
