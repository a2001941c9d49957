"""streams.batched_send: a transaction's records sent a partition at a time land exactly where, and in the
order, ``AIOKafkaProducer.send`` puts them; oversized records are refused before anything is sent."""

from __future__ import annotations

import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError

from streams.batched_send import PartitionBatches

pytestmark = pytest.mark.integration


async def _read(kw, topic: str, n: int) -> dict[int, list[tuple[bytes, bytes, list]]]:
    c = AIOKafkaConsumer(topic, **kw, group_id=None, auto_offset_reset="earliest", isolation_level="read_committed")
    await c.start()
    got: dict[int, list] = {}
    try:
        count = 0
        while count < n:
            batch = await c.getmany(timeout_ms=5000)
            assert batch, f"only {count} of {n} records came back"
            for tp, recs in batch.items():
                got.setdefault(tp.partition, []).extend((r.key, r.value, list(r.headers)) for r in recs)
                count += len(recs)
    finally:
        await c.stop()
    return got


async def test_same_partitions_and_order_as_send(kafka_settings, make_topic):
    by_send, by_batches = await make_topic(partitions=7, suffix="send"), await make_topic(partitions=7, suffix="batch")
    kw = kafka_settings.client_kwargs()
    # keys that repeat (a group's records share one), values of many sizes, more than one builder's worth
    messages = [(f"group-{i % 37}".encode(), (b"%06d" % i) * (1 + i % 500), [("n", str(i).encode())])
                for i in range(3000)]
    plain = AIOKafkaProducer(**kw, enable_idempotence=True)
    txn = AIOKafkaProducer(**kw, transactional_id=f"t-{uuid.uuid4().hex[:8]}", enable_idempotence=True,
                           max_batch_size=64 * 1024)  # several batches per partition
    await plain.start()
    await txn.start()
    try:
        for key, value, headers in messages:
            await plain.send(by_send, value, key=key, headers=headers)
        await plain.flush()
        await txn.begin_transaction()
        batches = PartitionBatches(txn, 1024 * 1024)
        for key, value, headers in messages:
            await batches.add(by_batches, value, key=key, headers=headers)
        await batches.add(by_batches, b"explicit", key=b"any", partition=3)
        await batches.send()
        written = await batches.written()
        await txn.commit_transaction()
    finally:
        await plain.stop()
        await txn.stop()
    expected = await _read(kw, by_send, len(messages))
    got = await _read(kw, by_batches, len(messages) + 1)
    assert got[3].pop() == (b"any", b"explicit", [])
    assert got == expected
    assert len(written) > 7  # more than one batch for some partitions
    last = {}
    for w in written:  # in send order: the last entry of a partition is its highest offset
        last[w.partition] = w.offset
    assert last == {p: len(recs) - 1 + (p == 3) for p, recs in got.items()}


async def test_an_oversized_record_is_refused_before_anything_is_sent(kafka_settings, make_topic):
    topic = await make_topic(partitions=1)
    kw = kafka_settings.client_kwargs()
    txn = AIOKafkaProducer(**kw, transactional_id=f"t-{uuid.uuid4().hex[:8]}", enable_idempotence=True)
    await txn.start()
    try:
        await txn.begin_transaction()
        batches = PartitionBatches(txn, 10_000)
        await batches.add(topic, b"x" * 100, key=b"k")
        with pytest.raises(MessageSizeTooLargeError):
            await batches.add(topic, b"x" * 20_000, key=b"k")
        await txn.abort_transaction()
    finally:
        await txn.stop()
