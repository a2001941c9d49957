"""streams.group_fencing: offsets committed in a transaction carry the member's generation, and the group
coordinator of a real broker refuses them once the group has moved on (KIP-447)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from tests.test_eos_pipeline import prefix  # noqa: F401  (fixture)
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

        # the generation is fixed when the offsets are queued: one that changes while the sender is still at
        # AddOffsetsToTxn (a stuck producer retrying through a rebalance) is not picked up
        member = GroupMember(now.generation_id - 1, now.member_id)
        await p.begin_transaction()
        queued = asyncio.ensure_future(p.send_offsets_to_transaction({tp: 13}, group))
        await asyncio.sleep(0)
        member = now
        with pytest.raises(GroupFenced):
            await queued
        await p.abort_transaction()
        assert await group_offsets.committed(c, [tp]) == {tp: 5}

        member = now  # the producer is still usable after an aborted, fenced transaction
        await p.begin_transaction()
        await p.send_offsets_to_transaction({tp: 11}, group)
        await p.commit_transaction()
        assert await asyncio.wait_for(group_offsets.committed(c, [tp]), 30) == {tp: 11}
    finally:
        await p.stop()
        await c.stop()


@pytest.mark.integration
async def test_a_processor_that_missed_a_rebalance_is_fenced_and_recovers(kafka_settings, prefix):
    """The processor's side of the fence, on a real broker: the three services run; the verifier is made to
    believe it still holds an older generation (what a member frozen through a rebalance would hold). Its next
    transaction is refused by the group and aborted, its tasks are dropped, it rejoins, takes its partitions over
    from the log, and every record still reaches exactly one batch."""
    from consumers import testing
    from consumers.runner import System
    from consumers.settings import ServiceSettings
    from streams import topics
    from tests.test_eos_pipeline import THREE, batch_record_ids, publish_revision, read_all, seed_groups

    kw = kafka_settings.client_kwargs()
    cfg = ServiceSettings(family=testing.FAMILY, batch_records=16, flush_after_s=1.0)
    async with System(THREE, cfg, kw) as system:
        await publish_revision(kw, 0)
        verifier = system.processors["verifier"]
        expected = await seed_groups(kw, 20)
        await read_all(kw, topics.TRAINER_BATCHES.name, until=lambda rs: len(rs) >= 1, timeout_s=60)
        async with verifier.lock:  # between two transactions
            assert verifier.member is not None and verifier.tasks
            verifier.member = GroupMember(verifier.member.generation_id - 1, verifier.member.member_id)
        expected |= await seed_groups(kw, 20, start=20)
        recs = await read_all(kw, topics.TRAINER_BATCHES.name,
                              until=lambda rs: sum(batch_record_ids(rs).values()) >= len(expected), timeout_s=90)
        await asyncio.sleep(2)  # a doubled record would show up now
        recs = await read_all(kw, topics.TRAINER_BATCHES.name, idle_s=2, timeout_s=60)
        assert verifier.stats.fenced >= 1, "the stale generation was never refused"
        assert verifier.member is not None and verifier.member.generation_id >= 2  # it rejoined
    got = batch_record_ids(recs)
    assert set(got) == expected and max(got.values()) == 1


def test_the_aiokafka_internals_the_fence_needs_are_checked_at_start(monkeypatch):
    """Issue 24, "Also": the private aiokafka names the exactly-once code uses are all in the installed release,
    and one gone (the method the fence replaces, or the sender no longer calling it) stops a processor loudly."""
    from aiokafka.producer.sender import Sender

    from streams import aiokafka_internals

    assert aiokafka_internals.missing() == []
    aiokafka_internals.check()
    monkeypatch.delattr(Sender, "_do_txn_offset_commit")
    assert aiokafka_internals.missing() == ["Sender._do_txn_offset_commit"]
    monkeypatch.undo()

    def renamed(self):  # a release whose sender commits offsets through another method
        return self._do_offsets_commit()

    monkeypatch.setattr(Sender, "_maybe_do_transactional_request", renamed)
    aiokafka_internals.check.cache_clear()
    with pytest.raises(aiokafka_internals.AiokafkaInternalsChanged, match="calling self._do_txn_offset_commit"):
        aiokafka_internals.check()
    monkeypatch.undo()
    aiokafka_internals.check.cache_clear()
