"""Rollout -> TrainerBatch through verifier, credit and batcher (exactly-once) vs a raw 3-hop aiokafka pipe.

    python -m benchmarks pipeline [--quick] [--rollouts N] [--tokens T] [--latency-rollouts M] [--layout L] [--rounds R]
                                  [--metrics off|on|both]

Broker: ROLLOUT_BOOTSTRAP_SERVERS, else the local one (streams.local_broker). Each run uses fresh topics
(a random ROLLOUT_TOPIC_PREFIX). ``--layout`` decides where the workers run, the same for both sides:

* ``process`` (default): the three services (one ``System``) and the raw pipe's three hops each share this one
  event loop, so they get the same CPU and the same garbage-collector pace (``consumers.runner.tune_gc``,
  ROLLOUT_GC_THRESHOLD: it would speed the raw pipe up too); the broker gets the rest of the machine.
* ``processes``: each service and each raw hop in its own forked process, as compose deploys the services;
  their start-up (topics check, clients, group join) is inside the clock on both sides, which starts at the fork.

* throughput: N single-turn arithmetic rollouts (groups of 4, T completion tokens each, steps + rollouts)
  are written first, then the services start; the clock runs from start until every expected record is
  in a TrainerBatch read back read_committed. N defaults to 4,096 (768 with --quick): whole batches of 64,
  so the clock does not end on the partial-batch flush timer (``--flush-after-s``, 0.5 s here), which
  measures a configured wait, not speed (runs before 2026-11-24 used 4,000 and 800 and included it). The
  raw pipe moves the same step and rollout bytes through three consume->produce hops (plain aiokafka, no
  transactions, no decoding).
* latency: M more rollouts are written at the same steady rate (--latency-rate, below capacity) to both; latency
  is batch write time - rollout write time (broker CreateTime of each message), p50/p99; for the raw pipe,
  hop-3 write time - source write time. For the services, each hop's p50 too (rollout -> score -> training
  record -> batch, from the write times of each rollout's outputs).
* metrics (``--metrics``): the services serve their Prometheus endpoints (ROLLOUT_METRICS_PORT, streams.metrics) or
  not (off, the default); ``both`` runs the services twice a round, metrics off and on in turns (the order swaps each
  round), and reports ``services_cpu_ms_per_rollout`` of each and their ratio. The endpoints are scraped once after
  each run with metrics on (a check that they counted: ``metrics_scraped_records_in``), outside the CPU clock.
* refusals: stale/cross-family refusals are counted from the dead-letter topic (reported, expected 0 here:
  the arena paces admission; refusal is the last line of defence).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from functools import partial
from typing import Any

from streams.settings import FETCH_OPTIONS, MAX_MESSAGE_BYTES


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def _messages(n_rollouts: int, tokens: int, start: int = 0):
    from consumers import testing
    from streams import serde, topics

    msgs = []  # (topic, key, value, headers, rollout_id or None)
    for g in range(start // 4, (start + n_rollouts) // 4):
        for steps, ro in testing.arithmetic_group(f"g{g:07d}", 4, n_tokens=tokens):
            for st in steps:
                k, v, h = serde.to_message(st)
                msgs.append((topics.STEPS.name, k, v, h, None))
            k, v, h = serde.to_message(ro)
            msgs.append((topics.ROLLOUTS.name, k, v, h, ro.rollout_id))
    return msgs


async def _produce(kw, msgs, *, rate_per_s: float | None = None, topic_map=None, chunk: int = 200) -> dict[str, int]:
    """Write messages (transactionally, like the arena); return rollout_id -> write timestamp (ms)."""
    from aiokafka import AIOKafkaProducer

    prod = AIOKafkaProducer(**kw, transactional_id=f"bench-seed-{uuid.uuid4().hex[:6]}", enable_idempotence=True,
                            linger_ms=5, max_request_size=MAX_MESSAGE_BYTES, max_batch_size=1024 * 1024)
    await prod.start()
    written: dict[str, int] = {}
    t0 = time.monotonic()
    try:
        for i in range(0, len(msgs), chunk):
            part = msgs[i:i + chunk]
            if rate_per_s:
                due = t0 + sum(1 for m in msgs[:i] if m[4]) / rate_per_s
                await asyncio.sleep(max(0.0, due - time.monotonic()))
            async with prod.transaction():
                futs = []
                for topic, k, v, h, rid in part:
                    t = topic_map[topic] if topic_map else topic
                    h2 = h + [("src_ts", str(int(time.time() * 1000)).encode())]
                    futs.append((rid, await prod.send(t, v, key=k, headers=h2)))
                for rid, f in futs:
                    md = await f
                    if rid:
                        written[rid] = md.timestamp
    finally:
        await prod.stop()
    return written


async def _batches_until(kw, n_records: int, timeout_s: float, written: dict[str, int] | None = None):
    """Read trainer batches until n_records are batched; return (t_done, latencies_ms, batches, tokens)."""
    from aiokafka import AIOKafkaConsumer

    from schemas import codec
    from schemas.events import TrainerBatch
    from streams import topics

    c = AIOKafkaConsumer(topics.TRAINER_BATCHES.name, **kw, group_id=None, isolation_level="read_committed",
                         auto_offset_reset="earliest", max_partition_fetch_bytes=64 * 1024 * 1024)
    await c.start()
    seen, lat, batches, toks = set(), [], 0, 0
    first: list[float] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(seen) < n_records and time.monotonic() < deadline:
            got = await c.getmany(timeout_ms=200)
            for recs in got.values():
                for r in recs:
                    # ids from the frame's JSON only: this reader shares the services' CPU, and validating
                    # every batch here (which the trainer does) cost ~7% of their time; the raw pipe's reader
                    # only counts messages
                    if codec.peek(r.value)[0] != TrainerBatch.EVENT_TYPE:
                        continue
                    b = codec.header(r.value)
                    if not first:
                        first.append(time.monotonic())
                    batches += 1
                    toks += b["completion_tokens"]
                    for x in b["records"]:
                        seen.add(x["record_id"])
                        if written and x["rollout_id"] in written:
                            lat.append(r.timestamp - written[x["rollout_id"]])
    finally:
        await c.stop()
    _batches_until.first = first[0] if first else None  # type: ignore[attr-defined]
    return time.monotonic(), lat, batches, toks, len(seen)


async def _hops(kw, written: dict[str, int]) -> dict[str, float]:
    """Where the latency goes: p50 of each hop (write time of a rollout's output in the next topic minus write time
    of its input) over the rollouts of the latency phase."""
    from aiokafka import AIOKafkaConsumer

    from schemas import codec
    from streams import topics

    at: dict[str, dict[str, int]] = {rid: {"rollouts": ts} for rid, ts in written.items()}
    for topic in (topics.SCORES, topics.TRAINING_RECORDS, topics.TRAINER_BATCHES):
        c = AIOKafkaConsumer(topic.name, **kw, group_id=None, isolation_level="read_committed",
                             auto_offset_reset="earliest", max_partition_fetch_bytes=64 * 1024 * 1024)
        await c.start()
        try:
            while got := await c.getmany(timeout_ms=1000):
                for recs in got.values():
                    for r in recs:
                        e = codec.decode(r.value)
                        for rid in ([x.rollout_id for x in e.records] if topic is topics.TRAINER_BATCHES
                                    else [getattr(e, "rollout_id", None)]):
                            if rid in at:
                                at[rid].setdefault(topic.key, r.timestamp)
        finally:
            await c.stop()
    chain = ["rollouts", topics.SCORES.key, topics.TRAINING_RECORDS.key, topics.TRAINER_BATCHES.key]
    return {f"{a}->{b}": _pct([t[b] - t[a] for t in at.values() if a in t and b in t], 0.5)
            for a, b in zip(chain, chain[1:])}


async def _refusals(kw) -> dict[str, int]:
    from aiokafka import AIOKafkaConsumer

    from schemas import codec
    from streams import topics

    c = AIOKafkaConsumer(topics.DEAD_LETTERS.name, **kw, group_id=None, isolation_level="read_committed",
                         auto_offset_reset="earliest")
    await c.start()
    out: dict[str, int] = {}
    try:
        got = await c.getmany(timeout_ms=1500)
        for recs in got.values():
            for r in recs:
                et = codec.decode(r.value).error_type
                out[et] = out.get(et, 0) + 1
    finally:
        await c.stop()
    return out


class _Forked:
    """Workers each in their own forked process (``--layout processes``): ``run(stop)`` is awaited in the child
    until SIGTERM sets ``stop``; what it returns comes back from ``stop_all``."""

    def __init__(self) -> None:
        import multiprocessing

        self._ctx = multiprocessing.get_context("fork")
        self._children: dict[str, tuple[Any, Any]] = {}

    def start(self, name: str, run: Callable[[asyncio.Event], Awaitable[dict[str, Any]]]) -> None:
        parent_end, child_end = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=self._child, args=(run, child_end), name=name, daemon=True)
        proc.start()
        child_end.close()
        self._children[name] = (proc, parent_end)

    @staticmethod
    def _child(run: Callable[[asyncio.Event], Awaitable[dict[str, Any]]], conn: Any) -> None:
        import signal

        async def main() -> dict[str, Any]:
            stop = asyncio.Event()
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
            return await run(stop)

        conn.send(asyncio.run(main()))

    def cpu_s(self) -> float:
        """CPU seconds the children have used so far (utime + stime from /proc)."""
        from benchmarks._shared import cpu_s

        return sum(cpu_s(proc.pid) for proc, _ in self._children.values())

    async def stop_all(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, (proc, conn) in self._children.items():
            proc.terminate()
            out[name] = await asyncio.to_thread(conn.recv) if await asyncio.to_thread(conn.poll, 60) else {}
            await asyncio.to_thread(proc.join, 10)
        return out


class _Tasks:
    """The same workers as tasks of this event loop (``--layout process``): ``run(stop)`` until ``stop_all``."""

    def __init__(self) -> None:
        self._stop = asyncio.Event()
        self._tasks: dict[str, asyncio.Task] = {}

    def start(self, name: str, run: Callable[[asyncio.Event], Awaitable[dict[str, Any]]]) -> None:
        self._tasks[name] = asyncio.create_task(run(self._stop), name=name)

    async def stop_all(self) -> dict[str, dict[str, Any]]:
        self._stop.set()
        done = await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        return {name: r if isinstance(r, dict) else {} for name, r in zip(self._tasks, done)}


async def _service(name: str, settings: Any, kw: dict[str, Any], stop: asyncio.Event) -> dict[str, Any]:
    """One service until ``stop`` (a child of ``--layout processes``)."""
    from consumers.runner import System

    async with System((name,), settings, kw) as system:
        system.processors[name].tick_s = 0.2
        await stop.wait()
        return {"transactions": system.processors[name].stats.transactions}


def _free_metrics_base() -> int:
    """A base port whose services' ports (base + 10, 11, 12: verifier, credit, batcher) are free now."""
    import random
    import socket

    from streams.metrics import SERVICE_OFFSET

    for _ in range(100):
        base = random.randrange(20000, 40000)
        try:
            for off in range(SERVICE_OFFSET, SERVICE_OFFSET + 3):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + off))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports for the metrics endpoints")


