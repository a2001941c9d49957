"""Faults on a three-broker KRaft cluster (streams/docker_cluster.py: replication factor 3, min.insync.replicas=2)
while 1,200 rollouts flow through verifier -> credit -> batcher -> trainer, two processes of each service:

    (a) SIGKILL of the broker that leads most of the pipeline's partitions, restarted after a while;
    (b) SIGKILL of the active KRaft controller (the quorum leader), restarted after a while;
    (c) a network partition: every packet to and from one broker dropped (the other brokers and the clients),
        then healed;
    (d) a rolling restart (SIGTERM, start, wait until every partition is fully replicated) of all three.

Each run: the input that committed is exactly the input trained, each record in one batch that a revision
names, or dead-lettered with its reason (0 lost, 0 doubled); the replayed run's audit is clean. It prints how
long the pipeline stalled (the longest time with no new committed revision, beside the longest gap before the
fault) and how long it took to catch up (from the end of the stall until the backlog, rollouts written but not
yet trained, is back to its pre-fault size). One cluster serves the module.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from consumers import testing
from consumers.trainer.step import initial_revision
from replay.audit import run_audit
from replay.ingest import Replayer
from schemas import codec
from schemas.events import DeadLetter, Rollout, TrainerBatch, TrainingRecord
from schemas.policy import PolicyRevision
from consumers.registry import SERVICES
from streams import security, topics
from streams.config import KafkaSettings
from streams.docker_cluster import LABEL, ClusterError, DockerCluster, ScramTls, docker
from streams.revisions import publish
from tests.test_eos_kill import Fleet
from tests.test_eos_pipeline import group_record_ids, read_all, read_to_end, seed_groups

pytestmark = pytest.mark.integration

GROUPS, PER_CHUNK = 240, 10  # 960 rollouts (4 per group), written 40 at a time: 48 s of input at most
CHUNK_EVERY_S = 2.0  # 20 rollouts/s at most
FAULT_AT_CHUNK = 10  # the fault hits the pipeline in its stride, 20 s in (or later), and a broker is back (12 s
# down, then its start: about 35 s in) while input still flows
STEADY_BACKLOG = 3 * 40  # until the fault, a chunk waits while the backlog is larger: the input goes no faster than
# the pipeline absorbs it (a 2-core machine also running vLLM on float32 absorbs less than 20 rollouts/s), so the
# fault finds it keeping up; from the fault on, the chunks come every CHUNK_EVERY_S whatever the backlog
KEEP_UP_S = 120.0  # a pipeline that does not drain its backlog to STEADY_BACKLOG in this long is stuck
RESULTS: list[str] = []


def _remove_orphans() -> None:
    """Clusters of earlier test processes that died before removing theirs (named rl-faults-<pid>-...)."""
    for name in set(docker("ps", "-a", "--filter", f"label={LABEL}", "--format", f'{{{{.Label "{LABEL}"}}}}').split()):
        m = re.fullmatch(r"rl-faults-(\d+)-\w+", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            DockerCluster(name).down()


def running_cluster(security: ScramTls | None = None):
    """A fresh three-broker cluster for a module (named for this process, so a later run removes it if this one
    dies), removed at the end with the figures the module's runs printed."""
    _remove_orphans()
    name = f"rl-faults-{os.getpid()}-{'s' if security else ''}{uuid.uuid4().hex[:4]}"
    c = DockerCluster(name, image=os.environ.get("ROLLOUT_KAFKA_IMAGE") or "rollout-log/kafka:local",
                      security=security)
    try:
        t0 = time.monotonic()
        c.up(timeout_s=240)
    except ClusterError as e:
        c.down()
        pytest.fail(f"the three-broker cluster did not start: {e}", pytrace=False)
    print(f"\n[cluster] {c.bootstrap}{' (SASL_SSL)' if security else ''} ready in {time.monotonic() - t0:.0f}s; "
          f"active controller: node {c.quorum_leader()}")
    try:
        yield c
    finally:
        c.down()
        if RESULTS:
            print("\n" + "\n".join(RESULTS))


@pytest.fixture(scope="module")
def cluster():
    yield from running_cluster()


