"""`rollout topics create|list`: the topics declared in streams/topics.py."""

from __future__ import annotations

import argparse
import asyncio


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("topics", help="create or list the pipeline topics (streams/topics.py)")
    tsub = p.add_subparsers(dest="topics_command", metavar="ACTION")
    tsub.required = True
    c = tsub.add_parser("create", help="create all pipeline topics (idempotent)")
    c.add_argument("--start-local", action="store_true",
                   help="start the local broker first when ROLLOUT_BOOTSTRAP_SERVERS is not set")
    c.set_defaults(func=cmd_create)
    tsub.add_parser("list", help="list topics with partitions and retention").set_defaults(func=cmd_list)


def _settings(start_local: bool = False):
    from streams.config import KafkaSettings, ensure_broker

    settings = KafkaSettings.from_env()
    if start_local and not settings.external:
        settings = settings.with_bootstrap(ensure_broker(settings))
    return settings


def cmd_create(args: argparse.Namespace) -> int:
    from streams import topics

    settings = _settings(args.start_local)
    result = asyncio.run(topics.create_topics(settings.admin_kwargs()))
    for t in topics.TOPICS.values():
        cfg = t.topic_configs()
        print(f"{result.get(t.name, '?'):8} {t.name:32} partitions={t.partitions} rf={t.replication_factor} "
              f"min.insync.replicas={cfg['min.insync.replicas']} retention.ms={cfg['retention.ms']}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from streams import topics

    settings = _settings()
    info = asyncio.run(topics.describe_topics(settings.admin_kwargs()))
    declared = {t.name for t in topics.TOPICS.values()}
    for name, d in sorted(info.items()):
        mark = "*" if name in declared else " "
        print(f"{mark} {name:32} partitions={d['partitions']} rf={d['replication_factor']} "
              f"retention.ms={d['configs'].get('retention.ms')} max.message.bytes={d['configs'].get('max.message.bytes')}")
    missing = sorted(declared - set(info))
    if missing:
        print("missing (run `rollout topics create`): " + ", ".join(missing))
    return 0
