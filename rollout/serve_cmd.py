"""`rollout serve <service>`: long-running services, one sub-subcommand each.

The pipeline services (verifier, credit, batcher, trainer, ...) come from ``consumers.registry``;
this module adds the inference servers. Keep module top levels light (heavy imports inside the
command functions).

    rollout serve policy --port 8000      # the local policy server (producers.inference.policy_server)
    rollout serve vllm --port 8000        # vLLM on the packaged model (producers.inference.vllm_server)
"""

from __future__ import annotations

import argparse
import asyncio

METRICS_HELP = ("serve Prometheus metrics on this port (default: ROLLOUT_METRICS_PORT + this process's offset, "
                "see docs/OBSERVABILITY.md 'Metrics'; 0: off)")


def register(sub: argparse._SubParsersAction) -> None:
    # the services' parsers (flags from the settings model, inputs from the registry) are built when `serve` is used
    sub.add_parser("serve", help="run a long-lived service (policy server, verifier, ...)", fill=_fill)


def _fill(p: argparse.ArgumentParser) -> None:
    from consumers.cli import register_serve as register_services

    ssub = p.add_subparsers(dest="service", metavar="SERVICE")
    ssub.required = True
    register_servers(ssub)
    register_services(ssub)


def register_servers(ssub: argparse._SubParsersAction) -> None:
    from schemas.policy import TINY_FAMILY

    p = ssub.add_parser("policy", help="the local tiny-LM policy server (OpenAI/vLLM-compatible HTTP API)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--checkpoint", help="checkpoint file to serve (default: seeded random init)")
    p.add_argument("--family", default=TINY_FAMILY, help="model family (without --checkpoint)")
    p.add_argument("--revision", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="init seed (without --checkpoint)")
    p.add_argument("--max-batch", type=int, default=64, help="requests generated together")
    p.add_argument("--metrics-port", type=int, default=None, help=METRICS_HELP)
    p.set_defaults(func=cmd_policy)
    _register_vllm(ssub)


def cmd_policy(args: argparse.Namespace) -> int:
    from producers.inference.policy_server import serve

    asyncio.run(serve(args.host, args.port, checkpoint=args.checkpoint, family=args.family,
                      revision=args.revision, seed=args.seed, max_batch=args.max_batch,
                      metrics_port=args.metrics_port))
    return 0


def _register_vllm(ssub: argparse._SubParsersAction) -> None:
    p = ssub.add_parser(
        "vllm", help="vLLM's OpenAI-compatible server on the packaged SmolLM2-135M-Instruct (or --model DIR)",
        description="Starts vLLM's OpenAI server (`python -m producers.inference.vllm_launch`, vLLM's api_server with its "
                    "engine core imported beside it) with VLLM_SERVER_DEV_MODE=1 (weight "
                    "reloads without a restart), waits until it answers, and stops it cleanly on SIGTERM/Ctrl-C. "
                    "Point an arena at it with `rollout arena PLAN --policy vllm --policy-url http://HOST:PORT/v1`.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", help="HF model folder (default: the packaged model, prepared on first use)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="the tokenizer's folder, for a --model folder without one (default: a trainer checkpoint's "
                        "family's packaged model)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the name clients ask for (default: the packaged model's family); e.g. a checkpoint's folder "
                        "name, which carries its digest, for a teacher an opd recipe names")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="KV cache size on a CPU host (GiB; default: room for 64 sequences of --max-model-len "
                        "tokens, at most 2)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--compile", action="store_true",
                   help="let vLLM torch.compile the model (faster decoding, 90-130 s start on 2 cores)")
    p.add_argument("--metrics-port", type=int, default=None, help=METRICS_HELP + "; vLLM's own metrics are on "
                   "its API port at /metrics")
    p.add_argument("--lora-rank", type=int, default=None, metavar="RANK",
                   help="serve LoRA adapters up to this rank, loaded at run time (what a LoRA recipe's arena loads "
                        "each revision's adapter with)")
    p.set_defaults(func=cmd_vllm)


def cmd_vllm(args: argparse.Namespace) -> int:
    import signal
    import sys

    from policy.hf import ModelUnavailable, prepare_model
    from producers.metrics import endpoint, vllm_samples
    from producers.inference.vllm_server import VllmServer, VllmStartError

    async def main() -> int:
        try:
            model = args.model or prepare_model(log=lambda s: print(s, file=sys.stderr)).path
            server = VllmServer(model, host=args.host, port=args.port, served_model_name=args.served_model_name,
                                kv_cache_gb=args.kv_cache_gb, tokenizer=args.tokenizer,
                                max_model_len=args.max_model_len, compile=args.compile, lora_rank=args.lora_rank)
            print(f"starting vLLM on {model} (log follows)", file=sys.stderr)
            await server.start(progress=lambda line: print(line, file=sys.stderr))
        except (VllmStartError, ModelUnavailable) as e:
            print(f"rollout serve vllm: error: {e}", file=sys.stderr)
            return 1
        print(f"vLLM ready: {server.base_url} (model {server.served_model_name})", flush=True)
        metrics = endpoint("vllm", args.metrics_port, ("vllm", lambda: vllm_samples(server)))
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        waiter = asyncio.ensure_future(server.proc.wait())
        await asyncio.wait([waiter, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        rc = await server.stop()
        metrics.close()
        return 0 if stop.is_set() else (rc or 1)

    return asyncio.run(main())
