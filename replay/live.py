"""A run as it happens: the state ``rollout dashboard`` shows, folded from the log's events in log order.

Pure (no Kafka): ``LiveRun.apply(event)`` for each committed record of the policy-revisions, rollouts, scores,
trainer-batches and dead-letters topics (the steps are not needed: a score names the revision of its learner's
steps); ``snapshot()`` and ``lineage(...)`` give JSON. Memory is bounded: rollouts are kept as short summaries,
the oldest dropped past ``keep_rollouts``; revisions, batches (their records' ids and credit) and counts are kept.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from schemas.envelope import Event
from schemas.events import DeadLetter, Rollout, RolloutScored, TrainerBatch
from schemas.policy import PolicyRevision
from streams.metrics import REFUSALS, learner_outcome

TEXT_CHARS = 400  # of a rollout's final text, kept for the page


@dataclass
class _Mean:
    n: int = 0
    total: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.total += x

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None


@dataclass
class LiveRun:
    run_id: str | None = None  # only this run's events (None: every run on the topics)
    recent: int = 30
    keep_rollouts: int = 100_000
    events: Counter = field(default_factory=Counter)
    runs: dict[str, float] = field(default_factory=dict)  # run id -> last event time
    revisions: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    reward: dict[tuple[str, int], _Mean] = field(default_factory=lambda: defaultdict(_Mean))
    accuracy: dict[tuple[str, int], _Mean] = field(default_factory=lambda: defaultdict(_Mean))
    staleness: Counter = field(default_factory=Counter)
    dead_letters: Counter = field(default_factory=Counter)  # (service, reason) -> count
    recent_dead_letters: deque = field(default_factory=lambda: deque(maxlen=20))
    rollouts: OrderedDict = field(default_factory=OrderedDict)  # rollout id -> summary
    batches: dict[str, dict[str, Any]] = field(default_factory=dict)
    lag: list[dict[str, Any]] = field(default_factory=list)  # set by the follower (not on the log)
    updated: float = 0.0

    def apply(self, ev: Event) -> None:
        if self.run_id is not None and ev.run_id != self.run_id:
            return
        self.events[ev.EVENT_TYPE] += 1
        self.runs[ev.run_id] = ev.created_at.timestamp()
        self.updated = time.time()
        if isinstance(ev, PolicyRevision):
            self.revisions[(ev.family, ev.revision)] = {
                "family": ev.family, "revision": ev.revision, "parent": ev.parent_revision, "batch_id": ev.batch_id,
                "checkpoint": ev.checkpoint.digest if ev.checkpoint else None, "metrics": dict(ev.metrics)}
        elif isinstance(ev, Rollout):
            self._rollout(ev)
        elif isinstance(ev, RolloutScored):
            self._scored(ev)
        elif isinstance(ev, TrainerBatch):
            self._batch(ev)
        elif isinstance(ev, DeadLetter):
            self.dead_letters[(ev.service, ev.error_type)] += 1
            self.recent_dead_letters.append({"service": ev.service, "reason": ev.error_type,
                                             "refusal": ev.error_type in REFUSALS,
                                             "message": ev.error_message[:300],
                                             "origin": f"{ev.origin_topic}:{ev.origin_partition}:{ev.origin_offset}"})

    def _rollout(self, ro: Rollout) -> None:
        text = ro.artifacts.get("final_text")
        self.rollouts[ro.rollout_id] = {
            "rollout_id": ro.rollout_id, "environment": ro.environment, "example_id": ro.example_id,
            "revision": ro.policy.revision if ro.policy else None, "status": ro.status, "evaluation": ro.evaluation,
            "text": str(text)[:TEXT_CHARS] if text is not None else (ro.failure_reason or ""),
            "answer": ro.artifacts.get("answer"), "reward": None, "correct": None}
        self.rollouts.move_to_end(ro.rollout_id)
        while len(self.rollouts) > self.keep_rollouts:
            self.rollouts.popitem(last=False)

    def _scored(self, sc: RolloutScored) -> None:
        outcome = learner_outcome(sc)
        summary = self.rollouts.get(sc.rollout_id)
        if summary is not None:
            summary["rewards"] = dict(sc.rewards)
        if outcome is None:
            return
        rev, reward, correct = outcome
        family = sc.trainable_steps[0].policy.family
        if summary is not None:
            summary.update(reward=reward, correct=correct, revision=rev)
        (self.accuracy if sc.evaluation else self.reward)[(family, rev)].add(float(correct) if sc.evaluation
                                                                            else reward)

    def _batch(self, b: TrainerBatch) -> None:
        for src in b.source_revisions:
            self.staleness[b.target.revision - src.policy.revision] += src.records
        self.batches[b.batch_id] = {
            "batch_id": b.batch_id, "family": b.family, "target": b.target.revision, "digest": b.batch_digest,
            "reward_mean": b.reward.mean, "completion_tokens": b.completion_tokens,
            "records": [{"record_id": r.record_id, "rollout_id": r.rollout_id, "source_revision": r.policy.revision,
                         "reward": r.reward, "advantage": r.advantage} for r in b.records]}

    # -- views -----------------------------------------------------------------------------------------
    def by_revision(self) -> list[dict[str, Any]]:
        keys = sorted(set(self.revisions) | set(self.reward) | set(self.accuracy))
        rows = []
        for key in keys:
            rev = self.revisions.get(key, {})
            m = rev.get("metrics", {})
            r, a = self.reward.get(key), self.accuracy.get(key)
            rows.append({"family": key[0], "revision": key[1], "published": key in self.revisions,
                         "parent": rev.get("parent"), "batch_id": rev.get("batch_id"),
                         "reward_mean": r.mean if r else None, "rollouts": r.n if r else 0,
                         "eval_accuracy": a.mean if a else None, "eval_answers": a.n if a else 0,
                         "loss": m.get("loss"), "step_s": m.get("step_s"),
                         "mismatch_mean": m.get("mismatch_mean"), "mismatch_max": m.get("mismatch_max")})
        return rows

    def snapshot(self) -> dict[str, Any]:
        published = [k[1] for k in self.revisions]
        return {
            "updated": self.updated, "runs": sorted(self.runs, key=self.runs.get, reverse=True),
            "events": dict(self.events), "latest_revision": max(published) if published else None,
            "revisions": self.by_revision(),
            "staleness": [{"staleness": k, "records": n} for k, n in sorted(self.staleness.items())],
            "dead_letters": [{"service": s, "reason": r, "count": n, "refusal": r in REFUSALS}
                             for (s, r), n in sorted(self.dead_letters.items())],
            "recent_dead_letters": list(reversed(self.recent_dead_letters)),
            "rollouts": [self.rollouts[k] for k in list(reversed(self.rollouts))[:self.recent]],
            "lag": self.lag,
        }

    def lineage(self, family: str, revision: int) -> dict[str, Any] | None:
        """Revision -> the batch it was trained on -> its records -> the rollouts they came from (summaries,
        where still kept), and the chain of parents back to revision 0."""
        rev = self.revisions.get((family, revision))
        if rev is None:
            return None
        chain, key = [], (family, revision)
        while key in self.revisions and len(chain) < 10_000:
            chain.append(key[1])
            parent = self.revisions[key]["parent"]
            if parent is None:
                break
            key = (family, parent)
        batch = self.batches.get(rev["batch_id"]) if rev["batch_id"] else None
        rollouts = {}
        if batch is not None:
            for r in batch["records"]:
                if r["rollout_id"] in self.rollouts:
                    rollouts[r["rollout_id"]] = self.rollouts[r["rollout_id"]]
        return {"revision": rev, "chain": chain, "batch": batch, "rollouts": list(rollouts.values())}
