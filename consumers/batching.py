"""Batching: TrainingRecords -> TrainerBatches for a target revision. Pure (no Kafka; time is passed in).

* size: ``batch_records`` records, or ``batch_tokens`` completion tokens (whichever is configured), and never
  more than one message holds (``max_batch_bytes``: a batch the broker refuses would be retried for ever);
  a partial batch is flushed once no record arrived for ``flush_after_s`` (generation stalled or the run ended):
  slow but steady generation (a float32 CPU, a tool program started per rollout) fills its batch, as prime-rl's
  orchestrator does, instead of training a smaller step for a timing reason.
* off-policy bound: a record more than ``max_off_policy_steps`` revisions behind the target is
  refused with its reason and counted (never silently dropped); a record *ahead* of the known target
  waits until its revision is announced, for ``ahead_timeout_s`` at most (then it is refused: a revision
  that never comes must not grow the buffer, and the snapshot of its offsets, without bound).
* a derived run (``BatchPolicy.history``): records of the fork's family, bounded by ``history_lag``, and at most
  ``HISTORY_AHEAD`` batches ahead of the trainer, since no arena's admissions pace history;
* admission (``schemas.admission``): while groups a batch owes a place are still coming (``owes``, asked with
  the revision the batch will be trained from: the target plus the batches ``ahead`` of the trainer), it is not
  emitted, partial or full; a batch takes the oldest records first, so those groups'
  records go into the last batch within their bound; and a partial batch is not flushed while any admitted group
  is still coming (``coming``): slow generation fills its batch. A partial batch that empties the buffer with
  nothing coming used up every admission (``Batcher.rebase``: the service says so on the ledger);
* a record of another family is refused on arrival (``CrossFamilyMixError``); an empty batch is never
  emitted (counted as ``empty_batch``). Batches are built by ``schemas.batch.assemble_batch``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

from schemas.batch import assemble_batch, staleness, stale_reason
from schemas.events import TrainerBatch, TrainingRecord
from schemas.history import HistoryRule
from schemas.policy import PolicyRevision

T = TypeVar("T")
HISTORY_AHEAD = 4
"""A derived run's batches ahead of its trainer: enough that the trainer never waits for the batcher's next tick
(benchmarks derive: 2 made a derived run 2.6x a live one's time, 4 made it 1.5x), few enough that a batch's
records, checked against its target, are trained by weights at most that many revisions newer."""


def record_bytes(record: TrainingRecord) -> int:
    """A record's share of an encoded batch: its arrays travel as raw bytes, its other fields are well under
    2 KB (a 128 x 1,024-token batch measured 10.8 KB a record, its arrays 10.2 KB)."""
    return sum(getattr(record, k).nbytes for k in ("prompt_token_ids", "completion_token_ids", "completion_logprobs",
                                                   "loss_mask")) + 2048


@dataclass
class Item(Generic[T]):
    record: TrainingRecord
    arrived: float
    tag: T = None  # the service keeps the input offset and raw bytes here


@dataclass
class Refusal(Generic[T]):
    item: Item[T]
    error_type: str
    reason: str


@dataclass
class BatchPolicy:
    family: str
    max_off_policy_steps: int = 1
    batch_records: int | None = 64
    batch_tokens: int | None = None
    max_batch_bytes: int | None = None  # the trainer-batches topic's message limit, with room for the envelope
    flush_after_s: float = 5.0
    ahead_timeout_s: float = 1800.0
    history: HistoryRule | None = None  # a derived run: records of the fork's family, bounded through the fork


@dataclass
class Batcher(Generic[T]):
    policy: BatchPolicy
    run_id: str = "run"
    producer: str = "batcher"
    items: list[Item[T]] = field(default_factory=list)
    refused: Counter = field(default_factory=Counter)
    emitted_records: int = 0
    emitted_batches: int = 0  # since ``base`` (state): with the trainer's revisions, the batches ahead of it
    base: tuple[int, int] | None = None  # (revision, dropped batches) when counting began (state; a derived run: its fork)
    rebase: int | None = None  # set by a poll whose partial batch emptied the buffer, nothing coming: the next
    # batch's revision (``schemas.admission.AdmissionRebase``)

    def add(self, record: TrainingRecord, now: float, tag: T = None) -> Refusal[T] | None:
        item = Item(record, now, tag)
        if record.policy.family != (self.policy.history.fork.family if self.policy.history else self.policy.family):
            self.refused["cross_family"] += 1
            return Refusal(item, "CrossFamilyMixError",
                           f"record {record.record_id} is from family {record.policy.family!r}; this batcher "
                           f"builds {self.policy.family!r} batches")
        if record.record_id in {it.record.record_id for it in self.items}:
            self.refused["duplicate"] += 1
            return Refusal(item, "DuplicateRecord", f"record {record.record_id} is already waiting for a batch")
        self.items.append(item)
        return None

    def full(self) -> bool:
        """Whether the waiting records make a whole batch (polling is worth it before the next tick)."""
        return self._full(self.items) > 0

    def _full(self, items: list[Item[T]]) -> int:
        """How many leading items make one full batch (0 if not enough): by records or tokens, or fewer when one
        message would not hold them (that batch is full: a smaller step)."""
        fit = self._fit(items)
        n = 0
        if self.policy.batch_tokens:
            tot = 0
            for i, it in enumerate(items):
                tot += len(it.record.completion_token_ids)
                if tot >= self.policy.batch_tokens:
                    n = i + 1
                    break
        else:
            n = self.policy.batch_records or 1
            n = n if len(items) >= n else 0
        return min(n or fit, fit) if fit < len(items) else n

    def _fit(self, items: list[Item[T]]) -> int:
        """How many leading items one message holds (at least one)."""
        if not self.policy.max_batch_bytes:
            return len(items)
        tot = 0
        for i, it in enumerate(items):
            tot += record_bytes(it.record)
            if tot > self.policy.max_batch_bytes:
                return max(i, 1)
        return len(items)

    def ahead(self, target: PolicyRevision, dropped: int = 0) -> int:
        """Batches emitted that the trainer has neither turned into revisions nor dropped yet: the next batch is
        trained from ``target.revision`` plus this many (pipelined, the batcher runs ahead of the announcements).
        ``dropped``: batches the trainer dead-lettered so far."""
        base = (self.policy.history.fork.revision, 0) if self.policy.history is not None else self.base
        if base is None:
            return 0
        return max(0, self.emitted_batches - (target.revision - base[0]) - (dropped - base[1]))

    def poll(self, target: PolicyRevision | None, now: float, *, flush: bool = False, dropped: int = 0,
             owes: Callable[[int], int] = lambda revision: 0, coming: int = 0
             ) -> tuple[list[tuple[TrainerBatch, list[Item[T]]]], list[Refusal[T]]]:
        """Batches ready for ``target`` and records refused as stale. ``flush`` empties what is eligible.
        ``dropped``: batches the trainer dead-lettered (never to be trained; they count as gone, not ahead).
        ``owes(revision)``: admitted groups, not come yet, that a batch trained from ``revision`` must take;
        ``coming``: admitted groups whose records have not come, whatever their batch (none: a partial flush).
        ``flush`` waits for neither."""
        refusals: list[Refusal[T]] = []
        keep: list[Item[T]] = []
        self.rebase = None
        for it in self.items:
            lag = staleness(it.record, target, self.policy.history) if target is not None else None
            if lag is not None and lag > self.policy.max_off_policy_steps:
                self.refused["stale"] += 1
                refusals.append(Refusal(it, "StaleRecordError", stale_reason(
                    it.record, target, self.policy.max_off_policy_steps, self.policy.history) or "stale"))
            elif (lag is None or lag < 0) and now - it.arrived >= self.policy.ahead_timeout_s:
                self.refused["ahead"] += 1
                known = f"r{target.revision}" if target is not None else "none"
                refusals.append(Refusal(it, "AheadOfTargetError",
                                        f"record {it.record.record_id} from r{it.record.policy.revision} waited "
                                        f"{now - it.arrived:.0f}s for its revision to be announced (target: {known}; "
                                        f"ahead_timeout_s={self.policy.ahead_timeout_s:g})"))
            else:
                keep.append(it)
        self.items = keep
        if target is None:
            return [], refusals
        ahead = self.ahead(target, dropped)
        room = len(self.items)  # batches this poll may emit: all there are, but for history...
        if self.policy.history is not None:  # ...no arena paces it: the trainer's steps do
            room = HISTORY_AHEAD - ahead
            if room <= 0:
                return [], refusals
        eligible = sorted((it for it in self.items if staleness(it.record, target, self.policy.history) >= 0),
                          key=lambda it: it.record.policy.revision)  # the oldest first: the nearest their bound
        batches: list[tuple[TrainerBatch, list[Item[T]]]] = []
        partial = False
        while eligible and len(batches) < room:
            if not flush and owes(target.revision + ahead + len(batches)):
                break  # a group this batch must take is still coming
            n = self._full(eligible)
            if n == 0:
                due = flush or (not coming and now - max(it.arrived for it in eligible) >= self.policy.flush_after_s)
                if not due:
                    break
                n, partial = len(eligible), not flush
            chosen, eligible = eligible[:n], eligible[n:]
            batches.append((self._assemble([it.record for it in chosen], target), chosen))
        if batches:
            taken = {id(it) for _, its in batches for it in its}
            self.items = [it for it in self.items if id(it) not in taken]
            self.emitted_records += sum(len(its) for _, its in batches)
            if self.base is None and self.policy.history is None:
                self.base = (target.revision, dropped)
            self.emitted_batches += len(batches)
            if partial and not self.items and self.policy.history is None:
                self.rebase = target.revision + self.ahead(target, dropped)
        elif flush and not self.items:
            self.refused["empty_batch"] += 1
        return batches, refusals

    def _assemble(self, records: list[TrainingRecord], target: PolicyRevision) -> TrainerBatch:
        return assemble_batch(records, target, self.policy.max_off_policy_steps, run_id=self.run_id,
                              producer=self.producer, causation_id=records[0].event_id, history=self.policy.history)

    def stats(self) -> dict[str, Any]:
        return {"buffered": len(self.items), "emitted_records": self.emitted_records, "refused": dict(self.refused)}