async def _scrape(base: int, names: tuple[str, ...]) -> float:
    """Sum of rollout_records_in over the services' endpoints (0.0 if none answered)."""
    import urllib.request

    from consumers.registry import SERVICES
    from streams.metrics import SERVICE_OFFSET

    def get(port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()

    total = 0.0
    for name in names:
        text = await asyncio.to_thread(get, base + SERVICE_OFFSET + list(SERVICES).index(name))
        total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("rollout_records_in_total{"))
    return total


async def bench_services(kw, n: int, tokens: int, m: int, batch_records: int, rate: float,
                         layout: str = "process", metrics: bool = False) -> dict[str, Any]:
    os.environ["ROLLOUT_TOPIC_PREFIX"] = f"bench{uuid.uuid4().hex[:6]}."
    metrics_base = _free_metrics_base() if metrics else 0
    os.environ["ROLLOUT_METRICS_PORT"] = str(metrics_base)  # 0: no endpoint, nothing counted
    from consumers import testing
    from consumers.runner import System
    from consumers.settings import ServiceSettings
    from streams import serde, topics

    msgs = _messages(n, tokens)
    await topics.create_topics(kw)
    from aiokafka import AIOKafkaProducer

    p = AIOKafkaProducer(**kw)
    await p.start()
    k, v, h = serde.to_message(testing.revision(0))
    await p.send_and_wait(topics.POLICY_REVISIONS.name, v, key=k, headers=h)
    await p.stop()
    await _produce(kw, msgs)
    settings = ServiceSettings(family=testing.FAMILY, batch_records=batch_records, flush_after_s=0.5)
    names = ("verifier", "credit", "batcher")
    forked = _Forked() if layout == "processes" else None
    async with AsyncExitStack() as stack:
        if forked is None:
            system = await stack.enter_async_context(System(names, settings, kw))
            for proc in system.processors.values():
                proc.tick_s = 0.2
        t0, c0 = time.monotonic(), time.process_time()
        if forked is not None:
            for name in names:
                forked.start(name, partial(_service, name, settings, kw))
        t1, _, batches, toks, nrec = await _batches_until(kw, n, 600)
        # the services and the batch reader: this process, and the services' own processes if forked
        cpu = time.process_time() - c0 + (forked.cpu_s() if forked else 0.0)
        tf = _batches_until.first  # type: ignore[attr-defined]
        thr = {"rollouts": nrec, "seconds": round(t1 - t0, 3), "rollouts_per_s": round(nrec / (t1 - t0), 1),
               "completion_tokens_per_s": round(toks / (t1 - t0)), "batches": batches,
               "steady_seconds": round(t1 - tf, 3), "steady_rollouts_per_s": round(nrec / (t1 - tf), 1),
               "steady_completion_tokens_per_s": round(toks / (t1 - tf)),
               "process_cpu_s": round(cpu, 3), "process_cpu_ms_per_rollout": round(cpu / max(nrec, 1) * 1000, 3)}
        lat: dict[str, Any] = {}
        if m:
            more = _messages(m, tokens, start=n)
            feeder = asyncio.create_task(_produce(kw, more, rate_per_s=rate, chunk=8))
            reader = asyncio.create_task(_batches_until(kw, n + m, 600))
            written = await feeder
            _, _, _, _, _ = await reader
            # latencies from the batches (read again, now that the write times are known)
            _, lats, _, _, _ = await _batches_until(kw, n + m, 60, written)
            lat = {"rate_rollouts_per_s": round(rate, 1), "p50_ms": _pct(lats, 0.5), "p99_ms": _pct(lats, 0.99),
                   "samples": len(lats), "hops_p50_ms": await _hops(kw, written)}
        ref = await _refusals(kw)
        scraped = await _scrape(metrics_base, names) if metrics_base else None
        if forked is None:
            txns = {name: proc.stats.transactions for name, proc in system.processors.items()}
        else:
            txns = {name: stats.get("transactions") for name, stats in (await forked.stop_all()).items()}
    return {"throughput": thr, "latency": lat, "dead_letters": ref, "transactions": txns, "metrics": metrics,
            "metrics_scraped_records_in": scraped}


