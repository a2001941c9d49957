"""streams.group_fencing: offsets committed in a transaction carry the member's generation, and the group
coordinator of a real broker refuses them once the group has moved on (KIP-447)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from streams import group_offsets
from streams.group_fencing import GroupFenced, GroupMember, TxnOffsetCommitRequest, TxnOffsetCommitRequest_v3, \
    fence_by_group


def test_the_request_carries_generation_and_member():
    req = TxnOffsetCommitRequest("tx", "g", 5, 1, 7, "m-1", [("t", [(0, 42, "")])]).build(TxnOffsetCommitRequest_v3)
    back = TxnOffsetCommitRequest_v3.decode(req.encode())
    assert (back.generation_id, back.member_id, back.group_instance_id) == (7, "m-1", None)
    assert back.topics == [("t", [(0, 42, -1, "", {})], {})]


@pytest.mark.integration
async def test_a_stale_generation_or_unknown_member_cannot_commit(kafka_settings, make_topic):
    topic = await make_topic(partitions=1)
    group = f"g-{uuid.uuid4().hex[:8]}"
    kw = kafka_settings.client_kwargs()
    tp = TopicPartition(topic, 0)
    c = AIOKafkaConsumer(topic, **kw, group_id=group, enable_auto_commit=False)
    p = AIOKafkaProducer(**kw, transactional_id=f"t-{uuid.uuid4().hex[:8]}")
    await c.start()
    await p.start()
    try:
        for _ in range(100):  # wait for the assignment: a generation and a member id
            await c.getmany(timeout_ms=100)
            if c.assignment():
                break
        now = GroupMember(c._coordinator.generation, c._coordinator.member_id)
        assert now.generation_id > 0 and now.member_id
        member = now
        fence_by_group(p, lambda: member)

        await p.begin_transaction()
        await p.send_offsets_to_transaction({tp: 5}, group)
        await p.commit_transaction()
        assert await group_offsets.committed(c, [tp]) == {tp: 5}

        for stale in (GroupMember(now.generation_id - 1, now.member_id), GroupMember(now.generation_id, "nobody")):
            member = stale
            await p.begin_transaction()
            with pytest.raises(GroupFenced):
                await p.send_offsets_to_transaction({tp: 9}, group)
            await p.abort_transaction()
            assert await group_offsets.committed(c, [tp]) == {tp: 5}, stale

        member = now  # the producer is still usable after an aborted, fenced transaction
        await p.begin_transaction()
        await p.send_offsets_to_transaction({tp: 11}, group)
        await p.commit_transaction()
        assert await asyncio.wait_for(group_offsets.committed(c, [tp]), 30) == {tp: 11}
    finally:
        await p.stop()
        await c.stop()
