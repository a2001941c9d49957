"""`rollout demo`: a minimal end-to-end check (to be replaced by the real pipeline demo).

Ensures a broker (ROLLOUT_BOOTSTRAP_SERVERS, else the local one), creates the pipeline topics and
the demo topic, writes 5 small JSON messages in one Kafka transaction, and reads them back with a
read_committed consumer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="start Kafka if needed, create topics, round-trip 5 transactional messages")
    p.add_argument("-n", "--count", type=int, default=5)
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from streams.config import KafkaSettings, ensure_broker

    settings = KafkaSettings.from_env()
    where = "configured cluster" if settings.external else "local broker"
    settings = settings.with_bootstrap(ensure_broker(settings))
    print(f"Kafka: {where} at {settings.bootstrap}")
    asyncio.run(_demo(settings, args.count))
    return 0


async def _demo(settings, count: int) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    from streams import topics

    created = await topics.create_topics(settings.admin_kwargs(), [*topics.TOPICS.values(), topics.DEMO])
    print(f"topics: {sum(v == 'created' for v in created.values())} created, "
          f"{sum(v == 'exists' for v in created.values())} already existed")

    run_id = uuid.uuid4().hex[:8]
    producer = AIOKafkaProducer(**settings.client_kwargs(
        transactional_id=f"rollout-demo-{run_id}", enable_idempotence=True,
        value_serializer=lambda v: json.dumps(v).encode(), key_serializer=str.encode))
    await producer.start()
    try:
        async with producer.transaction():
            metas = []
            for i in range(count):
                msg = {"run": run_id, "seq": i, "ts": time.time(), "text": f"hello {i}"}
                metas.append(await (await producer.send(topics.DEMO.name, msg, key=f"{run_id}-{i}")))
    finally:
        await producer.stop()
    print(f"produced {count} messages to {topics.DEMO.name} in one transaction "
          f"(partitions {sorted({m.partition for m in metas})})")

    consumer = AIOKafkaConsumer(**settings.client_kwargs(isolation_level="read_committed", enable_auto_commit=False))
    await consumer.start()
    try:
        starts: dict[TopicPartition, int] = {}
        for m in metas:
            tp = TopicPartition(m.topic, m.partition)
            starts[tp] = min(starts.get(tp, m.offset), m.offset)
        consumer.assign(list(starts))
        for tp, off in starts.items():
            consumer.seek(tp, off)
        got = []
        deadline = time.monotonic() + 30
        while len(got) < count and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=1000)
            for recs in batch.values():
                got += [json.loads(r.value) for r in recs if json.loads(r.value).get("run") == run_id]
    finally:
        await consumer.stop()
    for m in sorted(got, key=lambda m: m["seq"]):
        print(f"  consumed {json.dumps(m)}")
    if len(got) != count:
        from streams.config import KafkaError

        raise KafkaError(f"demo consumed {len(got)} of {count} messages")
    print(f"ok: {count} committed messages read back with isolation_level=read_committed")
