"""batcher: TrainingRecords -> lineage-stamped TrainerBatches targeting the latest revision.

The latest revision is a side input (``streams.revisions``, read_committed, no consumer group): every
instance sees every revision, and the off-policy bound is checked against it (``consumers.batching``). So is the
admissions ledger (``streams.admissions``): a batch waits for the admitted groups it must take, and a partial
batch for every admitted group (``AdmissionBook.coming``), less those whose records came (``arrived``, by group).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from consumers.batching import BatchPolicy, Batcher
from consumers.service import TaskDefaults, TaskFactory, dead_letter, decode
from consumers.settings import ServiceSettings
from schemas.errors import EventDecodeError
from schemas.events import TrainingRecord
from streams import topics
from streams.admissions import KafkaLedger
from streams.revisions import DroppedBatches, RevisionWatcher
from streams.settings import MAX_MESSAGE_BYTES
from streams.partition_task import Out

NAME = "batcher"
UNCLAIMED_KEEP_S = 60.0


class BatcherTask(TaskDefaults):  # no state beyond the buffered records, and a derived run's pace
    def __init__(self, partition: int, cfg: ServiceSettings, revisions: RevisionWatcher,
                 dropped: DroppedBatches | None = None, ledger: KafkaLedger | None = None) -> None:
        self.p = partition
        self.family = cfg.family
        self.revisions = revisions
        self.dropped = dropped  # a derived run's: the batches its trainer dead-lettered
        self.ledger = ledger  # a live run's admissions, folded as the arenas fold them
        self.arrived: dict[str, float] = {}  # group -> when its records came, while the ledger may still owe it
        self.batcher: Batcher[Any] = Batcher(BatchPolicy(
            family=cfg.family, max_off_policy_steps=cfg.max_off_policy_steps,
            batch_records=None if cfg.batch_tokens else cfg.batch_records, batch_tokens=cfg.batch_tokens,
            max_batch_bytes=MAX_MESSAGE_BYTES * 9 // 10,
            flush_after_s=cfg.flush_after_s, ahead_timeout_s=cfg.ahead_timeout_s,
            history=cfg.derivation.rule() if cfg.derivation else None), producer=f"{NAME}{cfg.instance}")

    def _add(self, rec: Any, record: TrainingRecord):
        self.batcher.run_id = record.run_id
        self.arrived[record.group_id] = time.monotonic()  # a sub-episode's records name its own group: not owed
        return self.batcher.add(record, time.monotonic(), rec)

    def _coming(self, target: Any) -> tuple[int, int]:
        """(owed, coming): admitted groups whose records have not come, that the batch for ``target`` must take,
        and of any batch. A group stays in ``arrived`` until the ledger can no longer count it (given back, or done
        ``flush_after_s`` ago), or, no claim naming it, for ``UNCLAIMED_KEEP_S`` (the ledger is folded a moment
        behind the log)."""
        if self.ledger is None or target is None:
            return 0, 0
        book, now, grace = self.ledger.book, self.ledger.now(), self.batcher.policy.flush_after_s
        for g, came in list(self.arrived.items()):
            state = book.claims.get(book.by_group.get(g, ""))
            if (state is None and time.monotonic() - came > UNCLAIMED_KEEP_S) or (state is not None and (
                    state.released or (state.done_at is not None and now - state.done_at >= grace))):
                del self.arrived[g]
        coming = book.coming(self.family, now, grace) - self.arrived.keys()
        bound = target.revision - self.batcher.policy.max_off_policy_steps
        owed = book.coming(self.family, now, grace, seen_at_most=bound)
        return len(owed - self.arrived.keys()), len(coming)

    async def process(self, rec: Any) -> list[Out]:
        try:
            record = decode(rec, TrainingRecord)
        except EventDecodeError as e:
            return [dead_letter(rec, NAME, type(e).__name__, str(e))]
        refusal = self._add(rec, record)
        outs = [dead_letter(rec, NAME, refusal.error_type, refusal.reason, record.run_id)] if refusal else []
        # a whole batch goes out at once; partial flushes and stale refusals wait for the processor's tick
        return outs + self.tick(time.monotonic()) if self.batcher.full() else outs

    def restore(self, rec: Any) -> None:
        self._add(rec, decode(rec, TrainingRecord))

    def tick(self, now: float) -> list[Out]:
        target = self.revisions.latest.get(self.family)
        owed, coming = self._coming(target)
        batches, refusals = self.batcher.poll(target, now, dropped=self.dropped.count if self.dropped else 0,
                                              owed=owed, coming=coming)
        outs = [Out(topics.TRAINER_BATCHES.name, b) for b, _ in batches]
        outs += [dead_letter(r.item.tag, NAME, r.error_type, r.reason, r.item.record.run_id) for r in refusals]
        return outs

    def buffered(self) -> dict[str, list[int]]:
        return {topics.TRAINING_RECORDS.name: [it.tag.offset for it in self.batcher.items]}

    def state(self) -> dict[str, Any]:
        return {"history_batches": self.batcher.history_batches} if self.batcher.history_batches else {}

    def load_state(self, state: dict[str, Any]) -> None:
        self.batcher.history_batches = int(state.get("history_batches", 0))



@asynccontextmanager
async def wiring(cfg: ServiceSettings, client_kwargs: dict[str, Any]) -> AsyncIterator[TaskFactory]:
    revisions = RevisionWatcher(client_kwargs)
    # a derived run is paced by its trainer's revisions; a live one by the arenas' admissions
    dropped = DroppedBatches(client_kwargs) if cfg.derivation else None
    ledger = None if cfg.derivation else KafkaLedger(client_kwargs)
    folding: asyncio.Task | None = None
    await revisions.start()
    try:
        if dropped is not None:
            await dropped.start()
        if ledger is not None:
            await ledger.start()
            folding = asyncio.create_task(_fold(ledger), name="admissions-ledger")
        yield lambda p: BatcherTask(p, cfg, revisions, dropped, ledger)
    finally:
        if folding is not None:
            folding.cancel()
            await asyncio.gather(folding, return_exceptions=True)
        for side in (ledger, dropped):
            if side is not None:
                await side.stop()
        await revisions.stop()


async def _fold(ledger: KafkaLedger) -> None:
    while True:
        await ledger.wait(1.0)
