"""The Kafka transaction system test, for our services: seed the input, SIGKILL the copiers at random
points, read the output read_committed, compare sets, count duplicates.

Two instances of each of verifier, credit and batcher run as real processes (`python -m consumers serve`),
so partitions move between them on every kill/restart; >= 2,000 rollouts flow while one process at a
time is killed hard and restarted, or frozen (SIGSTOP) past its session timeout and woken up again (a
zombie: its partitions have moved, and its producers must be fenced). Every expected TrainingRecord must land in exactly one TrainerBatch.
A second test restarts the broker itself mid-run.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest

from consumers import testing
from consumers.registry import SERVICES
from consumers.runner import ensure_topics
from schemas import codec
from schemas.events import Rollout
from streams import topics
from tests.test_eos_pipeline import batch_record_ids, publish_revision, read_all, read_to_end, seed_groups

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


class Fleet:
    """Service processes: two instances per service, each restartable."""

    def __init__(self, bootstrap: str, prefix: str, logdir: Path, services=("verifier", "credit", "batcher"),
                 named: bool = True, env: dict[str, str] | None = None,
                 service_env: dict[str, dict[str, str]] | None = None):
        self.env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": bootstrap, "ROLLOUT_TOPIC_PREFIX": prefix,
                    "ROLLOUT_SESSION_TIMEOUT_MS": "6000", "PYTHONPATH": str(ROOT),
                    "ROLLOUT_FAMILY": testing.FAMILY,  # a setting from the environment, as a deployment would
                    **(env or {})}
        self.logdir = logdir
        self.named = named  # False: no --instance, so each process takes a free slot of its group (streams.instances)
        self.service_env = service_env or {}  # per service (its principal's credentials on a secured cluster)
        self.procs: dict[tuple[str, str], subprocess.Popen] = {}
        self.services = services
        self.kills = Counter()

    def start(self, svc: str, inst: str) -> None:
        log = open(self.logdir / f"{svc}-{inst}.log", "ab")
        self.procs[(svc, inst)] = subprocess.Popen(
            [sys.executable, "-m", "consumers", "serve", svc, *(("--instance", inst) if self.named else ()),
             *(("--batch-records", "32", "--flush-after-s", "1") if svc == "batcher" else ())], cwd=ROOT,
            env={**self.env, **self.service_env.get(svc, {})}, stdout=log, stderr=subprocess.STDOUT)

    def start_all(self) -> None:
        for svc in self.services:
            for inst in ("a", "b"):
                self.start(svc, inst)

    def kill(self, svc: str, inst: str) -> None:
        p = self.procs[(svc, inst)]
        p.send_signal(signal.SIGKILL)
        p.wait()
        self.kills[svc] += 1

    def stop_all(self) -> dict[tuple[str, str], int | None]:
        """SIGTERM every process; their exit codes (0 = finished its transaction, left the group, closed)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = {}
        for key, p in self.procs.items():
            try:
                codes[key] = p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[key] = None
        return codes


async def read_batches(kw, expected: set[str], timeout_s: float) -> list:
    """The trainer batches once every expected record is in one, read again 3 s later (a duplicate would show)."""
    await read_all(kw, topics.TRAINER_BATCHES.name,
                   until=lambda rs: sum(batch_record_ids(rs).values()) >= len(expected), timeout_s=timeout_s)
    await asyncio.sleep(3)
    return await read_all(kw, topics.TRAINER_BATCHES.name, idle_s=3, timeout_s=60)


def check_exactly_once(expected: set[str], recs: list, **shown) -> None:
    """Print the run's figures (``shown`` first), then fail on a record missing from the batches or in two."""
    got = batch_record_ids(recs)
    missing = expected - set(got)
    doubled = sorted(k for k, n in got.items() if n > 1)
    print(*(f"{k}={v}" for k, v in shown.items()), f"records={len(expected)} batches={len(recs)} "
          f"missing={len(missing)} duplicates={len(doubled)}")
    assert not missing, f"{len(missing)} records never reached a batch"
    assert not doubled, f"{len(doubled)} records landed in two batches: {doubled[:4]}"
    assert set(got) == expected


async def start_fleet(bootstrap: str, kafka_settings, monkeypatch, tmp_path: Path, *, named: bool = True,
                      env: dict[str, str] | None = None) -> tuple[dict, Fleet]:
    """Fresh topics (their own prefix), revision 0 published, and two instances of each service running."""
    prefix = f"k{uuid.uuid4().hex[:8]}."
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", prefix)
    kw = kafka_settings.client_kwargs()
    for svc in ("verifier", "credit", "batcher"):
        await ensure_topics(SERVICES[svc], kw)
    await publish_revision(kw, 0)
    fleet = Fleet(bootstrap, prefix, tmp_path, named=named, env=env)
    fleet.start_all()
    return kw, fleet


