"""verifier: joins each Rollout with its Steps (co-partitioned by root group) and scores it.

A rollout whose verifier kind scores it from its children's outcomes (Monte Carlo proposer/solver)
waits for their scores; they share its root group, so they arrive on this partition.

In a derived run (``ServiceSettings.derivation``) it reads the source run's Steps and Rollouts, skips those of
other runs and outside the range, scores with the derivation's re-scoring, and names each score's source Rollout.
It also reads its own run's: the held-out answers its evaluation generated (``rollout derive``), scored as the
environment scores them, as the source run's were, so both runs' held-out accuracy is measured alike.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from consumers import scoring
from consumers.judge import http_judge
from consumers.service import TaskDefaults, TaskFactory, dead_letter, decode
from consumers.settings import ServiceSettings
from schemas.envelope import SourceEvent
from schemas.errors import EventDecodeError
from schemas.events import Rollout, Step
from streams import topics
from streams.partition_task import Out

NAME = "verifier"


class VerifierTask(TaskDefaults):
    def __init__(self, partition: int, cfg: ServiceSettings, judge: scoring.Judge | None = None) -> None:
        self.p = partition
        self.cfg = cfg
        self.judge = judge
        self.steps: dict[str, tuple[Any, Step, float]] = {}  # step_id -> (rec, step, arrived)
        self.rollouts: dict[str, tuple[Any, Rollout, float]] = {}
        self.children: dict[str, dict[str, float]] = {}  # parent id -> child id -> outcome (state)
        self.children_seen: dict[str, float] = {}  # parent id -> when its last child was scored (since restore)
        self.scored = 0
        self.derivation = cfg.derivation
        self.own_run = cfg.derivation.run_id if cfg.derivation else None  # a derived run's dead letters are its own
        self.steps_topics, self.rollouts_topics = cfg.reads(topics.STEPS), cfg.reads(topics.ROLLOUTS)
        self.skipped: dict[str, float] = {}  # a derived run's rollouts out of range -> when (their late steps go too)

    def _own(self, rec: Any) -> bool:
        """Whether ``rec`` is on the service's own topics (a derived run's: its evaluation's; every record of a
        live run is), not a source run's."""
        return rec.topic in (self.steps_topics[-1], self.rollouts_topics[-1])

    def _takes(self, ro: Rollout, *, own: bool) -> bool:
        """Whether a derived run scores ``ro``: its own run's (held-out answers), and its source run's in range,
        but not the source's held-out answers (scored by the source run; the derived run's are its own)."""
        d = self.derivation
        if own:
            return ro.run_id == d.run_id
        return not ro.evaluation and d.takes(ro.run_id, ro.policy.revision if ro.policy else None, ro.created_at)

    def _buffer(self, rec: Any) -> str | None:
        """The rollout the record belongs to, buffered; None when a derived run does not take it."""
        d = self.derivation
        if rec.topic in self.steps_topics:
            step = decode(rec, Step)
            if d is not None and (step.run_id != (d.run_id if self._own(rec) else d.source_run_id)
                                  or step.rollout_id in self.skipped):
                return None
            self.steps[step.step_id] = (rec, step, time.monotonic())
            return step.rollout_id
        ro = decode(rec, Rollout)
        if d is not None and not self._takes(ro, own=self._own(rec)):
            self.skipped[ro.rollout_id] = time.monotonic()
            for s in ro.step_ids:
                self.steps.pop(s, None)
            return None
        self.rollouts[ro.rollout_id] = (rec, ro, time.monotonic())
        return ro.rollout_id

    async def process(self, rec: Any) -> list[Out]:
        try:
            rid = self._buffer(rec)
        except EventDecodeError as e:
            return [dead_letter(rec, NAME, type(e).__name__, str(e), self.own_run)]
        return [] if rid is None else await self._try(rid)

    def restore(self, rec: Any) -> None:
        self._buffer(rec)

    async def _try(self, rollout_id: str) -> list[Out]:
        entry = self.rollouts.get(rollout_id)
        if entry is None:
            return []
        rec, ro, _ = entry
        if any(s not in self.steps for s in ro.step_ids):
            return []
        outcomes = None
        if scoring.needs_children(ro):
            got = self.children.get(ro.rollout_id, {})
            if any(c not in got for c in ro.child_rollout_ids):
                return []
            outcomes = [got[c] for c in ro.child_rollout_ids]
        steps = [self.steps[s][1] for s in ro.step_ids]
        outs: list[Out] = []
        scored = None
        try:
            d = None if self._own(rec) else self.derivation  # a derived run's own answers: the env's scoring
            verdict = await scoring.score(ro, steps, judge=self.judge, child_outcomes=outcomes,
                                          rescore=d.rescore if d else None)
            derived = (d.run_id, SourceEvent.of(ro.run_id, rec.topic, rec.partition, rec.offset, rec.value),
                       d.rescore) if d else None
            ref = None if ro.evaluation or not self.cfg.references.any else self.cfg.references.of(ro.train_source)
            scored = scoring.to_scored(ro, steps, verdict, producer=f"{NAME}{self.cfg.instance}", derived=derived,
                                       demonstration=ref.demonstration if ref is not None else None)
            outs.append(Out(topics.SCORES.name, scored))
            self.scored += 1
        except scoring.ScoringError as e:
            outs.append(dead_letter(rec, NAME, "ScoringError", str(e), self._run(ro)))
        except Exception as e:  # noqa: BLE001 - an unexpected scoring bug dead-letters too; the service goes on
            outs.append(dead_letter(rec, NAME, type(e).__name__, f"scoring crashed: {e}", self._run(ro)))
        self._forget(ro)
        if ro.parent_rollout_id:
            parent = self.rollouts.get(ro.parent_rollout_id)
            member = scoring.child_member(parent[1]) if parent is not None else None
            outcome = scoring.child_outcome(scored, member) if scored is not None else 0.0
            self.children.setdefault(ro.parent_rollout_id, {})[ro.rollout_id] = outcome
            self.children_seen[ro.parent_rollout_id] = time.monotonic()
            outs.extend(await self._try(ro.parent_rollout_id))
        return outs

    def _run(self, ev: Rollout | Step) -> str:
        """The run a dead letter belongs to: a derived run's own (the source run's topics are never written)."""
        return self.own_run or ev.run_id

    def _forget(self, ro: Rollout) -> None:
        self.rollouts.pop(ro.rollout_id, None)
        for s in ro.step_ids:
            self.steps.pop(s, None)
        self.children.pop(ro.rollout_id, None)
        self.children_seen.pop(ro.rollout_id, None)

    def tick(self, now: float) -> list[Out]:
        outs: list[Out] = []
        t = self.cfg.step_timeout_s
        for rid, (rec, ro, arrived) in list(self.rollouts.items()):
            if now - arrived >= t:
                missing = [s for s in ro.step_ids if s not in self.steps]
                waiting = [c for c in ro.child_rollout_ids if c not in self.children.get(rid, {})]
                outs.append(dead_letter(rec, NAME, "Timeout",
                                        f"rollout {rid} incomplete after {t:g}s: {len(missing)} steps missing, "
                                        f"{len(waiting)} children unscored", self._run(ro)))
                self._forget(ro)
        for sid, (rec, st, arrived) in list(self.steps.items()):
            if now - arrived >= t and st.rollout_id not in self.rollouts:
                outs.append(dead_letter(rec, NAME, "OrphanStep",
                                        f"step {sid}: no rollout {st.rollout_id} within {t:g}s", self._run(st)))
                del self.steps[sid]
        for rid, when in list(self.skipped.items()):
            if now - when >= t:
                del self.skipped[rid]
        # Children's outcomes whose parent never came (or timed out before they were scored): the state, and
        # every snapshot of it, would grow without bound. A parent arriving later times out with its children
        # unscored, dead-lettered, so nothing goes unaccounted for.
        for parent, seen in list(self.children_seen.items()):
            if parent not in self.rollouts and now - seen >= self.cfg.children_timeout_s:
                self.children.pop(parent, None)
                del self.children_seen[parent]
        return outs

    def buffered(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {name: [] for name in self.steps_topics + self.rollouts_topics}
        for rec, _, _ in (*self.steps.values(), *self.rollouts.values()):
            out[rec.topic].append(rec.offset)
        return out

    def state(self) -> dict[str, Any]:
        return {"children": self.children} if self.children else {}

    def load_state(self, state: dict[str, Any]) -> None:
        self.children = {k: dict(v) for k, v in state.get("children", {}).items()}
        now = time.monotonic()  # a restore restarts their clock: the snapshot holds no monotonic time
        self.children_seen = {k: now for k in self.children}


@asynccontextmanager
async def wiring(cfg: ServiceSettings, client_kwargs: dict[str, Any]) -> AsyncIterator[TaskFactory]:
    judge = http_judge(cfg.judge_targets) if cfg.judge_targets else None
    yield lambda p: VerifierTask(p, cfg, judge)
