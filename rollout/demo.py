"""`rollout demo`: the full loop, locally.

Broker up (ROLLOUT_BOOTSTRAP_SERVERS, else the local one), fresh topics for this run (prefix
``demo-<run>.``), revision 0 of the tiny policy written to disk and published; then the services
(verifier, credit, batcher, reference trainer) run in this process while the arena
(``rollout arena examples/plans/arithmetic.toml --follow-revisions``, with its local policy server) generates
single-turn arithmetic rollouts in a subprocess, loading each new revision the trainer publishes. Ends with
a summary: rollouts, batches, revisions, mean reward by the revision that generated the rollouts.

    rollout demo [--groups 192] [--plan examples/plans/arithmetic.toml] [--lr 2e-2] [--epochs 4]

The example plan scores arithmetic with a shaped rubric (exact answer + a numeric reply + closeness),
so the tiny model has something to climb within a couple of minutes; the summary shows each reward
component by revision, exact match included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the full loop: broker, policy server, arena, services, trainer, summary")
    p.add_argument("--plan", default=str(ROOT / "examples" / "plans" / "arithmetic.toml"))
    p.add_argument("--groups", type=int, default=192, help="groups the arena admits (plan.group_size rollouts each)")
    p.add_argument("--lr", type=float, default=2e-2, help="reference trainer learning rate")
    p.add_argument("--epochs", type=int, default=4, help="reference trainer: optimizer passes over each batch")
    p.add_argument("--batch-records", type=int, default=None, help="default: the plan's batch_size")
    p.add_argument("--timeout", type=float, default=600.0)
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    import logging

    from streams.config import KafkaSettings, ensure_broker

    logging.basicConfig(level=logging.ERROR)
    settings = KafkaSettings.from_env()
    where = "configured cluster" if settings.external else "local broker"
    settings = settings.with_bootstrap(ensure_broker(settings))
    print(f"Kafka: {where} at {settings.bootstrap}")
    return asyncio.run(_demo(settings, args))


async def _demo(settings, args) -> int:
    from consumers.services import ServiceConfig, build_processor, ensure_topics
    from consumers.trainer import TrainerTask, initial_revision
    from schemas.plan import compile_plan
    from streams import serde, topics
    from streams.local_broker import free_port
    from streams.transactions import TransactionalProcessor

    run = uuid.uuid4().hex[:8]
    prefix = f"demo-{run}."
    os.environ["ROLLOUT_TOPIC_PREFIX"] = prefix
    kw = settings.client_kwargs()
    plan = compile_plan(args.plan)
    family = plan.family
    ckdir = ROOT / ".state" / "demo" / run
    print(f"run {run}: topics {prefix}*, checkpoints {ckdir}, plan {args.plan} (family {family}, "
          f"group_size {plan.group_size}, batch_size {plan.batch_size}, max_off_policy_steps "
          f"{plan.max_off_policy_steps}, advantage {plan.advantage.type})")
    for svc in ("verifier", "credit", "batcher", "trainer"):
        await ensure_topics(svc, kw)
    rev0 = initial_revision(family, ckdir, seed=0, run_id=run)
    from aiokafka import AIOKafkaProducer

    prod = AIOKafkaProducer(**kw)
    await prod.start()
    k, v, h = serde.to_message(rev0)
    await prod.send_and_wait(topics.POLICY_REVISIONS.name, v, key=k, headers=h)
    await prod.stop()

    credit = plan.advantage.type if plan.advantage.type in ("grpo", "reinforce_baseline", "ema_per_member",
                                                            "per_step") else "grpo"
    cfg = ServiceConfig(family=family, credit=credit, credit_params=dict(plan.advantage.params or {}),
                        max_off_policy_steps=plan.max_off_policy_steps,
                        batch_records=args.batch_records or max(1, plan.batch_size // topics.TRAINING_RECORDS.partitions),
                        flush_after_s=1.0, group_timeout_s=60)
    procs = [build_processor(n, cfg, kw) for n in ("verifier", "credit", "batcher")]
    trainer_tasks: list[TrainerTask] = []

    def make_trainer(p: int) -> TrainerTask:
        t = TrainerTask(p, family, ckdir, lr=args.lr, epochs=args.epochs, producer="trainer",
                        min_records=plan.batch_size)
        trainer_tasks.append(t)
        return t

    procs.append(TransactionalProcessor("trainer", [topics.TRAINER_BATCHES.name], topics.TRAINER_BATCHES.partitions,
                                        make_trainer, kw))
    tasks = [asyncio.create_task(p.run()) for p in procs]
    t0 = time.monotonic()
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": settings.bootstrap, "ROLLOUT_TOPIC_PREFIX": prefix}
    checkpoint = rev0.checkpoint.uri.removeprefix("file://")
    arena = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollout.cli", "arena", args.plan, "--groups", str(args.groups), "--follow-revisions",
        "--no-progress", "--run-id", run, "--policy-port", str(free_port()), "--checkpoint", checkpoint,
        cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = b""
    try:
        out, _ = await asyncio.wait_for(arena.communicate(), args.timeout)
        print(f"arena finished (rc {arena.returncode}) in {time.monotonic() - t0:.1f}s")
        # let the services drain: every scored rollout batched and trained on
        from consumers.status import service_lag

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            lag = {r["service"]: r["lag"] for r in await service_lag(kw, sample_s=0.2)}
            if all(lag.get(s, 0) == 0 for s in ("verifier", "credit", "batcher", "trainer")):
                await asyncio.sleep(cfg.flush_after_s + 1.0)
                lag = {r["service"]: r["lag"] for r in await service_lag(kw, sample_s=0.2)}
                if all(lag.get(s, 0) == 0 for s in ("verifier", "credit", "batcher", "trainer")):
                    break
            await asyncio.sleep(1.0)
    except asyncio.TimeoutError:
        arena.kill()
        print("arena timed out")
    finally:
        for p in procs:
            p.stopping.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for p in procs:
            side = getattr(p, "side", None)
            if side is not None:
                await side.stop()
    if arena.returncode not in (0, None):
        print(out.decode(errors="replace")[-2000:])
    summary = await _summary(kw, trainer_tasks)
    summary["seconds"] = round(time.monotonic() - t0, 1)
    _print_summary(summary)
    print(json.dumps(summary))
    return 0


async def _summary(kw, trainer_tasks) -> dict:
    from aiokafka import AIOKafkaConsumer

    from schemas import codec
    from streams import topics

    async def read(topic: str) -> list:
        c = AIOKafkaConsumer(topic, **kw, group_id=None, isolation_level="read_committed",
                             auto_offset_reset="earliest", max_partition_fetch_bytes=64 * 1024 * 1024)
        await c.start()
        out, idle = [], 0
        try:
            while idle < 3:
                got = await c.getmany(timeout_ms=300)
                n = sum(len(v) for v in got.values())
                idle = idle + 1 if n == 0 else 0
                for recs in got.values():
                    out.extend(codec.decode(r.value) for r in recs)
        finally:
            await c.stop()
        return out

    rollouts = await read(topics.ROLLOUTS.name)
    scores = await read(topics.SCORES.name)
    batches = await read(topics.TRAINER_BATCHES.name)
    revisions = await read(topics.POLICY_REVISIONS.name)
    letters = await read(topics.DEAD_LETTERS.name)
    by_rev: dict[int, list[float]] = {}
    parts: dict[str, dict[int, list[float]]] = {}  # reward component (rubric function) -> revision -> values
    for s in scores:
        rev = s.trainable_steps[0].policy.revision if s.trainable_steps else None
        if rev is None:
            continue
        by_rev.setdefault(rev, []).extend(s.rewards.values())
        for name, v in s.metrics.items():
            if "/reward/" in name:
                parts.setdefault(name.rsplit("/", 1)[-1], {}).setdefault(rev, []).append(v)
    mean = lambda v: round(sum(v) / len(v), 4)  # noqa: E731
    losses = [h.get("loss") for t in trainer_tasks for h in t.history]
    return {
        "rollouts": len(rollouts), "scored": len(scores), "batches": len(batches),
        "records_in_batches": sum(len(b.records) for b in batches),
        "revisions": max((r.revision for r in revisions), default=0),
        "dead_letters": len(letters),
        "dead_letter_reasons": dict(Counter(f"{d.service}: {d.error_type}" for d in letters)),
        "mean_reward_by_revision": {str(k): mean(v) for k, v in sorted(by_rev.items())},
        "reward_parts_by_revision": {n: {str(k): mean(v) for k, v in sorted(p.items())} for n, p in parts.items()},
        "rollouts_by_revision": {str(k): len(v) for k, v in sorted(by_rev.items())},
        "trainer_losses": [round(x, 4) for x in losses if x is not None][:50],
    }


def _print_summary(s: dict) -> None:
    print(f"rollouts {s['rollouts']}, scored {s['scored']}, batches {s['batches']} "
          f"({s['records_in_batches']} records), revisions published {s['revisions']}, "
          f"dead letters {s['dead_letters']} {s['dead_letter_reasons'] or ''}")
    print("mean reward by the revision that generated the rollouts:")
    names = list(s["reward_parts_by_revision"])
    for rev, r in s["mean_reward_by_revision"].items():
        parts = "  ".join(f"{n} {s['reward_parts_by_revision'][n].get(rev, 0.0):.3f}" for n in names)
        print(f"  r{rev:>3}: {r:.3f}  ({s['rollouts_by_revision'][rev]} rollouts)  {parts}")
    rs = list(s["mean_reward_by_revision"].values())
    if len(rs) >= 2:
        trend = "rose" if rs[-1] > rs[0] else "did not rise"
        print(f"mean reward {trend}: r{list(s['mean_reward_by_revision'])[0]} {rs[0]:.3f} -> "
              f"r{list(s['mean_reward_by_revision'])[-1]} {rs[-1]:.3f}")
