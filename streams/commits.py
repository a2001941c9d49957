"""A commit is checked, not trusted.

``commit_transaction`` returns when the coordinator has logged the commit; the markers that move each
partition's last stable offset (what ``read_committed`` readers reach) are written after that. Usually
that is a moment (``wait_visible`` waits it out for a writer whose caller reads next). But a broker
restarted while a transaction commits can leave it *hanging* (seen with Kafka 4.4, single node: the
producer's EndTxn succeeded, the coordinator lost the transaction, its records and offsets stay open on
the partitions, and ``read_committed`` readers of those partitions stop at them for good). aiokafka has
neither KIP-890's per-transaction epoch bump nor KIP-664's abort tooling, so the processor confirms that
what it committed became visible (``CommitWatch``) and, when not within ``ROLLOUT_CONFIRM_S``, commits
again with the same producer and epoch over the same partitions and offsets (``commit_again``): the
coordinator then writes the commit markers the first commit should have, which is the outcome this
producer was told.

What a commit wrote is kept in a file per transactional id (``CommitWatch(path=...)``) until it is seen: a process
that dies with a commit hanging leaves it to the next process with its id (a restarted named instance, or the next
unnamed one on the host, ``streams.instances``), which reads the file and commits again over it, since only that
id can close it. Without the file nobody knew which partitions to close: the readers of those partitions waited for
good.

``StallWatch`` is the last safety net: input waiting, no commit, for too long.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from streams import group_offsets
from streams.instances import write_for_successor

log = logging.getLogger("rollout.eos")


async def wait_visible(client_kwargs: dict[str, Any], written: dict[TopicPartition, int],
                       timeout_s: float = 30.0) -> None:
    """Return once ``read_committed`` readers reach every offset in ``written`` (partition -> last offset).

    A writer whose caller reads next (an import, a test's fixture run, then a replay) waits here so what it
    reported written is what a reader sees.
    """
    if not written:
        return
    consumer = AIOKafkaConsumer(**client_kwargs, group_id=None, enable_auto_commit=False,
                                isolation_level="read_committed")
    await consumer.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            lso = await consumer.end_offsets(list(written))
            behind = {tp: off for tp, off in written.items() if lso.get(tp, 0) <= off}
            if not behind:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"committed records not readable after {timeout_s:.0f}s on "
                                   f"{sorted(f'{tp.topic}-{tp.partition}' for tp in behind)}: an open or "
                                   "hanging transaction holds their last stable offset")
            await asyncio.sleep(0.05)
    finally:
        await consumer.stop()


class Lasting:
    """Per partition: whether a condition has held, with an unchanged key (the offsets it is about), for a while."""

    def __init__(self) -> None:
        self.since: dict[int, tuple[Any, float]] = {}

    def __call__(self, p: int, key: Any, holds: bool, now: float, after_s: float) -> bool:
        """True once ``holds`` has stayed true for partition ``p``, with ``key`` unchanged, for ``after_s``."""
        seen, t0 = self.since.get(p, (None, now))
        if not holds or seen != key:
            self.since[p] = (key, now)
            return False
        return now - t0 >= after_s


class CommitWatch:
    """What committed transactions wrote, per output partition, until readers can see it.

    Visible means: every output partition's last stable offset is past the last offset a commit wrote there,
    and the group's committed offsets reach what was committed. Another producer's open transaction on a
    shared output partition also holds the last stable offset back; re-committing is harmless then (same
    offsets, no records), so no attempt is made to tell the two apart.
    """

    def __init__(self, confirm_s: float, path: Path | None = None) -> None:
        self.confirm_s = confirm_s
        self.unconfirmed: dict[TopicPartition, tuple[int, float]] = {}  # output tp -> (last offset, awaited since)
        self._offsets_behind = Lasting()
        self._last_check = time.monotonic()
        self.path = path  # where what is not yet seen outlives the process (the module's docstring)
        inherited = self._load()  # what a predecessor with this id left unseen: due at once
        if inherited:
            log.info("commits a predecessor left unconfirmed on %s: checked at once",
                     sorted(f"{tp.topic}-{tp.partition}" for tp in inherited))
        self.unconfirmed.update({tp: (off, self._last_check - confirm_s) for tp, off in inherited.items()})

    def _load(self) -> dict[TopicPartition, int]:
        try:
            rows = json.loads(self.path.read_text()) if self.path is not None and self.path.exists() else []
            return {TopicPartition(t, int(p)): int(o) for t, p, o in rows}
        except (ValueError, TypeError, OSError) as e:  # a torn write: nothing to close is the old behaviour
            log.warning("unreadable unconfirmed commits in %s (%s): not checked", self.path, e)
            return {}

    def _save(self) -> None:
        """A file that names a partition already visible costs its reader one look; removed once nothing is
        unconfirmed."""
        if self.path is None:
            return
        if not self.unconfirmed:
            self.path.unlink(missing_ok=True)
            return
        write_for_successor(self.path, json.dumps([[tp.topic, tp.partition, off]
                                                   for tp, (off, _) in self.unconfirmed.items()]))

    def time_to_check(self) -> bool:
        """True once per ``confirm_s``: checking asks the brokers, so it is not done every step."""
        if time.monotonic() - self._last_check < self.confirm_s:
            return False
        self._last_check = time.monotonic()
        return True

    def wrote(self, written: list[Any]) -> None:
        """Record metadata of what a transaction is about to commit, in send order (the last one per output
        partition is its highest offset). Called before the commit, so no death between the commit and this
        record loses it; if the transaction aborts instead, its abort markers make it visible and it is dropped."""
        now = time.monotonic()
        for md in written:
            self.unconfirmed[TopicPartition(md.topic, md.partition)] = (md.offset, now)
        if written:
            self._save()

    def _seen(self, tp: TopicPartition) -> None:
        del self.unconfirmed[tp]
        if not self.unconfirmed:
            self._save()

    def partitions_dropped(self) -> None:
        """The processor dropped its partitions (a failed transaction, a fence, a new member id). What its
        commits wrote stays watched: a hanging transaction belongs to the transactional id, not to the
        partitions, and only this producer's id can close it (a new owner waits on its offsets for good)."""
        self._offsets_behind.since.clear()

    async def hidden(self, consumer: AIOKafkaConsumer) -> list[TopicPartition]:
        """The output partitions where what was committed is still not visible, asked now (a take-over's check:
        a commit that only was in flight is visible by the time its partitions are taken over)."""
        if self.unconfirmed:
            lso = await asyncio.wait_for(consumer.end_offsets(list(self.unconfirmed)), 10)
            for tp, (off, _) in list(self.unconfirmed.items()):
                if lso.get(tp, 0) > off:
                    self._seen(tp)
        return sorted(self.unconfirmed, key=str)

    async def overdue(self, consumer: AIOKafkaConsumer, committed: dict[int, dict[str, int]]
                      ) -> list[TopicPartition] | None:
        """None when everything committed is visible or not yet ``confirm_s`` old; else the output partitions
        still waiting for markers (empty when only the group's offsets lag). ``committed``: partition -> input
        topic -> offset the processor committed."""
        now = time.monotonic()
        owned = [TopicPartition(t, p) for p, offs in committed.items() for t in offs]
        try:
            lso = (await asyncio.wait_for(consumer.end_offsets(list(self.unconfirmed)), 10)
                   if self.unconfirmed else {})
            done = await group_offsets.committed(consumer, owned, timeout_s=10, stable=False) if owned else {}
        except Exception as e:  # noqa: BLE001 - broker away: the next round asks again
            log.debug("confirming commits: %s", e)
            return None
        due: list[TopicPartition] = []
        for tp, (off, since) in list(self.unconfirmed.items()):
            if lso.get(tp, 0) > off:
                self._seen(tp)
            elif now - since >= self.confirm_s:
                due.append(tp)
        mine = {TopicPartition(t, p): o for p, offs in committed.items() for t, o in offs.items()}
        behind = any((done.get(tp) or 0) < o for tp, o in mine.items())
        offsets_lag = self._offsets_behind(0, tuple(sorted(mine.items())), behind, now, self.confirm_s)
        return due if due or offsets_lag else None

    def recommitted(self, tps: list[TopicPartition]) -> None:
        """Committed again: look again after another ``confirm_s``."""
        now = time.monotonic()
        for tp in tps:
            off, _ = self.unconfirmed.get(tp, (-1, now))
            self.unconfirmed[tp] = (off, now)
        self._offsets_behind.since.clear()


async def commit_again(prod: AIOKafkaProducer, group_id: str, tps: list[TopicPartition],
                       offsets: dict[TopicPartition, int]) -> None:
    """A transaction with no records over ``tps``, the group's offsets partition and the given committed input
    offsets: the coordinator adds the partitions and writes commit markers there, which also close a hanging
    transaction's records and offsets of the same producer id under an older epoch (a producer opened again
    after a drop). aiokafka adds a partition only when a record is sent, and the group only with offsets to
    send, hence its transaction manager's and sender's own hooks when a processor owns nothing (yet)."""
    await prod.begin_transaction()
    for tp in tps:
        prod._txn_manager.maybe_add_partition_to_txn(tp)
    if offsets:
        await prod.send_offsets_to_transaction(offsets, group_id)
    else:
        await prod._sender._do_add_offsets_to_txn(group_id)  # AddOffsetsToTxn alone: a marker, no offsets
    await prod.commit_transaction()


class StallWatch:
    """Owned partitions with input waiting (end offset > committed) but no commit for a while.

    A safety net for client-side stalls (a fetcher left without a leader after a broker restart, a takeover
    that keeps failing): the service rebuilds its clients when it reports any.
    """

    def __init__(self) -> None:
        self._progress = Lasting()
        self._ends_failing_since: float | None = None

    async def stalled(self, consumer: AIOKafkaConsumer, committed: dict[int, dict[str, int]],
                      after_s: float) -> list[int]:
        now = time.monotonic()
        tps = [TopicPartition(t, p) for p, offs in committed.items() for t in offs]
        try:
            ends = await asyncio.wait_for(consumer.end_offsets(tps), 10)
            self._ends_failing_since = None
        except Exception:  # noqa: BLE001 - cannot even ask: a stall too, once it lasts
            self._ends_failing_since = self._ends_failing_since or now
            return sorted(committed) if now - self._ends_failing_since >= after_s else []
        return [p for p, offs in list(committed.items())
                if self._progress(p, tuple(sorted(offs.items())),
                                  any(ends.get(TopicPartition(t, p), 0) > o for t, o in offs.items()), now, after_s)]
