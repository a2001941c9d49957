"""Exactly-once through verifier -> credit -> batcher on a real broker (in-process services).

Also: malformed / unknown-version events injected into every input topic land in the dead-letter
topic with their reason while everything else flows.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import pytest

from consumers import testing
from consumers.runner import System
from consumers.settings import ServiceSettings
from schemas import codec
from schemas.batch import verify_batch
from schemas.events import DeadLetter, Rollout, TrainerBatch
from streams import serde, topics
from streams.settings import MAX_MESSAGE_BYTES

pytestmark = pytest.mark.integration


@pytest.fixture
def prefix(monkeypatch):
    p = f"t{uuid.uuid4().hex[:8]}."
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", p)
    return p


def group_record_ids(groups: int, size: int = 4, *, start: int = 0) -> set[str]:
    """The TrainingRecord ids of the groups `seed_groups` writes (ids derive from the group ids alone)."""
    from consumers.credit import record_id

    return {record_id(ro.rollout_id, st.step_id) for g in range(start, start + groups)
            for steps, ro in testing.arithmetic_group(f"g{g:06d}", size) for st in steps}


async def seed_groups(kw, groups: int, size: int = 4, *, start: int = 0, extra: list | None = None,
                      revision: int = 0, transactional_id: str | None = None) -> set[str]:
    """Write `groups` arithmetic groups (steps then rollout, one transaction per 50 groups); return record ids."""
    from aiokafka import AIOKafkaProducer

    from consumers.credit import record_id

    prod = AIOKafkaProducer(**kw, transactional_id=transactional_id or f"seed-{uuid.uuid4().hex[:6]}",
                            enable_idempotence=True, max_request_size=MAX_MESSAGE_BYTES)
    await prod.start()
    expected: set[str] = set()
    try:
        for chunk in range(start, start + groups, 50):
            async with prod.transaction():
                futs = []
                for g in range(chunk, min(chunk + 50, start + groups)):
                    for steps, ro in testing.arithmetic_group(f"g{g:06d}", size, revision_=revision):
                        for st in steps:
                            k, v, h = serde.to_message(st)
                            futs.append(await prod.send(topics.STEPS.name, v, key=k, headers=h))
                            expected.add(record_id(ro.rollout_id, st.step_id))
                        k, v, h = serde.to_message(ro)
                        futs.append(await prod.send(topics.ROLLOUTS.name, v, key=k, headers=h))
                for topic, key, value in extra or []:
                    futs.append(await prod.send(topic, value, key=key))
                extra = None
                await asyncio.gather(*futs)
    finally:
        await prod.stop()
    return expected


async def reseed_missing(kw, transactional_id: str, groups: int, *, start: int = 0) -> set[str]:
    """After `seed_groups(..., transactional_id=...)` raised (its broker went away mid-transaction): settle that
    transactional id (a new producer with it aborts the open transaction, or lets a commit in flight finish),
    then write again only the 50-group chunks that are not on the log. Re-seeding everything would put the
    chunks that did commit on the log twice. Returns the record ids of all `groups`."""
    from aiokafka import AIOKafkaProducer

    settle = AIOKafkaProducer(**kw, transactional_id=transactional_id, enable_idempotence=True)
    await settle.start()  # init_transactions: the previous incarnation's transaction is resolved
    await settle.stop()
    present = {codec.decode(r.value, Rollout).group_id for r in await read_all(kw, topics.ROLLOUTS.name, idle_s=2)}
    for chunk in range(start, start + groups, 50):
        if f"g{chunk:06d}" not in present:  # a chunk is one transaction: all of it or none
            await seed_groups(kw, min(50, start + groups - chunk), start=chunk)
    return group_record_ids(groups, start=start)


async def publish_revision(kw, rev: int = 0) -> None:
    from streams.revisions import publish

    await publish(kw, testing.revision(rev))


async def read_all(kw, topic: str, *, until=None, timeout_s: float = 60.0, idle_s: float = 3.0) -> list:
    """Read a topic read_committed from the beginning until `until(values)` or idle/timeout."""
    from aiokafka import AIOKafkaConsumer

    cons = AIOKafkaConsumer(topic, **kw, group_id=None, isolation_level="read_committed",
                            auto_offset_reset="earliest", max_partition_fetch_bytes=16 * 1024 * 1024)
    await cons.start()
    out = []
    try:
        deadline = time.monotonic() + timeout_s
        last = time.monotonic()
        while time.monotonic() < deadline:
            got = await cons.getmany(timeout_ms=500)
            for recs in got.values():
                out.extend(recs)
                if recs:
                    last = time.monotonic()
            if until is not None and until(out):
                break
            if until is None and time.monotonic() - last > idle_s:
                break
    finally:
        await cons.stop()
    return out


_decoded: dict[tuple[str, int, int], list[str]] = {}


def batch_record_ids(recs) -> Counter:
    """record_id -> number of batches it appears in (each batch's digests verified once)."""
    c: Counter = Counter()
    for r in recs:
        key = (r.topic, r.partition, r.offset)
        if key not in _decoded:
            b = codec.decode(r.value, TrainerBatch)
            assert verify_batch(b) == []
            _decoded[key] = [x.record_id for x in b.records]
        c.update(_decoded[key])
    return c


THREE = ("verifier", "credit", "batcher")


async def test_three_services_exactly_once(kafka_settings, prefix):
    from consumers.status import service_lag

    kw = kafka_settings.client_kwargs()
    cfg = ServiceSettings(family=testing.FAMILY, batch_records=32, flush_after_s=1.0)
    async with System(THREE, cfg, kw):
        await publish_revision(kw, 0)
        expected = await seed_groups(kw, 100)
        recs = await read_all(kw, topics.TRAINER_BATCHES.name,
                              until=lambda rs: sum(batch_record_ids(rs).values()) >= len(expected), timeout_s=90)
        await asyncio.sleep(1.5)
        lag = {r["service"]: r for r in await service_lag(kw, sample_s=0.2)}
    # `rollout status`: every input consumed and committed (transaction markers included)
    assert {s: lag[s]["lag"] for s in ("verifier", "credit", "batcher")} == {"verifier": 0, "credit": 0, "batcher": 0}
    assert lag["verifier"]["committed"] == lag["verifier"]["end"] > 800
    got = batch_record_ids(recs)
    assert set(got) == expected
    assert max(got.values()) == 1


async def test_malformed_events_dead_lettered_everything_else_flows(kafka_settings, prefix):
    kw = kafka_settings.client_kwargs()
    cfg = ServiceSettings(family=testing.FAMILY, batch_records=16, flush_after_s=1.0)
    future = codec.encode(testing.revision(0))
    future = future[:4] + future[4:6] + future[6:6 + len("policy_revision")] + b"\x09\x00" + future[8 + len("policy_revision"):]
    bad_frames = [b"garbage", b"RLEV\x01\x04rollxxxxxxxx", future]
    extra = [(t.name, b"k", v) for t in (topics.STEPS, topics.ROLLOUTS, topics.SCORES, topics.TRAINING_RECORDS)
             for v in bad_frames]
    async with System(THREE, cfg, kw):
        await publish_revision(kw, 0)
        expected = await seed_groups(kw, 20, extra=extra)
        recs = await read_all(kw, topics.TRAINER_BATCHES.name,
                              until=lambda rs: sum(batch_record_ids(rs).values()) >= len(expected), timeout_s=60)
        dls = await read_all(kw, topics.DEAD_LETTERS.name, until=lambda rs: len(rs) >= len(extra), timeout_s=30)
    got = batch_record_ids(recs)
    assert set(got) == expected and max(got.values()) == 1
    letters = [codec.decode(r.value, DeadLetter) for r in dls]
    assert sorted((d.origin_topic, d.raw) for d in letters) == sorted((t, v) for t, _, v in extra)
    assert all(d.error_type.endswith("Error") and d.error_message for d in letters)
    by_topic = Counter(d.origin_topic for d in letters)
    assert set(by_topic) == {t.name for t in (topics.STEPS, topics.ROLLOUTS, topics.SCORES, topics.TRAINING_RECORDS)}
