"""The producing side against a real broker: every episode kind end to end through Kafka, read back
with read_committed consumers; hierarchy links; backpressure driven by PolicyRevision events; a
producer SIGKILLed mid-transaction leaves no visible partial rollout."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from policy import PolicyModel, save_checkpoint
from producers.arena.config import ArenaConfig
from producers.arena.arena import Arena
from producers.inference.echo_server import EchoServer, ScriptedServer
from producers.arena.emitter import KafkaEmitter
from producers.inference.policy_server import PolicyServer
from schemas.events import Rollout, Step
from schemas.plan_compiler import compile_plan
from schemas.policy import PolicyRevision
from streams import serde
from streams.revisions import RevisionFollower

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


async def read_all(kw: dict, topic: str, *, expect: int | None = None, isolation: str = "read_committed",
                   timeout_s: float = 20.0) -> list:
    """(partition, offset, key, event) of every message on ``topic``, in partition/offset order."""
    consumer = AIOKafkaConsumer(**kw, group_id=None, enable_auto_commit=False, isolation_level=isolation,
                                auto_offset_reset="earliest")
    await consumer.start()
    try:
        cluster = await consumer._client.fetch_all_metadata()
        parts = cluster.partitions_for_topic(topic) or set()
        assert parts, f"topic {topic} has no partitions"
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        out = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=300)
            for tp, recs in batch.items():
                out.extend((tp.partition, r.offset, r.key, serde.from_message(r.value)) for r in recs)
            if expect is not None and len(out) >= expect:
                break
            if expect is None and not batch:
                ends = await consumer.end_offsets(tps)
                positions = [await consumer.position(tp) for tp in tps]
                if all(pos >= ends[tp] for pos, tp in zip(positions, tps)):
                    break
        return sorted(out, key=lambda x: (x[0], x[1]))
    finally:
        await consumer.stop()


def _plan(name: str, url: str, **update):
    plan = compile_plan(ROOT / f"examples/plans/{name}.toml")
    targets = {k: t.model_copy(update={"base_urls": [url]}) if t.base_urls else t for k, t in plan.targets.items()}
    return plan.model_copy(update={"targets": targets, **update})


@pytest.fixture
async def pipeline_topics(make_topic):
    return await make_topic(12, "steps"), await make_topic(12, "rollouts")


def _emitter(kafka_settings, topics, **kw) -> KafkaEmitter:
    return KafkaEmitter(kafka_settings.client_kwargs(), f"test-arena-{uuid.uuid4().hex[:8]}",
                        steps_topic=topics[0], rollouts_topic=topics[1], **kw)


async def _check_log(kw, topics, n_rollouts: int):
    rollouts = await read_all(kw, topics[1], expect=n_rollouts)
    n_steps = sum(len(ev.step_ids) for *_, ev in rollouts)
    steps = await read_all(kw, topics[0], expect=n_steps)
    assert len(rollouts) == n_rollouts and len(steps) == n_steps
    step_part = {}
    for part, _, key, ev in steps:
        assert isinstance(ev, Step) and key == ev.root_group_id.encode()
        step_part[ev.step_id] = (part, ev)
    for part, _, key, r in rollouts:
        assert isinstance(r, Rollout) and key == r.root_group_id.encode()
        # co-location: the rollout's steps sit on the same partition number, in call order
        assert all(step_part[s][0] == part for s in r.step_ids)
        assert [step_part[s][1].index for s in r.step_ids] == list(range(len(r.step_ids)))
    offsets = {ev.step_id: off for _, off, _, ev in steps}
    for _, _, _, r in rollouts:
        assert [offsets[s] for s in r.step_ids] == sorted(offsets[s] for s in r.step_ids)
    return [r for *_, r in rollouts], [s for *_, s in steps]


async def test_every_example_episode_through_kafka(kafka_settings, pipeline_topics):
    kw = kafka_settings.client_kwargs()
    emitter = _emitter(kafka_settings, pipeline_topics)
    expected = 0
    async with PolicyServer(PolicyModel.from_seed(0)) as server, emitter:
        # one transactional emitter shared by three arenas
        for name, groups, per_group in (("arithmetic", 2, 8), ("debate", 1, 4), ("proposer_solver", 1, 4 * 5)):
            async with Arena(_plan(name, server.base_url), emitter=emitter, manage_emitter=False,
                             config=ArenaConfig(policy_base_url=server.base_url, concurrency=16)) as arena:
                await arena.run(num_groups=groups)
            expected += groups * per_group
    rollouts, steps = await _check_log(kw, pipeline_topics, expected)
    envs = {r.environment for r in rollouts}
    assert envs == {"arithmetic@1.2.0", "debate@1.0.0", "proposer-solver@1.0.0"}
    by_id = {r.rollout_id: r for r in rollouts}
    children = [r for r in rollouts if r.parent_rollout_id]
    assert len(children) == 16
    for c in children:
        parent = by_id[c.parent_rollout_id]
        assert c.rollout_id in parent.child_rollout_ids and c.root_group_id == parent.root_group_id
    assert all(by_id[cid].parent_rollout_id == p.rollout_id for p in rollouts for cid in p.child_rollout_ids)
    assert emitter.stats.aborted == 0


async def test_tool_episode_through_kafka(kafka_settings, pipeline_topics):
    from test_producers import _env, _tool_script, add, single_plan
    from producers.environments.episodes import ToolEpisode

    async with ScriptedServer(_tool_script) as server:
        async with Arena(single_plan(group_size=3), {"unit": _env(ToolEpisode([add]))},
                         emitter=_emitter(kafka_settings, pipeline_topics),
                         config=ArenaConfig(policy_base_url=server.base_url)) as arena:
            await arena.run(num_groups=2)
    rollouts, steps = await _check_log(kafka_settings.client_kwargs(), pipeline_topics, 6)
    assert all(r.episode_type == "tool_use" and r.artifacts["tool_calls_made"] == 1 for r in rollouts)
    assert sum(1 for s in steps if s.tool_calls and s.tool_calls[0].name == "add") == 6
    assert len({r.group_id for r in rollouts}) == 2


async def _publish_revision(kw, topic, rev: PolicyRevision) -> None:
    producer = AIOKafkaProducer(**kw, enable_idempotence=True)
    await producer.start()
    try:
        key, value, headers = serde.to_message(rev)
        await producer.send_and_wait(topic, value=value, key=key, headers=headers)
    finally:
        await producer.stop()


async def _wait_for(pred, timeout_s=20.0, what: str = "condition", state=lambda: ""):
    """Poll ``pred`` until true; past ``timeout_s`` fail naming ``what`` and ``state()`` (what was there)."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s:.0f} s {state()}".rstrip())
        await asyncio.sleep(0.05)


