"""credit: RolloutScored -> TrainingRecords with the plan's credit strategy (``consumers.credit``); a ref_kl
source's scores (prime-rl's opd) are read from the reference service's RolloutReferenced instead, co-partitioned.

A strategy that waits for whole groups keeps each open group's input records, so a group that times
out dead-letters exactly the rollouts it held and a new owner re-reads exactly those. A group the plan's admission
gates keep out of training yields no records and one ``AdmissionRefund`` on the arenas' ledger, in the same
transaction, so its batch slots go to another group.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from consumers import credit
from consumers.service import TaskDefaults, TaskFactory, dead_letter, decode
from consumers.settings import ServiceSettings
from schemas.admission import AdmissionRefund
from schemas.errors import EventDecodeError
from schemas.events import RolloutReferenced, RolloutScored
from schemas.plan import PlanError
from streams import topics
from streams.partition_task import Out

NAME = "credit"


class CreditTask(TaskDefaults):
    def __init__(self, partition: int, cfg: ServiceSettings) -> None:
        self.p = partition
        self.instance = cfg.instance
        self.assigner = credit.CreditAssigner(cfg.credit, cfg.strategy_params, producer=f"{NAME}{cfg.instance}",
                                              gates=cfg.admission_gates)
        self.recs: dict[str, Any] = {}  # rollout id -> input record (while its group is open)
        self.references = cfg.references

    async def process(self, rec: Any) -> list[Out]:
        referenced = rec.topic == topics.REFERENCED.name
        try:
            scored = decode(rec, RolloutReferenced if referenced else RolloutScored)
        except EventDecodeError as e:
            return [dead_letter(rec, NAME, type(e).__name__, str(e))]
        if referenced:
            if not self._from_reference(scored.scored):  # credited from the scores topic already: not twice
                return [dead_letter(rec, NAME, "PlanError", f"source {scored.scored.train_source!r} has no reference "
                                    "in credit's plan: its score is credited from the scores topic", scored.run_id)]
            return [Out(topics.TRAINING_RECORDS.name, r) for r in self.assigner.add_referenced(scored)] \
                + self._refunds()
        if self._from_reference(scored):
            return []
        if self.assigner.buffers and not scored.evaluation:
            self.recs.setdefault(scored.rollout_id, rec)
        records = self.assigner.add(scored, time.monotonic())
        self._forget_closed()
        return [Out(topics.TRAINING_RECORDS.name, r) for r in records] + self._refunds()

    def _from_reference(self, scored: RolloutScored) -> bool:
        """Whether the score is a ref_kl source's: trained from the reference service's RolloutReferenced, not
        from here. One the plan cannot place is the reference service's to dead-letter."""
        if scored.evaluation or not self.references.any:
            return False
        try:
            return self.references.of(scored.train_source) is not None
        except PlanError:
            return True

    def _refunds(self) -> list[Out]:
        outs = [Out(topics.ADMISSIONS.name, AdmissionRefund(run_id=run_id, producer=f"{NAME}{self.instance}",
                                                            group_id=gid, reason=why))
                for gid, run_id, why in self.assigner.withheld]
        self.assigner.withheld.clear()
        return outs

    def restore(self, rec: Any) -> None:
        scored = decode(rec, RolloutScored)
        self.recs.setdefault(scored.rollout_id, rec)
        self.assigner.groups.add(scored, time.monotonic())

    def _forget_closed(self) -> None:
        if len(self.recs) != sum(len(g) for g in self.assigner.groups.groups.values()):
            open_ids = {rid for g in self.assigner.groups.groups.values() for rid in g}
            self.recs = {k: v for k, v in self.recs.items() if k in open_ids}

    def tick(self, now: float) -> list[Out]:
        records, refused = self.assigner.flush_expired(now)
        outs = [Out(topics.TRAINING_RECORDS.name, r) for r in records]
        outs += self._refunds()
        for group, reason in refused:
            for s in group:
                rec = self.recs.get(s.rollout_id)
                if rec is not None:
                    outs.append(dead_letter(rec, NAME, "GroupTimeout", reason, s.run_id))
        if records or refused:
            self._forget_closed()
        return outs

    def buffered(self) -> dict[str, list[int]]:
        return {topics.SCORES.name: [r.offset for r in self.recs.values()]}

    def state(self) -> dict[str, Any]:
        return self.assigner.state()

    def load_state(self, state: dict[str, Any]) -> None:
        self.assigner.load_state(state)


@asynccontextmanager
async def wiring(cfg: ServiceSettings, client_kwargs: dict[str, Any]) -> AsyncIterator[TaskFactory]:
    yield lambda p: CreditTask(p, cfg)
