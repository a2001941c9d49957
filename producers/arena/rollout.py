"""One rollout as the arena runs it: the request (environment, example, group, seed) and the context its episode
calls the model through (routes by the plan, Steps stamped with the answering revision, sub-episodes)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from producers.arena.progress import ArenaStats
from producers.environments.dataset import Example
from producers.environments.episodes import Episode, EpisodeState, GenerateResult
from producers.environments.types import Environment
from producers.inference.client import Completion, InferenceClient, InferenceError
from producers.inference.weights import RevisionGate, WeightLoadError
from schemas.envelope import new_id
from schemas.events import ChatMessage, Step
from schemas.policy import PolicyRef
from schemas.scoring import ScoringSpec


@dataclass
class EpisodeRequest:
    """One rollout to run: which environment/episode, which example, its group and seed."""

    env: Environment
    example: Example
    group_id: str
    root_group_id: str
    group_size: int
    sample_seed: int
    episode: Episode | None = None  # default: env.episode
    scoring: ScoringSpec | Callable[[Example, EpisodeState], ScoringSpec] | None = None  # default: env's
    parent_rollout_id: str | None = None
    rollout_id: str = field(default_factory=new_id)
    evaluation: bool = False  # a held-out question: sampled with the arena's eval_sampling, never trained on
    train_source: str | None = None  # the plan's training source it was sampled for (its name): its algorithm


class RolloutHost(Protocol):
    """What a rollout reads of the arena that runs it (``producers.arena.arena.Arena``): routing and sampling, the
    served revision and its gate, the run's names, counters and seed stream."""

    plan: Any
    env_sampling: dict[str, dict[str, Any]]
    eval_sampling: dict[str, Any]
    eval_environments: list[tuple[Any, Environment]]
    weights: Any
    gate: RevisionGate
    current_policy: PolicyRef
    served_exact: bool
    learner_model: str | None
    run_id: str
    producer_name: str
    stats: ArenaStats
    rng: Any

    def client_for(self, target: Any) -> InferenceClient: ...

    async def run_rollout(self, req: EpisodeRequest) -> GenerateResult: ...


class RolloutContext:
    """What an episode sees of the arena while it runs: ``call_model`` routes a member's call by the plan and
    records it as a Step stamped with the revision that answered; ``spawn`` runs sub-episodes."""

    def __init__(self, arena: RolloutHost, req: EpisodeRequest, state: EpisodeState, policy: PolicyRef) -> None:
        self.arena, self.req, self.state, self.policy = arena, req, state, policy
        self.rollout_id = req.rollout_id
        self.sample_seed = req.sample_seed
        self.steps: list[Step] = []
        episode = req.episode or req.env.episode
        self.routes = {m: arena.plan.route(m, req.rollout_id, req.sample_seed) for m in episode.members}

    async def call_model(self, member_id: str, messages: Sequence[ChatMessage], *,
                         tools: list[dict[str, Any]] | None = None,
                         sampling: dict[str, Any] | None = None) -> Completion:
        if member_id not in self.routes:
            raise ValueError(f"member {member_id!r} is not declared in the episode's members {sorted(self.routes)}")
        target, trainable = self.routes[member_id]
        episode = self.req.episode or self.req.env.episode
        samp = dict(target.sampling)
        if target.is_learner:
            samp.update(self.req.env.sampling)
            samp.update(self.arena.env_sampling.get(self.req.env.ref, {}))
        samp.update(episode.sampling.get(member_id, {}))
        samp.update(sampling or {})
        if self.req.evaluation:
            samp.update(self.arena.eval_sampling)
            if target.is_learner and any(env is self.req.env for _, env in self.arena.eval_environments):
                samp.update(self.req.env.sampling)  # an evaluation source's own sampling is the recipe's word
        index = len(self.steps)
        client = self.arena.client_for(target)
        gated = target.is_learner and self.arena.weights is not None
        t0 = time.perf_counter()
        try:
            async with self.arena.gate.call() if gated else _no_gate():
                # no swap can start before this call ends
                held, held_exact = self.arena.current_policy, self.arena.served_exact
                comp = await client.chat(list(messages), sampling=samp, tools=tools,
                                         seed=self.sample_seed * 1000 + index, require_tokens=trainable,
                                         model=self.arena.learner_model if gated else None)
        except WeightLoadError as e:
            raise InferenceError(str(e)) from None
        latency = time.perf_counter() - t0
        policy, exact = None, True
        if trainable:
            if comp.policy and comp.policy.family == self.arena.plan.family:
                policy = comp.policy
            else:
                policy, exact = held, gated and held_exact
        step = Step(
            run_id=self.arena.run_id, producer=self.arena.producer_name, step_id=f"{self.rollout_id}-{index:03d}",
            rollout_id=self.rollout_id, root_group_id=self.req.root_group_id, index=index, member_id=member_id,
            target=target.name, trainable=trainable, policy=policy, prompt=list(messages),
            completion=[comp.message.model_copy(update={"name": member_id})],
            prompt_token_ids=comp.prompt_token_ids, completion_token_ids=comp.completion_token_ids,
            completion_logprobs=comp.logprobs, finish_reason=comp.finish_reason,
            tool_calls=list(comp.message.tool_calls), latency_s=latency, policy_exact=exact)
        self.steps.append(step)
        self.arena.stats.steps += 1
        self.arena.stats.completion_tokens += len(comp.completion_token_ids)
        return comp

    async def spawn(self, episode: Episode, examples: Sequence[Example], *,
                    scoring: ScoringSpec | Callable[[Example, EpisodeState], ScoringSpec] | None = None,
                    ) -> list[GenerateResult]:
        group_id = new_id()
        reqs = [EpisodeRequest(env=self.req.env, example=ex, group_id=group_id, root_group_id=self.req.root_group_id,
                               group_size=len(examples), sample_seed=self.arena.rng.getrandbits(31), episode=episode,
                               scoring=scoring, parent_rollout_id=self.rollout_id, evaluation=self.req.evaluation,
                               train_source=self.req.train_source)
                for ex in examples]
        results = await asyncio.gather(*(self.arena.run_rollout(r) for r in reqs))
        self.state.children.extend(results)
        return list(results)


@asynccontextmanager
async def _no_gate() -> Any:
    yield