async def test_backpressure_pauses_until_the_trainer_publishes(kafka_settings, pipeline_topics, make_topic, tmp_path):
    kw = kafka_settings.client_kwargs()
    revisions = await make_topic(1, "revisions")
    async with PolicyServer(PolicyModel.from_seed(0)) as server:
        # batch_size 4, groups of 2, bound 0: each batch may only be generated by the revision it trains
        plan = _plan("arithmetic", server.base_url, group_size=2, batch_size=4, max_off_policy_steps=0)
        follower = RevisionFollower(kw, plan.family, topic=revisions)
        arena = Arena(plan, emitter=_emitter(kafka_settings, pipeline_topics), revisions=follower,
                      config=ArenaConfig(policy_base_url=server.base_url))
        async with arena:
            run = asyncio.create_task(arena.run(num_groups=6))
            await _wait_for(lambda: arena.pacer.paused)
            await _wait_for(lambda: arena.stats.rollouts == 4)  # in-flight work finishes while paused
            await asyncio.sleep(0.5)
            assert arena.pacer.admitted == 4 and arena.stats.rollouts == 4 and arena.pacer.paused
            ref1 = save_checkpoint(PolicyModel.from_seed(1), tmp_path, plan.family, 1)
            await _publish_revision(kw, revisions, PolicyRevision(run_id="t", producer="trainer", family=plan.family,
                                                                  revision=1, checkpoint=ref1, parent_revision=0))
            await _wait_for(lambda: arena.pacer.admitted == 8)
            await _wait_for(lambda: arena.pacer.paused)
            assert arena.current_policy.revision == 1 and server.policy.revision == 1
            # a revision of another family does not count
            await _publish_revision(kw, revisions, PolicyRevision(run_id="t", producer="trainer", family="other",
                                                                  revision=5))
            await asyncio.sleep(0.5)
            assert arena.pacer.admitted == 8
            ref2 = save_checkpoint(PolicyModel.from_seed(2), tmp_path, plan.family, 2)
            await _publish_revision(kw, revisions, PolicyRevision(run_id="t", producer="trainer", family=plan.family,
                                                                  revision=2, checkpoint=ref2, parent_revision=1))
            stats = await asyncio.wait_for(run, 30)
        assert stats.rollouts == 12 and arena.pacer.pauses == 2
    rollouts, steps = await _check_log(kw, pipeline_topics, 12)
    revs = sorted(r.policy.revision for r in rollouts)
    assert revs == [0] * 4 + [1] * 4 + [2] * 4
    step_of = {s.step_id: s for s in steps}
    for r in rollouts:  # the revision that produced each step is the one current when it ran
        assert all(step_of[s].policy.revision == r.policy.revision for s in r.step_ids)
        if r.policy.revision:
            assert step_of[r.step_ids[0]].policy.checkpoint_digest == (ref1 if r.policy.revision == 1 else ref2).digest


