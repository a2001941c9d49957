"""`rollout arena PLAN`: run a GenerationPlan's environments and write every Step and Rollout to Kafka.

    rollout arena examples/plans/arithmetic.toml --groups 8
    rollout arena examples/plans/debate.toml --groups 4 --follow-revisions

The learner target (a plan's learner has no base_url) is the local policy server: started in-process on
``--policy-port`` (default 8000, which is also where the example plans' fixed targets point) unless
``--policy-url`` names a running one. Topics are created if missing. ``--follow-revisions`` follows the
policy-revisions topic (new revisions are loaded into the local policy server and pace admission).
SIGTERM (or Ctrl-C) stops admission; the episodes in flight finish and are written before it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import signal


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("arena", help="generate rollouts for a plan and write them to Kafka")
    p.add_argument("plan", help="GenerationPlan TOML (e.g. examples/plans/arithmetic.toml)")
    p.add_argument("--groups", type=int, default=4, help="groups to admit (each plan.group_size rollouts); 0 = forever")
    p.add_argument("--concurrency", type=int, default=32, help="rollouts in flight at most")
    p.add_argument("--policy-url", help="learner endpoint (default: start the local policy server)")
    p.add_argument("--policy-port", type=int, default=8000, help="port of the in-process local policy server")
    p.add_argument("--checkpoint", help="checkpoint for the local policy server (default: seeded init)")
    p.add_argument("--follow-revisions", action="store_true", help="follow the policy-revisions topic (pacing)")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    p.add_argument("--run-id", help="run id stamped on every event (default: random)")
    p.add_argument("--seed", type=int, default=0, help="arena sampling seed")
    p.add_argument("--start-local", action="store_true",
                   help="start the local broker when ROLLOUT_BOOTSTRAP_SERVERS is not set")
    p.set_defaults(func=cmd_arena)


async def _main(args: argparse.Namespace) -> int:
    import json

    from producers.arena import Arena, RevisionFollower
    from producers.emitter import KafkaEmitter
    from schemas.envelope import new_id
    from schemas.plan import compile_plan
    from streams import topics
    from streams.config import KafkaSettings, ensure_broker

    plan = compile_plan(args.plan)
    settings = KafkaSettings.from_env()
    if args.start_local and not settings.external:
        settings = settings.with_bootstrap(ensure_broker(settings))
    await topics.create_topics(settings.admin_kwargs())
    run_id = args.run_id or new_id()
    server = None
    url = args.policy_url
    if url is None and not plan.learner.base_urls:
        from policy import PolicyModel
        from policy.checkpoint import load_checkpoint_info
        from producers.policy_server import PolicyServer

        if args.checkpoint:
            model, info = load_checkpoint_info(args.checkpoint)
            server = PolicyServer(model, family=info["family"], revision=info["revision"],
                                  checkpoint_digest=info["digest"], port=args.policy_port)
        else:
            server = PolicyServer(PolicyModel.from_seed(0), family=plan.family, port=args.policy_port)
        await server.start()
        url = server.base_url
        print(f"local policy server: {url} serving {server.policy}")
    try:
        emitter = KafkaEmitter(settings.client_kwargs(), f"arena-{run_id}")
        follower = RevisionFollower(settings.client_kwargs(), plan.family) if args.follow_revisions else None
        arena = Arena(plan, emitter=emitter, policy_base_url=url, concurrency=args.concurrency,
                      progress=not args.no_progress, run_id=run_id, revisions=follower, seed=args.seed)
        stop = asyncio.Event()  # SIGTERM/SIGINT: admit no more, finish and emit what is in flight, exit 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        async with arena:
            stats = await arena.run(num_groups=args.groups or None, stop=stop)
        print(json.dumps({"run_id": run_id, "plan": args.plan, **stats.as_dict(),
                          "transactions": emitter.stats.transactions, "messages": emitter.stats.messages,
                          "steps_topic": emitter.steps_topic, "rollouts_topic": emitter.rollouts_topic}))
    finally:
        if server is not None:
            await server.stop()
    return 0


def cmd_arena(args: argparse.Namespace) -> int:
    return asyncio.run(_main(args))