async def bench_raw(kw, n: int, tokens: int, m: int, rate: float, layout: str = "process") -> dict[str, Any]:
    """Same step+rollout bytes through 3 plain consume->produce hops (at-least-once, no decoding)."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from streams import topics

    prefix = f"raw{uuid.uuid4().hex[:6]}."
    os.environ["ROLLOUT_TOPIC_PREFIX"] = prefix
    hops = [topics.Topic(f"hop{i}", 12, {"max.message.bytes": str(MAX_MESSAGE_BYTES)}) for i in range(1, 4)]
    await topics.create_topics(kw, [topics.STEPS, topics.ROLLOUTS, *hops])
    msgs = _messages(n, tokens)
    await _produce(kw, msgs)
    total = len(msgs)

    async def hop(src: list[str], dst: str, gid: str, stop: asyncio.Event) -> dict[str, Any]:
        c = AIOKafkaConsumer(*src, **kw, group_id=gid, auto_offset_reset="earliest", enable_auto_commit=True,
                             **FETCH_OPTIONS)  # as the services fetch
        p = AIOKafkaProducer(**kw, linger_ms=5, max_request_size=MAX_MESSAGE_BYTES, max_batch_size=1024 * 1024,
                             enable_idempotence=True)
        await c.start()
        await p.start()
        try:
            while not stop.is_set():
                got = await c.getmany(timeout_ms=200, max_records=2000)
                futs = [await p.send(dst, r.value, key=r.key, headers=list(r.headers), partition=r.partition)
                        for recs in got.values() for r in recs]
                if futs:
                    await asyncio.gather(*futs)
        finally:
            await c.stop()
            await p.stop()
        return {}

    c = AIOKafkaConsumer(hops[2].name, **kw, group_id=None, auto_offset_reset="earliest",
                         max_partition_fetch_bytes=16 * 1024 * 1024)
    await c.start()
    runs = {"h1": partial(hop, [topics.STEPS.name, topics.ROLLOUTS.name], hops[0].name, prefix + "h1"),
            "h2": partial(hop, [hops[0].name], hops[1].name, prefix + "h2"),
            "h3": partial(hop, [hops[1].name], hops[2].name, prefix + "h3")}
    t0 = time.monotonic()
    workers = _Forked() if layout == "processes" else _Tasks()
    for name, run in runs.items():
        workers.start(name, run)
    count, nbytes, lats = 0, 0, []
    tf = None
    try:
        while count < total and time.monotonic() - t0 < 600:
            got = await c.getmany(timeout_ms=200)
            for recs in got.values():
                if recs and tf is None:
                    tf = time.monotonic()
                count += len(recs)
                nbytes += sum(len(r.value) for r in recs)
        t1 = time.monotonic()
        thr = {"messages": count, "seconds": round(t1 - t0, 3), "rollouts_per_s": round(n / (t1 - t0), 1),
               "completion_tokens_per_s": round(n * tokens / (t1 - t0)), "MB_per_s": round(nbytes / (t1 - t0) / 1e6, 1),
               "steady_seconds": round(t1 - tf, 3), "steady_rollouts_per_s": round(n / (t1 - tf), 1),
               "steady_completion_tokens_per_s": round(n * tokens / (t1 - tf))}
        lat: dict[str, Any] = {}
        if m:
            more = _messages(m, tokens, start=n)
            feeder = asyncio.create_task(_produce(kw, more, rate_per_s=rate, chunk=8))
            want = total + len(more)
            while count < want and time.monotonic() - t1 < 600:
                got = await c.getmany(timeout_ms=200)
                for recs in got.values():
                    for r in recs:
                        count += 1
                        src = dict(r.headers).get("src_ts")
                        if src and dict(r.headers).get("event_type") == b"rollout":
                            lats.append(r.timestamp - int(src))
            await feeder
            lat = {"rate_rollouts_per_s": round(rate, 1), "p50_ms": _pct(lats, 0.5), "p99_ms": _pct(lats, 0.99),
                   "samples": len(lats)}
    finally:
        await c.stop()
        await workers.stop_all()
    return {"throughput": thr, "latency": lat}


def _summary(raw: dict[str, Any], svc: dict[str, Any], args: argparse.Namespace, n: int, m: int,
             svc_on: dict[str, Any] | None = None) -> dict[str, Any]:
    """The figures of one round; ``svc_on``: the services' run with metrics on (``--metrics both``)."""
    ratio = raw["throughput"]["rollouts_per_s"] / max(svc["throughput"]["rollouts_per_s"], 1e-9)
    steady_ratio = raw["throughput"]["steady_rollouts_per_s"] / max(svc["throughput"]["steady_rollouts_per_s"], 1e-9)
    refused = sum(v for k, v in svc["dead_letters"].items() if k in ("StaleRecordError", "CrossFamilyMixError"))
    return {
        "benchmark": "pipeline", "layout": args.layout, "quick": args.quick, "rollouts": n, "latency_rollouts": m,
        "completion_tokens_per_rollout": args.tokens, "batch_records": args.batch_records,
        "services_rollouts_per_s": svc["throughput"]["rollouts_per_s"],
        "services_completion_tokens_per_s": svc["throughput"]["completion_tokens_per_s"],
        "services_p50_ms": svc["latency"].get("p50_ms"), "services_p99_ms": svc["latency"].get("p99_ms"),
        "services_hops_p50_ms": svc["latency"].get("hops_p50_ms"),
        "raw_rollouts_per_s": raw["throughput"]["rollouts_per_s"],
        "raw_completion_tokens_per_s": raw["throughput"]["completion_tokens_per_s"],
        "raw_p50_ms": raw["latency"].get("p50_ms"), "raw_p99_ms": raw["latency"].get("p99_ms"),
        "raw_over_services": round(ratio, 2), "raw_over_services_steady": round(steady_ratio, 2),
        "services_steady_completion_tokens_per_s": svc["throughput"]["steady_completion_tokens_per_s"], "target_ratio_max": 2.0, "target_tokens_per_s": 500000,
        "latency_rate_rollouts_per_s": args.latency_rate, "refused_records": refused, "dead_letters": svc["dead_letters"],
        "commit_interval_ms": int(os.environ.get("ROLLOUT_COMMIT_INTERVAL_MS") or 0),
        "services_transactions": svc["transactions"],
        "services_cpu_ms_per_rollout": svc["throughput"]["process_cpu_ms_per_rollout"], "load_avg_1m": round(os.getloadavg()[0], 1),
        "metrics": args.metrics, **_metrics_figures(svc, svc_on),
        "machine": f"{os.cpu_count()} cpu, {platform.python_version()}",
        "detail": {"services": svc, "raw": raw, **({"services_metrics_on": svc_on} if svc_on else {})},
    }


