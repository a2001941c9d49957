"""reference: a ref_kl source's scores (prime-rl's opd, opsd) -> RolloutReferenced, the reference's logprob of every
trainable completion token, by prefill (``consumers.reference``): a frozen teacher's, or the live policy's with the
score's demonstration prepended (opsd, at ``policy_url``).

Scores of other sources, and held-out evaluations, are passed over: credit reads those from the scores topic. A
reference that is down is waited for, never a reason to drop a token's score; a score the reference refuses, or
that names no source where the plan's sources differ, is dead-lettered with the reason.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx

from consumers.reference import ReferenceRefused, ReferenceScorer
from consumers.service import TaskDefaults, TaskFactory, dead_letter, decode
from consumers.settings import ServiceSettings
from schemas.errors import EventDecodeError
from schemas.events import RolloutReferenced, RolloutScored, StepReference
from schemas.objectives import Reference
from schemas.plan import PlanError
from streams import topics
from streams.partition_task import EnvironmentFault, Out

NAME = "reference"
TIMEOUT_S = 120.0
"""One prefill's HTTP timeout: a long sequence on a busy CPU server."""


class ReferenceTask(TaskDefaults):
    """Each score's prefills start when it is read and run together (a fetch's scores at once: one at a time, a
    CPU vLLM took 3.0 s a score, 32 at once 0.57 s each); a score waits in ``buffered`` until its logprobs come,
    and goes out with the next transaction after (``input_read``, ``tick``). A new owner scores the waiting ones
    again."""

    def __init__(self, partition: int, cfg: ServiceSettings, scorer: ReferenceScorer) -> None:
        self.p = partition
        self.cfg = cfg
        self.scorer = scorer
        self.scoring: dict[int, tuple[Any, RolloutScored, asyncio.Future]] = {}  # input offset -> its prefills

    async def process(self, rec: Any) -> list[Out]:
        try:
            scored = decode(rec, RolloutScored)
        except EventDecodeError as e:
            return [dead_letter(rec, NAME, type(e).__name__, str(e))]
        try:
            ref = None if scored.evaluation else self.cfg.references.of(scored.train_source)
        except PlanError as e:
            return [dead_letter(rec, NAME, "PlanError", str(e), scored.run_id)]
        if ref is not None:
            self._start(rec, scored, ref)
        return self._scored()

    def restore(self, rec: Any) -> None:
        scored = decode(rec, RolloutScored)
        self._start(rec, scored, self.cfg.references.of(scored.train_source))

    def _start(self, rec: Any, scored: RolloutScored, ref: Reference) -> None:
        job = asyncio.ensure_future(self._score(scored, ref))
        job.add_done_callback(lambda f: f.cancelled() or f.exception())  # a dropped task's: retrieved, not logged
        self.scoring[rec.offset] = (rec, scored, job)

    async def _score(self, scored: RolloutScored, ref: Reference) -> RolloutReferenced:
        served = await self.scorer.served(ref)
        prefix: list[int] = []
        if ref.demonstration is not None:
            if scored.demonstration is None:
                raise ReferenceRefused(f"opsd needs the demonstration {ref.demonstration.key!r} in the example's info "
                                       f"or the rollout's fields (source {scored.train_source}, example "
                                       f"{scored.example_id}); this one has none")
            prefix = await self.scorer.hint_ids(ref, scored.demonstration)
        logprobs = await asyncio.gather(*(self.scorer.score(ref, s.prompt_token_ids, s.completion_token_ids, prefix)
                                          for s in scored.trainable_steps))
        return RolloutReferenced(
            run_id=scored.run_id, producer=f"{NAME}{self.cfg.instance}", causation_id=scored.event_id,
            scored=scored, root_group_id=scored.root_group_id, reference=served,
            steps=[StepReference(step_id=s.step_id, ref_logprobs=lp) for s, lp in zip(scored.trainable_steps, logprobs)])

    def _scored(self) -> list[Out]:
        """The scores whose prefills are done. A reference that stayed down (``ReferenceUnavailable``, the
        environment's fault) gives the transaction up: the partition is taken over again and its waiting scores
        tried again, nothing dropped. A score the reference refused, or whose scoring failed otherwise, is
        dead-lettered with the reason."""
        outs = []
        for offset, (rec, scored, job) in list(self.scoring.items()):
            if not job.done():
                continue
            error = job.exception()
            if isinstance(error, EnvironmentFault):
                raise error
            del self.scoring[offset]
            if error is None:
                outs.append(Out(topics.REFERENCED.name, job.result()))
            else:
                kind = "ReferenceRefused" if isinstance(error, ReferenceRefused) else type(error).__name__
                outs.append(dead_letter(rec, NAME, kind, str(error), scored.run_id))
        return outs

    def input_read(self, now: float) -> list[Out]:
        return self._scored()

    def tick(self, now: float) -> list[Out]:
        return self._scored()

    def buffered(self) -> dict[str, list[int]]:
        return {topics.SCORES.name: sorted(self.scoring)}

    def close(self) -> None:
        """Dropped: its prefills stop (they would hold the scorer's slots); the partition's next owner starts them
        again."""
        for _, _, job in self.scoring.values():
            job.cancel()


def with_policy_url(cfg: ServiceSettings) -> ServiceSettings:
    """``cfg`` with every reference that is the run's own policy (opsd) pointed at ``policy_url``; refused without
    one, before anything is read."""
    refs = cfg.references.by_source
    if all(r is None or r.base_url is not None for r in refs.values()):
        return cfg
    if not cfg.policy_url:
        live = ", ".join(n for n, r in refs.items() if r is not None and r.base_url is None)
        raise PlanError(f"source(s) {live} self-distill (opsd) under the live policy: give the reference service "
                        "the learner's endpoint (--policy-url http://HOST:PORT/v1, env ROLLOUT_POLICY_URL)")
    resolved = {n: r if r is None or r.base_url is not None else r.model_copy(update={"base_url": cfg.policy_url})
                for n, r in refs.items()}
    return cfg.model_copy(update={"references": cfg.references.model_copy(update={"by_source": resolved})})


@asynccontextmanager
async def wiring(cfg: ServiceSettings, client_kwargs: dict[str, Any]) -> AsyncIterator[TaskFactory]:
    cfg = with_policy_url(cfg)
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        scorer = ReferenceScorer(client)
        yield lambda p: ReferenceTask(p, cfg, scorer)
