"""`rollout serve <service>`: long-running services, one sub-subcommand each.

Extensible: any module can add a service by registering in ``SERVICES`` (name -> module path); the
module must define ``register_serve(subparsers)`` that adds its parser and sets ``func``.
Keep module top levels light (heavy imports inside the command functions).

    rollout serve policy --port 8000      # the local policy server (producers.policy_server)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib

SERVICES: dict[str, str] = {
    "policy": "rollout.serve_cmd",  # this module's register_serve below
    "verifier": "consumers.cli",  # verifier, credit, batcher, trainer (consumers/cli.py)
    "credit": "consumers.cli",
    "batcher": "consumers.cli",
    "trainer": "consumers.cli",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run a long-lived service (policy server, verifier, ...)")
    ssub = p.add_subparsers(dest="service", metavar="SERVICE")
    ssub.required = True
    seen: set[str] = set()
    for module in SERVICES.values():
        if module in seen:
            continue
        seen.add(module)
        importlib.import_module(module).register_serve(ssub)


def register_serve(ssub: argparse._SubParsersAction) -> None:
    p = ssub.add_parser("policy", help="the local tiny-LM policy server (OpenAI/vLLM-compatible HTTP API)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--checkpoint", help="checkpoint file to serve (default: seeded random init)")
    p.add_argument("--family", default="tiny-byte-lm", help="model family (without --checkpoint)")
    p.add_argument("--revision", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="init seed (without --checkpoint)")
    p.add_argument("--max-batch", type=int, default=64, help="requests generated together")
    p.set_defaults(func=cmd_policy)


def cmd_policy(args: argparse.Namespace) -> int:
    from producers.policy_server import serve

    asyncio.run(serve(args.host, args.port, checkpoint=args.checkpoint, family=args.family,
                      revision=args.revision, seed=args.seed, max_batch=args.max_batch))
    return 0