def _metrics_figures(svc: dict[str, Any], svc_on: dict[str, Any] | None) -> dict[str, Any]:
    if svc_on is None:
        return {"metrics_scraped_records_in": svc.get("metrics_scraped_records_in")}
    off, on = (s["throughput"]["process_cpu_ms_per_rollout"] for s in (svc, svc_on))
    return {"services_cpu_ms_per_rollout_metrics_off": off, "services_cpu_ms_per_rollout_metrics_on": on,
            "metrics_cpu_ratio": round(on / off, 3) if off else None,
            "services_p50_ms_metrics_on": svc_on["latency"].get("p50_ms"),
            "services_rollouts_per_s_metrics_on": svc_on["throughput"]["rollouts_per_s"],
            "metrics_scraped_records_in": svc_on.get("metrics_scraped_records_in")}


def _medians(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several rounds (raw pipe, then services, each round on fresh topics): every plain figure is the rounds'
    median, the rounds' own figures are listed, the rest is the last round's."""
    out = dict(outs[-1])
    for key, value in out.items():
        values = [o[key] for o in outs if o.get(key) is not None]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and values:
            out[key] = statistics.median(values)
    out["rounds"] = [{k: o[k] for k in (*ROUND_KEYS, *METRICS_KEYS) if k in o} for o in outs]
    out["detail"] = [o["detail"] for o in outs]
    return out


ROUND_KEYS = ("raw_over_services", "services_rollouts_per_s", "raw_rollouts_per_s", "services_p50_ms",
              "services_p99_ms", "services_cpu_ms_per_rollout")
METRICS_KEYS = ("services_cpu_ms_per_rollout_metrics_off", "services_cpu_ms_per_rollout_metrics_on",
                "metrics_cpu_ratio", "services_p50_ms_metrics_on")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks pipeline", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small run (about a minute)")
    ap.add_argument("--rollouts", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=512, help="completion tokens per rollout")
    ap.add_argument("--latency-rollouts", type=int, default=None)
    ap.add_argument("--batch-records", type=int, default=64)
    ap.add_argument("--latency-rate", type=float, default=300.0, help="rollouts/s offered in the latency phase")
    ap.add_argument("--layout", choices=("process", "processes"), default="process",
                    help="process (default): every service, and every raw hop, on this one event loop; processes: "
                         "each service and each raw hop in its own forked process, as compose deploys them")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of raw pipe then services, each on fresh topics; more than 1: every figure is the "
                         "rounds' median, and each round's ratio is listed (the raw pipe's own speed moves 2x "
                         "between minutes on a shared machine)")
    ap.add_argument("--commit-interval-ms", type=int, default=None,
                    help="the services' ROLLOUT_COMMIT_INTERVAL_MS (default: the environment's, else 0: commit "
                         "after every fetch); more: fewer, larger transactions, later outputs")
    ap.add_argument("--metrics", choices=("off", "on", "both"), default="off",
                    help="the services' Prometheus endpoints: off (default), on, or both: the services run twice a "
                         "round, off and on in turns, each with its own CPU per rollout")
    args = ap.parse_args(argv)
    if args.commit_interval_ms is not None:
        os.environ["ROLLOUT_COMMIT_INTERVAL_MS"] = str(args.commit_interval_ms)
    n = args.rollouts or (768 if args.quick else 4096)
    m = args.latency_rollouts if args.latency_rollouts is not None else (200 if args.quick else 800)
    n, m = n - n % 4, m - m % 4

    import logging

    logging.basicConfig(level=logging.ERROR)
    from streams.config import KafkaSettings, ensure_broker

    settings = KafkaSettings.from_env()
    settings = settings.with_bootstrap(ensure_broker(settings))
    kw = settings.client_kwargs()
    from consumers.runner import tune_gc
    from streams.settings import ProcessingSettings

    tune_gc(ProcessingSettings())  # before both sides, not only where System sets it for the services

    async def both(i: int):
        raw = await bench_raw(kw, n, args.tokens, m, args.latency_rate, args.layout)
        if args.metrics != "both":
            svc = await bench_services(kw, n, args.tokens, m, args.batch_records, args.latency_rate, args.layout,
                                       metrics=args.metrics == "on")
            return raw, svc, None
        runs = {}
        for on in ((False, True) if i % 2 == 0 else (True, False)):
            runs[on] = await bench_services(kw, n, args.tokens, m, args.batch_records, args.latency_rate,
                                            args.layout, metrics=on)
        return raw, runs[False], runs[True]

    outs = []
    for i in range(args.rounds):
        raw, svc, svc_on = asyncio.run(both(i))
        outs.append(_summary(raw, svc, args, n, m, svc_on))
        if args.rounds > 1:
            o = outs[-1]
            print(f"round {i + 1}: raw / services {o['raw_over_services']} (services {o['services_rollouts_per_s']}, "
                  f"raw {o['raw_rollouts_per_s']} rollouts/s), p50 {o['services_p50_ms']} ms, cpu "
                  f"{o['services_cpu_ms_per_rollout']} ms/rollout"
                  + (f", metrics on: cpu {o['services_cpu_ms_per_rollout_metrics_on']} ms/rollout, p50 "
                     f"{o['services_p50_ms_metrics_on']} ms" if svc_on else "")
                  + f", load {o['load_avg_1m']}", flush=True)
    out = outs[0] if len(outs) == 1 else _medians(outs)
    print(json.dumps(out))
    return 0