@dataclass
class Timeline:
    """When input committed and when output (batches named by a revision) committed, in monotonic seconds."""

    seeded: list[tuple[float, int]] = field(default_factory=list)  # (t, records in the chunk)
    named: list[tuple[float, str]] = field(default_factory=list)  # (t, the batch a new revision trained)
    sizes: dict[str, int] = field(default_factory=dict)  # batch id -> records

    @property
    def revisions(self) -> list[float]:
        return [t for t, _ in self.named]

    @property
    def trained(self) -> list[tuple[float, int]]:
        return [(t, self.sizes.get(b, 0)) for t, b in self.named]

    def backlog(self, t: float) -> int:
        return sum(n for s, n in self.seeded if s <= t) - sum(n for s, n in self.trained if s <= t)

    def figures(self, fault_at: float, healed_at: float) -> dict[str, float]:
        before = [t for t in self.revisions if t < fault_at]
        last = before[-20:]
        gaps_before = [b - a for a, b in zip(last, last[1:])]  # (zipping before[-20:] with before[-19:] paired
        # each revision with itself whenever fewer than 20 came before the fault: a gap of 0.0)
        after = [t for t in self.revisions if t >= fault_at]
        # the stall: the longest span without a new revision from the fault on (the last one before it opens it)
        marks = ([before[-1]] if before else []) + after
        stall, resumed = 0.0, fault_at
        for a, b in zip(marks, marks[1:]):
            if b - a > stall:
                stall, resumed = b - a, b
        # caught up: the backlog is back to the largest it was in the 20 s before the fault
        window = [t for t, _ in self.named + self.seeded if fault_at - 20 <= t < fault_at]
        normal = max((self.backlog(t) for t in window), default=0)
        events = sorted(t for t in self.revisions if t >= resumed)
        caught = next((t for t in events if self.backlog(t) <= normal), events[-1] if events else resumed)
        # the input waits too (the seeder, like an arena, writes through the same brokers)
        ins = [fault_at] + [t for t, _ in self.seeded if t >= fault_at]
        input_stall = max((b - a for a, b in zip(ins, ins[1:])), default=0.0)
        return {"stall_s": stall, "gap_before_s": max(gaps_before, default=0.0), "revisions_before": len(before),
                "catch_up_s": caught - resumed,
                "fault_s": healed_at - fault_at, "backlog_before": normal, "input_stall_s": input_stall}


async def _watch(kw, tl: Timeline, stop: asyncio.Event) -> None:
    """Follow trainer-batches and policy-revisions read_committed; a revision names the batch it trained."""
    from aiokafka import AIOKafkaConsumer

    cons = AIOKafkaConsumer(topics.TRAINER_BATCHES.name, topics.POLICY_REVISIONS.name, **kw, group_id=None,
                            isolation_level="read_committed", auto_offset_reset="earliest",
                            max_partition_fetch_bytes=16 * 1024 * 1024)
    await cons.start()
    try:
        while not stop.is_set():
            for tp, recs in (await cons.getmany(timeout_ms=300)).items():
                now = time.monotonic()
                for r in recs:
                    if tp.topic == topics.TRAINER_BATCHES.name:
                        b = codec.decode(r.value, TrainerBatch)
                        tl.sizes[b.batch_id] = len(b.records)
                    else:
                        rev = codec.decode(r.value, PolicyRevision)
                        if rev.batch_id:
                            tl.named.append((now, rev.batch_id))
    finally:
        await cons.stop()


