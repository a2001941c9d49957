"""What the Kafka benchmarks share: their own topics on the configured (or local) cluster, and the closing
JSON line. Not a benchmark itself (``python -m benchmarks`` skips modules whose name starts with ``_``)."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any


def kafka_for(benchmark: str) -> Any:  # -> streams.config.KafkaSettings
    """ROLLOUT_BOOTSTRAP_SERVERS, else the local broker (started if needed), with topics of this run's own
    (prefix ``bench.<benchmark>.<random>.``, set in the environment, where streams.topics reads it)."""
    os.environ["ROLLOUT_TOPIC_PREFIX"] = f"bench.{benchmark}.{uuid.uuid4().hex[:8]}."
    from streams.config import KafkaSettings, ensure_broker

    settings = KafkaSettings.from_env()
    if not settings.external:
        settings = settings.with_bootstrap(ensure_broker(settings))
    return settings


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def report(run: Callable[[Any], Awaitable[dict]], args: Any) -> int:
    """``run(args)``'s figures, with --quick and the wall time, as the one JSON line a benchmark ends with."""
    t0 = time.perf_counter()
    out = asyncio.run(run(args))
    out["quick"] = args.quick
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return 0


def arithmetic_question(rng: Any) -> str:
    """A question shaped like the demo's (``random.Random`` draws its operands)."""
    return f"What is {rng.randint(1, 99)} + {rng.randint(1, 99)}? Answer with a number."


async def demo_chat(http: Any, url: str, question: str, temperature: float) -> None:
    """One chat request as the demo's episodes send it to vLLM (16 tokens, logprobs) to the model served as "m"."""
    r = await http.post(url + "/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": question}], "max_tokens": 16,
        "temperature": temperature, "logprobs": True})
    r.raise_for_status()


async def timed_into(out: dict, name: str, *calls: Awaitable[Any], digits: int = 2) -> None:
    """``calls`` at once; their wall seconds appended to ``out[name]``."""
    t0 = time.perf_counter()
    await asyncio.gather(*calls)
    out.setdefault(name, []).append(round(time.perf_counter() - t0, digits))
