"""Slow work does not livelock a service (issue 24, hole 3).

While a service processes a fetch it does not poll, and a revocation waits for the transaction in flight: work
that outlasts the group's patience (``Service.max_process_s``: max_poll_interval and the rebalance timeout) got
the member removed, its commit fenced, and the same work redone, for ever. Now a transaction stops taking input
after half that budget and commits what it has; the rest goes first into the next one.

Here the verifier's patience is 8 s and its reward function takes 0.5 s a rollout: 40 rollouts seeded at once
are 20 s of scoring, with a second instance joining mid-way. (The issue's shape was 100 rollouts at 1.5 s
against the default 120 s: the same ratio, 9 times shorter.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import pytest

from consumers import testing
from consumers.registry import SERVICES
from consumers.runner import System
from consumers.settings import ServiceSettings
from schemas.scoring import ScoringSpec, WeightedFunc
from streams import topics
from tests._slow_reward import SLOW_S
from tests.test_eos_pipeline import THREE, batch_record_ids, publish_revision, read_all, seed_groups

pytestmark = pytest.mark.integration

PATIENCE_S = 8.0
GROUPS = 10  # of 4 rollouts


async def test_scoring_longer_than_the_groups_patience_commits_in_pieces_through_a_rebalance(kafka_settings,
                                                                                           monkeypatch):
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", f"slow{uuid.uuid4().hex[:8]}.")
    monkeypatch.setitem(SERVICES, "verifier", dataclasses.replace(SERVICES["verifier"], max_process_s=PATIENCE_S))
    assert GROUPS * 4 * SLOW_S > 2 * PATIENCE_S  # one fetch's work is far more than the group waits for
    kw = kafka_settings.client_kwargs()
    spec = ScoringSpec(kind="rubric", funcs=[WeightedFunc(fn="tests._slow_reward:correct_sum")],
                       params={"timeout_s": 10}).model_dump(mode="json")
    cfg = ServiceSettings(family=testing.FAMILY, batch_records=16, flush_after_s=1.0)
    async with System(THREE, cfg, kw) as first:
        await publish_revision(kw, 0)
        t0 = asyncio.get_running_loop().time()
        expected = await seed_groups(kw, GROUPS, spec=spec)
        await asyncio.sleep(3.0)  # the first instance is scoring its first fetch: now a second one joins
        async with System(THREE, cfg.model_copy(update={"instance": "-b"}), kw) as second:
            recs = await read_all(kw, topics.TRAINER_BATCHES.name,
                                  until=lambda rs: sum(batch_record_ids(rs).values()) >= len(expected), timeout_s=150)
            took = asyncio.get_running_loop().time() - t0
            verifiers = [first.processors["verifier"], second.processors["verifier"]]
            fenced = [v.stats.fenced for v in verifiers]
    got = batch_record_ids(recs)
    print(f"rollouts={len(expected)} lost={len(expected - set(got))} doubled={sum(n > 1 for n in got.values())} "
          f"fenced={fenced} all_batched_after_s={took:.1f} (scoring alone: {len(expected) * SLOW_S:.0f}s)")
    assert set(got) == expected and max(got.values()) == 1  # nothing lost, nothing doubled
    assert fenced == [0, 0], f"a verifier lost its partitions mid-work and redid it: fenced {fenced}"
    assert await read_all(kw, topics.DEAD_LETTERS.name, idle_s=1.0) == []