async def test_an_arena_evaluates_a_revision_before_it_generates_the_revisions_batch(kafka_settings, pipeline_topics,
                                                                                       make_topic, tmp_path):
    """With an off-policy bound of 0 the batch a revision generates waits for its evaluation (the seconds of each
    are their own), and an arena starts on the revision already on the log: loaded and evaluated in ``start``,
    before anything is admitted."""
    kw = kafka_settings.client_kwargs()
    revisions = await make_topic(1, "revisions")
    async with PolicyServer(PolicyModel.from_seed(0)) as server:
        plan = _plan("arithmetic", server.base_url, group_size=2, batch_size=4, max_off_policy_steps=0,
                     eval_interval=1)
        train = plan.environments[0].model_copy(update={"args": {"num_examples": 20, "eval_examples": 3}})
        plan = plan.model_copy(update={"environments": [train]})

        async def publish(n: int) -> None:
            ref = save_checkpoint(PolicyModel.from_seed(n), tmp_path, plan.family, n)
            await _publish_revision(kw, revisions, PolicyRevision(
                run_id="t", producer="trainer", family=plan.family, revision=n, checkpoint=ref,
                parent_revision=n - 1 if n else None))

        await publish(0)
        arena = Arena(plan, emitter=_emitter(kafka_settings, pipeline_topics),
                      revisions=RevisionFollower(kw, plan.family, topic=revisions),
                      config=ArenaConfig(policy_base_url=server.base_url, evaluate=True))
        events, run_rollout = [], arena.run_rollout

        async def recorded(req):
            revision = arena.current_policy.revision
            events.append(("start", req.evaluation, revision))
            try:
                return await run_rollout(req)
            finally:
                events.append(("end", req.evaluation, revision))
        arena.run_rollout = recorded
        async with arena:
            assert arena.stats.evaluated_revisions == [0] and arena.pacer.admitted == 0
            assert [e[1] for e in events] == [True] * 6  # revision 0's 3 questions, started and answered
            run = asyncio.create_task(arena.run(num_groups=4))
            await _wait_for(lambda: arena.pacer.paused and arena.stats.rollouts == 4)
            await publish(1)
            await asyncio.wait_for(run, 30)
    assert arena.stats.evaluated_revisions == [0, 1] and arena.stats.evaluations == 6
    for revision in (0, 1):
        at = [(i, kind, evaluation) for i, (kind, evaluation, r) in enumerate(events) if r == revision]
        last_answer = max(i for i, kind, evaluation in at if evaluation and kind == "end")
        first_training = min(i for i, kind, evaluation in at if not evaluation and kind == "start")
        assert last_answer < first_training, events
    await _check_log(kw, pipeline_topics, 14)


async def test_producer_killed_mid_transaction_leaves_nothing_visible(kafka_settings, pipeline_topics):
    kw = kafka_settings.client_kwargs()
    txn_id = f"test-kill-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests/_kill_mid_transaction.py"), kafka_settings.bootstrap,
                             txn_id, *pipeline_topics], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.startswith("SENT "), (line, proc.stderr.read() if proc.poll() is not None else "")
        killed_ids = set(line.split()[1:])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    # the messages were written: an uncommitted reader sees the partial episode...
    raw = await read_all(kw, pipeline_topics[0], isolation="read_uncommitted", expect=2)
    assert {ev.rollout_id for *_, ev in raw} == killed_ids and len(raw) == 2
    # ...a new instance with the same transactional id fences the dead one (its transaction is aborted),
    async with EchoServer() as echo:
        from _kill_mid_transaction import TwoTurns  # noqa: F401  (same episode, committed this time)
        from producers.environments.dataset import Example
        from producers.environments.types import Environment
        from schemas.scoring import ScoringSpec

        env_ = Environment(name="killme", version="1", dataset=[Example(id="x", prompt="committed")],
                           episode=TwoTurns(max_turns=2), scoring=ScoringSpec(kind="exact_match", answer="x"))
        plan = compile_plan(ROOT / "examples/plans/arithmetic.toml").model_copy(update={"group_size": 1})
        emitter = KafkaEmitter(kw, txn_id, steps_topic=pipeline_topics[0], rollouts_topic=pipeline_topics[1])
        async with Arena(plan, {"k": env_}, emitter=emitter,
                         config=ArenaConfig(policy_base_url=echo.base_url)) as arena:
            await arena.run(num_groups=1)
    # ...and read_committed readers see only the committed episode, never the partial one.
    steps = await read_all(kw, pipeline_topics[0])
    rollouts = await read_all(kw, pipeline_topics[1])
    assert len(rollouts) == 1 and len(steps) == 2
    assert not killed_ids & {ev.rollout_id for *_, ev in steps + rollouts}
    assert rollouts[0][3].seed["prompt"] == "committed"