async def test_sigkill_two_instances_exactly_once(kafka_bootstrap, kafka_settings, monkeypatch, tmp_path):
    kw, fleet = await start_fleet(kafka_bootstrap, kafka_settings, monkeypatch, tmp_path)
    rng = random.Random(1234)
    expected: set[str] = set()
    groups, per_chunk = 520, 20  # 2,080 rollouts
    try:
        stop_killing = asyncio.Event()

        events = 0

        async def killer():
            nonlocal events
            while not stop_killing.is_set() or events < 6:
                await asyncio.sleep(rng.uniform(1.5, 4.0))
                svc, inst = rng.choice(["verifier", "credit", "batcher"]), rng.choice("ab")
                events += 1
                if events % 3 == 0:
                    # a zombie: frozen past its session timeout, its partitions move, then it wakes up
                    # mid-whatever and tries to carry on; its producers must be fenced
                    p = fleet.procs[(svc, inst)]
                    p.send_signal(signal.SIGSTOP)
                    await asyncio.sleep(8.0)
                    p.send_signal(signal.SIGCONT)
                    fleet.kills["zombie:" + svc] += 1
                    continue
                fleet.kill(svc, inst)
                await asyncio.sleep(rng.uniform(0.0, 1.5))
                fleet.start(svc, inst)

        killing = asyncio.create_task(killer())
        for start in range(0, groups, per_chunk):
            expected |= await seed_groups(kw, per_chunk, start=start)
            await asyncio.sleep(0.6)
        await asyncio.sleep(3)
        stop_killing.set()
        await killing
        assert sum(n for k, n in fleet.kills.items() if not k.startswith("zombie")) >= 4, fleet.kills
        assert sum(n for k, n in fleet.kills.items() if k.startswith("zombie")) >= 2, fleet.kills
        recs = await read_batches(kw, expected, timeout_s=150)
    finally:
        codes = fleet.stop_all()
    assert set(codes.values()) == {0}, f"not a graceful SIGTERM shutdown: {codes}"
    assert len(expected) == groups * 4
    # transactions the group refused (a member whose partitions had moved: KIP-447's fence, streams.group_fencing)
    fenced = sum(f.read_text(errors="replace").count("refused the offsets of generation")
                 for f in tmp_path.glob("*.log"))
    check_exactly_once(expected, recs, kills=dict(fleet.kills), zombie_transactions_fenced=fenced)


async def freeze_in_a_transaction(kw, topic: topics.Topic, procs: list[subprocess.Popen], group_id: str,
                                  tries: int = 4000) -> float:
    """SIGSTOP ``procs`` at a moment one of them holds an open transaction on ``topic`` that has sent offsets of
    ``group_id`` (records written, not committed: a partition's high watermark is past its last stable offset;
    offsets pending: an OffsetFetch with require_stable answers UNSTABLE_OFFSET_COMMIT), and both stay so while
    they are frozen; returns how many seconds it took, or raises if no such transaction was caught. Otherwise
    they are resumed. (Frozen before its offsets were sent, a transaction holds nothing a new owner waits for.)"""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from streams.group_offsets import Unstable, committed as group_committed

    committed = AIOKafkaConsumer(**kw, group_id=None, isolation_level="read_committed")
    written = AIOKafkaConsumer(**kw, group_id=None, isolation_level="read_uncommitted")
    group = AIOKafkaConsumer(**kw, group_id=group_id, enable_auto_commit=False)  # never joins: asks only
    await asyncio.gather(committed.start(), written.start(), group.start())
    t0 = asyncio.get_running_loop().time()
    try:
        tps = [TopicPartition(topic.name, p) for p in range(topic.partitions)]
        inputs = [TopicPartition(t.name, p) for t in SERVICES["verifier"].inputs for p in range(t.partitions)]

        async def open_() -> bool:
            lso, hw = await asyncio.gather(committed.end_offsets(tps), written.end_offsets(tps))
            if not any(hw[tp] > lso[tp] for tp in tps):
                return False
            try:
                await group_committed(group, inputs, timeout_s=0)
            except Unstable:
                return True
            return False

        for _ in range(tries):
            if await open_():
                for p in procs:
                    p.send_signal(signal.SIGSTOP)
                await asyncio.sleep(0.5)
                if await open_():
                    return asyncio.get_running_loop().time() - t0
                for p in procs:
                    p.send_signal(signal.SIGCONT)
            await asyncio.sleep(0.002)
    finally:
        await asyncio.gather(committed.stop(), written.stop(), group.stop())
    raise AssertionError(f"no open transaction with offsets pending on {topic.name} caught in {tries} tries")


