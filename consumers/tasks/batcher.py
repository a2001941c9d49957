"""batcher: TrainingRecords -> lineage-stamped TrainerBatches targeting the latest revision.

The latest revision is a side input (``streams.revisions``, read_committed, no consumer group): every
instance sees every revision, and the off-policy bound is checked against it (``consumers.batching``). So is the
admissions ledger (``streams.admissions``): a batch waits for the admitted groups it must take, and a partial
batch for every admitted group (``AdmissionBook.coming``), less those whose records came (``arrived``, by group).
A group strategy (grpo) credits a group in one transaction, so its first record means the whole group came; a
per-rollout one (per_step, reinforce_baseline, ema_per_member) emits each rollout as it is scored, so a group has
come once records of all its claim's rollouts have (a rollout that yields none, a failed one, keeps its group owed
until the ledger settles the claim: done ``flush_after_s`` ago, or for a group strategy ``group_timeout_s`` more,
the time credit holds a group one of whose rollouts the verifier dead-lettered). A partial batch that leaves
nothing buffered, with nothing coming, goes out with an ``AdmissionRebase`` in the same transaction: the arenas
count batch slots again from its revision.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from consumers.batching import BatchPolicy, Batcher
from consumers.credit import STRATEGIES
from consumers.service import TaskDefaults, TaskFactory, dead_letter, decode
from consumers.settings import ServiceSettings
from schemas.admission import AdmissionRebase
from schemas.errors import EventDecodeError
from schemas.events import TrainingRecord
from streams import topics
from streams.admissions import KafkaLedger
from streams.revisions import DroppedBatches, RevisionWatcher
from streams.settings import MAX_MESSAGE_BYTES
from streams.partition_task import Out

NAME = "batcher"
UNCLAIMED_KEEP_S = 60.0


class BatcherTask(TaskDefaults):  # no state beyond the buffered records and the count of batches emitted
    def __init__(self, partition: int, cfg: ServiceSettings, revisions: RevisionWatcher, dropped: DroppedBatches,
                 ledger: KafkaLedger | None = None) -> None:
        self.p = partition
        self.family = cfg.family
        self.revisions = revisions
        self.dropped = dropped  # the batches the trainer dead-lettered: never revisions, not ahead of it
        self.ledger = ledger  # a live run's admissions, folded as the arenas fold them
        # group -> (when its first record came, the rollouts whose records came), while the ledger may still owe it
        self.arrived: dict[str, tuple[float, set[str]]] = {}
        self.whole_groups = STRATEGIES[cfg.credit].buffers  # a group's records come together
        # how long after its Done a group whose records have not come may still come: credit holds an incomplete
        # group for group_timeout_s, then credits what came. A shorter grace flushed the batch and rebased without
        # it, and its records came after: trained a batch late, or never at the run's end
        self.grace_s = cfg.flush_after_s + (cfg.group_timeout_s if self.whole_groups else 0.0)
        self.batcher: Batcher[Any] = Batcher(BatchPolicy(
            family=cfg.family, max_off_policy_steps=cfg.max_off_policy_steps,
            batch_records=None if cfg.batch_tokens else cfg.batch_records, batch_tokens=cfg.batch_tokens,
            max_batch_bytes=MAX_MESSAGE_BYTES * 9 // 10,
            flush_after_s=cfg.flush_after_s, ahead_timeout_s=cfg.ahead_timeout_s,
            history=cfg.derivation.rule() if cfg.derivation else None), producer=f"{NAME}{cfg.instance}")

    def _add(self, rec: Any, record: TrainingRecord):
        self.batcher.run_id = record.run_id
        # a sub-episode's records name its own group, which no claim names: not owed
        self.arrived.setdefault(record.group_id, (time.monotonic(), set()))[1].add(record.rollout_id)
        return self.batcher.add(record, time.monotonic(), rec)

    def _ledger_view(self) -> tuple[Callable[[int], int], int]:
        """(owes, coming) for ``Batcher.poll``: admitted groups whose records have not come, that a batch trained
        from a given revision must take, and of any batch. A group stays in ``arrived`` until the ledger can no
        longer count it (given back, or done ``grace_s`` ago), or, no claim naming it, for
        ``UNCLAIMED_KEEP_S`` (the ledger is folded a moment behind the log)."""
        if self.ledger is None:
            return (lambda revision: 0), 0
        book, now, grace = self.ledger.book, self.ledger.now(), self.grace_s
        coming = book.coming(self.family, now, grace)  # (which settles what can no longer come)
        come = set()
        for g, (first, rollouts) in list(self.arrived.items()):
            claim_id = book.by_group.get(g)
            if claim_id not in book.unsettled and (claim_id is not None or time.monotonic() - first > UNCLAIMED_KEEP_S):
                del self.arrived[g]
            elif self.whole_groups or claim_id is None or len(rollouts) >= book.claims[claim_id].claim.rollouts:
                come.add(g)
        bound = self.batcher.policy.max_off_policy_steps

        def owes(revision: int) -> int:
            return len(book.coming(self.family, now, grace, seen_at_most=revision - bound) - come)

        return owes, len(coming - come)

    async def process(self, rec: Any) -> list[Out]:
        try:
            record = decode(rec, TrainingRecord)
        except EventDecodeError as e:
            return [dead_letter(rec, NAME, type(e).__name__, str(e))]
        refusal = self._add(rec, record)
        return [dead_letter(rec, NAME, refusal.error_type, refusal.reason, record.run_id)] if refusal else []

    def input_read(self, now: float) -> list[Out]:
        """A whole batch goes out once the input read with it is processed, not at the record that fills it: a
        group's records come in one credit transaction, and the rest of the group is owed the same batch.
        Partial flushes and stale refusals wait for the processor's tick."""
        return self.tick(now) if self.batcher.full() else []

    def restore(self, rec: Any) -> None:
        self._add(rec, decode(rec, TrainingRecord))

    def tick(self, now: float) -> list[Out]:
        self.revisions.check()  # a side input that stopped reading ends the service, not the batcher's judgement
        self.dropped.check()
        owes, coming = self._ledger_view()
        batches, refusals = self.batcher.poll(self.revisions.latest.get(self.family), now, dropped=self.dropped.count,
                                              owes=owes, coming=coming)
        outs = [Out(topics.TRAINER_BATCHES.name, b) for b, _ in batches]
        outs += [dead_letter(r.item.tag, NAME, r.error_type, r.reason, r.item.record.run_id) for r in refusals]
        if self.batcher.rebase is not None and self.ledger is not None:
            last = batches[-1][0]
            outs.append(Out(topics.ADMISSIONS.name, AdmissionRebase(
                run_id=last.run_id, producer=self.batcher.producer, family=self.family, revision=self.batcher.rebase,
                claims=self.ledger.book.claims_folded(self.family),
                reason=f"batch {last.batch_id} went out with {len(last.records)} records, no admitted group still "
                       f"coming")))
        return outs

    def buffered(self) -> dict[str, list[int]]:
        return {topics.TRAINING_RECORDS.name: [it.tag.offset for it in self.batcher.items]}

    def state(self) -> dict[str, Any]:
        b = self.batcher
        return {"emitted_batches": b.emitted_batches, "base": b.base} if b.emitted_batches else {}

    def load_state(self, state: dict[str, Any]) -> None:
        # "history_batches": a derived run's count, before live runs counted theirs (its base is its fork)
        self.batcher.emitted_batches = int(state.get("emitted_batches", state.get("history_batches", 0)))
        base = state.get("base")
        self.batcher.base = (int(base[0]), int(base[1])) if base else None



@asynccontextmanager
async def wiring(cfg: ServiceSettings, client_kwargs: dict[str, Any]) -> AsyncIterator[TaskFactory]:
    revisions = RevisionWatcher(client_kwargs)
    dropped = DroppedBatches(client_kwargs)
    # a derived run is paced by its trainer's revisions; a live one by the arenas' admissions
    ledger = None if cfg.derivation else KafkaLedger(client_kwargs)
    folding: asyncio.Task | None = None
    await revisions.start()
    try:
        await dropped.start()
        if ledger is not None:
            await ledger.start()
            folding = asyncio.create_task(_fold(ledger), name="admissions-ledger")
        yield lambda p: BatcherTask(p, cfg, revisions, dropped, ledger)
    finally:
        if folding is not None:
            folding.cancel()
            await asyncio.gather(folding, return_exceptions=True)
        if ledger is not None:
            await ledger.stop()
        await dropped.stop()
        await revisions.stop()


async def _fold(ledger: KafkaLedger) -> None:
    while True:
        await ledger.wait(1.0)
