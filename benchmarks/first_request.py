"""vLLM's first requests after its start, with its sampler's torch.compile on (vLLM's default) and off (ours).

    python -m benchmarks first_request [--reps 3]

``--enforce-eager`` still leaves vLLM compiling a sampler helper with inductor (the rank count of a sampled
token's logprob) on the first request that asks for logprobs; ``VllmServer`` runs vLLM with
``TORCHDYNAMO_DISABLE=1`` unless it compiles the model. For each side, one fresh server (the packaged SmolLM2, the
demo's settings: context 256, blocks of 32) answers, in this order:

* ``first_logprobs_s``: one chat request with ``logprobs`` (what every episode asks for): the first one pays the
  compile;
* ``eval48_s``: the demo's 48 greedy held-out questions at once, 16 tokens, ``reps`` times (the first is the
  demo's revision 0);
* ``train32_s``: 4 groups of 8 sampled answers at once, ``reps`` times (the demo's batch).

The sides take turns (on, off, on, off with ``--rounds 2``). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time


async def _requests(url: str, reps: int) -> dict:
    import httpx

    from benchmarks._shared import arithmetic_question, demo_chat, timed_into

    rng = random.Random(0)
    out: dict = {}
    async with httpx.AsyncClient(timeout=300) as http:
        def chat(q: str, temperature: float):
            return demo_chat(http, url, q, temperature)

        def timed(name: str, *calls):
            return timed_into(out, name, *calls, digits=3)

        await timed("first_logprobs_s", chat("What is 2 + 2? Answer with a number.", 1.0))
        for _ in range(reps):
            await timed("eval48_s", *(chat(arithmetic_question(rng), 0.0) for _ in range(48)))
            groups = [arithmetic_question(rng) for _ in range(4)]
            await timed("train32_s", *(chat(q, 1.0) for q in groups for _ in range(8)))
    out["first_logprobs_s"] = out["first_logprobs_s"][0]
    return out


async def _side(compiled: bool, reps: int) -> dict:
    from policy.hf import prepare_model
    from producers.inference.vllm_server import VllmServer
    from streams.local_broker import free_port

    # the server's environment is this process's, with its own defaults added: "0" here keeps dynamo on
    os.environ["TORCHDYNAMO_DISABLE"] = "0" if compiled else "1"
    server = VllmServer(prepare_model().path, served_model_name="m", port=free_port(), max_model_len=256)
    t0 = time.perf_counter()
    await server.start()
    start_s = time.perf_counter() - t0
    try:
        return {"sampler_compiled": compiled, "start_s": round(start_s, 1), **await _requests(server.base_url, reps)}
    finally:
        await server.stop()


async def _run(rounds: int, reps: int) -> list[dict]:
    rows = []
    for _ in range(rounds):
        for compiled in (True, False):
            rows.append(await _side(compiled, reps))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks first_request", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one repetition, one round")
    p.add_argument("--reps", type=int, default=3, help="repetitions of the 48 questions and the batch")
    p.add_argument("--rounds", type=int, default=2, help="times each side runs (they take turns)")
    a = p.parse_args(argv)
    saved = os.environ.get("TORCHDYNAMO_DISABLE")
    t0 = time.perf_counter()
    try:
        rows = asyncio.run(_run(1 if a.quick else a.rounds, 1 if a.quick else a.reps))
    finally:
        os.environ.pop("TORCHDYNAMO_DISABLE", None)
        if saved is not None:
            os.environ["TORCHDYNAMO_DISABLE"] = saved
    print(json.dumps({"benchmark": "first_request", "quick": a.quick, "rows": rows,
                      "wall_s": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