async def test_producer_failure_surfaces_as_an_error(kafka_settings, pipeline_topics):
    from producers.arena.emitter import EmissionError
    from test_producers import CountdownEpisode, _env, single_plan

    kw = kafka_settings.client_kwargs(request_timeout_ms=3000)
    emitter = KafkaEmitter(kw, f"test-fail-{uuid.uuid4().hex[:8]}", steps_topic="no.such.topic." + uuid.uuid4().hex,
                           rollouts_topic=pipeline_topics[1])
    async with EchoServer() as echo:
        arena = Arena(single_plan(group_size=2), {"unit": _env(CountdownEpisode(max_turns=1))}, emitter=emitter,
                      config=ArenaConfig(policy_base_url=echo.base_url))
        with pytest.raises(EmissionError, match="transaction of .* failed"):
            async with arena:
                await arena.run(num_groups=1)
    assert emitter.stats.transactions == 0 and emitter.stats.aborted >= 1
    # nothing of the failed transaction is visible
    assert await read_all(kafka_settings.client_kwargs(), pipeline_topics[1]) == []


async def test_an_oversized_episode_fails_alone(kafka_settings, pipeline_topics):
    from producers.arena.emitter import EmissionError
    from test_producers import CountdownEpisode, _env, single_plan

    em = _emitter(kafka_settings, pipeline_topics)
    async with EchoServer() as echo, em:
        env = _env(CountdownEpisode(max_turns=1))
        ok = await Arena(single_plan(), {"u": env}, emitter=em, manage_emitter=False,
                         config=ArenaConfig(policy_base_url=echo.base_url)).start()
        good = await ok.run_rollout(ok.sample_request_group()[0])
        big = await ok.run_rollout(ok.sample_request_group()[0])
        huge = big.steps[0].model_copy(update={"prompt": [big.steps[0].prompt[0].model_copy(
            update={"content": "x" * (9 * 1024 * 1024)})]})
        big.steps[0] = huge
        results = await asyncio.gather(em.emit(big), em.emit(good), return_exceptions=True)
        await ok.stop()
    assert isinstance(results[0], EmissionError) and "request limit" in str(results[0]) and results[1] is None
    rollouts = await read_all(kafka_settings.client_kwargs(), pipeline_topics[1], expect=1)
    assert [r.rollout_id for *_, r in rollouts] == [good.rollout.rollout_id]


async def test_a_failed_transaction_discards_its_producer(kafka_settings, pipeline_topics):
    """A transaction that fails after its records were sent: the emitter opens a fresh producer with the same
    transactional id (its InitProducerId aborts the failed transaction on the broker, whatever aiokafka's local
    state), the failed episode is never visible, and the next episode commits alone."""
    from producers.arena.emitter import EmissionError
    from test_producers import CountdownEpisode, _env, single_plan

    calls = []

    async def fail_first(results):
        calls.append([r.rollout.rollout_id for r in results])
        if len(calls) == 1:
            raise RuntimeError("the first commit fails")

    em = _emitter(kafka_settings, pipeline_topics, before_commit=fail_first)
    async with EchoServer() as echo, em:
        arena = await Arena(single_plan(), {"u": _env(CountdownEpisode(max_turns=1))}, emitter=em, manage_emitter=False,
                            config=ArenaConfig(policy_base_url=echo.base_url)).start()
        first = await arena.run_rollout(arena.sample_request_group()[0])
        second = await arena.run_rollout(arena.sample_request_group()[0])
        with pytest.raises(EmissionError, match="the first commit fails"):
            await em.emit(first)
        await em.emit(second)
        await arena.stop()
    assert em.stats.producers == 2 and em.stats.aborted == 1 and em.stats.transactions == 1
    kw = kafka_settings.client_kwargs()
    assert [r.rollout_id for *_, r in await read_all(kw, pipeline_topics[1], expect=1)] == [second.rollout.rollout_id]
    # the failed transaction's records were written, then aborted
    raw = await read_all(kw, pipeline_topics[1], isolation="read_uncommitted", expect=2)
    assert {r.rollout_id for *_, r in raw} == {first.rollout.rollout_id, second.rollout.rollout_id}
