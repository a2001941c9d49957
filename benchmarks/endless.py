"""Memory while the arena runs an endless taskset: resident memory and Python's heap every N rollouts.

    python -m benchmarks endless [--quick] [--rollouts 10000] [--every 1000] [--recipe tests/envs/recipes/rlt-tally-duel.toml]

The recipe's first training source (an installed verifiers package, found by id: by default the endless two-seat
game `rlt-tally-duel` of tests/envs) runs through the arena's own path (``environment_from_spec``: the seeded
``TaskStream`` shuffle buffer, verifiers' ``run_episode``, the capture harness) against an instant scripted
endpoint (``producers.inference.echo_server.ScriptedServer``: no model, so memory is the arena's and the taskset's).
Episodes go to an emitter that counts and drops them (no Kafka: a kept log would be the memory measured).
Baseline in the same run: the process with verifiers imported, before the environment is loaded; Python's heap is
traced (tracemalloc) from then on with ``--trace-heap`` (off by default: it slows the run ~3x). Ends with one JSON
line.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def _run(recipe: Path, rollouts: int, every: int, concurrency: int, trace_heap: bool) -> dict:
    from producers.arena.config import ArenaConfig
    from producers.arena.arena import Arena
    from producers.inference.echo_server import ScriptedServer
    from producers.arena.emitter import Emitter, EmitterStats
    from producers.environments.loader import environment_from_spec
    from schemas.plan_compiler import compile_plan

    class Dropping(Emitter):
        def __init__(self) -> None:
            self.stats = EmitterStats()
            self.steps = self.rollouts = 0

        async def start(self) -> None: ...

        async def stop(self) -> None: ...

        async def emit(self, result) -> None:
            self.rollouts += 1
            self.steps += len(result.steps)

    import verifiers.v1  # noqa: F401 - imported before the baseline: its import is not the taskset's memory

    gc.collect()
    base_rss = _rss_mb()
    plan = compile_plan(recipe)
    spec = plan.environments[0]
    # no trainer here: an unbounded off-policy allowance, so admission never waits for a revision
    plan = plan.model_copy(update={"group_size": 1, "eval_environments": [], "max_off_policy_steps": 10**9})
    if trace_heap:
        tracemalloc.start()
    env = environment_from_spec(spec)
    loaded = (_rss_mb(), tracemalloc.get_traced_memory()[0])
    emitter = Dropping()
    samples = []
    async with ScriptedServer(lambda body: {"content": "7"}) as server:
        arena = Arena(plan, {spec.display_name: env}, emitter=emitter,
                      config=ArenaConfig(policy_base_url=server.base_url, concurrency=concurrency))
        t0 = time.perf_counter()
        async with arena:
            while emitter.rollouts < rollouts:
                await arena.run(num_groups=every)
                server.requests.clear()  # the scripted endpoint keeps what it was asked: not the arena's memory
                gc.collect()
                samples.append({"rollouts": emitter.rollouts, "rss_mb": round(_rss_mb(), 1),
                                "heap_mb": round(tracemalloc.get_traced_memory()[0] / 2**20, 2),
                                "s": round(time.perf_counter() - t0, 1)})
                print(samples[-1], flush=True)
        await env.episode.aclose()
    tracemalloc.stop()
    first, last = samples[0], samples[-1]
    return {"benchmark": "endless", "recipe": str(recipe), "environment": env.ref,
            "store": type(env.store).__name__, "buffer": getattr(env.store, "buffer", None),
            "rollouts": emitter.rollouts, "steps": emitter.steps, "tasks_drawn": getattr(env.store, "drawn", None),
            "rss_before_load_mb": round(base_rss, 1), "rss_after_load_mb": round(loaded[0], 1),
            "heap_after_load_mb": round(loaded[1] / 2**20, 2),
            f"rss_growth_after_first_{first['rollouts']}_mb": round(last["rss_mb"] - first["rss_mb"], 1),
            f"heap_growth_after_first_{first['rollouts']}_mb": round(last["heap_mb"] - first["heap_mb"], 2),
            "rollouts_per_s": round(emitter.rollouts / last["s"], 1), "samples": samples}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks endless", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1,000 rollouts, a sample every 250")
    p.add_argument("--rollouts", type=int, default=10_000)
    p.add_argument("--every", type=int, default=1000, help="sample memory every this many rollouts")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--trace-heap", action="store_true", help="also trace Python's heap (tracemalloc: ~3x slower)")
    p.add_argument("--recipe", default=str(ROOT / "tests" / "envs" / "recipes" / "rlt-tally-duel.toml"))
    args = p.parse_args(argv)
    if args.quick:
        args.rollouts, args.every = 1000, 250
    import json

    print(json.dumps(asyncio.run(_run(Path(args.recipe), args.rollouts, args.every, args.concurrency,
                                      args.trace_heap))))
    return 0