async def test_an_unnamed_instance_killed_in_a_transaction_is_taken_over_exactly_once(kafka_bootstrap, kafka_settings,
                                                                                    monkeypatch, tmp_path):
    """Instances started without --instance. Both verifiers are frozen while one of them has a transaction open
    (written, offsets sent, not committed), then killed, and two new unnamed ones start on the same host: they take
    the dead ones' slots (streams.instances), so their transactional ids are the dead ones', and starting their
    producers aborts the orphan at once, long before the broker's transaction timeout (20 s here) would. Nothing
    may be lost or doubled; the take-over waits for no timeout."""
    kw, fleet = await start_fleet(kafka_bootstrap, kafka_settings, monkeypatch, tmp_path, named=False,
                                  env={"ROLLOUT_TRANSACTION_TIMEOUT_MS": "20000"})
    expected: set[str] = set()
    groups, per_chunk = 200, 5  # 800 rollouts, arriving all along, so the verifiers keep committing

    async def seed() -> None:
        for start in range(0, groups, per_chunk):
            expected.update(await seed_groups(kw, per_chunk, start=start))
            await asyncio.sleep(0.2)

    try:
        seeding = asyncio.create_task(seed())
        await asyncio.sleep(3)  # the fleet has joined and is working
        waited = await freeze_in_a_transaction(kw, topics.SCORES, [fleet.procs[("verifier", i)] for i in "ab"],
                                               SERVICES["verifier"].group_id)
        for inst in "ab":
            fleet.kill("verifier", inst)
            fleet.start("verifier", inst)
        await seeding
        recs = await read_batches(kw, expected, timeout_s=180)
    finally:
        codes = fleet.stop_all()
    assert set(codes.values()) == {0}, f"not a graceful SIGTERM shutdown: {codes}"
    took = [float(m) for f in tmp_path.glob("verifier-*.log")
            for m in re.findall(r"verifier took over \[[^]]*\] in ([0-9.]+)s", f.read_text(errors="replace"))]
    check_exactly_once(expected, recs, open_transaction_caught_after_s=round(waited, 1), verifier_take_overs_s=sorted(took))
    assert took and max(took) < 10.0, f"a take-over waited for the broker to abort the orphan: {took}"


async def test_broker_restart_mid_run_exactly_once(monkeypatch, tmp_path):
    """A broker this test owns (streams.local_broker: the same Kafka jars, one KRaft node) is stopped and
    started again while the services run. (The shared testcontainers broker advertises a host port it cannot
    reach from inside its container, so after a container restart its own transaction coordinator cannot
    write markers; a restart there tests the fixture, not the services.)"""
    from streams.config import KafkaSettings
    from streams.local_broker import LocalBroker, free_port

    monkeypatch.delenv("ROLLOUT_BOOTSTRAP_SERVERS", raising=False)
    broker = LocalBroker(state_dir=tmp_path / "kafka", port=free_port(restartable=True),
                         controller_port=free_port(restartable=True))
    await asyncio.to_thread(broker.up, 180)
    prefix = f"r{uuid.uuid4().hex[:8]}."
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", prefix)
    kw = KafkaSettings().with_bootstrap(broker.bootstrap).client_kwargs()
    fleet = None
    try:
        for svc in ("verifier", "credit", "batcher"):
            await ensure_topics(SERVICES[svc], kw)
        await publish_revision(kw, 0)
        fleet = Fleet(broker.bootstrap, prefix, tmp_path)
        fleet.start_all()
        expected: set[str] = set()
        expected |= await seed_groups(kw, 100)
        # mid-run: the services are up and batches are flowing, and a fresh 400 records are on their way
        await read_all(kw, topics.TRAINER_BATCHES.name, until=lambda rs: len(rs) >= 2, timeout_s=60)
        expected |= await seed_groups(kw, 100, start=100)
        for t in (topics.STEPS.name, topics.ROLLOUTS.name):  # the seeder's commit markers are written
            await read_to_end(kw, t)
        await asyncio.to_thread(broker.down)
        await asyncio.sleep(2.0)
        await asyncio.to_thread(broker.up, 180)  # a loaded 2-core machine can take a while
        # The input is written before and after the restart, never across it, and is visible before it: a test
        # producer caught by the restart has to guess what committed (a wrong guess doubles the input), and
        # has no CommitWatch to re-commit a transaction the restart left hanging (streams/commits.py).
        expected |= await seed_groups(kw, 100, start=200)
        recs = await read_batches(kw, expected, timeout_s=180)
        seeded = Counter(codec.decode(r.value, Rollout).rollout_id
                         for r in await read_to_end(kw, topics.ROLLOUTS.name))
    finally:
        if fleet is not None:
            fleet.stop_all()
        await asyncio.to_thread(broker.down)
    # the input first: each rollout seeded once, so any doubling below is the services' doing
    assert max(seeded.values()) == 1, f"the test seeded {sum(n > 1 for n in seeded.values())} rollouts twice"
    check_exactly_once(expected, recs)