async def _leaders(kw) -> Counter:
    """Partitions of this run's topics led by each broker."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**kw)
    await admin.start()
    try:
        names = [n for n in await admin.list_topics() if n.startswith(topics.topic_prefix())]
        return Counter(p["leader"] for t in await admin.describe_topics(names) for p in t["partitions"])
    finally:
        await admin.close()


async def _fully_replicated(kw, timeout_s: float = 180) -> None:
    """Every partition (the internal topics' too) has all 3 replicas in sync: the next fault starts clean."""
    from aiokafka.admin import AIOKafkaAdminClient

    deadline = time.monotonic() + timeout_s
    lagging: list = []
    while time.monotonic() < deadline:
        admin = AIOKafkaAdminClient(**kw)
        try:
            await admin.start()
            desc = await admin.describe_topics(await admin.list_topics())
            lagging = [(t["topic"], p["partition"], p["isr"]) for t in desc for p in t["partitions"]
                       if len(p["isr"]) < len(p["replicas"])]
            if not lagging:
                return
        except Exception as e:  # noqa: BLE001 - a broker coming back: ask again
            lagging = [repr(e)]
        finally:
            await admin.close()
        await asyncio.sleep(1.0)
    raise AssertionError(f"partitions not fully replicated after {timeout_s:.0f}s: {lagging[:5]}")


async def _committed_groups(kw) -> Counter:
    return Counter(codec.decode(r.value, Rollout).group_id
                   for r in await read_all(kw, topics.ROLLOUTS.name, idle_s=5, timeout_s=120))


async def _run(cluster: DockerCluster, fault, label: str, monkeypatch, tmp_path: Path) -> None:
    prefix = f"f{uuid.uuid4().hex[:8]}."
    for k, v in {**cluster.client_env(), "ROLLOUT_TOPIC_PREFIX": prefix}.items():
        monkeypatch.setenv(k, v)
    settings = KafkaSettings.from_env()  # the test's own reads and writes: the admin's, on a secured cluster
    kw = settings.client_kwargs()
    await _fully_replicated(kw)
    await topics.create_topics(kw)
    services = ("verifier", "credit", "batcher", "trainer")
    if cluster.security:  # one principal per service, allowed what its declaration needs and nothing else
        await security.apply_acls(kw, security.all_acls(SERVICES))
    ckdir = tmp_path / "checkpoints"
    await publish(kw, initial_revision(testing.FAMILY, ckdir, seed=0))
    fleet = Fleet(cluster.bootstrap, prefix, tmp_path, services=services,
                  service_env={s: cluster.client_env(s) for s in services})
    fleet.env.update(ROLLOUT_CHECKPOINT_DIR=str(ckdir), ROLLOUT_MAX_OFF_POLICY_STEPS="100000")
    tl, stop = Timeline(), asyncio.Event()
    watcher = asyncio.create_task(_watch(kw, tl, stop))
    fleet.start_all()
    committed, uncertain = set(), set()  # chunks (first group index) whose commit returned / raised
    fault_task, input_rate = None, 0.0
    t_start = time.monotonic()
    try:
        for i, start in enumerate(range(0, GROUPS, PER_CHUNK)):
            if fault_task is None:  # before the fault: no faster than the pipeline absorbs
                waited = time.monotonic()
                while tl.backlog(time.monotonic()) > STEADY_BACKLOG:
                    assert time.monotonic() - waited < KEEP_UP_S, (
                        f"the pipeline stalled before any fault: backlog {tl.backlog(time.monotonic())} rollouts "
                        f"after {KEEP_UP_S:.0f} s (chunk {i})")
                    await asyncio.sleep(0.2)
                if i >= FAULT_AT_CHUNK:
                    input_rate = sum(n for _, n in tl.seeded) / (time.monotonic() - t_start)
                    fault_task = asyncio.create_task(fault(cluster, kw))  # the pipeline keeps up: now the fault
            next_chunk = time.monotonic() + CHUNK_EVERY_S
            try:
                await asyncio.wait_for(seed_groups(kw, PER_CHUNK, start=start), 90)
                committed.add(start)
                tl.seeded.append((time.monotonic(), PER_CHUNK * 4))
            except Exception as e:  # noqa: BLE001 - the seeder's own transaction failed in the fault: not retried
                uncertain.add(start)
                print(f"chunk {start}: the seeder's transaction failed ({type(e).__name__}: {e})")
            while i == 0 and not tl.revisions:  # the first batch trained: every service is up
                await asyncio.sleep(0.2)
            await asyncio.sleep(max(0.0, next_chunk - time.monotonic()))
        fault_at, healed_at = await fault_task
        on_log = await _committed_groups(kw)
        assert max(on_log.values()) == 4, "the test's own input is on the log twice"  # 4 rollouts per group
        groups_on_log = {int(g[1:]) // PER_CHUNK * PER_CHUNK for g in on_log}
        assert committed <= groups_on_log <= committed | uncertain
        expected: set[str] = set()
        for chunk in groups_on_log:
            expected |= group_record_ids(PER_CHUNK, start=chunk)
        assert len(expected) >= 0.9 * 4 * GROUPS, f"only {len(expected)} rollouts committed"
        deadline = time.monotonic() + 300
        while sum(n for _, n in tl.trained) < len(expected) and time.monotonic() < deadline:
            await asyncio.sleep(1.0)
        await asyncio.sleep(3)  # anything extra (a record trained twice) would show up now
    finally:
        codes = fleet.stop_all()
        stop.set()
        await watcher
        if fault_task is not None and not fault_task.done():
            fault_task.cancel()
    total_s = time.monotonic() - t_start
    batches = {b.batch_id: b for b in (codec.decode(r.value, TrainerBatch) for r in
                                      await read_to_end(kw, topics.TRAINER_BATCHES.name))}
    revs = [codec.decode(r.value, PolicyRevision) for r in await read_to_end(kw, topics.POLICY_REVISIONS.name)]
    letters = [codec.decode(r.value, DeadLetter) for r in await read_to_end(kw, topics.DEAD_LETTERS.name)]
    # a record is trained (in a batch a revision names, not refused there) or dead-lettered (refused as stale by
    # the batcher or by the trainer, with the reason); with ROLLOUT_MAX_OFF_POLICY_STEPS this high, none is
    batched = Counter(x.record_id for r in revs if r.batch_id for x in batches[r.batch_id].records)
    refused = Counter(codec.decode(d.raw, TrainingRecord).record_id for d in letters
                      if d.error_type == "StaleRecordError")
    trained = batched - Counter({k: 1 for k in refused if k in batched})
    other_letters = [(d.service, d.error_type, d.error_message[:200]) for d in letters
                     if d.error_type != "StaleRecordError"]
    lost = expected - set(trained) - set(refused)
    doubled = {k for k, n in (trained + refused).items() if n > 1}
    untrained_batches = set(batches) - {r.batch_id for r in revs}
    figures = tl.figures(fault_at, healed_at)
    line = (f"[{label}] rollouts={len(expected)} trained={sum(trained.values())} dead_lettered={sum(refused.values())} "
            f"lost={len(lost)} doubled={len(doubled)} revisions={len(revs) - 1} fault_s={figures['fault_s']:.1f} "
            f"stall_s={figures['stall_s']:.1f} (longest gap between the {figures['revisions_before']} revisions before the "
            f"fault {figures['gap_before_s']:.1f}) "
            f"catch_up_s={figures['catch_up_s']:.1f} (backlog before {figures['backlog_before']}) "
            f"input_stall_s={figures['input_stall_s']:.1f} "
            f"seeder_failed_chunks={len(uncertain)} input_before_fault={input_rate:.1f}/s run_s={total_s:.0f}")
    print(line)
    RESULTS.append(line)
    assert set(codes.values()) == {0}, f"not a graceful SIGTERM shutdown: {codes}"
    assert not other_letters, other_letters[:5]
    assert all(d.error_message for d in letters)
    assert not lost, f"{len(lost)} records neither trained nor dead-lettered: {sorted(lost)[:4]}"
    assert not doubled, f"{len(doubled)} records trained or refused twice: {sorted(doubled)[:4]}"
    assert set(trained) | set(refused) == expected
    assert not untrained_batches, f"{len(untrained_batches)} batches no revision names"
    assert [r.revision for r in revs] == list(range(len(revs)))
    db = str(tmp_path / "run.duckdb")
    await Replayer(db, settings).run()
    report = run_audit(db)
    assert report.ok, [f.message for f in report.violations][:5]
    assert report.checked["chain_links"] == len(revs) - 1
    await _fully_replicated(kw)


DOWN_S = 12.0  # a crashed broker's absence: longer than its session timeout (9 s), so the controller fences it


async def _kill_and_restart(cluster: DockerCluster, node: int) -> tuple[float, float]:
    fault_at = time.monotonic()
    await asyncio.to_thread(cluster.kill, node)
    await asyncio.sleep(DOWN_S)
    await asyncio.to_thread(cluster.start, node)
    await asyncio.to_thread(cluster.wait_ready, 180, [node])
    return fault_at, time.monotonic()


async def test_sigkill_partition_leader(cluster, monkeypatch, tmp_path):
    async def fault(c, kw):
        leaders = await _leaders(kw)
        node = leaders.most_common(1)[0][0]
        print(f"partition leaders {dict(leaders)}: SIGKILL node {node}")
        return await _kill_and_restart(c, node)

    await _run(cluster, fault, "leader SIGKILL", monkeypatch, tmp_path)


async def test_sigkill_active_controller(cluster, monkeypatch, tmp_path):
    async def fault(c, kw):
        node = await asyncio.to_thread(c.quorum_leader)
        print(f"active controller: node {node}: SIGKILL")
        fault_at, healed_at = await _kill_and_restart(c, node)
        print(f"new active controller: node {await asyncio.to_thread(c.quorum_leader)}")
        return fault_at, healed_at

    await _run(cluster, fault, "controller SIGKILL", monkeypatch, tmp_path)


async def test_network_partition_of_one_broker(cluster, monkeypatch, tmp_path):
    async def fault(c, kw):
        node = (await _leaders(kw)).most_common(1)[0][0]
        print(f"isolating node {node} from the other brokers and the clients")
        fault_at = time.monotonic()
        await asyncio.to_thread(c.isolate, node)
        await asyncio.sleep(20.0)
        await asyncio.to_thread(c.heal, node)
        await asyncio.to_thread(c.wait_ready, 180, [node])
        return fault_at, time.monotonic()

    await _run(cluster, fault, "network partition", monkeypatch, tmp_path)


async def test_rolling_restart(cluster, monkeypatch, tmp_path):
    async def fault(c, kw):
        fault_at = time.monotonic()
        for node in c.nodes:
            await asyncio.to_thread(c.stop, node)
            await asyncio.to_thread(c.start, node)
            await asyncio.to_thread(c.wait_ready, 180, [node])
            await _fully_replicated(kw)  # as an operator would: the next broker only once nothing is under-replicated
            print(f"node {node} restarted")
        return fault_at, time.monotonic()

    await _run(cluster, fault, "rolling restart", monkeypatch, tmp_path)
