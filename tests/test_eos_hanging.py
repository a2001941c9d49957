"""A hanging transaction, made for real, is committed again by the processor that was told it committed.

A broker restarted while a transaction commits can leave it hanging: the producer's commit succeeded, the
coordinator no longer knows the transaction, and its records stay open on a partition, so every
``read_committed`` reader stops there for good (seen in ``test_eos_kill.py``'s broker restart: 28 scores on two
partitions, the coordinator showing CompleteCommit). To make one on purpose, this test runs its own broker with
``transaction.partition.verification.enable=false`` (so the partition leader does not ask the coordinator) and
lets the verifier's producers append scores without ever adding those partitions to the transaction at the
coordinator. The verifier then has no further input for those partitions, so nothing else would ever close
them: only ``TransactionalProcessor.confirm_commits`` can (or, once it died, the next process with its
transactional id).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from consumers import testing
from consumers.runner import System
from consumers.settings import ServiceSettings
from schemas import codec
from schemas.events import Rollout, RolloutScored
from streams import topics
from tests.test_eos_pipeline import publish_revision, read_all, seed_groups

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


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


def _hide_from_coordinator(prod, hidden_topics: set[str], *, group: bool = False) -> None:
    """Records this producer sends to ``hidden_topics`` skip AddPartitionsToTxn, and with ``group`` its offsets
    skip AddOffsetsToTxn (TxnOffsetCommit still reaches the group coordinator): the transaction coordinator never
    hears of those partitions, so its commit writes no marker there (the hanging transaction of a broker
    restart)."""
    mgr = prod._txn_manager
    real = mgr.maybe_add_partition_to_txn
    real_group = mgr.consumer_group_to_add

    def add(tp: TopicPartition) -> None:
        if tp.topic in hidden_topics:
            mgr._txn_partitions.add(tp)
        else:
            real(tp)

    def group_to_add():
        g = real_group()
        if g is not None:
            mgr.consumer_group_added(g)  # as if AddOffsetsToTxn had been answered
        return None

    mgr.maybe_add_partition_to_txn = add
    if group:
        mgr.consumer_group_to_add = group_to_add


def _restore(prod) -> None:
    for name in ("maybe_add_partition_to_txn", "consumer_group_to_add"):
        prod._txn_manager.__dict__.pop(name, None)


async def _until(cond, timeout_s: float, every_s: float = 0.25) -> bool:
    """Poll the coroutine function ``cond`` until true; False after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if await cond():
            return True
        await asyncio.sleep(every_s)
    return await cond()


@pytest.fixture(scope="module")
def unverified_broker(tmp_path_factory):
    """One broker for this module with ``transaction.partition.verification.enable=false``; each test has its
    own topics (prefix)."""
    from streams.local_broker import LocalBroker, free_port

    broker = LocalBroker(state_dir=tmp_path_factory.mktemp("kafka"), port=free_port(), controller_port=free_port(),
                         overrides={"transaction.partition.verification.enable": "false"})
    broker.up(180)
    try:
        yield broker
    finally:
        broker.down()


@asynccontextmanager
async def _verifier_on_a_broker_without_verification(broker, monkeypatch, confirm_s: int):
    """Fresh topics on ``broker``, revision 0 and one verifier (``System``); yields (client kwargs, its
    processor), 40 rollouts scored and visible."""
    from streams.config import KafkaSettings

    monkeypatch.delenv("ROLLOUT_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", f"h{uuid.uuid4().hex[:8]}.")
    monkeypatch.setenv("ROLLOUT_CONFIRM_S", str(confirm_s))
    kw = KafkaSettings().with_bootstrap(broker.bootstrap).client_kwargs()
    await topics.create_topics(kw)
    await publish_revision(kw, 0)
    system = System(["verifier"], ServiceSettings(family=testing.FAMILY), kw)
    await system.__aenter__()
    proc = system.processors["verifier"]
    await seed_groups(kw, 10)  # 40 rollouts
    await _until(lambda: _committed_scores(kw, 40, proc), 30)
    assert await _visible(kw, "read_committed") == 40
    yield kw, proc
    await asyncio.wait_for(system.__aexit__(None, None, None), 30)


async def _committed_scores(kw, n: int, proc) -> bool:
    return proc.producer is not None and await _visible(kw, "read_committed") >= n


