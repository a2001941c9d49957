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
from schemas.events import DeadLetter, TrainerBatch
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
                      revision: int = 0, transactional_id: str | None = None, family: str = testing.FAMILY,
                      spec: dict | None = None, run_id: str = "run") -> set[str]:
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
                    for steps, ro in testing.arithmetic_group(f"g{g:06d}", size, revision_=revision, family=family,
                                                                 spec=spec, run_id=run_id):
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


async def read_to_end(kw, topic: str, timeout_s: float = 180.0) -> list:
    """Every committed record of ``topic``, read up to its end once no transaction is open on it.

    Unlike ``read_all``'s quiet spell, this cannot stop short on a slow fetch or on commit markers still on
    their way.
    """
    from aiokafka import AIOKafkaConsumer

    committed = AIOKafkaConsumer(topic, **kw, group_id=None, isolation_level="read_committed",
                                 enable_auto_commit=False, auto_offset_reset="earliest",
                                 max_partition_fetch_bytes=16 * 1024 * 1024)
    raw = AIOKafkaConsumer(**kw, group_id=None, isolation_level="read_uncommitted", enable_auto_commit=False)
    await committed.start()
    await raw.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not committed.assignment():  # all partitions, assigned once the topic's metadata is in
            assert time.monotonic() < deadline, f"no metadata for {topic}"
            await asyncio.sleep(0.1)
        tps = sorted(committed.assignment())
        while True:  # the last stable offset reaches the high watermark: nothing is pending on the topic
            lso, hw = await committed.end_offsets(tps), await raw.end_offsets(tps)
            if lso == hw:
                break
            assert time.monotonic() < deadline, f"a transaction stays open on {topic}: {lso} < {hw}"
            await asyncio.sleep(0.1)
        out = []
        while [tp for tp in tps if await committed.position(tp) < lso[tp]]:
            assert time.monotonic() < deadline, f"could not read {topic} to its end offsets {lso}"
            for recs in (await committed.getmany(timeout_ms=500)).values():
                out.extend(recs)
        return out
    finally:
        await committed.stop()
        await raw.stop()


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


@pytest.mark.parametrize("fetch_bytes", [None, 1024], ids=["default-fetches", "fetches-smaller-than-a-message"])
async def test_three_services_exactly_once(kafka_settings, prefix, monkeypatch, fetch_bytes):
    """Also with a fetch size below every message's: the broker still sends a whole first record batch."""
    from consumers.status import service_lag
    from streams.settings import FETCH_OPTIONS

    if fetch_bytes:
        monkeypatch.setitem(FETCH_OPTIONS, "fetch_max_bytes", fetch_bytes)
    kw = kafka_settings.client_kwargs()
    cfg = ServiceSettings(family=testing.FAMILY, batch_records=32, flush_after_s=1.0)
    async with System(THREE, cfg, kw):
        await publish_revision(kw, 0)
        expected = await seed_groups(kw, 100)
        recs = await read_all(kw, topics.TRAINER_BATCHES.name,
                              until=lambda rs: sum(batch_record_ids(rs).values()) >= len(expected), timeout_s=90)
        deadline = time.monotonic() + 30  # the last inputs' commit markers are consumed after their records
        while True:
            await asyncio.sleep(0.5)
            lag = {r["service"]: r for r in await service_lag(kw, sample_s=0.2)}
            if all(lag[s]["lag"] == 0 for s in THREE) or time.monotonic() > deadline:
                break
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
