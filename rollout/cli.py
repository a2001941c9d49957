"""`rollout` command line: a small argparse dispatcher.

Each area registers its subcommand from its own module: add the module to SUBCOMMANDS; it must
define `register(subparsers)` that adds a parser and sets `func=<callable(args) -> int | None>`
via `set_defaults`. Keep module top levels light (import heavy things inside the functions): every
`rollout ... --help` imports every module listed here. A sub-command whose options need heavy imports to build
(`serve`: one parser per service, with flags derived from the settings model) passes `fill=FUNCTION` to
`add_parser`: `fill(parser)` adds them when that sub-command is parsed or its help is shown, not before
(`python -m benchmarks coldstart`; tests/test_coldstart.py keeps `rollout --help` free of torch, pandas and the like).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

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


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that may add its arguments on first use: ``fill(self)``, when it parses or formats
    its help or usage (``add_parser(name, fill=...)``; its own sub-parsers are of this class too)."""

    def __init__(self, *args: Any, fill: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._fill = fill

    def filled(self) -> Parser:
        fill, self._fill = self._fill, None
        if fill is not None:
            fill(self)
        return self

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        return super(Parser, self.filled()).parse_known_args(args, namespace)

    def format_help(self) -> str:
        return super(Parser, self.filled()).format_help()

    def format_usage(self) -> str:
        return super(Parser, self.filled()).format_usage()


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="rollout", description="Event-sourced rollout pipeline on Apache Kafka")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def tools_beside_interpreter() -> None:
    """The tools installed beside this interpreter first on PATH, as in an activated venv: verifiers runs ``uv``
    (a dependency) by name, and ``.venv/bin/rollout`` is run without activating ``.venv``."""
    here = os.path.dirname(sys.executable)
    if here not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join(p for p in (here, os.environ.get("PATH", "")) if p)


def main(argv: Sequence[str] | None = None) -> int:
    tools_beside_interpreter()
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is None and getattr(args, "trains", False):  # a command line (not a call from Python) whose process trains
        from consumers.trainer import allocator

        allocator.reexec()
    # aiokafka logs every failed connection attempt; commands report failures themselves, in one line.
    logging.basicConfig(level=os.environ.get("ROLLOUT_LOG_LEVEL", "WARNING").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if "ROLLOUT_LOG_LEVEL" not in os.environ:
        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        # errors that say what to do in one line; their modules are looked up, not imported: an error of a class
        # from a module the command never imported cannot have been raised (and `rollout kafka status` need not
        # load the plan models to find that out)
        if _raised(e, "streams.kafka_errors", "KafkaError"):
            print(f"rollout: error: {e}", file=sys.stderr)
            return 1
        if _raised(e, "aiokafka.errors", "KafkaConnectionError"):
            print(f"rollout {args.command}: error: cannot reach Kafka ({e}): is the broker up (`rollout kafka up` "
                  "starts the local one), and is ROLLOUT_BOOTSTRAP_SERVERS its address?", file=sys.stderr)
            return 1
        if _raised(e, "duckdb", "IOException"):  # a database folder that does not exist, a file not DuckDB's
            print(f"rollout {args.command}: error: {e}", file=sys.stderr)
            return 1
        unavailable = _raised(e, "producers.environments.types", "EnvironmentUnavailable")
        if _raised(e, "schemas.plan", "PlanError") or unavailable:
            print(f"rollout {args.command}: error: {e}", file=sys.stderr)
            return 1
        raise
    return int(rc or 0)


def _raised(e: BaseException, module: str, name: str) -> bool:
    m = sys.modules.get(module)
    return m is not None and isinstance(e, getattr(m, name))


if __name__ == "__main__":
    sys.exit(main())
