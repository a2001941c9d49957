"""streams.group_offsets: a group-level error in an OffsetFetch answer is an error, never "nothing committed"."""

from __future__ import annotations

import uuid

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka import errors as Errors
from aiokafka.protocol.commit import OffsetFetchResponse_v3

from streams import group_offsets


def test_a_group_level_error_is_raised_not_read_as_no_commit():
    # what a coordinator that is loading its offsets after a restart answers: an error and no partitions
    loading = OffsetFetchResponse_v3(throttle_time_ms=0, topics=[], error_code=Errors.GroupLoadInProgressError.errno)
    with pytest.raises(Errors.GroupLoadInProgressError):
        group_offsets._parse(loading)
    ok = OffsetFetchResponse_v3(throttle_time_ms=0, topics=[("t", [(0, 42, "", 0), (1, -1, "", 0)])], error_code=0)
    assert group_offsets._parse(ok) == {TopicPartition("t", 0): 42, TopicPartition("t", 1): None}
    bad = OffsetFetchResponse_v3(throttle_time_ms=0, topics=[("t", [(0, -1, "", 30)])], error_code=0)
    with pytest.raises(Errors.GroupAuthorizationFailedError):
        group_offsets._parse(bad)


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
