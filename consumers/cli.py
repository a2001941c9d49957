"""`rollout serve <service>` for every service in ``consumers.registry`` (``python -m consumers serve`` too)."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from consumers import settings as settings_mod
from consumers.registry import SERVICES

COMMON = ("instance",)


def add_service_parser(ssub: argparse._SubParsersAction, name: str) -> argparse.ArgumentParser:
    svc = SERVICES[name]
    p = ssub.add_parser(
        name, help=svc.help, description=f"{svc.help}. Reads {', '.join(t.key for t in svc.inputs)}; writes "
        f"{', '.join(t.key for t in svc.outputs)}. Consumer group {svc.group_id}: start more instances to "
        "scale out. Settings: a flag given here > the plan (--plan) > ROLLOUT_<SETTING> > the default.")
    p.add_argument("--plan", default=None, help="GenerationPlan (prime-rl TOML) whose settings this service uses")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (default: ROLLOUT_METRICS_PORT + the service's offset; "
                        "see docs/OBSERVABILITY.md 'Metrics'; 0: off)")
    settings_mod.add_flags(p, COMMON + svc.options)
    p.set_defaults(func=cmd_serve, name=name)
    return p


def register_serve(ssub: argparse._SubParsersAction) -> None:
    for name in SERVICES:
        add_service_parser(ssub, name)


def settings_from_args(args: argparse.Namespace) -> settings_mod.ServiceSettings:
    """Flags > plan > environment > defaults; a plan the service cannot run ends the command with one line."""
    svc = SERVICES[args.name]
    plan = None
    try:
        if args.plan:
            from schemas.plan_compiler import compile_plan

            plan = compile_plan(args.plan)
        return settings_mod.build(settings_mod.flags_of(args, COMMON + svc.options), plan,
                                  credit=svc.runs_algorithm)
    except settings_mod.PlanRefused as e:
        raise SystemExit(f"rollout serve {svc.name}: refusing the plan: {e}") from None
    except ValidationError as e:  # a bad ROLLOUT_* value or plan setting
        raise SystemExit(f"rollout serve {svc.name}: invalid settings: "
                         + "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())) from None


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from consumers.runner import serve, setup_logging
    from streams.config import KafkaSettings, ensure_broker
    from streams.kafka_errors import KafkaError
    from streams.poison import ProcessMustRestart

    svc = SERVICES[args.name]
    cfg = settings_from_args(args)
    setup_logging(args.log_level)
    group = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun: one rank of a data-parallel group
        if not svc.data_parallel:
            raise SystemExit(f"rollout serve {svc.name}: runs one process per instance, not under torchrun "
                             "(scale it out by starting more instances); only the trainer trains data-parallel")
        from consumers.trainer import distributed
        from consumers.trainer.step import group_refusal

        if why := group_refusal(cfg.lora, cfg.optimizer):
            raise SystemExit(f"rollout serve {svc.name}: {why}")
        group = distributed.launch()
        if not group.leader:  # no Kafka here: train in lockstep with rank 0 until it stops
            from consumers.trainer.step import open_trainer

            distributed.follow(group, open_trainer)
            return 0
    try:
        kafka = KafkaSettings.from_env()
        kafka = kafka.with_bootstrap(ensure_broker(kafka))
        asyncio.run(serve(svc, cfg, kafka.client_kwargs(), metrics_port=args.metrics_port))
    except KafkaError as e:  # wrong credentials, untrusted broker, missing permission: one line, exit 1
        print(f"rollout serve {args.name}: error: {e}", file=sys.stderr)
        return 1
    except ProcessMustRestart as e:  # a torchrun group's rank 0: torchrun starts the group again
        # no goodbye to the followers: one may still wait in the failed step's collectives, where a "stop" broadcast
        # would wait with it for good; this rank's exit breaks their connections and torchrun restarts every rank
        group = None
        print(f"rollout serve {args.name}: {e}", file=sys.stderr)
        return 1
    finally:
        if group is not None:
            distributed.stop_followers(group)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """python -m consumers serve <service> [...] | status (what torchrun launches: deploy/k8s/trainer.yaml)"""
    from consumers import status

    parser = argparse.ArgumentParser(prog="python -m consumers")
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="run one service").add_subparsers(dest="service", required=True)
    register_serve(serve)
    status.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None and getattr(args, "name", None) == "trainer":  # a command line whose process trains
        from consumers.trainer import allocator

        allocator.reexec()
    return args.func(args)

