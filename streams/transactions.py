"""The transactional read-process-write loop every service runs (exactly-once, Kafka Streams EOS-v2 style).

Why this shape (see docs/EXACTLY-ONCE.md):

* **One transactional producer per service instance**, and one transaction per step for the work of all the
  partitions it owns: outputs, changelog snapshots and the input offsets of every owned partition. Zombies
  are fenced by the consumer group (KIP-447, ``streams.group_fencing``): the offsets carry the generation
  and member id the partitions were assigned in, and the group coordinator refuses them once the group has
  moved on, so a member that lost its partitions cannot commit (its transaction is aborted). Every
  transaction commits offsets, even one with outputs only (a timer's flush), so none escapes the fence.
* A new owner reads the committed offsets with ``require_stable`` (``streams.group_offsets``): while the
  previous owner's transaction is open, it waits; then it restores the last committed snapshot from the
  changelog (``streams.changelog``), once no transaction is open there either.
* The transactional id is ``{group}-{instance}`` (``--instance``, else the lowest slot of the group free on this
  host, ``streams.instances``): a restarted instance with the same name, or the next unnamed one on the same
  host, aborts its crashed predecessor's open transaction at once; elsewhere the broker aborts it after
  ``ROLLOUT_TRANSACTION_TIMEOUT_MS``.
* Co-partitioned inputs (steps + rollouts) are owned together: a consumer group with the range
  assignor hands out the same partition number of every input topic to one member.
* A failed transaction is aborted and every owned partition's task is rebuilt from the changelog and the
  committed offsets (their tasks ran ahead of what committed); a fenced one drops the partitions and asks
  the group again who owns what.
* A commit is checked, not trusted: one that does not become visible to ``read_committed`` readers (a
  transaction left hanging by a broker restart) is committed again (``streams.commits``).

Timeouts and the topic prefix come from ``streams.settings``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import KafkaError, ProducerFenced

from streams import aiokafka_internals, serde
from streams.batched_send import PartitionBatches
from streams.changelog import Restorer, encode_snapshot
from streams.commits import CommitWatch, StallWatch, commit_again
from streams.group_fencing import GroupFenced, GroupMember, fence_by_group, fence_error_seen
from streams.instances import slot_name, slots_dir
from streams.partition_task import EnvironmentFault, Out, PartitionTask, dead_letter
from streams.poison import PoisonCounts, ProcessMustRestart
from streams.processor_config import LINGER_MS, MAX_RECORDS, TICK_S, ProcessorConfig
from streams.rebalance import Rebalance
from streams.settings import FETCH_OPTIONS, MAX_MESSAGE_BYTES

log = logging.getLogger("rollout.eos")

POISON_ATTEMPTS = 3  # a record a task raises on this many times is dead-lettered (``TransactionalProcessor._process``)
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})
ENVIRONMENT_RETRY_S = 30.0  # how long an instance waits before trying again after the environment's fault


def environment_fault(e: BaseException) -> bool:
    """The environment's fault, not the record's (a full disk, a failing or read-only one, memory exhausted, a
    server a task needs that is down: ``EnvironmentFault``): waited out and tried again, never a reason to
    dead-letter the record."""
    return isinstance(e, MemoryError | EnvironmentFault) or (isinstance(e, OSError) and e.errno in ENVIRONMENT_ERRNOS)


# What every processor's transactional producer is opened with (besides its id, linger and transaction timeout);
# ``benchmarks send`` measures a producer opened the same way.
PRODUCER_OPTIONS: dict[str, Any] = {"enable_idempotence": True, "acks": "all", "max_request_size": MAX_MESSAGE_BYTES,
                                    "max_batch_size": 1024 * 1024}


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


@dataclass
class Transaction:
    """One transaction's work (``TransactionalProcessor._transact``): the input it processed per partition and
    each partition's fetch position, what it writes (outputs, changed snapshots), the offsets it commits (every
    owned partition's, changed or not: the group's generation check fences it) and the input it left over."""
    started: float
    read: dict[int, list]
    positions: dict[int, dict[str, int]]
    offsets: dict[int, dict[str, int]]
    outputs: dict[int, list[Out]] = field(default_factory=dict)
    snapshots: dict[int, bytes] = field(default_factory=dict)
    left: dict[int, list] = field(default_factory=dict)

    def writes_nothing(self, committed: dict[int, dict[str, int]]) -> bool:
        moved = any(self.offsets[p] != committed[p] for p in self.read)
        return not moved and not self.snapshots and not any(self.outputs.values())


class TransactionalProcessor:
    """Consume the config's inputs (co-partitioned) in its service's group and run one ``PartitionTask`` per
    partition. ``make_task(partition)`` builds a fresh task; ``client_kwargs`` are aiokafka connection kwargs;
    ``poison_dir``: where the failure counts outlive the process (``streams.poison``), else in memory."""

    def __init__(self, config: ProcessorConfig, make_task: Callable[[int], PartitionTask],
                 client_kwargs: dict[str, Any], *, poison_dir: Path | None = None) -> None:
        self.config = config
        self.make_task = make_task
        self.kw = dict(client_kwargs)
        # an unnamed instance: the lowest slot of its group free on this host, the id a dead predecessor had
        self.txn_id = f"{config.group_id}-{config.instance or slot_name(config.group_id)}"
        self.tick_s = TICK_S  # a benchmark shortens it
        # how often each input record failed (``_process``); in a file where a failure can kill the process first
        self.poison = PoisonCounts(poison_dir / f"{self.txn_id}.json" if poison_dir else None)
        self.tasks: dict[int, PartitionTask] = {}
        self.producer: AIOKafkaProducer | None = None
        self.committed: dict[int, dict[str, int]] = {}
        self.snap_written: dict[int, bytes] = {}
        self.stats = Stats()
        # called with (partition, input records, outputs) after each committed transaction (streams.metrics)
        self.on_commit: Callable[[int, list, list[Out]], None] | None = None
        self.lock = asyncio.Lock()
        self.stopping = asyncio.Event()
        self.consumer: AIOKafkaConsumer | None = None
        self.restorer = Restorer(self.kw, config.changelog, list(config.inputs))
        self._last_tick = 0.0
        self.pending: set[int] = set()
        self.epoch = 0  # bumped by every rebalance callback
        # the group generation the tasks belong to; None between a revocation and the next assignment, when
        # nothing may commit (the partitions may be someone else's by now)
        self.member: GroupMember | None = None
        self._tasks_member: GroupMember | None = None
        self._closing: set[asyncio.Task] = set()
        # what this id committed and no reader saw yet, in a file a successor with the id reads (streams.commits)
        self.commits = CommitWatch(config.settings.confirm_s, slots_dir() / f"{self.txn_id}.commits.json")
        # Fetched input not processed yet: with ROLLOUT_COMMIT_INTERVAL_MS, a partition's input waits here until
        # its last commit is that old, then is processed and committed. Never ahead of the task's state: it is
        # dropped, and re-read from the committed offsets, whenever the partitions are re-seeked.
        self.inbox: dict[int, list] = defaultdict(list)
        self.inbox_pos: dict[int, dict[str, int]] = defaultdict(dict)
        self.last_commit: dict[int, float] = {}
        self.stalls = StallWatch()

    # -- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        aiokafka_internals.check()  # before anything is committed: a fence that silently went away is no fence
        await self.restorer.start()
        cfg = self.config
        self.consumer = AIOKafkaConsumer(
            **self.kw, group_id=cfg.group_id, enable_auto_commit=False, isolation_level="read_committed",
            auto_offset_reset="earliest", partition_assignment_strategy=(RangePartitionAssignor,),
            **FETCH_OPTIONS, session_timeout_ms=cfg.session_timeout_ms,
            heartbeat_interval_ms=min(1000, cfg.session_timeout_ms // 3),
            rebalance_timeout_ms=max(30000, cfg.max_process_ms), max_poll_interval_ms=cfg.max_process_ms,
            fetch_max_wait_ms=cfg.settings.fetch_max_wait_ms)
        await self.consumer.start()
        self.consumer.subscribe(self.config.inputs, listener=Rebalance(self))

    async def stop(self) -> None:
        """Graceful: finish the open transaction (lock), then leave the group and close the producer. The group is
        left outside the lock: aiokafka's ``consumer.stop()`` first waits for its coordination task, which in a
        rebalance is in our revocation callback waiting for that lock (``streams.rebalance``). Holding it there
        hung a System's exit for good when a second instance had just left the group (the event loop idle in
        ``select``: ``test_commit_interval``). Called once the loop is done, so no transaction starts meanwhile."""
        async with self.lock:
            pass  # the transaction in flight, if any, is committed or aborted
        if self.consumer is not None and self.commits.unconfirmed:
            try:  # one look, so a stop leaves no file of what is already visible (a broker gone: not waited for)
                await asyncio.wait_for(self.commits.hidden(self.consumer), 1.0)
            except Exception as e:  # noqa: BLE001
                log.debug("last look at unconfirmed commits: %s", e)
        if self.consumer is not None:
            try:
                await aiokafka_internals.stop_consumer(self.consumer)  # leaves the group
            except Exception as e:  # noqa: BLE001
                log.warning("consumer stop: %s", e)
        async with self.lock:
            self._drop_all()
            await self._close_producer()
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

    async def _open_producer(self) -> AIOKafkaProducer:
        """The instance's producer; ``init_transactions`` (InitProducerId) aborts whatever a predecessor with
        the same transactional id left open and fences it."""
        prod = AIOKafkaProducer(**self.kw, **PRODUCER_OPTIONS, transactional_id=self.txn_id, linger_ms=LINGER_MS,
                                transaction_timeout_ms=self.config.settings.transaction_timeout_ms)
        try:
            await prod.start()
            await asyncio.shield(prod._txn_manager.wait_for_pid())
        except BaseException:
            await self._close_quietly(prod)
            raise
        fence_by_group(prod, self._member)
        return prod

    def _member(self) -> GroupMember:
        assert self.member is not None, "no transaction may commit between a revocation and an assignment"
        return self.member

    async def _close_producer(self, *, broken: bool = False) -> None:
        prod, self.producer = self.producer, None
        if prod is None:
            return
        if broken:  # may be stuck retrying: close it in the background; its successor fences it anyway
            t = asyncio.create_task(self._close_quietly(prod))
            self._closing.add(t)
            t.add_done_callback(self._closing.discard)
        else:
            await self._close_quietly(prod)

    @staticmethod
    async def _close_quietly(prod: AIOKafkaProducer) -> None:
        try:
            await asyncio.wait_for(prod.stop(), 10)
        except BaseException as e:  # noqa: BLE001 - a fenced or stuck producer may complain on close
            log.debug("producer stop: %s", e)

    async def _take(self) -> None:
        """Take over the pending partitions: the producer if there is none, then (``Restorer``) the committed
        offsets once no transaction holds them, the last committed snapshot, exactly the buffered input."""
        assert self.consumer is not None
        ps = sorted(self.pending)
        t0 = time.monotonic()
        if self.producer is None:
            self.producer = await self._open_producer()
        hidden = await self.commits.hidden(self.consumer)
        if hidden:
            # a commit of ours still not visible may hang and hold these partitions' offsets and snapshots: close
            # it first, or the restore below waits on it for good (at worst an empty transaction, when another
            # producer's open transaction was what held the last stable offset)
            await self._commit_again(hidden)
        await self._rebuild(ps)
        self.pending.difference_update(ps)
        self.consumer.resume(*[TopicPartition(t, p) for p in ps for t in self.config.inputs])
        log.info("%s took over %s in %.2fs", self.config.name, ps, time.monotonic() - t0)

    def _clear_inbox(self) -> None:
        self.inbox.clear()
        self.inbox_pos.clear()

    def _drop(self, p: int) -> None:
        self.inbox.pop(p, None)
        self.inbox_pos.pop(p, None)
        task = self.tasks.pop(p, None)
        if task is not None:
            task.close()
        self.committed.pop(p, None)
        self.snap_written.pop(p, None)

    def _drop_all(self) -> None:
        for p in list(self.tasks):
            self._drop(p)
        self.commits.partitions_dropped()

    async def _retake_all(self) -> None:
        """After a failed transaction: every owned partition's task ran ahead of what committed; rebuild them
        all from the log, with a fresh producer (this one may be stuck, or hold the transaction open)."""
        owned = set(self.tasks) | self.pending
        self._drop_all()
        await self._close_producer(broken=True)
        self.pending = owned
        if self.consumer is not None and owned:
            self.consumer.pause(*[TopicPartition(t, p) for p in owned for t in self.config.inputs])

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
        """True when a client knows no broker at all (aiokafka does not re-bootstrap then)."""
        try:
            clients = [self.consumer._client] if self.consumer is not None else []
            clients += [self.producer.client] if self.producer is not None else []
            return any(not c.cluster.brokers() for c in clients)
        except Exception:  # noqa: BLE001
            return False

    async def safe_step(self) -> None:
        """One step; a Kafka error outside a transaction (broker restarting...) is logged and retried."""
        try:
            await self.step()
        except KafkaError as e:
            log.warning("%s: %s: %s; retrying", self.config.name, type(e).__name__, e)
            await asyncio.sleep(1.0)

    # -- the loop --------------------------------------------------------------------------------------
    async def step(self) -> None:
        assert self.consumer is not None
        if self.pending:
            async with self.lock:
                if self.pending and self.member is not None:
                    try:
                        await asyncio.wait_for(self._take(), self.config.txn_timeout_s)
                    except Exception as e:  # noqa: BLE001 - broker away, coordinator moving: retry next step
                        # (the partitions already owned are untouched: no transaction was open)
                        log.warning("%s: taking over %s failed (%s: %s); retrying", self.config.name,
                                    sorted(self.pending), type(e).__name__, e)
                        await asyncio.sleep(1.0)
                        return
        if self.commits.time_to_check():
            await self.confirm_commits()
        epoch = self.epoch
        # waiting for an assignment, or with partitions to take over: look again soon, not after a whole tick
        wait_s = 0.02 if self.pending or self.member is None else self.tick_s
        batch = await self.consumer.getmany(timeout_ms=int(wait_s * 1000), max_records=MAX_RECORDS)
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
                await self._past_lone_markers()
            due = {p for p in self.inbox if now - self.last_commit.get(p, 0.0) >= self.config.commit_interval_s}
            ps = due | (set(self.tasks) if tick else set())
            if ps and self.member is not None and self.producer is not None:
                await self._transact(sorted(ps), tick)

    async def _past_lone_markers(self) -> None:
        """A fetch cut right after a transaction's last record brings its commit marker alone, in the next fetch:
        the position moves past it with no record to process, so nothing would commit it (and `rollout status`
        would show a lag of 1 on an idle service). With nothing waiting in a partition's inbox, everything between
        its committed offset and the position is markers or aborted records: the tick's transaction commits it."""
        assert self.consumer is not None
        for p, offs in self.committed.items():
            if p in self.tasks and not self.inbox.get(p):
                for t, off in offs.items():
                    pos = await self.consumer.position(TopicPartition(t, p))
                    if pos > off:
                        self.inbox_pos[p][t] = pos

    async def _transact(self, ps: list[int], tick: bool) -> None:
        """Process the inbox of ``ps`` (and their timers on a tick) and commit it all in one transaction."""
        prod = self.producer
        assert prod is not None
        recs = {p: self.inbox.pop(p, []) for p in ps if p in self.tasks}
        txn = Transaction(time.monotonic(), recs, {p: self.inbox_pos.pop(p, {}) for p in recs},
                          {p: dict(self.committed[p]) for p in self.tasks})
        try:
            await self._fill(txn, tick)
            if txn.writes_nothing(self.committed):
                return
            await asyncio.wait_for(self._send_and_commit(prod, txn), self.config.txn_timeout_s)
        except GroupFenced as e:
            self.stats.fenced += 1
            log.warning("%s: %s; dropping partitions %s and asking the group who owns what", self.config.name,
                        e.args[-1], sorted(self.tasks))
            # Not abort_transaction: aiokafka forgets the transaction's partitions on this error, so its abort
            # sends no EndTxn and the open transaction would be committed by the next one (the fence test saw
            # the fenced scores doubled). A fresh producer's InitProducerId aborts it on the broker.
            fence_error_seen(prod)
            await self._close_producer(broken=True)
            self._drop_all()
            self.pending.clear()
            self.member = None
            if self.consumer is not None:
                self.consumer._coordinator.request_rejoin()
            return
        except ProcessMustRestart:
            raise
        except ProducerFenced:
            # Only a process with the same transactional id does this: another instance with our name, or our
            # own successor after a restart of the clients.
            self.stats.fenced += 1
            log.warning("%s: transactional id %s fenced by another producer (is a second instance running "
                        "with the same --instance?); taking the partitions over again", self.config.name,
                        self.txn_id)
            await self._retake_all()
            return
        except Exception as e:  # noqa: BLE001 - abort, rebuild the partitions from the log, keep serving
            # Covers a failed or stuck transaction too (e.g. a broker restart can leave a produce retrying
            # forever). The producer is discarded; a fresh one with the same transactional id aborts whatever
            # this one left open, and every owned partition's task is rebuilt from the changelog and the
            # committed offsets.
            self.stats.aborted += 1
            log.warning("%s: transaction over partitions %s failed (%s: %s); discarding it and taking them "
                        "over again", self.config.name, sorted(txn.read), type(e).__name__, e)
            await self._retake_all()
            return
        self._committed(txn)

    async def _fill(self, txn: Transaction, tick: bool) -> None:
        """Process ``txn``'s input, partition by partition, into its outputs, snapshots and offsets. Input is
        left for the next transaction once this one has processed for its budget: the group hears nothing from
        this member while it processes (no fetch; a revocation waits), so work is committed in pieces that each
        fit its patience, never lost and redone whole (``Service.max_process_s``)."""
        budget_end, processed = txn.started + self.config.process_budget_s, 0
        for p, rs in txn.read.items():
            task, out, nxt = self.tasks[p], [], txn.offsets[p]
            for i, rec in enumerate(rs):
                if processed and time.monotonic() > budget_end:
                    txn.left[p], txn.read[p] = rs[i:], rs[:i]
                    break
                out.extend(await self._process(task, rec))
                nxt[rec.topic] = rec.offset + 1
                processed += 1
            if p not in txn.left:
                for t, o in txn.positions[p].items():  # past any transaction markers after the last record
                    nxt[t] = max(nxt[t], o)
            out.extend(task.tick(txn.started) if tick else task.input_read(txn.started))
            snap = encode_snapshot(task.buffered(), task.state())
            if snap != self.snap_written.get(p):
                txn.snapshots[p] = snap
            txn.outputs[p] = out

    def _committed(self, txn: Transaction) -> None:
        """``txn`` is committed: what it wrote and read is now the partitions' committed state."""
        self.stats.transactions += 1
        for p, left in txn.left.items():  # first in line for the next transaction
            self.inbox[p][:0] = left
            self.inbox_pos[p] = {**txn.positions[p], **self.inbox_pos.get(p, {})}
        for p, out in txn.outputs.items():
            if p in txn.snapshots:
                self.snap_written[p] = txn.snapshots[p]
            self.committed[p] = txn.offsets[p]
            self.last_commit[p] = txn.started
            self.stats.records_in += len(txn.read[p])
            self.stats.records_out += len(out)
            for o in out:
                self.stats.by_type[o.event.EVENT_TYPE] += 1
            self.tasks[p].committed()
            if self.on_commit is not None and (txn.read[p] or out):
                self.on_commit(p, txn.read[p], out)
        if self.poison:  # committed past: forgotten
            self.poison.forget(self.committed)

    async def _process(self, task: PartitionTask, rec: Any) -> list[Out]:
        """``task.process(rec)``; a record it failed on ``POISON_ATTEMPTS`` times (each time the transaction was
        aborted and the partition rebuilt; ``streams.poison`` counts a try its process died in as failed too) is
        dead-lettered with the last error instead, so one poison record cannot hold its instance's partitions for
        ever. The environment's faults (``environment_fault``) are waited out and tried again, however often: they
        say nothing about the record."""
        key = (rec.topic, rec.partition, rec.offset)
        failed, why = self.poison.get(key)
        if failed >= POISON_ATTEMPTS:
            log.error("%s: %s[%d]@%d failed %d times (%s): dead-lettered, going on", self.config.name,
                      rec.topic, rec.partition, rec.offset, failed, why)
            return [dead_letter(rec, self.config.service, "PoisonRecordError",
                                f"processing failed {failed} times; the last: {why}")]
        self.poison.start(key)
        try:
            out = await task.process(rec)
        except Exception as e:
            fault = environment_fault(e)  # not counted towards poison: the same record succeeds once space is freed
            self.poison.ended(key, None if fault else e)
            if fault:
                log.error("%s: %s[%d]@%d: %s: %s. The environment's fault, not the record's: nothing is "
                          "dead-lettered; trying again in %.0fs (free the space or memory, or bring the server back, meanwhile)",
                          self.config.name, rec.topic, rec.partition, rec.offset, type(e).__name__, e,
                          ENVIRONMENT_RETRY_S)
                await asyncio.sleep(ENVIRONMENT_RETRY_S)
            if self.poison.once_per_life:  # a group may not agree where its failed step stopped: every rank restarts
                uncounted = "not counted against it, " if fault else ""
                raise ProcessMustRestart(f"{self.config.name}: {rec.topic}[{rec.partition}]@{rec.offset} failed "
                                         f"({type(e).__name__}: {e}); exiting, {uncounted}to be tried again by the "
                                         "next start (a torchrun group restarts every rank)") from e
            raise
        except BaseException:  # cancelled by a stop: no try of the record's
            self.poison.ended(key, None)
            raise
        self.poison.ended(key, None)
        return out

    def _offsets(self, offsets: dict[int, dict[str, int]]) -> dict[TopicPartition, int]:
        return {TopicPartition(t, p): o for p, offs in offsets.items() for t, o in offs.items()}

    async def _send_and_commit(self, prod: AIOKafkaProducer, txn: Transaction) -> None:
        await prod.begin_transaction()
        batches = PartitionBatches(prod, PRODUCER_OPTIONS["max_request_size"])
        for out in txn.outputs.values():
            for o in out:
                key, value, headers = serde.to_message(o.event)
                await batches.add(o.topic, value, key=key, headers=headers)
        for p, snap in txn.snapshots.items():
            await batches.add(self.config.changelog, snap, key=str(p).encode(), partition=p)
        await batches.send()
        # every owned partition's offsets, changed or not: the group's generation check fences this transaction
        await prod.send_offsets_to_transaction(self._offsets(txn.offsets), self.config.group_id)
        self.commits.wrote(await batches.written())
        await prod.commit_transaction()

    async def confirm_commits(self) -> list[TopicPartition]:
        """Re-commit when committed transactions are not visible after ``confirm_s``
        (``streams.commits.CommitWatch``), owning partitions or not (a new owner of ours may be waiting on a
        hanging commit of ours). Returns the output partitions re-committed."""
        if self.consumer is None or not (self.tasks or self.commits.unconfirmed):
            return []
        due = await self.commits.overdue(self.consumer, self.committed)
        if due is not None:
            await self._recommit(due)
        return due or []

    async def _recommit(self, tps: list[TopicPartition]) -> None:
        async with self.lock:
            if self.member is None or self.pending:  # a take-over re-commits first
                return
            log.warning("%s: committed transactions not visible after %.0fs (outputs %s); committing again over "
                        "the same partitions and offsets", self.config.name, self.commits.confirm_s,
                        [f"{tp.topic}-{tp.partition}" for tp in tps])
            try:
                if self.producer is None:  # owning nothing: a commit our id left hanging is still ours to close
                    self.producer = await self._open_producer()
                await self._commit_again(tps)
            except Exception:  # noqa: BLE001 - a fence or a dead broker: take everything over again
                await self._retake_all()

    async def _commit_again(self, tps: list[TopicPartition]) -> None:
        """``commit_again`` with this instance's producer, over ``tps`` and the owned partitions' committed
        offsets; a failure leaves the producer closed (it may be fenced or stuck) and is raised."""
        prod = self.producer
        assert prod is not None
        try:
            await asyncio.wait_for(commit_again(prod, self.config.group_id, tps, self._offsets(self.committed)),
                                   self.config.txn_timeout_s)
        except Exception as e:
            log.warning("%s: re-commit failed (%s: %s)", self.config.name, type(e).__name__, e)
            fence_error_seen(prod)
            await self._close_producer(broken=True)
            raise
        self.stats.recommitted += 1
        self.commits.recommitted(tps)
