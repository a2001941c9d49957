"""streams.group_offsets: a group-level error in an OffsetFetch answer is an error, never "nothing committed";
offsets pending in an open transaction are waited for (require_stable)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka import errors as Errors

from streams import group_offsets
from streams.group_offsets import OffsetFetchResponse_v7


def _response(partitions, error_code=0):
    return OffsetFetchResponse_v7(throttle_time_ms=0, topics=[("t", [(p, off, -1, "", err, {}) for p, off, err in
                                                                    partitions], {})] if partitions else [],
                                  error_code=error_code, tags={})


def test_a_group_level_error_is_raised_not_read_as_no_commit():
    # what a coordinator that is loading its offsets after a restart answers: an error and no partitions
    loading = _response([], Errors.GroupLoadInProgressError.errno)
    with pytest.raises(Errors.GroupLoadInProgressError):
        group_offsets._parse(loading)
    ok = _response([(0, 42, 0), (1, -1, 0)])
    assert group_offsets._parse(ok) == {TopicPartition("t", 0): 42, TopicPartition("t", 1): None}
    with pytest.raises(Errors.GroupAuthorizationFailedError):
        group_offsets._parse(_response([(0, -1, 30)]))
    with pytest.raises(group_offsets.Unstable) as e:  # an open transaction commits offsets there: ask again
        group_offsets._parse(_response([(0, -1, group_offsets.UNSTABLE_OFFSET_COMMIT)]))
    assert e.value.retriable


def test_the_answer_round_trips_through_the_wire_format():
    raw = _response([(0, 42, 0), (3, -1, 0)]).encode()
    assert group_offsets._parse(OffsetFetchResponse_v7.decode(raw)) == {TopicPartition("t", 0): 42,
                                                                        TopicPartition("t", 3): None}


@pytest.mark.integration
async def test_committed_offsets_on_a_real_broker(kafka_settings, make_topic):
    topic = await make_topic(partitions=2)
    group = f"g-{uuid.uuid4().hex[:8]}"
    kw = kafka_settings.client_kwargs()
    c = AIOKafkaConsumer(**kw, group_id=group, enable_auto_commit=False)
    await c.start()
    try:
        tps = [TopicPartition(topic, 0), TopicPartition(topic, 1)]
        assert await group_offsets.committed(c, tps) == {tps[0]: None, tps[1]: None}
        c.assign(tps)
        await c.commit({tps[0]: 7})
        assert await group_offsets.committed(c, tps) == {tps[0]: 7, tps[1]: None}
    finally:
        await c.stop()


@pytest.mark.integration
async def test_offsets_pending_in_an_open_transaction_are_waited_for(kafka_settings, make_topic):
    """KIP-447's second half, on a real broker: while a transaction that commits the group's offsets is open,
    the fetch does not answer with the older offsets; once it commits, it answers with the new ones."""
    topic = await make_topic(partitions=1)
    group = f"g-{uuid.uuid4().hex[:8]}"
    kw = kafka_settings.client_kwargs()
    tp = TopicPartition(topic, 0)
    c = AIOKafkaConsumer(**kw, group_id=group, enable_auto_commit=False)
    p = AIOKafkaProducer(**kw, transactional_id=f"t-{uuid.uuid4().hex[:8]}")
    await c.start()
    await p.start()
    try:
        c.assign([tp])
        await c.commit({tp: 3})
        await p.begin_transaction()
        await p.send_offsets_to_transaction({tp: 9}, group)
        with pytest.raises(group_offsets.Unstable):
            await group_offsets.committed(c, [tp], timeout_s=1.5)
        waiting = asyncio.create_task(group_offsets.committed(c, [tp], timeout_s=30))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        await p.commit_transaction()
        assert await asyncio.wait_for(waiting, 30) == {tp: 9}
    finally:
        await p.stop()
        await c.stop()
