"""batcher: TrainingRecords -> lineage-stamped TrainerBatches targeting the latest revision.

The latest revision is a side input (``streams.revisions``, read_committed, no consumer group): every
instance sees every revision, and the off-policy bound is checked against it (``consumers.batching``).
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from consumers.batching import BatchPolicy, Batcher
from consumers.service import TaskDefaults, TaskFactory, dead_letter, decode
from consumers.settings import ServiceSettings
from schemas.errors import EventDecodeError
from schemas.events import TrainingRecord
from streams import topics
from streams.revisions import DroppedBatches, RevisionWatcher
from streams.settings import MAX_MESSAGE_BYTES
from streams.partition_task import Out

NAME = "batcher"


class BatcherTask(TaskDefaults):  # no state beyond the buffered records, and a derived run's pace
    def __init__(self, partition: int, cfg: ServiceSettings, revisions: RevisionWatcher,
                 dropped: DroppedBatches | None = None) -> None:
        self.p = partition
        self.family = cfg.family
        self.revisions = revisions
        self.dropped = dropped  # a derived run's: the batches its trainer dead-lettered
        self.batcher: Batcher[Any] = Batcher(BatchPolicy(
            family=cfg.family, max_off_policy_steps=cfg.max_off_policy_steps,
            batch_records=None if cfg.batch_tokens else cfg.batch_records, batch_tokens=cfg.batch_tokens,
            max_batch_bytes=MAX_MESSAGE_BYTES * 9 // 10,
            flush_after_s=cfg.flush_after_s, ahead_timeout_s=cfg.ahead_timeout_s,
            history=cfg.derivation.rule() if cfg.derivation else None), producer=f"{NAME}{cfg.instance}")

    def _add(self, rec: Any, record: TrainingRecord):
        self.batcher.run_id = record.run_id
        return self.batcher.add(record, time.monotonic(), rec)

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
        batches, refusals = self.batcher.poll(self.revisions.latest.get(self.family), now,
                                              dropped=self.dropped.count if self.dropped else 0)
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
    dropped = DroppedBatches(client_kwargs) if cfg.derivation else None  # paced by its trainer's revisions
    await revisions.start()
    try:
        if dropped is not None:
            await dropped.start()
        yield lambda p: BatcherTask(p, cfg, revisions, dropped)
    finally:
        if dropped is not None:
            await dropped.stop()
        await revisions.stop()