async def _hang_next_commits(kw, proc, hidden_topics: set[str], *, group: bool = False) -> None:
    """Score 40 more rollouts in commits whose ``hidden_topics`` (and with ``group``, offsets) hang."""
    async with proc.lock:  # between two transactions
        _hide_from_coordinator(proc.producer, hidden_topics, group=group)
        hidden = proc.producer
    await seed_groups(kw, 10, start=10)
    await _until(lambda: _visible_at_least(kw, "read_uncommitted", 80), 30)
    async with proc.lock:
        _restore(hidden)


async def _visible_at_least(kw, isolation: str, n: int) -> bool:
    return await _visible(kw, isolation) >= n


async def test_hanging_transaction_is_committed_again(unverified_broker, monkeypatch):
    async with _verifier_on_a_broker_without_verification(unverified_broker, monkeypatch, confirm_s=8) as (kw, proc):
        await _hang_next_commits(kw, proc, {topics.SCORES.name})
        recommitted_before = proc.stats.recommitted
        # the commits succeeded, yet the new scores are not there for read_committed readers: hanging
        assert await _visible(kw, "read_uncommitted") == 80
        assert await _visible(kw, "read_committed") < 80
        assert recommitted_before == 0

        # confirm_commits: every ROLLOUT_CONFIRM_S, re-commit what stays invisible
        await _until(lambda: _visible_at_least(kw, "read_committed", 80), 60, every_s=0.5)
        assert await _visible(kw, "read_committed") == 80  # all of them, none twice
        assert proc.stats.recommitted >= 1
        assert proc.stats.aborted == 0


async def test_a_hanging_commit_is_closed_after_the_processor_drops_its_partitions(unverified_broker, monkeypatch):
    """Issue 24, hole 1: a commit whose scores, snapshots and offsets all hang, then a forced drop (what a failed
    transaction, a fence or a new member id does). The take-over of the instance's own partitions must not wait
    for good on the offsets its hanging commit holds: it commits again first, with a fresh producer of the same
    transactional id, whose markers close the older epoch's transaction. ROLLOUT_CONFIRM_S is 300 here, so the
    periodic check cannot be what closes it."""
    from streams import group_offsets

    async with _verifier_on_a_broker_without_verification(unverified_broker, monkeypatch, confirm_s=300) as (kw,
                                                                                                      proc):
        await _hang_next_commits(kw, proc, {topics.SCORES.name, proc.config.changelog}, group=True)
        assert await _visible(kw, "read_committed") < 80
        inputs = [TopicPartition(t, p) for p in proc.tasks for t in proc.config.inputs]
        with pytest.raises(group_offsets.Unstable):  # the offsets are pending: a new owner would wait on them
            await group_offsets.committed(proc.consumer, inputs, timeout_s=0)

        t0 = asyncio.get_running_loop().time()
        async with proc.lock:
            owned = set(proc.tasks)
            await proc._retake_all()
        assert await _until(lambda: _owned_again(proc, owned), 60), "the partitions were not taken over again"
        took = asyncio.get_running_loop().time() - t0
        assert await _visible(kw, "read_committed") == 80  # the hanging commit closed, as committed
        t1 = asyncio.get_running_loop().time()
        await seed_groups(kw, 10, start=20)  # and the instance commits again
        assert await _until(lambda: _visible_at_least(kw, "read_committed", 120), 60)
        caught_up = asyncio.get_running_loop().time() - t1
        assert await _visible(kw, "read_committed") == 120  # nothing scored twice
        print(f"rollouts=120 scores_readable={await _visible(kw, 'read_committed')} stall_s={took:.1f} (forced drop to "
              f"owned again, the 40 hanging scores readable) catch_up_s={caught_up:.1f} (40 more, seeded then "
              f"readable) recommitted={proc.stats.recommitted}")
        assert proc.stats.recommitted >= 1


async def _owned_again(proc, owned: set[int]) -> bool:
    return not proc.pending and set(proc.tasks) == owned


