"""The transactional read-process-write loop every service runs (exactly-once, Kafka Streams EOS-alpha style).

Why this shape (see README "Services and exactly-once"):

* aiokafka does not implement KIP-447 group-metadata fencing (``send_offsets_to_transaction`` takes a
  group id only), so a zombie that lost its partitions could still commit. Zombies are fenced the way
  Kafka Streams' first exactly-once mode did it: **one transactional producer per input partition
  number**, with the stable ``transactional.id = f"{prefix}{service}-{partition}"``. A new owner's
  ``init_transactions`` aborts the old owner's open transaction and fences its producer (its next
  commit raises ``ProducerFenced``), and only then does the new owner read the committed offsets.
* Co-partitioned inputs (steps + rollouts) are owned together: a consumer group with the range
  assignor hands out the same partition number of every input topic to one member.
* State is never ahead of the log: each transaction also writes a snapshot of the task's buffered input
  and small state to the service's changelog, and a new owner restores from it (``streams.changelog``).
* A failed transaction (anything but a fence) is aborted and that partition's task is rebuilt from
  the changelog and the committed offsets; a fenced one is dropped (someone else owns it now).
* A commit is checked, not trusted: one that does not become visible to ``read_committed`` readers (a
  transaction left hanging by a broker restart) is committed again (``streams.commits``).

Timeouts and the topic prefix come from ``streams.settings``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import KafkaError, ProducerFenced

from schemas.envelope import Event
from streams import serde, topics
from streams.changelog import Restorer, changelog_topic, encode_snapshot
from streams.commits import CommitWatch, StallWatch, commit_again
from streams.settings import MAX_MESSAGE_BYTES, ProcessingSettings

log = logging.getLogger("rollout.eos")


@dataclass(frozen=True)
class Out:
    """One output message of a transaction."""

    topic: str
    event: Event


class PartitionTask(Protocol):
    """Per-partition-number processing state. Pure with respect to Kafka: the processor owns I/O."""

    async def process(self, record: Any) -> list[Out]:
        """Handle one input record (aiokafka ConsumerRecord); may buffer it instead of emitting."""

    def restore(self, record: Any) -> None:
        """Re-buffer a record listed in the snapshot (no outputs: it was processed before)."""

    def tick(self, now: float) -> list[Out]:
        """Time-based work (timeouts, partial-batch flushes)."""

    def buffered(self) -> dict[str, list[int]]:
        """Input offsets still held in memory, by topic name."""

    def state(self) -> dict[str, Any]:
        """Small JSON state that must survive a crash."""

    def load_state(self, state: dict[str, Any]) -> None: ...


@dataclass
class Stats:
    records_in: int = 0
    records_out: int = 0
    transactions: int = 0
    aborted: int = 0
    fenced: int = 0
    rebuilt: int = 0
    recommitted: int = 0  # re-commits of transactions found hanging (streams.commits)
    by_type: dict[str, int] = field(default_factory=lambda: defaultdict(int))


class TransactionalProcessor:
    """Consume ``inputs`` (co-partitioned) in group ``group_id`` and run one ``PartitionTask`` per partition.

    ``make_task(partition)`` builds a fresh task. ``client_kwargs`` are aiokafka connection kwargs.
    """

    def __init__(self, service: str, inputs: list[str], partitions: int, make_task: Callable[[int], PartitionTask],
                 client_kwargs: dict[str, Any], *, group_id: str | None = None, tick_s: float = 0.5,
                 max_records: int = 2000, instance: str = "", linger_ms: int = 5,
                 on_start: Callable[[], Awaitable[None]] | None = None, session_timeout_ms: int | None = None,
                 settings: ProcessingSettings | None = None) -> None:
        self.settings = settings or ProcessingSettings()
        self.service = service
        self.inputs = inputs
        self.partitions = partitions
        self.make_task = make_task
        self.kw = dict(client_kwargs)
        self.group_id = group_id or topics.group_id(service)
        self.changelog = changelog_topic(service, partitions).name
        self.tick_s = tick_s
        self.max_records = max_records
        self.instance = instance
        self.linger_ms = linger_ms
        self.on_start = on_start
        self.session_timeout_ms = session_timeout_ms or self.settings.session_timeout_ms
        self.tasks: dict[int, PartitionTask] = {}
        self.producers: dict[int, AIOKafkaProducer] = {}
        self.committed: dict[int, dict[str, int]] = {}
        self.snap_written: dict[int, bytes] = {}
        self.stats = Stats()
        # called with (partition, input records, outputs) after each committed transaction (streams.metrics)
        self.on_commit: Callable[[int, list, list[Out]], None] | None = None
        self.lock = asyncio.Lock()
        self.stopping = asyncio.Event()
        self.consumer: AIOKafkaConsumer | None = None
        self.restorer = Restorer(self.kw, self.changelog, inputs)
        self._last_tick = 0.0
        self.pending: set[int] = set()
        self.epoch = 0  # bumped by every rebalance callback
        self._closing: set[asyncio.Task] = set()
        self.txn_timeout_s = self.settings.txn_timeout_s
        self.commits = CommitWatch(self.settings.confirm_s)
        # Fetched input not processed yet: with ROLLOUT_COMMIT_INTERVAL_MS, a partition's input waits here until
        # its last commit is that old, then is processed and committed in one transaction (fewer, larger
        # transactions; each record waits up to the interval longer). Never ahead of the task's state: it is
        # dropped, and re-read from the committed offsets, whenever the partitions are re-seeked.
        self.commit_interval_s = self.settings.commit_interval_ms / 1000
        self.inbox: dict[int, list] = defaultdict(list)
        self.inbox_pos: dict[int, dict[str, int]] = defaultdict(dict)
        self.last_commit: dict[int, float] = {}
        self.stalls = StallWatch()

    # -- lifecycle -------------------------------------------------------------------------------------
    def txn_id(self, p: int) -> str:
        return f"{topics.group_id(self.service)}-{p}"

    async def start(self) -> None:
        await self.restorer.start()
        self.consumer = AIOKafkaConsumer(
            **self.kw, group_id=self.group_id, enable_auto_commit=False, isolation_level="read_committed",
            auto_offset_reset="earliest", partition_assignment_strategy=(RangePartitionAssignor,),
            max_partition_fetch_bytes=MAX_MESSAGE_BYTES, fetch_max_bytes=64 * 1024 * 1024,
            session_timeout_ms=self.session_timeout_ms, heartbeat_interval_ms=min(1000, self.session_timeout_ms // 3),
            rebalance_timeout_ms=30000, max_poll_interval_ms=120000, fetch_max_wait_ms=self.settings.fetch_max_wait_ms)
        await self.consumer.start()
        self.consumer.subscribe(self.inputs, listener=_Listener(self))
        if self.on_start:
            await self.on_start()

    async def stop(self) -> None:
        """Graceful: finish the open transaction (lock), then leave the group and close producers."""
        async with self.lock:
            if self.consumer is not None:
                try:
                    await self.consumer.stop()  # leaves the group
                except Exception as e:  # noqa: BLE001
                    log.warning("consumer stop: %s", e)
            for p in list(self.producers):
                await self._drop(p)
            await self.restorer.stop()

    async def run(self, *, until: Callable[[], bool] | None = None) -> None:
        await self.start()
        try:
            while not self.stopping.is_set() and not (until and until()):
                await self.safe_step()
        finally:
            await self.stop()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)

    # -- rebalance -------------------------------------------------------------------------------------
    async def _on_revoked(self, revoked: list[TopicPartition]) -> None:
        async with self.lock:  # waits for the in-flight transaction to commit or abort
            self.epoch += 1
            self._clear_inbox()
            ps = {tp.partition for tp in revoked}
            log.info("%s%s revoked %s", self.service, self.instance, sorted(ps))
            # Keep producers and state: if the partition comes back to us, they are still valid (fencing
            # would tell us otherwise); if it goes elsewhere, the new owner fences this producer.

    async def _on_assigned(self, assigned: list[TopicPartition]) -> None:
        """Keep this fast: heartbeats stop while a rebalance callback runs. Partitions we still hold state
        and a producer for resume at once; new ones are paused and taken over by the main loop (``_take``)."""
        async with self.lock:
            assert self.consumer is not None
            self.epoch += 1
            self._clear_inbox()  # kept partitions are sought back to their committed offsets below
            ps = sorted({tp.partition for tp in assigned})
            for p in list(self.tasks):
                if p not in ps:
                    await self._drop(p)
            self.pending = {p for p in ps if p not in self.tasks or p not in self.producers}
            for p in ps:
                if p in self.pending:
                    self.consumer.pause(*[TopicPartition(t, p) for t in self.inputs])
                else:
                    for topic, off in self.committed[p].items():
                        self.consumer.seek(TopicPartition(topic, p), off)
            log.info("%s%s assigned %s (to take over: %s)", self.service, self.instance, ps, sorted(self.pending))

    async def _take(self) -> None:
        """Take over the pending partitions: producer + init_transactions (fences the previous owner), then
        committed offsets, then the last committed snapshot, then re-read exactly the buffered input."""
        assert self.consumer is not None
        ps = sorted(self.pending)
        t0 = time.monotonic()
        for p in ps:
            await self._drop(p)

        async def init(p: int) -> None:
            prod = AIOKafkaProducer(**self.kw, transactional_id=self.txn_id(p), enable_idempotence=True, acks="all",
                                    linger_ms=self.linger_ms, max_request_size=MAX_MESSAGE_BYTES,
                                    max_batch_size=1024 * 1024)
            await prod.start()
            # init_transactions (InitProducerId) completes/aborts the previous owner's open transaction and
            # fences its producer. Only after this are the committed offsets and the changelog stable.
            await asyncio.shield(prod._txn_manager.wait_for_pid())
            self.producers[p] = prod

        await asyncio.gather(*(init(p) for p in ps))
        await self._rebuild(ps)
        self.pending.difference_update(ps)
        self.consumer.resume(*[TopicPartition(t, p) for p in ps for t in self.inputs])
        log.info("%s%s took over %s in %.2fs", self.service, self.instance, ps, time.monotonic() - t0)

    def _clear_inbox(self) -> None:
        self.inbox.clear()
        self.inbox_pos.clear()

    async def _drop(self, p: int, *, broken: bool = False) -> None:
        self.inbox.pop(p, None)
        self.inbox_pos.pop(p, None)
        self.tasks.pop(p, None)
        self.committed.pop(p, None)
        self.commits.forget(p)
        self.snap_written.pop(p, None)
        prod = self.producers.pop(p, None)
        if prod is not None:
            if broken:  # may be stuck retrying: close it in the background; its successor fences it anyway
                t = asyncio.create_task(self._close_quietly(prod, p))
                self._closing.add(t)
                t.add_done_callback(self._closing.discard)
            else:
                await self._close_quietly(prod, p)

    @staticmethod
    async def _close_quietly(prod: AIOKafkaProducer, p: int) -> None:
        try:
            await asyncio.wait_for(prod.stop(), 10)
        except BaseException as e:  # noqa: BLE001 - a fenced or stuck producer may complain on close
            log.debug("producer %s stop: %s", p, e)

    async def _rebuild(self, ps: list[int]) -> None:
        """Fresh tasks for ``ps`` from the last committed snapshots and the committed input offsets."""
        assert self.consumer is not None
        if not ps:
            return
        self.stats.rebuilt += len(ps)
        for p, r in (await self.restorer.restore(ps, self.consumer, self.make_task)).items():
            self.tasks[p] = r.task
            self.committed[p] = r.committed
            self.snap_written[p] = r.snapshot
            for t, off in r.committed.items():
                self.consumer.seek(TopicPartition(t, p), off)

    async def stalled(self, after_s: float = 30.0) -> list[int]:
        """Owned partitions with input waiting but no commit for ``after_s`` (``streams.commits.StallWatch``):
        the service rebuilds its clients when this is not empty."""
        if self.consumer is None or not self.committed:
            return []
        return await self.stalls.stalled(self.consumer, self.committed, after_s)

    def lost_cluster(self) -> bool:
        """True when the consumer's client knows no broker at all (aiokafka does not re-bootstrap then)."""
        try:
            clients = [self.consumer._client] if self.consumer is not None else []
            clients += [prod.client for prod in self.producers.values()]
            return any(not c.cluster.brokers() for c in clients)
        except Exception:  # noqa: BLE001
            return False

    async def safe_step(self) -> None:
        """One step; a Kafka error outside a transaction (broker restarting...) is logged and retried."""
        try:
            await self.step()
        except KafkaError as e:
            log.warning("%s%s: %s: %s; retrying", self.service, self.instance, type(e).__name__, e)
            await asyncio.sleep(1.0)

    # -- the loop --------------------------------------------------------------------------------------
    async def step(self) -> None:
        assert self.consumer is not None
        if self.pending:
            async with self.lock:
                if self.pending:
                    try:
                        await asyncio.wait_for(self._take(), self.txn_timeout_s)
                    except Exception as e:  # noqa: BLE001 - broker away, coordinator moving: retry next step
                        log.warning("%s%s: taking over %s failed (%s: %s); retrying", self.service, self.instance,
                                    sorted(self.pending), type(e).__name__, e)
                        for p in list(self.pending):
                            await self._drop(p, broken=True)
                        await asyncio.sleep(1.0)
                        return
        if self.commits.time_to_check():
            await self.confirm_commits()
        epoch = self.epoch
        batch = await self.consumer.getmany(timeout_ms=int(self.tick_s * 1000), max_records=self.max_records)
        async with self.lock:
            if self.epoch != epoch:
                # A rebalance ran while getmany waited and re-seeked our partitions to their committed offsets:
                # these records were fetched before that and will be fetched again. Processing them now would
                # process them twice (the SIGKILL test caught exactly this). Dropping them must not skip them
                # either (getmany advanced the positions), so every owned partition goes back to its last
                # committed offsets, which is exactly where its task's state stands.
                self._clear_inbox()
                for p, offs in self.committed.items():
                    if p in self.tasks:
                        for t, off in offs.items():
                            self.consumer.seek(TopicPartition(t, p), off)
                return
            for tp, recs in batch.items():
                if tp.partition in self.tasks and recs:
                    self.inbox[tp.partition].extend(recs)
                    # the consumer's position: past the last record and any transaction markers right after it,
                    # so a fully processed partition commits at its end offset (lag 0 in `rollout status`)
                    try:
                        self.inbox_pos[tp.partition][tp.topic] = await self.consumer.position(tp)
                    except Exception:  # noqa: BLE001 - fall back to last offset + 1
                        pass
            now = time.monotonic()
            tick = now - self._last_tick >= self.tick_s
            if tick:
                self._last_tick = now
            due = {p for p in self.inbox if now - self.last_commit.get(p, 0.0) >= self.commit_interval_s}
            ps = due | (set(self.tasks) if tick else set())
            if ps:
                await asyncio.gather(*(self._transact(p, self.inbox.pop(p, []), tick, self.inbox_pos.pop(p, {}))
                                       for p in ps))

    async def _transact(self, p: int, recs: list, tick: bool, pos: dict[str, int] | None = None) -> None:
        task, prod = self.tasks.get(p), self.producers.get(p)
        if task is None or prod is None:
            return
        outs: list[Out] = []
        next_off: dict[str, int] = {}
        try:
            for rec in recs:
                outs.extend(await task.process(rec))
                next_off[rec.topic] = rec.offset + 1
            for t, o in (pos or {}).items():
                if t in next_off and o > next_off[t]:
                    next_off[t] = o
            if tick:
                outs.extend(task.tick(time.monotonic()))
            snap = encode_snapshot(task.buffered(), task.state())
            if not outs and not next_off and snap == self.snap_written.get(p):
                return
            await asyncio.wait_for(self._send_and_commit(p, prod, outs, snap, next_off), self.txn_timeout_s)
        except ProducerFenced:
            self.stats.fenced += 1
            log.warning("%s partition %d: fenced by a newer owner; dropping it and asking the group who owns it",
                        self.service, p)
            await self._drop(p)
            # Usually the owner is another member and a rebalance is already on its way. But when sessions
            # expire (a broker failure), rebalances follow each other: another member took p over in one
            # generation, and the next gave p back to us while we still held its task, so the group says p is
            # ours and nobody would ever process it (a three-broker fault run stalled so, for good). A rejoin
            # makes the group decide again: whoever gets p without a task takes it over (``_on_assigned``).
            if self.consumer is not None:
                self.consumer._coordinator.request_rejoin()
            return
        except Exception as e:  # noqa: BLE001 - abort, rebuild the partition from the log, keep serving
            # Covers a failed or stuck transaction too (e.g. a broker restart can leave a produce retrying
            # forever). The producer is discarded; the partition is taken over again by a fresh producer with
            # the same transactional id, whose init_transactions aborts whatever this one left open, and the
            # task is rebuilt from the changelog and the committed offsets.
            self.stats.aborted += 1
            log.warning("%s partition %d: transaction failed (%s: %s); discarding it and taking the partition "
                        "over again", self.service, p, type(e).__name__, e)
            await self._drop(p, broken=True)
            self.pending.add(p)
            if self.consumer is not None:
                self.consumer.pause(*[TopicPartition(t, p) for t in self.inputs])
            return
        self.snap_written[p] = snap
        self.committed[p].update(next_off)
        self.last_commit[p] = time.monotonic()
        self.stats.transactions += 1
        self.stats.records_in += len(recs)
        self.stats.records_out += len(outs)
        for o in outs:
            self.stats.by_type[o.event.EVENT_TYPE] += 1
        if self.on_commit is not None:
            self.on_commit(p, recs, outs)


    async def _send_and_commit(self, p: int, prod: AIOKafkaProducer, outs: list[Out], snap: bytes,
                               next_off: dict[str, int]) -> None:
        await prod.begin_transaction()
        futs = []
        for o in outs:
            key, value, headers = serde.to_message(o.event)
            futs.append(await prod.send(o.topic, value=value, key=key, headers=headers))
        if snap != self.snap_written.get(p):
            futs.append(await prod.send(self.changelog, value=snap, key=str(p).encode(), partition=p))
        if next_off:
            await prod.send_offsets_to_transaction({TopicPartition(t, p): o for t, o in next_off.items()},
                                                   self.group_id)
        written = await asyncio.gather(*futs)
        await prod.commit_transaction()
        self.commits.wrote(p, written)

    async def confirm_commits(self) -> list[int]:
        """Re-commit the owned partitions whose committed transactions are not visible after ``confirm_s``
        (``streams.commits.CommitWatch``). Returns the partitions re-committed."""
        if self.consumer is None or not self.tasks:
            return []
        due = await self.commits.overdue(self.consumer, self.committed)
        for p, tps in sorted(due.items()):
            await self._recommit(p, tps)
        return sorted(due)

    async def _recommit(self, p: int, tps: list[TopicPartition]) -> None:
        async with self.lock:
            prod, offs = self.producers.get(p), self.committed.get(p)
            if prod is None or offs is None or p not in self.tasks:
                return
            log.warning("%s%s partition %d: committed transaction not visible after %.0fs (outputs %s); "
                        "committing again over the same partitions and offsets", self.service, self.instance, p,
                        self.commits.confirm_s, [f"{tp.topic}-{tp.partition}" for tp in tps])
            try:
                await asyncio.wait_for(commit_again(prod, self.group_id, tps,
                                                    {TopicPartition(t, p): o for t, o in offs.items()}),
                                       self.txn_timeout_s)
            except Exception as e:  # noqa: BLE001 - a fence or a dead broker: the usual paths take over
                log.warning("%s partition %d: re-commit failed (%s: %s)", self.service, p, type(e).__name__, e)
                return
            self.stats.recommitted += 1
            self.commits.recommitted(p, tps)


class _Listener(ConsumerRebalanceListener):
    def __init__(self, proc: TransactionalProcessor) -> None:
        self.proc = proc

    async def on_partitions_revoked(self, revoked):
        await self.proc._on_revoked(list(revoked))

    async def on_partitions_assigned(self, assigned):
        await self.proc._on_assigned(list(assigned))
