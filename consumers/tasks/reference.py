"""reference: a ref_kl source's scores (prime-rl's opd) -> RolloutReferenced, the reference's logprob of every
trainable completion token, by prefill (``consumers.reference``).

Scores of other sources, and held-out evaluations, are passed over: credit reads those from the scores topic. A
reference that is down is waited for (``EnvironmentFault``), never a reason to drop a token's score; a score the
reference refuses, or that names no source where the plan's sources differ, is dead-lettered with the reason.
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
from schemas.plan import PlanError
from streams import topics
from streams.partition_task import Out

NAME = "reference"
TIMEOUT_S = 120.0
"""One prefill's HTTP timeout: a long sequence on a busy CPU server."""


class ReferenceTask(TaskDefaults):
    def __init__(self, partition: int, cfg: ServiceSettings, scorer: ReferenceScorer) -> None:
        self.p = partition
        self.cfg = cfg
        self.scorer = scorer

    async def process(self, rec: Any) -> list[Out]:
        try:
            scored = decode(rec, RolloutScored)
        except EventDecodeError as e:
            return [dead_letter(rec, NAME, type(e).__name__, str(e))]
        if scored.evaluation:
            return []
        try:
            ref = self.cfg.references.of(scored.train_source)
        except PlanError as e:
            return [dead_letter(rec, NAME, "PlanError", str(e), scored.run_id)]
        if ref is None:
            return []
        try:
            served = await self.scorer.served(ref)
            logprobs = await asyncio.gather(*(self.scorer.score(ref, s.prompt_token_ids, s.completion_token_ids)
                                              for s in scored.trainable_steps))
        except ReferenceRefused as e:
            return [dead_letter(rec, NAME, "ReferenceRefused", str(e), scored.run_id)]
        return [Out(topics.REFERENCED.name, RolloutReferenced(
            run_id=scored.run_id, producer=f"{NAME}{self.cfg.instance}", causation_id=scored.event_id,
            scored=scored, root_group_id=scored.root_group_id, reference=served,
            steps=[StepReference(step_id=s.step_id, ref_logprobs=lp)
                   for s, lp in zip(scored.trainable_steps, logprobs)]))]


@asynccontextmanager
async def wiring(cfg: ServiceSettings, client_kwargs: dict[str, Any]) -> AsyncIterator[TaskFactory]:
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        scorer = ReferenceScorer(client)
        yield lambda p: ReferenceTask(p, cfg, scorer)
