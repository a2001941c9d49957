"""`rollout status`: per-service consumer lag and throughput, from the broker alone.

Lag = end offset (read_committed LSO) - committed offset of the service's consumer group, summed over
its input partitions; throughput = committed-offset advance per second over a short sampling window.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

async def service_lag(client_kwargs: dict[str, Any], *, sample_s: float = 1.0, settings: Any = None
                      ) -> list[dict[str, Any]]:
    """``settings`` (``ServiceSettings``): where the services read their inputs (a derived run: its source's)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient

    from consumers.registry import SERVICES

    admin = AIOKafkaAdminClient(**client_kwargs)
    await admin.start()
    cons = AIOKafkaConsumer(**client_kwargs, group_id=None, isolation_level="read_committed")
    await cons.start()
    try:
        existing = set(await admin.list_topics())
        groups = {g[0] if isinstance(g, tuple) else g for g in await admin.list_consumer_groups()}

        async def snapshot() -> dict[str, dict[str, int]]:
            out = {}
            for svc, service in SERVICES.items():
                group = service.group_id
                names = [(n, t) for t in service.inputs
                         for n in (settings.reads(t) if settings is not None else (t.name,))]
                tps = [TopicPartition(n, p) for n, t in names for p in range(t.partitions) if n in existing]
                if not tps or (service.runs_when is not None and group not in groups):
                    continue  # a service only some runs start (the reference), never started here: no lag to owe
                ends = await cons.end_offsets(tps)
                committed = await admin.list_consumer_group_offsets(group) if group in groups else {}
                out[svc] = {"end": sum(ends.values()),
                            "committed": sum(committed[tp].offset for tp in tps if tp in committed and committed[tp].offset >= 0),
                            "lag": sum(max(0, ends[tp] - (committed[tp].offset if tp in committed else 0)) for tp in tps),
                            "group": group, "active": group in groups}
            return out

        a = await snapshot()
        t0 = time.monotonic()
        await asyncio.sleep(sample_s)
        b = await snapshot()
        dt = time.monotonic() - t0
        rows = []
        for svc in b:
            rows.append({"service": svc, "group": b[svc]["group"], "lag": b[svc]["lag"],
                         "committed": b[svc]["committed"], "end": b[svc]["end"],
                         "throughput_per_s": round((b[svc]["committed"] - a.get(svc, b[svc])["committed"]) / dt, 1),
                         "group_exists": b[svc]["active"]})
        return rows
    finally:
        await cons.stop()
        await admin.close()


def add_args(p: Any) -> None:
    p.add_argument("--json", action="store_true", help="one JSON object per service")
    p.add_argument("--sample-s", type=float, default=1.0)


def cmd_status(args: Any) -> int:
    from streams.config import KafkaSettings

    settings = KafkaSettings.from_env()
    rows = asyncio.run(service_lag(settings.client_kwargs(), sample_s=args.sample_s))
    if getattr(args, "json", False):
        for r in rows:
            print(json.dumps(r))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title="rollout services")
    for col in ("service", "group", "lag", "committed", "end", "throughput/s"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["service"], r["group"], str(r["lag"]), str(r["committed"]), str(r["end"]),
                  str(r["throughput_per_s"]))
    Console().print(t)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("status", help="per-service consumer lag and throughput")
    add_args(p)
    p.set_defaults(func=cmd_status)
