"""Arena throughput: rollouts/s and completion tokens/s emitted to Kafka, against the local policy server
and against an instant echo endpoint, next to raw aiokafka producing the same bytes.

    python -m benchmarks arena [--quick] [--groups N] [--tokens T] [--concurrency C]

Workload: single-turn episodes (group_size 8) whose prompt is T bytes and whose max_tokens is T, so
the echo endpoint returns T+1 tokens and the tiny policy model about as many. Each rollout is 1 Step + 1
Rollout, written transactionally by the arena's KafkaEmitter (group commit: up to 64 finished episodes per
transaction; also measured with 1 episode per transaction). "raw" replays the exact (topic, key, value,
headers) the echo run wrote with one plain idempotent AIOKafkaProducer (acks=all, no transactions, no
episodes, no HTTP): the floor of what Kafka itself costs here. "echo_no_kafka" runs the same arena
with an in-memory emitter: the arena + HTTP + episode cost without Kafka.

Kafka: ROLLOUT_BOOTSTRAP_SERVERS, else the local broker (started if needed); topics are fresh
(prefix bench.arena.<random>.). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid

from benchmarks._shared import kafka_for, report


def _env(tokens: int, n: int = 64):
    from producers.environments.dataset import Example
    from producers.environments.types import Environment
    from producers.environments.episodes import SingleTurnEpisode
    from schemas.scoring import ScoringSpec

    filler = "0123456789abcdefghijklmnopqrstuvwxyz "
    rows = [Example(id=f"b{i}", prompt=(f"{i}:" + filler * (tokens // len(filler) + 1))[:tokens], answer="x")
            for i in range(n)]
    return Environment(name="bench", version="1", dataset=rows, episode=SingleTurnEpisode(member="solver"),
                       scoring=ScoringSpec(kind="exact_match", answer="x"), sampling={"max_tokens": tokens})


async def _arena_run(settings, plan, url: str, groups: int, tokens: int, concurrency: int, per_txn: int,
                     collect: bool = False) -> tuple[dict, list]:
    from producers.arena.config import ArenaConfig
    from producers.arena.arena import Arena
    from producers.arena.emitter import EmitterStats, KafkaEmitter, MemoryEmitter

    if per_txn == 0:  # no Kafka: episodes kept in memory (the arena + HTTP + episode cost alone)
        emitter = MemoryEmitter()
        emitter.stats = EmitterStats()
    else:
        emitter = KafkaEmitter(settings.client_kwargs(), f"bench-arena-{uuid.uuid4().hex[:8]}",
                               max_episodes_per_txn=per_txn)
    arena = Arena(plan, {"bench": _env(tokens)}, emitter=emitter,
                  config=ArenaConfig(policy_base_url=url, concurrency=concurrency))
    async with arena:
        # warm up one group (connections, first batch), not counted
        await arena.run(num_groups=1)
        s0 = (arena.stats.rollouts, arena.stats.completion_tokens, emitter.stats.messages, emitter.stats.bytes,
              emitter.stats.transactions)
        t0 = time.perf_counter()
        out = await arena.run(num_groups=groups, collect=collect)
        dt = time.perf_counter() - t0
    stats, results = out if collect else (out, [])
    n_roll = stats.rollouts - s0[0]
    toks = stats.completion_tokens - s0[1]
    msgs = emitter.stats.messages - s0[2]
    nbytes = emitter.stats.bytes - s0[3]
    txns = emitter.stats.transactions - s0[4]
    return {"rollouts": n_roll, "seconds": round(dt, 3), "rollouts_per_s": round(n_roll / dt, 1),
            "completion_tokens_per_s": round(toks / dt, 1), "messages_per_s": round(msgs / dt, 1),
            "mb_per_s": round(nbytes / dt / 1e6, 2), "transactions": txns,
            "episodes_per_txn": round(n_roll / max(txns, 1), 1), "failed": stats.failed}, results


async def _raw(settings, messages: list) -> dict:
    from aiokafka import AIOKafkaProducer

    from streams.settings import MAX_MESSAGE_BYTES

    producer = AIOKafkaProducer(**settings.client_kwargs(), enable_idempotence=True, acks="all",
                                max_request_size=MAX_MESSAGE_BYTES)
    await producer.start()
    try:
        t0 = time.perf_counter()
        futs = [await producer.send(t, value=v, key=k, headers=h) for t, k, v, h in messages]
        await asyncio.gather(*futs)
        dt = time.perf_counter() - t0
    finally:
        await producer.stop()
    nbytes = sum(len(v) + len(k) for _, k, v, _ in messages)
    return {"messages": len(messages), "seconds": round(dt, 3), "messages_per_s": round(len(messages) / dt, 1),
            "mb_per_s": round(nbytes / dt / 1e6, 2)}


async def run(args) -> dict:
    settings = kafka_for("arena")
    from policy import PolicyModel
    from producers.inference.echo_server import EchoServer
    from producers.arena.emitter import messages_for
    from producers.inference.policy_server import PolicyServer
    from schemas.plan_compiler import compile_plan
    from streams import serde, topics

    await topics.create_topics(settings.admin_kwargs(), [topics.STEPS, topics.ROLLOUTS])
    plan = compile_plan("examples/plans/arithmetic.toml").model_copy(update={"group_size": 8, "batch_size": 10**9})

    out: dict = {"kafka": settings.bootstrap, "groups": args.groups, "group_size": 8, "tokens": args.tokens,
                 "concurrency": args.concurrency, "cpus": os.cpu_count()}
    async with EchoServer() as echo:
        out["echo"], results = await _arena_run(settings, plan, echo.base_url, args.groups, args.tokens,
                                                args.concurrency, 64, collect=True)
        print(f"arena vs echo endpoint:        {out['echo']}", file=sys.stderr)
        out["echo_1_per_txn"], _ = await _arena_run(settings, plan, echo.base_url, max(args.groups // 4, 2),
                                                    args.tokens, args.concurrency, 1)
        print(f"arena vs echo, 1 episode/txn:  {out['echo_1_per_txn']}", file=sys.stderr)
        out["echo_no_kafka"], _ = await _arena_run(settings, plan, echo.base_url, args.groups, args.tokens,
                                                   args.concurrency, 0)
        print(f"arena vs echo, no Kafka:       {out['echo_no_kafka']}", file=sys.stderr)
    async with PolicyServer(PolicyModel.from_seed(0)) as server:
        out["policy"], _ = await _arena_run(settings, plan, server.base_url, args.policy_groups, args.tokens,
                                            args.concurrency, 64)
        out["policy"]["server_batches"] = server.batches_run
        print(f"arena vs local policy server:  {out['policy']}", file=sys.stderr)
    messages = []
    for res in results:
        for ev in messages_for(res):
            k, v, h = serde.to_message(ev)
            messages.append((topics.STEPS.name if ev.EVENT_TYPE == "step" else topics.ROLLOUTS.name, k, v, h))
    out["raw_aiokafka"] = await _raw(settings, messages)
    print(f"raw aiokafka, same bytes:      {out['raw_aiokafka']}", file=sys.stderr)
    out["ratios"] = {
        "echo_arena_vs_raw_messages": round(out["echo"]["messages_per_s"] / out["raw_aiokafka"]["messages_per_s"], 3),
        "policy_vs_echo_rollouts": round(out["policy"]["rollouts_per_s"] / out["echo"]["rollouts_per_s"], 3),
        "group_commit_speedup": round(out["echo"]["rollouts_per_s"] / out["echo_1_per_txn"]["rollouts_per_s"], 2),
        "echo_kafka_vs_no_kafka_rollouts": round(out["echo"]["rollouts_per_s"]
                                                 / out["echo_no_kafka"]["rollouts_per_s"], 3),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks arena", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small run (< 1 min)")
    p.add_argument("--groups", type=int, help="groups of 8 against the echo endpoint")
    p.add_argument("--policy-groups", type=int, help="groups of 8 against the local policy server")
    p.add_argument("--tokens", type=int, default=128, help="prompt bytes = max_tokens")
    p.add_argument("--concurrency", type=int, default=64)
    args = p.parse_args(argv)
    if args.groups is None:
        args.groups = 40 if args.quick else 250
    if args.policy_groups is None:
        args.policy_groups = 12 if args.quick else 60
    return report(run, args)


if __name__ == "__main__":
    sys.exit(main())
