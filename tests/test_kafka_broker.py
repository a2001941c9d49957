"""aiokafka against the real broker of the test session (testcontainers, or ROLLOUT_BOOTSTRAP_SERVERS)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from rollout.cli import main as rollout_main
from streams import topics
from streams.config import KafkaSettings

pytestmark = pytest.mark.integration


async def _drain(consumer: AIOKafkaConsumer, want: int, timeout_s: float = 20.0, idle_ms: int = 500) -> list:
    """Records until `want` were seen and the topic stays quiet for idle_ms, or timeout."""
    got: list = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        batch = await consumer.getmany(timeout_ms=idle_ms if len(got) >= want else 1000)
        recs = [r for rs in batch.values() for r in rs]
        if not recs and len(got) >= want:
            break
        got += recs
    return got


async def test_produce_consume_round_trip(kafka_settings: KafkaSettings, make_topic):
    topic = await make_topic(partitions=3)
    producer = AIOKafkaProducer(**kafka_settings.client_kwargs(acks="all"))
    await producer.start()
    try:
        sent = {f"k{i}".encode(): f"v{i}".encode() for i in range(30)}
        for k, v in sent.items():
            await producer.send(topic, v, key=k)
        await producer.flush()
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(topic, **kafka_settings.client_kwargs(
        group_id=f"rt-{uuid.uuid4().hex[:6]}", auto_offset_reset="earliest"))
    await consumer.start()
    try:
        got = await _drain(consumer, len(sent))
    finally:
        await consumer.stop()
    assert {r.key: r.value for r in got} == sent
    assert len(got) == len(sent)


async def test_consumer_group_of_two_splits_partitions(kafka_settings: KafkaSettings, make_topic):
    partitions = 6
    topic = await make_topic(partitions=partitions)
    group = f"split-{uuid.uuid4().hex[:6]}"
    members = [AIOKafkaConsumer(topic, **kafka_settings.client_kwargs(
        group_id=group, auto_offset_reset="earliest", session_timeout_ms=10000, heartbeat_interval_ms=500))
        for _ in range(2)]
    for m in members:
        await m.start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 45
        while loop.time() < deadline:
            # Both members must keep polling for the rebalance to complete.
            await asyncio.gather(*(m.getmany(timeout_ms=300) for m in members))
            a, b = (m.assignment() for m in members)
            if a and b and len(a | b) == partitions:
                break
        a, b = (m.assignment() for m in members)
    finally:
        for m in members:
            await m.stop()
    assert a and b, f"both members need partitions: {a} / {b}"
    assert not (a & b), f"overlapping assignment: {a & b}"
    assert a | b == {TopicPartition(topic, p) for p in range(partitions)}


async def test_transactional_read_process_write(kafka_settings: KafkaSettings, make_topic):
    src = await make_topic(partitions=2, suffix="in")
    dst = await make_topic(partitions=2, suffix="out")
    group = f"proc-{uuid.uuid4().hex[:6]}"

    plain = AIOKafkaProducer(**kafka_settings.client_kwargs(acks="all"))
    await plain.start()
    try:
        for i in range(10):
            await plain.send(src, f"msg-{i}".encode(), key=str(i).encode())
        await plain.flush()
    finally:
        await plain.stop()

    consumer = AIOKafkaConsumer(src, **kafka_settings.client_kwargs(
        group_id=group, auto_offset_reset="earliest", enable_auto_commit=False, isolation_level="read_committed"))
    txp = AIOKafkaProducer(**kafka_settings.client_kwargs(transactional_id=f"txn-{group}"))
    await consumer.start()
    await txp.start()
    try:
        records = await _drain(consumer, 10)
        assert len(records) == 10
        # Committed transaction: outputs + input offsets, atomically.
        async with txp.transaction():
            for r in records:
                await txp.send(dst, r.value.upper(), key=r.key)
            offsets = {}
            for r in records:
                tp = TopicPartition(r.topic, r.partition)
                offsets[tp] = max(offsets.get(tp, 0), r.offset + 1)
            await txp.send_offsets_to_transaction(offsets, group)
        # Aborted transaction: written to the log, but must never be visible to read_committed readers.
        await txp.begin_transaction()
        for i in range(5):
            await txp.send(dst, f"ABORTED-{i}".encode())
        await txp.send_offsets_to_transaction({tp: 0 for tp in offsets}, group)
        await txp.abort_transaction()
        committed = {tp: await consumer.committed(tp) for tp in offsets}
    finally:
        await txp.stop()
        await consumer.stop()
    assert committed == offsets, "offsets from the committed transaction only"

    async def read_all(isolation: str) -> list[bytes]:
        c = AIOKafkaConsumer(dst, **kafka_settings.client_kwargs(
            group_id=None, auto_offset_reset="earliest", isolation_level=isolation))
        await c.start()
        try:
            return [r.value for r in await _drain(c, 10 if isolation == "read_committed" else 15)]
        finally:
            await c.stop()

    committed_view = await read_all("read_committed")
    assert sorted(committed_view) == sorted(f"MSG-{i}".encode() for i in range(10))
    uncommitted_view = await read_all("read_uncommitted")
    assert sum(v.startswith(b"ABORTED-") for v in uncommitted_view) == 5, "aborted records were really written"


async def test_create_topics_idempotent_with_configs(kafka_settings: KafkaSettings, monkeypatch):
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", f"t{uuid.uuid4().hex[:6]}.")
    monkeypatch.setenv("ROLLOUT_STEPS_RETENTION_MS", "86400000")
    admin_kwargs = kafka_settings.admin_kwargs()
    first = await topics.create_topics(admin_kwargs)
    assert first == {t.name: "created" for t in topics.TOPICS.values()}
    second = await topics.create_topics(admin_kwargs)
    assert second == {t.name: "exists" for t in topics.TOPICS.values()}

    described = await topics.describe_topics(admin_kwargs, [t.name for t in topics.TOPICS.values()])
    expected_partitions = {"policy-revisions": 1, "steps": 12, "rollouts": 12, "scores": 12,
                           "training-records": 1, "trainer-batches": 1, "dead-letters": 3}
    assert {k: described[topics.TOPICS[k].name]["partitions"] for k in expected_partitions} == expected_partitions
    for key, t in topics.TOPICS.items():
        cfg = described[t.name]["configs"]
        assert cfg["cleanup.policy"] == "delete"
        assert cfg["retention.ms"] == ("86400000" if key == "steps" else "-1"), key
        assert cfg["retention.bytes"] == "-1"
        if key in ("steps", "rollouts", "trainer-batches"):
            assert cfg["max.message.bytes"] == str(8 * 1024 * 1024)
    assert topics.STEPS.name.endswith(".steps")


def test_rollout_topics_cli(kafka_bootstrap: str, monkeypatch, capsys):
    """What the compose `topics` service runs."""
    prefix = f"cli{uuid.uuid4().hex[:6]}."
    monkeypatch.setenv("ROLLOUT_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", prefix)
    assert rollout_main(["topics", "create"]) == 0
    out = capsys.readouterr().out
    assert out.count("created") == len(topics.TOPICS) and f"{prefix}steps" in out
    assert rollout_main(["topics", "create"]) == 0
    assert capsys.readouterr().out.count("exists") == len(topics.TOPICS)
    assert rollout_main(["topics", "list"]) == 0
    listed = capsys.readouterr().out
    assert f"{prefix}trainer-batches" in listed and "missing" not in listed


async def test_partitions_of_names_only_existing_topics_and_creates_none(kafka_settings: KafkaSettings, make_topic):
    """One metadata request for the named topics: each existing one with its partitions, a missing one absent and
    still missing after (the request refuses auto-creation, whatever the broker's default)."""
    three, one = await make_topic(partitions=3), await make_topic(partitions=1)
    missing = f"missing-{uuid.uuid4().hex[:8]}"
    consumer = AIOKafkaConsumer(**kafka_settings.client_kwargs())
    await consumer.start()
    try:
        assert await topics.partitions_of(consumer._client, [three, missing, one]) == {three: [0, 1, 2], one: [0]}
        assert await topics.partitions_of(consumer._client, []) == {}
        assert missing not in (await consumer._client.fetch_all_metadata()).topics()
    finally:
        await consumer.stop()
