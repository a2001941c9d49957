"""`rollout` command line: a small argparse dispatcher.

Each area registers its subcommand from its own module: add the module to SUBCOMMANDS; it must
define `register(subparsers)` that adds a parser and sets `func=<callable(args) -> int | None>`
via `set_defaults`. Keep module top levels light (import heavy things inside the functions).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

SUBCOMMANDS: list[str] = [
    "rollout.kafka_cmd",  # rollout kafka up|down|status|logs
    "rollout.topics_cmd",  # rollout topics create|list
    "rollout.demo",  # rollout demo
    "rollout.rl_cmd",  # rollout rl RECIPE: a prime-rl recipe's whole loop, as `rl @ recipe.toml`
    "consumers.status",  # rollout status: per-service consumer lag and throughput
    "rollout.arena_cmd",  # rollout arena PLAN (producers: episodes -> Steps/Rollouts on Kafka)
    "rollout.serve_cmd",  # rollout serve policy|vllm|<service> (services: consumers.registry)
    "rollout.replay_cmd",  # rollout runs|replay|audit|sql|export|report: a run from the log in DuckDB
    "rollout.derive_cmd",  # rollout derive RUN: re-score, re-credit, re-train a past run's rollouts as a new run
    "rollout.dashboard",  # rollout dashboard: a live web page of a run, following the log
    "rollout.plan_cmd",  # rollout plan FILE [--json]: the compiled GenerationPlan
    "rollout.model_cmd",  # rollout model prepare|info: the packaged model (SmolLM2-135M-Instruct)
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout", description="Event-sourced rollout pipeline on Apache Kafka")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # aiokafka logs every failed connection attempt; commands report failures themselves, in one line.
    logging.basicConfig(level=os.environ.get("ROLLOUT_LOG_LEVEL", "WARNING").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if "ROLLOUT_LOG_LEVEL" not in os.environ:
        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    from producers.environment import EnvironmentUnavailable
    from schemas.plan import PlanError
    from streams.config import KafkaError

    try:
        rc = args.func(args)
    except KafkaError as e:
        print(f"rollout: error: {e}", file=sys.stderr)
        return 1
    except (PlanError, EnvironmentUnavailable) as e:  # each says what to do, in one line
        print(f"rollout {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
