"""A hanging transaction, made for real, is committed again by the processor that was told it committed.

A broker restarted while a transaction commits can leave it hanging: the producer's commit succeeded, the
coordinator no longer knows the transaction, and its records stay open on a partition, so every
``read_committed`` reader stops there for good (seen in ``test_eos_kill.py``'s broker restart: 28 scores on two
partitions, the coordinator showing CompleteCommit). To make one on purpose, this test runs its own broker with
``transaction.partition.verification.enable=false`` (so the partition leader does not ask the coordinator) and
lets the verifier's producers append scores without ever adding those partitions to the transaction at the
coordinator. The verifier then has no further input for those partitions, so nothing else would ever close
them: only ``TransactionalProcessor.confirm_commits`` can.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from consumers import testing
from consumers.runner import System
from consumers.settings import ServiceSettings
from streams import topics
from tests.test_eos_pipeline import publish_revision, seed_groups

pytestmark = pytest.mark.integration


async def _visible(kw, isolation: str) -> int:
    """Records a reader of the scores topic reaches (read_committed stops at the first open transaction)."""
    c = AIOKafkaConsumer(**kw, group_id=None, isolation_level=isolation, enable_auto_commit=False)
    await c.start()
    try:
        tps = [TopicPartition(topics.SCORES.name, p) for p in range(topics.SCORES.partitions)]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        n, idle = 0, 0
        while idle < 3:
            got = await c.getmany(timeout_ms=300)
            idle = 0 if got else idle + 1
            n += sum(len(v) for v in got.values())
        return n
    finally:
        await c.stop()


def _hide_scores_from_coordinator(prod) -> None:
    """Records this producer sends to the scores topic skip AddPartitionsToTxn: the coordinator never hears of
    those partitions, so its commit writes no marker there (the hanging transaction of a broker restart)."""
    mgr = prod._txn_manager
    real = mgr.maybe_add_partition_to_txn

    def add(tp: TopicPartition) -> None:
        if tp.topic == topics.SCORES.name:
            mgr._txn_partitions.add(tp)
        else:
            real(tp)

    mgr.maybe_add_partition_to_txn = add


def _restore(prod) -> None:
    prod._txn_manager.__dict__.pop("maybe_add_partition_to_txn", None)


async def test_hanging_transaction_is_committed_again(monkeypatch, tmp_path):
    from streams.config import KafkaSettings
    from streams.local_broker import LocalBroker, free_port

    monkeypatch.delenv("ROLLOUT_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", f"h{uuid.uuid4().hex[:8]}.")
    monkeypatch.setenv("ROLLOUT_CONFIRM_S", "8")  # long enough to see it hang first
    broker = LocalBroker(state_dir=tmp_path / "kafka", port=free_port(), controller_port=free_port(),
                         overrides={"transaction.partition.verification.enable": "false"})
    await asyncio.to_thread(broker.up, 180)
    kw = KafkaSettings().with_bootstrap(broker.bootstrap).client_kwargs()
    try:
        await topics.create_topics(kw)
        await publish_revision(kw, 0)
        system = System(["verifier"], ServiceSettings(family=testing.FAMILY), kw)
        await system.__aenter__()
        proc = system.processors["verifier"]
        await seed_groups(kw, 10)  # 40 rollouts
        for _ in range(120):
            if await _visible(kw, "read_committed") >= 40 and proc.producer is not None:
                break
            await asyncio.sleep(0.25)
        assert await _visible(kw, "read_committed") == 40

        async with proc.lock:  # between two transactions
            hidden = [proc.producer]
            for prod in hidden:
                _hide_scores_from_coordinator(prod)
        await seed_groups(kw, 10, start=10)  # 40 more, scored into transactions the coordinator half-knows
        for _ in range(120):
            if await _visible(kw, "read_uncommitted") >= 80:
                break
            await asyncio.sleep(0.25)
        async with proc.lock:
            for prod in hidden:
                _restore(prod)
            recommitted_before = proc.stats.recommitted
        # the commits succeeded, yet the new scores are not there for read_committed readers: hanging
        assert await _visible(kw, "read_uncommitted") == 80
        assert await _visible(kw, "read_committed") < 80
        assert recommitted_before == 0

        for _ in range(120):  # confirm_commits: every ROLLOUT_CONFIRM_S, re-commit what stays invisible
            if await _visible(kw, "read_committed") >= 80:
                break
            await asyncio.sleep(0.5)
        assert await _visible(kw, "read_committed") == 80  # all of them, none twice
        assert proc.stats.recommitted >= 1
        assert proc.stats.aborted == 0
        await asyncio.wait_for(system.__aexit__(None, None, None), 30)
    finally:
        await asyncio.to_thread(broker.down)
