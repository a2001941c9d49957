"""The learner's inference pool (``producers.inference.pool``, ``producers.inference.weights.PoolWeights``): the pick rule; two local
policy servers, one stopped and started again fresh, which must load the current revision before it serves;
two real vLLM servers behind one arena following revisions on a real broker, one SIGKILLed mid-run; `rollout
arena` with several --policy-url."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid
from collections import Counter
from types import SimpleNamespace

import httpx
import pytest

from policy import PolicyModel, save_checkpoint
from policy.hf import FAMILY, prepare_model
from producers.arena.config import ArenaConfig
from producers.arena.arena import Arena
from producers.inference.client import InferenceClient, InferenceUnavailable
from producers.inference.policy_server import PolicyServer
from producers.inference.pool import InferencePool, await_servers, server_root
from producers.inference.vllm_server import CPU_CLIENT_OPTIONS, VllmServer
from producers.inference.weights import LocalPolicyWeights, PoolWeights, RevisionRefused, VllmWeights, WeightLoadError
from schemas.events import ChatMessage
from schemas.policy import PolicyRevision
from streams.local_broker import free_port
from streams.revisions import RevisionFollower
from test_producers_kafka import _emitter, _publish_revision, _wait_for, pipeline_topics, read_all  # noqa: F401
from test_vllm import _cli, _distinct_checkpoint, _plan

MSG = [ChatMessage(role="user", content="What is 2 + 2?")]


async def test_pick_least_outstanding_skips_servers_out_and_takes_turns_on_ties():
    pool = InferencePool(["http://a:1/v1", "http://b:1/v1", "http://c:1/v1"], probe_s=3600)
    a, b, c = pool.servers
    try:
        assert Counter(pool.pick().url for _ in range(9)) == {s.url: 3 for s in pool.servers}  # ties in turn
        a.outstanding, b.outstanding, c.outstanding = 3, 1, 2
        assert {pool.pick().url for _ in range(4)} == {b.url}
        assert pool.pick(avoid=b) is c  # a retry goes elsewhere
        with pool.sending(b), pool.sending(b):
            assert b.outstanding == 3 and {pool.pick().url for _ in range(4)} == {c.url}
        assert b.outstanding == 1
        pool.failed(b, "ConnectError", take_out=True)
        assert not b.up and b.errors == 1 and pool.pick() is c and pool.pick(avoid=c) is a
        pool.take_out(a, "HTTP 503")
        assert pool.pick(avoid=c) is c  # the last one up
        pool.take_out(c, "HTTP 502")
        assert pool.pick() in pool.servers  # nothing to restore on rejoin: an out server is still tried
        pool.rejoin = lambda server, http: asyncio.sleep(0)
        assert pool.pick() is None and "HTTP 502" in pool.why_out()  # weights to restore: none until rejoined
    finally:
        await pool.aclose()


def _revision(tmp_path, revision: int, digest: str | None = None) -> PolicyRevision:
    ref = save_checkpoint(PolicyModel.from_seed(revision), tmp_path, "tiny-byte-lm", revision)
    if digest:
        ref = ref.model_copy(update={"digest": digest})
    return PolicyRevision(run_id="t", producer="test", family="tiny-byte-lm", revision=revision, checkpoint=ref)


async def _calls(client: InferenceClient, n: int) -> list:
    return await asyncio.gather(*(client.chat(MSG, sampling={"max_tokens": 8}, seed=i) for i in range(n)))


async def test_an_arena_awaits_servers_still_starting_and_names_the_silent_ones():
    """``await_servers`` (``rollout arena --await-servers``): a server that starts answering 0.6 s later is waited
    for; one that never answers is named when the time is up."""
    from streams.local_broker import free_port

    late = PolicyServer(port=free_port())
    silent = f"http://127.0.0.1:{free_port()}/v1"

    async def start_late():
        await asyncio.sleep(0.6)
        await late.start()

    starting = asyncio.create_task(start_late())
    try:
        t0 = time.monotonic()
        assert await await_servers([late.base_url], timeout_s=30) == []
        assert 0.5 < time.monotonic() - t0 < 10 and starting.done()
        t0 = time.monotonic()
        assert await await_servers([late.base_url, silent], timeout_s=0.5) == [silent]
        assert time.monotonic() - t0 >= 0.5
    finally:
        await starting
        await late.stop()


@contextlib.asynccontextmanager
async def _pool_of_two():
    """Two local policy servers behind one pool (its health watch every 0.1 s), the pool's weight loader, an HTTP
    client and an inference client; a server a test starts later goes in ``servers`` to be stopped with them."""
    servers = [PolicyServer(), PolicyServer()]
    for server in servers:
        await server.start()
    pool = InferencePool([server.base_url for server in servers], probe_s=0.1)
    try:
        async with httpx.AsyncClient(timeout=30) as http, \
                InferenceClient(pool, "tiny-byte-lm", max_attempts=3, backoff_s=0.01) as client:
            yield SimpleNamespace(servers=servers, pool=pool, weights=PoolWeights(pool, LocalPolicyWeights),
                                  http=http, client=client)
    finally:
        await pool.aclose()
        for server in servers:
            await server.stop()


async def test_a_server_back_from_the_dead_loads_the_current_revision_before_it_serves(tmp_path):
    async with _pool_of_two() as p:
        (one, two), pool, weights, http, client = p.servers, p.pool, p.weights, p.http, p.client
        await weights.load(http, _revision(tmp_path, 1))
        assert (one.policy.revision, two.policy.revision) == (1, 1)
        assert {c.policy.revision for c in await _calls(client, 16)} == {1}
        assert one.requests_served and two.requests_served  # both took calls
        # a revision whose checkpoint is not its digest: every server refuses it, none is taken out
        with pytest.raises(RevisionRefused):
            await weights.load(http, _revision(tmp_path, 2, digest="0" * 64))
        assert all(s.up for s in pool.servers) and one.policy.revision == 1

        await two.stop()  # dies: its calls move to the other server (its failed calls, or the health watch, take
        assert {c.policy.revision for c in await _calls(client, 16)} == {1}  # it out first)
        out = pool.servers[1]
        assert not out.up and out.taken_out == 1
        await weights.load(http, _revision(tmp_path, 2))  # the swap goes on without it
        assert one.policy.revision == 2 and out.revision == 1

        # started again fresh (the seeded init, revision 0): it rejoins only once it holds revision 2
        restarted = PolicyServer(port=two.http.port)
        p.servers.append(restarted)
        await restarted.start()
        deadline = time.monotonic() + 20
        while not out.up:
            assert time.monotonic() < deadline, "the restarted server never rejoined"
            await asyncio.sleep(0.05)
        assert restarted.policy.revision == 2 and out.revision == 2 and restarted.requests_served == 0
        assert {c.policy.revision for c in await _calls(client, 16)} == {2}
        assert restarted.requests_served > 0  # it serves again, revision 2 only

        # every server out: calls back off and fail with the typed error, a swap has nowhere to go
        await one.stop()
        await restarted.stop()
        with pytest.raises(InferenceUnavailable, match="after 3 attempts"):
            await _calls(client, 1)
        with pytest.raises(WeightLoadError, match="no server of the pool took"):
            await weights.load(http, _revision(tmp_path, 3))


async def test_a_server_restarted_while_idle_is_reloaded_before_it_serves_again(tmp_path):
    """No call fails to say it restarted: the pool's health watch sees it gone, and it rejoins holding the current
    revision, not its start-up weights."""
    async with _pool_of_two() as p:
        one, two = p.servers
        await p.weights.load(p.http, _revision(tmp_path, 1))
        await two.stop()  # idle: no call is in flight or sent while it is away
        await asyncio.sleep(0.5)
        restarted = PolicyServer(port=two.http.port)  # the seeded init: revision 0
        p.servers.append(restarted)
        await restarted.start()
        out = p.pool.servers[1]
        deadline = time.monotonic() + 20
        while not (out.taken_out and out.up):
            assert time.monotonic() < deadline, "the restart was never seen"
            await asyncio.sleep(0.05)
        assert restarted.policy.revision == 1 and out.revision == 1 and one.requests_served == 0
        assert {c.policy.revision for c in await _calls(p.client, 16)} == {1}
        assert restarted.requests_served > 0


@pytest.mark.integration
async def test_two_vllm_servers_one_killed_mid_run_nothing_lost_every_step_exact(
        vllm_server, kafka_settings, pipeline_topics, make_topic, tmp_path):  # noqa: F811
    kw = kafka_settings.client_kwargs()
    revisions = await make_topic(1, "revisions")
    revs = [PolicyRevision(run_id="t", producer="test", family=FAMILY, revision=0,
                           checkpoint=prepare_model().checkpoint),
            _distinct_checkpoint(tmp_path, 1), _distinct_checkpoint(tmp_path, 2)]
    second = VllmServer(vllm_server.model_dir, port=free_port(), kv_cache_gb=1, log_path=tmp_path / "vllm-2.log")
    await second.start()
    await _publish_revision(kw, revisions, revs[0])
    # the plan's learner lists both servers: one pool
    arena = Arena(_plan([vllm_server.base_url, second.base_url], batch_size=10**6), weights=VllmWeights,
                  emitter=_emitter(kafka_settings, pipeline_topics),
                  revisions=RevisionFollower(kw, FAMILY, topic=revisions),
                  config=ArenaConfig(concurrency=16, client_options=CPU_CLIENT_OPTIONS))
    survivor, killed = arena.pool.servers
    stop = asyncio.Event()

    def servers() -> str:  # the waits are generous: two vLLMs share 2 cores with the other worker's tests
        return str({s.url: (s.served, dict(s.served_by_revision), s.outstanding, s.up) for s in arena.pool.servers})

    try:
        async with arena:
            await _wait_for(lambda: arena.current_policy.checkpoint_digest == revs[0].checkpoint.digest, 180,
                            "revision 0 on both servers", servers)
            assert survivor.revision == killed.revision == 0  # both loaded
            run = asyncio.create_task(arena.run(stop=stop))
            await _wait_for(lambda: survivor.served >= 4 and killed.served >= 4, 300, "4 answers from each", servers)
            await _publish_revision(kw, revisions, revs[1])  # swapped into both while calls are in flight
            await _wait_for(lambda: killed.served_by_revision[1] >= 4 and killed.outstanding > 0, 300,
                            "4 answers at r1 from the server to kill, with calls in flight", servers)
            os.killpg(second.proc.pid, signal.SIGKILL)
            killed_at, before = time.monotonic(), {s.url: s.served for s in arena.pool.servers}
            in_flight = killed.outstanding
            await _wait_for(lambda: not killed.up, 30, "the killed server out of the pool", servers)
            detect_s, served_when_out = time.monotonic() - killed_at, killed.served
            await _publish_revision(kw, revisions, revs[2])  # the swap goes on with the survivor alone
            await _wait_for(lambda: survivor.served_by_revision[2] >= 16, 300, "16 answers at r2 from the survivor",
                            servers)
            stop.set()
            stats = await asyncio.wait_for(run, 120)
        async with httpx.AsyncClient() as http:  # what vLLM itself says it holds; then the shared server's own again
            held = (await http.get(server_root(vllm_server.base_url) + "/weight_info")).json()["weight_version"]
            await VllmWeights(vllm_server.base_url).load(http, revs[0])
    finally:
        stop.set()
        await second.stop()
    rollouts = [e for *_, e in await read_all(kw, pipeline_topics[1], expect=stats.rollouts)]
    steps = [e for *_, e in await read_all(kw, pipeline_topics[0], expect=stats.steps)]
    spread = {s.url: {"served": s.served, "errors": s.errors, "by_revision": dict(s.served_by_revision)}
              for s in arena.pool.servers}
    print(f"\n[pool] rollouts {len(rollouts)}, steps {len(steps)}, reloads {[round(x, 2) for x in arena.reload_s]}, "
          f"served before the kill {before}, in flight at the kill {in_flight}, dead server out after "
          f"{detect_s * 1000:.0f} ms, attempts moved {killed.errors}, cut short by the stop {stats.cut_short}; "
          f"spread {spread}")
    # nothing lost: every admitted rollout is on the log, completed, but those the stop cut short past its grace (on
    # a slow machine, a few of the 16 in flight), which are not emitted at all
    assert stats.failed == 0 and len(rollouts) == stats.rollouts
    assert stats.rollouts + stats.cut_short == stats.groups * 8, stats
    assert all(r.status == "completed" for r in rollouts) and len(steps) == stats.steps == len(rollouts)
    # both servers served before the kill; after it, every call went to the survivor, the dead one's included
    # (an answer already written when the kill came may still be read: at most the calls then in flight)
    assert all(n > 0 for n in before.values()) and in_flight > 0 and killed.errors > 0
    assert killed.served - before[killed.url] <= in_flight and killed.served == served_when_out and not killed.up
    # (an episode the stop cut short may have had its answer already)
    assert len(steps) <= survivor.served + killed.served <= len(steps) + stats.cut_short
    # every Step is exact: its stamp is the revision its server held when it answered, on every server
    assert all(s.policy_exact for s in steps)
    assert all(s.policy.checkpoint_digest == revs[s.policy.revision].checkpoint.digest for s in steps)
    stamped, served = Counter(s.policy.revision for s in steps), survivor.served_by_revision + killed.served_by_revision
    assert not stamped - served and sum((served - stamped).values()) <= stats.cut_short, (stamped, served)
    assert set(killed.served_by_revision) == {0, 1} and set(survivor.served_by_revision) == {0, 1, 2}
    assert len(arena.reload_s) == 3 and survivor.revision == 2 and killed.revision == 1 and held == "r2"


@pytest.mark.integration
async def test_rollout_arena_spreads_its_calls_over_every_policy_url(kafka_bootstrap):
    servers = [await PolicyServer().start() for _ in range(3)]
    try:
        env = {"ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap, "ROLLOUT_TOPIC_PREFIX": f"tpool{uuid.uuid4().hex[:8]}."}
        a, b, c = (s.base_url for s in servers)
        out = await asyncio.to_thread(_cli, "arena", "examples/plans/arithmetic.toml", "--groups", "6",
                                      "--concurrency", "12", "--no-progress", "--policy-url", f"{a},{b}",
                                      "--policy-url", c, env=env)
    finally:
        for s in servers:
            await s.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\n[pool] rollout arena over three servers: {stats['servers']}")
    assert stats["failed"] == 0 and [s["url"] for s in stats["servers"]] == [a, b, c]
    assert all(s["served"] > 0 and s["up"] for s in stats["servers"])  # every server took calls
    assert [s["served"] for s in stats["servers"]] == [s.requests_served for s in servers]
    assert sum(s["served"] for s in stats["servers"]) == stats["steps"]
