"""Replay of a run produced by the real pipeline services (verifier -> credit -> batcher, in process,
exactly-once transactional processors) on a real broker, replayed while the services are still live.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import duckdb
import pytest

from consumers import testing
from consumers.runner import System
from consumers.settings import ServiceSettings
from replay.audit import run_audit
from replay.ingest import Replayer
from streams import serde, topics
from streams.settings import MAX_MESSAGE_BYTES

pytestmark = pytest.mark.integration


@pytest.fixture
def prefix(monkeypatch):
    p = f"trp{uuid.uuid4().hex[:8]}."
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", p)
    return p


async def seed(kw, run_id: str, groups: int, eval_groups: int = 0) -> tuple[int, int, list[bool]]:
    """Revision 0, then `groups` arithmetic groups (steps, rollout) in transactions, then `eval_groups`
    groups of held-out evaluation rollouts; (training steps, rollouts, whether each evaluation answer is right)."""
    from aiokafka import AIOKafkaProducer

    prod = AIOKafkaProducer(**kw, transactional_id=f"arena-{uuid.uuid4().hex[:6]}", enable_idempotence=True,
                            max_request_size=MAX_MESSAGE_BYTES)
    await prod.start()
    n_steps = n_rollouts = 0
    right: list[bool] = []
    try:
        async with prod.transaction():
            k, v, h = serde.to_message(testing.revision(0, run_id=run_id))
            await prod.send(topics.POLICY_REVISIONS.name, v, key=k, headers=h)
        for chunk in range(0, groups + eval_groups, 10):
            async with prod.transaction():
                for g in range(chunk, min(chunk + 10, groups + eval_groups)):
                    evaluation = g >= groups
                    for steps, ro in testing.arithmetic_group(f"{run_id[:6]}-g{g:04d}", 4, run_id=run_id):
                        for st in steps:
                            k, v, h = serde.to_message(st)
                            await prod.send(topics.STEPS.name, v, key=k, headers=h)
                            n_steps += not evaluation
                        if evaluation:
                            ro = ro.model_copy(update={"evaluation": True})
                            right.append(steps[-1].completion[-1].content.endswith(f" {ro.artifacts['scoring']['answer']}"))
                        k, v, h = serde.to_message(ro)
                        await prod.send(topics.ROLLOUTS.name, v, key=k, headers=h)
                        n_rollouts += 1
    finally:
        await prod.stop()
    return n_steps, n_rollouts, right


async def group_offsets(admin) -> dict:
    out = {}
    for g in await admin.list_consumer_groups():
        out[g[0]] = await admin.list_consumer_group_offsets(g[0])
    return out


async def test_replay_of_a_run_from_the_real_pipeline(kafka_settings, prefix, tmp_path):
    from aiokafka.admin import AIOKafkaAdminClient

    kw = kafka_settings.client_kwargs()
    run_id = f"pipeline-{uuid.uuid4().hex[:8]}"
    cfg = ServiceSettings(family=testing.FAMILY, batch_records=16, flush_after_s=0.5)
    await topics.create_topics(kafka_settings.admin_kwargs())
    async with System(("verifier", "credit", "batcher"), cfg, kw):
        admin = AIOKafkaAdminClient(**kafka_settings.admin_kwargs())
        await admin.start()
        db = str(tmp_path / "pipeline.duckdb")
        try:
            n_steps, n_rollouts, right = await seed(kw, run_id, groups=30, eval_groups=3)
            # wait until the batcher has batched every record (one per trainable step)
            deadline = time.monotonic() + 120
            while True:
                await Replayer(db, kafka_settings, run_id=run_id).run()  # incremental, while the services run
                con = duckdb.connect(db, read_only=True)
                batched = con.execute("SELECT count(DISTINCT record_id) FROM batch_records").fetchone()[0]
                con.close()
                if batched >= n_steps or time.monotonic() > deadline:
                    break
                await asyncio.sleep(1.0)
            assert batched == n_steps
            # the services are live; a replay neither joins nor moves their consumer groups
            # (other tests' groups on the shared broker may expire meanwhile: only this run's are compared)
            before = await group_offsets(admin)
            ours = {g: o for g, o in before.items() if g.startswith(prefix)}
            assert any(g.endswith("verifier") for g in ours)
            fresh = str(tmp_path / "fresh.duckdb")
            await Replayer(fresh, kafka_settings, run_id=run_id).run()
            after = await group_offsets(admin)
            assert set(after) - set(before) == set()  # the replay joined no group
            assert {g: o for g, o in after.items() if g.startswith(prefix)} == ours
        finally:
            await admin.close()
    await Replayer(db, kafka_settings).run()
    con = duckdb.connect(db, read_only=True)
    got = dict(con.execute("SELECT * FROM v_counts").fetchall())
    evals = con.execute("SELECT count(*) FROM scores WHERE evaluation").fetchone()[0]
    eval_acc = con.execute("SELECT policy_revision, answers, accuracy FROM v_eval_accuracy_by_revision").fetchall()
    env_rollouts = con.execute("SELECT sum(rollouts) FROM v_env_pass_rates").fetchone()[0]
    con.close()
    assert got["policy_revisions"] == 1
    assert got["steps"] == n_steps + len(right) and got["rollouts"] == n_rollouts
    assert got["scores"] == n_rollouts  # the verifier scored each rollout once
    assert got["training_records"] == n_steps  # credit: one record per trainable training step, exactly once
    assert got["batch_records"] == n_steps  # each record in exactly one batch
    assert got["replay_errors"] == 0 and got["dead_letters"] == 0
    # held-out evaluation: scored (the verifier keeps the flag), never credited, on the eval views only
    assert evals == len(right) == 3 * 4
    assert eval_acc == [(0, len(right), pytest.approx(sum(right) / len(right)))]
    assert env_rollouts == n_rollouts - len(right)
    report = run_audit(db)
    assert report.ok, report.findings[:5]
    assert report.checked["batch_digests"] == got["trainer_batches"]


async def test_replay_of_arena_episodes_through_the_services(kafka_settings, prefix, tmp_path):
    """The producing side too: the arena plays the example arithmetic plan against the local policy
    server (the tiny torch model), the verifier, credit and batcher services score, credit and batch it."""
    from pathlib import Path

    from policy import PolicyModel
    from producers.arena.config import ArenaConfig
    from producers.arena.arena import Arena
    from producers.arena.emitter import KafkaEmitter
    from producers.inference.policy_server import PolicyServer
    from schemas.plan_compiler import compile_plan

    root = Path(__file__).resolve().parents[1]
    kw = kafka_settings.client_kwargs()
    run_id = f"arena-{uuid.uuid4().hex[:8]}"
    await topics.create_topics(kafka_settings.admin_kwargs())
    async with PolicyServer(PolicyModel.from_seed(0)) as server:
        plan = compile_plan(root / "examples/plans/arithmetic.toml")
        plan = plan.model_copy(update={"targets": {k: t.model_copy(update={"base_urls": [server.base_url]})
                                                   if t.base_urls else t for k, t in plan.targets.items()}})
        cfg = ServiceSettings(family=plan.family, batch_records=16, flush_after_s=0.5,
                              max_off_policy_steps=plan.max_off_policy_steps)
        async with System(("verifier", "credit", "batcher"), cfg, kw):
            db = str(tmp_path / "arena.duckdb")
            from aiokafka import AIOKafkaProducer

            prod = AIOKafkaProducer(**kw)
            await prod.start()
            k, v, h = serde.to_message(testing.revision(0, family=plan.family, run_id=run_id))
            await prod.send_and_wait(topics.POLICY_REVISIONS.name, v, key=k, headers=h)
            await prod.stop()
            emitter = KafkaEmitter(kw, f"arena-{uuid.uuid4().hex[:8]}")
            arena = Arena(plan, emitter=emitter, weights=None,
                          config=ArenaConfig(policy_base_url=server.base_url, run_id=run_id))
            await arena.start()
            try:
                await arena.run(num_groups=4)
            finally:
                await arena.stop()
            deadline = time.monotonic() + 120
            while True:
                await Replayer(db, kafka_settings, run_id=run_id).run()
                con = duckdb.connect(db, read_only=True)
                n_trainable, batched = con.execute(
                    "SELECT (SELECT count(*) FROM steps WHERE trainable), "
                    "(SELECT count(DISTINCT record_id) FROM batch_records)").fetchone()
                con.close()
                if (n_trainable and batched >= n_trainable) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(1.0)
    con = duckdb.connect(db, read_only=True)
    got = dict(con.execute("SELECT * FROM v_counts").fetchall())
    envs = con.execute("SELECT environment, rollouts FROM v_env_pass_rates").fetchall()
    con.close()
    assert got["rollouts"] == 4 * plan.group_size == got["scores"]
    assert got["steps"] >= got["rollouts"] and got["training_records"] == n_trainable == got["batch_records"]
    assert [e for e, _ in envs] and all(n == got["rollouts"] for _, n in envs)
    report = run_audit(db)
    assert report.ok, report.findings[:5]
