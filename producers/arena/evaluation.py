"""The arena's held-out evaluation: which examples are due at a revision, answered once per revision.

With ``evaluate=True`` a revision made current answers each environment's ``eval_dataset`` and every example of
the plan's evaluation sources (``plan.eval_environments``) that are due at it (``GenerationPlan.eval_due``:
prime-rl's cadence, revision 0 unless ``skip_first_step``, then every ``eval_interval`` revisions, an evaluation
source's own ``interval`` over the plan's), once (``eval_sampling``, greedy by default) before the next swap may
start, so the revision is scored on the whole held-out set. The run's last revision (``last_revision``: trained on
the last batch admitted, known once ``run`` has admitted its ``num_groups``) answers all of them whatever the
cadence. A revision with nothing due may be skipped when a newer one is already there. Evaluation Rollouts carry
``evaluation=True`` (scored, never trained on) and do not count for admission pacing; the seconds spent on them
are ``ArenaStats.eval_s_each``: admitted training rollouts keep running beside them, and the pacer hears of the
revision only once it is evaluated, so with an off-policy bound of 0 its batch is generated after, not beside.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from producers.arena.progress import ArenaStats
from producers.arena.rollout import EpisodeRequest
from producers.environments.dataset import Example
from producers.environments.types import Environment
from schemas.envelope import new_id
from schemas.policy import PolicyRef


class ArenaEvaluation:
    """The evaluation half of ``producers.arena.arena.Arena`` (its state is set by ``Arena.__init__``)."""

    plan: Any
    evaluate: bool
    environments: dict[str, Environment]
    eval_environments: list[tuple[Any, Environment]]
    eval_concurrency: int
    last_revision: int | None
    current_policy: PolicyRef
    rng: random.Random
    stats: ArenaStats
    _evaluating: asyncio.Lock
    _fatal: BaseException | None
    generate: Callable[[Sequence[EpisodeRequest], int | None], Awaitable[Any]]  # the arena's: runs and emits them

    def _evaluates(self, revision: int) -> bool:
        """Whether the arena evaluates ``revision``: a revision it evaluates is loaded even when superseded, so
        the eval curve has every point the recipe's ``interval`` asks for."""
        return self.evaluate and bool(self.eval_due(revision))

    def eval_due(self, revision: int) -> list[tuple[Environment, Example, int]]:
        """The training environments' held-out ``eval_dataset`` and every example of the plan's eval sources,
        those due at ``revision`` (``GenerationPlan.eval_due``, or the run's ``last_revision``), with how many times
        each is answered (``group_size``: pass@k)."""
        last = self.last_revision
        held_out = [(env, ex, 1) for env in self.environments.values() for ex in env.eval_dataset] \
            if self.plan.eval_due(revision, last=last) else []
        for spec, env in self.eval_environments:
            if self.plan.eval_due(revision, spec, last):
                held_out += [(env, ex, int(spec.options.get("group_size") or 1)) for ex in env.store]
        return held_out

    def eval_requests(self, revision: int | None = None) -> list[EpisodeRequest]:
        """The evaluation rollouts due at ``revision`` (``eval_due``), one group per example."""
        revision = self.current_policy.revision if revision is None else revision
        return [EpisodeRequest(env=env, example=ex, group_id=gid, root_group_id=gid, group_size=n,
                               sample_seed=self.rng.getrandbits(31), evaluation=True)
                for env, ex, n in self.eval_due(revision) for gid in [new_id()] for _ in range(n)]

    async def run_evaluation(self) -> int:
        """Answer every held-out example due at the current revision and emit the rollouts."""
        reqs = self.eval_requests()
        if reqs:
            t0 = time.monotonic()
            await self.generate(reqs, self.eval_concurrency)
            self.stats.eval_s_each.append(time.monotonic() - t0)
            self.stats.evaluated_revisions.append(self.current_policy.revision)
        return len(reqs)

    async def _evaluate_current(self) -> int:
        """``run_evaluation``, once per revision: the revision feed and ``evaluate_last`` may both come to it."""
        async with self._evaluating:
            if self.current_policy.revision in self.stats.evaluated_revisions:
                return 0
            return await self.run_evaluation()

    async def evaluate_last(self, revision: int, timeout_s: float) -> bool:
        """Evaluate ``revision`` as the run's last, whatever the cadence, for a run that learns which is its last
        only once it was trained (``rollout derive``): it may be current already, passed over as not due. False
        when it was not current within ``timeout_s``."""
        self.last_revision = revision
        deadline = time.monotonic() + timeout_s
        while self.current_policy.revision < revision:
            if time.monotonic() > deadline or self._fatal is not None:
                return False
            await asyncio.sleep(0.2)
        await self._evaluate_current()
        return True

    async def wait_for_revision(self, revision: int, timeout_s: float, idle_s: float = 300.0) -> bool:
        """Wait until ``revision`` is current (and evaluated, when evaluation is due at it); False after
        ``timeout_s``, or after ``idle_s`` without a new revision (records refused as stale can leave the last batch
        unfilled).
        ``idle_s`` outlasts a slow trainer step: on an AVX2-only CPU the first revision of SmolLM2 came 3.4
        minutes after its batch."""
        deadline = time.monotonic() + timeout_s
        last = (self.current_policy.revision, len(self.stats.evaluated_revisions), time.monotonic())
        due = self._evaluates(revision)  # fixed by the revision: asked once, not each poll
        while time.monotonic() < deadline and self._fatal is None:
            # evaluated at it or later (a revision superseded before the arena loaded it is skipped), or nothing
            # due at it (not on the cadence, or nothing held out): nothing to wait for
            evaluated = not due or any(r >= revision for r in self.stats.evaluated_revisions)
            if self.current_policy.revision >= revision and evaluated:
                return True
            now = (self.current_policy.revision, len(self.stats.evaluated_revisions))
            if now != last[:2]:
                last = (*now, time.monotonic())
            elif time.monotonic() - last[2] > idle_s:
                return False
            await asyncio.sleep(0.2)
        return False
