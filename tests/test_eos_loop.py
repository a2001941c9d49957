"""The loop closed on a real broker: verifier -> credit -> batcher -> reference trainer -> PolicyRevision ->
the batcher's next target. Off-policy refusals are counted with their reason, never silent."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from consumers import testing
from consumers.registry import SERVICES
from consumers.runner import System
from consumers.settings import ServiceSettings
from consumers.trainer.step import initial_revision
from schemas import codec
from schemas.events import DeadLetter, TrainerBatch
from schemas.policy import PolicyRevision
from streams import topics
from streams.revisions import publish
from tests.test_eos_pipeline import prefix, read_all, seed_groups  # noqa: F401 - fixture

pytestmark = pytest.mark.integration


async def test_trainer_closes_the_loop_and_stale_records_are_refused(kafka_settings, prefix, tmp_path):  # noqa: F811
    kw = kafka_settings.client_kwargs()
    cfg = ServiceSettings(family=testing.FAMILY, batch_records=16, flush_after_s=1.0, max_off_policy_steps=2,
                          checkpoint_dir=str(tmp_path), lr=1e-3)
    rev0 = initial_revision(testing.FAMILY, tmp_path, seed=0)
    await topics.create_topics(kw)
    await publish(kw, rev0)
    async with System(SERVICES, cfg, kw):
        async def revisions() -> list[PolicyRevision]:
            raw = await read_all(kw, topics.POLICY_REVISIONS.name, idle_s=0.3, timeout_s=5)
            return [codec.decode(r.value, PolicyRevision) for r in raw]

        async def wait_revision(at_least: int) -> int:
            for _ in range(60):
                latest = max(r.revision for r in await revisions())
                if latest >= at_least:
                    return latest
                await asyncio.sleep(0.5)
            raise AssertionError(f"no revision {at_least} from the trainer")

        # wave 1: records from r0 -> batches for r0 -> the trainer publishes r1, r2, r3
        expected = await seed_groups(kw, 12)
        latest = await wait_revision(3)
        # wave 2: the arena would never admit these now: r0 records, > 2 behind -> refused, with reasons
        expected |= await seed_groups(kw, 4, start=100)
        # wave 3: records from the current revision -> batches that target it
        expected |= await seed_groups(kw, 8, start=200, revision=latest)

        def settled(_):
            got = sum(len(codec.decode(r.value, TrainerBatch).records) for r in batches_raw)
            return got + len(letters_raw) >= len(expected)

        for _ in range(60):
            batches_raw = await read_all(kw, topics.TRAINER_BATCHES.name, idle_s=0.5, timeout_s=5)
            letters_raw = await read_all(kw, topics.DEAD_LETTERS.name, idle_s=0.5, timeout_s=5)
            if settled(None):
                break
            await asyncio.sleep(1)
        await asyncio.sleep(2)  # the trainer's last revision
        revs_raw = await read_all(kw, topics.POLICY_REVISIONS.name, idle_s=1, timeout_s=10)
    batches = [codec.decode(r.value, TrainerBatch) for r in batches_raw]
    letters = [codec.decode(r.value, DeadLetter) for r in letters_raw]
    revs = [codec.decode(r.value, PolicyRevision) for r in revs_raw]
    in_batches = Counter(x.record_id for b in batches for x in b.records)
    refused = Counter(codec.decode(d.raw).record_id for d in letters if d.error_type == "StaleRecordError")
    assert max(in_batches.values()) == 1 and set(in_batches).isdisjoint(refused)
    assert set(in_batches) | set(refused) == expected, "a record was neither batched nor refused"
    assert all("behind target" in d.error_message for d in letters if d.error_type == "StaleRecordError")
    # one revision per batch, chained, each with a checkpoint digest on disk
    assert [r.revision for r in revs] == list(range(len(batches) + 1))
    assert all(r.parent_revision == r.revision - 1 for r in revs[1:]) and all(r.checkpoint for r in revs)
    # the batcher followed the trainer: later batches target later revisions, within the off-policy bound
    targets = [b.target.revision for b in batches]
    assert max(targets) >= 1
    assert all(t - s.policy.revision <= 2 for b, t in zip(batches, targets) for s in b.source_revisions)
    print(f"batches={len(batches)} refused={sum(refused.values())} of {len(expected)} targets={targets}")
