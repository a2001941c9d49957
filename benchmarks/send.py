"""Producer CPU a record inside a transaction: AIOKafkaProducer.send() per record vs streams.batched_send.

    python -m benchmarks send [--quick] [--records N] [--value-bytes B] [--reps R]

The same N keyed records (groups of 4 share a key, as a group's training records do) are written into a
12-partition topic in one transaction each way, alternated R times; the figure is the process CPU from the
first record handed over until the commit returned, per record (best of R), and the wall time.
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

from benchmarks._shared import kafka_for, report


async def _one(kw: dict[str, Any], topic: str, records: list[tuple[bytes, bytes]], batched: bool) -> tuple[float, float]:
    from aiokafka import AIOKafkaProducer

    from streams.batched_send import PartitionBatches
    from streams.transactions import PRODUCER_OPTIONS

    prod = AIOKafkaProducer(**kw, **PRODUCER_OPTIONS, transactional_id=f"bench-send-{uuid.uuid4().hex[:8]}",
                            linger_ms=5)
    await prod.start()
    try:
        await prod.partitions_for(topic)
        headers = [("event_type", b"training_record"), ("schema_version", b"1"), ("run_id", b"bench")]
        c0, t0 = time.process_time(), time.perf_counter()
        await prod.begin_transaction()
        if batched:
            batches = PartitionBatches(prod, PRODUCER_OPTIONS["max_request_size"])
            for key, value in records:
                await batches.add(topic, value, key=key, headers=headers)
            await batches.send()
            await batches.written()
        else:
            futs = [await prod.send(topic, value, key=key, headers=headers) for key, value in records]
            for f in futs:
                await f
        await prod.commit_transaction()
        return time.process_time() - c0, time.perf_counter() - t0
    finally:
        await prod.stop()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from streams import topics

    settings = kafka_for("send")
    kw = settings.client_kwargs()
    topic = topics.Topic("send-bench", 12)
    await topics.create_topics(kw, [topic])
    n = 2048 if args.quick else args.records
    value = b"\x01" * args.value_bytes
    records = [(f"group-{i // 4:07d}".encode(), value) for i in range(n)]
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.reps):
        for name, batched in (("send", False), ("batched", True)):
            cpu, wall = await _one(kw, topic.name, records, batched)
            if name not in best or cpu < best[name][0]:
                best[name] = (cpu, wall)
    out: dict[str, Any] = {"benchmark": "send", "records": n, "value_bytes": args.value_bytes, "reps": args.reps}
    for name, (cpu, wall) in best.items():
        out[name] = {"cpu_us_per_record": round(cpu / n * 1e6, 2), "wall_s": round(wall, 3)}
    out["cpu_ratio_batched_vs_send"] = round(best["batched"][0] / best["send"][0], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks send", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2,048 records")
    ap.add_argument("--records", type=int, default=8192)
    ap.add_argument("--value-bytes", type=int, default=2500, help="bytes a record (a scored rollout: ~2.5 KB)")
    ap.add_argument("--reps", type=int, default=3)
    return report(run, ap.parse_args(argv))