async def _stable_ends(kw, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
    from aiokafka import AIOKafkaConsumer

    c = AIOKafkaConsumer(**kw, group_id=None, isolation_level="read_committed")
    await c.start()
    try:
        return await c.end_offsets(tps)
    finally:
        await c.stop()


async def test_a_commit_left_hanging_by_a_dead_process_is_closed_by_its_successor(unverified_broker, monkeypatch,
                                                                                 tmp_path):
    """Issue 36: what a commit wrote stays in a file per transactional id until a reader could see it
    (``streams.commits``), so a process that dies with a commit hanging leaves it to the next process with its id
    (here the next unnamed verifier on the host: it takes the dead one's slot). The dead one hangs its first
    commit with scores (``tests/_hang_a_commit.py``) and is SIGKILLed. Then:

    * a successor with the same id but without the file (moved away) runs for 15 s: the hang stays, so nothing
      else it does (starting its producer, taking the partitions over, its own checks) closes it;
    * a successor with the file closes it at its take-over: the hung scores become readable, each exactly once.
    """
    from streams.config import KafkaSettings

    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", f"h{uuid.uuid4().hex[:8]}.")
    kw = KafkaSettings().with_bootstrap(unverified_broker.bootstrap).client_kwargs()
    await topics.create_topics(kw)
    await publish_revision(kw, 0)
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": unverified_broker.bootstrap, "PYTHONPATH": str(ROOT),
           "ROLLOUT_CACHE_DIR": str(tmp_path / "cache"),  # the slot and the unconfirmed commits: this test's own
           "ROLLOUT_CONFIRM_S": "2"}
    await seed_groups(kw, 8)  # 32 rollouts in one transaction: all there before the verifier starts
    expected = {codec.decode(r.value, Rollout).rollout_id for r in await read_all(kw, topics.ROLLOUTS.name, idle_s=2)}
    dead = subprocess.Popen([sys.executable, "tests/_hang_a_commit.py"], cwd=ROOT,
                            env={**env, "ROLLOUT_CONFIRM_S": "600"},  # it never checks its own commits
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "dead.log", "wb"), text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(dead.stdout.readline), 90)
    finally:
        dead.send_signal(signal.SIGKILL)
        dead.wait()
    assert line.startswith("HUNG "), f"the harness said {line!r}; see {tmp_path / 'dead.log'}"
    hung = {TopicPartition(topics.SCORES.name, int(p)): off for p, off in json.loads(line[5:]).items()}
    files = list((tmp_path / "cache").rglob("*.commits.json"))
    assert len(files) == 1, files
    ends = await _stable_ends(kw, list(hung))
    assert hung and all(ends[tp] <= off for tp, off in hung.items()), f"no hang was made: {hung} {ends}"

    def successor(log: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "consumers", "serve", "verifier"], cwd=ROOT, env=env,
                                stdout=open(tmp_path / log, "wb"), stderr=subprocess.STDOUT)

    kept = files[0].rename(tmp_path / "kept.json")
    blind = successor("blind.log")
    try:
        await asyncio.sleep(15)  # its take-over, and more than one confirm_s (2 s) of its own checks
        ends = await _stable_ends(kw, list(hung))
    finally:
        blind.send_signal(signal.SIGTERM)
        assert blind.wait(timeout=30) == 0
    assert all(ends[tp] <= off for tp, off in hung.items()), "something other than the file closed the hang"
    assert "took over" in (tmp_path / "blind.log").read_text()

    kept.rename(files[0])
    t0 = time.monotonic()
    heir = successor("heir.log")
    try:
        while True:
            ends = await _stable_ends(kw, list(hung))
            if all(ends[tp] > off for tp, off in hung.items()):
                closed_s = time.monotonic() - t0
                break
            assert time.monotonic() - t0 < 60, f"the hang is still open 60 s after the successor started: {ends}"
            await asyncio.sleep(0.2)
        scores = [codec.decode(r.value, RolloutScored) for r in await read_all(kw, topics.SCORES.name, idle_s=3)]
    finally:
        heir.send_signal(signal.SIGTERM)
        assert heir.wait(timeout=30) == 0
    print(f"hung partitions {sorted(tp.partition for tp in hung)}; closed {closed_s:.1f}s after the successor started")
    got = [s.rollout_id for s in scores]
    assert sorted(got) == sorted(set(got)), "a rollout scored twice"
    assert set(got) == expected
    assert not files[0].exists(), "the successor saw every commit: the file should be gone"
