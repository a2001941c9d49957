"""Where one batcher saturates: TrainingRecords offered at rising rates to the real batcher (one partition, one
exactly-once service), what it batches per second, against a plain consume of the same topic.

    python -m benchmarks saturation [--quick] [--tokens 256,1024] [--rates 500,1000,...] [--level-s S]
                                    [--prompt-tokens P] [--batch-records B] [--backlog N] [--level-mb M]

Broker: ROLLOUT_BOOTSTRAP_SERVERS, else the local one; fresh topics for each record size (deleted at the end).
The training-records and trainer-batches topics have one partition and one batcher builds every step
(``streams.topics``): these are the pipeline's single-partition stages (the trainer's speed is its GPU's; credit
and the services before it have 12 partitions and scale out). For each record size (completion tokens, after
``--prompt-tokens`` prompt tokens), with revision 0 published as the batcher's target:

* drain: ``--backlog`` records are written first; a plain aiokafka consume of them (read_committed, the services'
  fetch sizes) counts them (transport), then decodes each (``schemas.codec.decode``, as the batcher does); then the
  batcher (``python -m consumers serve batcher``: the production runner, its own process, production settings but
  the batch size) is started and batches them all; its rate is first batch -> last batch (broker timestamps);
* load: records are offered at each ``--rates`` level for ``--level-s`` seconds (fewer if a level would write
  more than ``--level-mb``), by a transactional producer in this process (a transaction each 100 ms, as the
  credit service writes them). batched/s: records in batches stamped (broker time) from 1 s after the level's
  start to its end; achieved/s: the level's records over the time until the last of them was batched (behind:
  the seconds after the writing stopped); lag: the batcher group's (``consumers.status``) when the writing
  stopped. A level is *saturated* when achieved/s was under 90% of written/s (its backlog grew; 0.5 s of grace
  for the last batch's trip), and the levels stop there (or at the first the producer itself could not offer:
  written/s under 90% of offered; this process's CPU, on a shared machine, is then the limit). CPU% is of one
  core: the batcher's
  process, this process (producer and batch reader) and the local broker's; us/rec: the batcher's CPU
  microseconds per record it batched; wait% is the time the batcher's threads were ready to run but had no
  core (a starved batcher, not an idle one).
* batch path: the TrainerBatch event of ``--batch-records`` records of that size (bytes), written to and read
  back from a one-partition topic configured as trainer-batches (plain producer, acks=all; a plain consume) and
  decoded, as the trainer does: what one partition carries, in batches/s and the records and tokens in them.

Records are drawn in turn from a pool of distinct encoded records (``POOL`` of them, far more than a batch), so
the producer's cost is a send, not building events; record ids repeat across pool passes, never inside a batch.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

from benchmarks._shared import cpu_s, kafka_for, report

POOL = 4096
TICK_S = 0.1
WARM_S = 1.0
GRACE_S = 0.5
CATCH_UP_S = 5.0
SATURATED = 0.9


def _pool(tokens: int, prompt: int, batch_records: int) -> list[tuple[bytes, bytes, list]]:
    """Distinct records, many batches' worth: a record id never comes back while it may still wait for a batch."""
    from consumers import testing
    from streams import serde

    return [serde.to_message(testing.training_record(i, n=tokens, prompt=prompt))
            for i in range(max(POOL, 4 * batch_records))]


class _Offer:
    """A transactional producer of the pool's records into training-records (its one partition)."""

    def __init__(self, kw: dict[str, Any], pool: list[tuple[bytes, bytes, list]]) -> None:
        from aiokafka import AIOKafkaProducer

        from streams.transactions import PRODUCER_OPTIONS

        self.pool = pool
        self.sent = 0
        self.prod = AIOKafkaProducer(**kw, **PRODUCER_OPTIONS, linger_ms=5,
                                     transactional_id=f"bench-saturation-{uuid.uuid4().hex[:8]}")

    async def _txn(self, n: int) -> None:
        from streams import topics
        from streams.batched_send import PartitionBatches
        from streams.transactions import PRODUCER_OPTIONS

        async with self.prod.transaction():
            batches = PartitionBatches(self.prod, PRODUCER_OPTIONS["max_request_size"])
            for i in range(self.sent, self.sent + n):
                k, v, h = self.pool[i % len(self.pool)]
                await batches.add(topics.TRAINING_RECORDS.name, v, key=k, headers=h, partition=0)
            await batches.send()
            await batches.written()
        self.sent += n

    async def backlog(self, n: int) -> None:
        for chunk in range(0, n, 500):
            await self._txn(min(500, n - chunk))

    async def rate(self, per_s: float, seconds: float) -> tuple[int, float]:
        """Offer ``per_s`` records/s for ``seconds`` (a transaction each tick, catching up at most a second's
        worth when behind): (records written, seconds it took)."""
        first, t0 = self.sent, time.monotonic()
        while (now := time.monotonic()) - t0 < seconds:
            due = int(per_s * (now - t0)) - (self.sent - first)
            if due > 0:
                await self._txn(min(due, max(1, int(per_s))))
            await asyncio.sleep(max(0.0, TICK_S - (time.monotonic() - now)))
        return self.sent - first, time.monotonic() - t0


class _BatchLog:
    """Every TrainerBatch as it is committed: (broker timestamp s, records)."""

    def __init__(self, kw: dict[str, Any]) -> None:
        from aiokafka import AIOKafkaConsumer

        from streams import topics
        from streams.settings import FETCH_OPTIONS

        self.batches: list[tuple[float, int]] = []
        self.consumer = AIOKafkaConsumer(topics.TRAINER_BATCHES.name, **kw, group_id=None,
                                         isolation_level="read_committed", auto_offset_reset="earliest",
                                         **FETCH_OPTIONS)
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.consumer.start()
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        from schemas import codec
        from schemas.events import TrainerBatch

        while True:
            for recs in (await self.consumer.getmany(timeout_ms=200)).values():
                for r in recs:
                    if codec.peek(r.value)[0] == TrainerBatch.EVENT_TYPE:  # ids only: no need to validate
                        self.batches.append((r.timestamp / 1000, len(codec.header(r.value)["records"])))

    @property
    def records(self) -> int:
        return sum(n for _, n in self.batches)

    def between(self, t0: float, t1: float) -> int:
        return sum(n for ts, n in self.batches if t0 <= ts <= t1)

    def reached(self, records: int) -> float:
        """The timestamp of the batch that brought the count to ``records``."""
        total = 0
        for ts, n in self.batches:
            total += n
            if total >= records:
                return ts
        raise ValueError(f"only {total} records batched")

    async def until(self, records: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.records < records:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.consumer.stop()


async def _consume(kw: dict[str, Any], n: int, decode: bool) -> dict[str, float]:
    """A plain read_committed consume of the first ``n`` training records, each decoded or only counted."""
    from aiokafka import AIOKafkaConsumer

    from schemas import codec
    from schemas.events import TrainingRecord
    from streams import topics
    from streams.settings import FETCH_OPTIONS

    c = AIOKafkaConsumer(topics.TRAINING_RECORDS.name, **kw, group_id=None, isolation_level="read_committed",
                         auto_offset_reset="earliest", **FETCH_OPTIONS)
    await c.start()
    try:
        await c.getmany(timeout_ms=1000, max_records=1)  # connected and positioned; that record is read again
        await c.seek_to_beginning()
        count = 0
        t0, c0 = time.monotonic(), time.process_time()
        while count < n and time.monotonic() - t0 < 120:
            for recs in (await c.getmany(timeout_ms=500)).values():
                for r in recs:
                    count += 1
                    if decode:
                        codec.decode(r.value, TrainingRecord)
        dt, cpu = time.monotonic() - t0, time.process_time() - c0
    finally:
        await c.stop()
    return {"records": count, "seconds": round(dt, 3), "records_per_s": round(count / dt),
            "cpu_pct": round(100 * cpu / dt)}


def _batcher(bootstrap: str, batch_records: int, log: Any) -> subprocess.Popen:
    """The batcher as production runs it, in its own process, under this run's topic prefix; its log to ``log``."""
    from consumers import testing

    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": bootstrap}
    return subprocess.Popen([sys.executable, "-m", "consumers", "serve", "batcher", "--family", testing.FAMILY,
                             "--batch-records", str(batch_records), "--metrics-port", "0", "--log-level", "WARNING"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def _last_warning(path: str) -> str:
    with open(path, errors="replace") as f:
        lines = [ln.strip() for ln in f if "WARNING" in ln or "ERROR" in ln]
    return lines[-1][:400] if lines else "(nothing logged)"


async def _lag(kw: dict[str, Any]) -> int | None:
    from consumers.status import service_lag

    rows = await service_lag(kw, sample_s=0.0)
    return next((r["lag"] for r in rows if r["service"] == "batcher"), None)


class _Cpu:
    """CPU% of one core over an interval, for the batcher, this process and the local broker (if any), and the
    batcher's ``wait``: % of the interval its threads were ready to run but waited for a core (schedstat), which
    on a shared machine tells a starved batcher from an idle one."""

    def __init__(self, pids: dict[str, int | None]) -> None:
        self.pids = {k: p for k, p in pids.items() if p}

    def mark(self) -> tuple[float, dict[str, float]]:
        used = {k: cpu_s(p) for k, p in self.pids.items()}
        return time.monotonic(), {**used, "wait": _waited_s(self.pids["batcher"])}

    def since(self, mark: tuple[float, dict[str, float]]) -> dict[str, float]:
        t0, c0 = mark
        t1, c1 = self.mark()
        return {k: round(100 * (c1[k] - c0[k]) / (t1 - t0), 1) for k in c0}


def _waited_s(pid: int) -> float:
    """Seconds the threads of ``pid`` have spent runnable but not running (/proc/<pid>/task/*/schedstat)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
        except OSError:  # a thread that ended
            pass
    return total / 1e9


async def _size(kw: dict[str, Any], bootstrap: str, broker_pid: int | None, args: argparse.Namespace,
                tokens: int) -> dict[str, Any]:
    from consumers import testing
    from streams import topics
    from streams.revisions import publish

    os.environ["ROLLOUT_TOPIC_PREFIX"] = f"{args.prefix}t{tokens}."
    await topics.create_topics(kw)
    await publish(kw, testing.revision(0))
    pool = _pool(tokens, args.prompt_tokens, args.batch_records)
    offer = _Offer(kw, pool)
    await offer.prod.start()
    log = _BatchLog(kw)
    proc: subprocess.Popen | None = None
    proc_log = tempfile.NamedTemporaryFile("w+", prefix="saturation-batcher-", suffix=".log", delete=False)
    out: dict[str, Any] = {"completion_tokens": tokens, "prompt_tokens": args.prompt_tokens,
                           "record_bytes": len(pool[0][1]), "levels": []}
    try:
        backlog = args.backlog - args.backlog % args.batch_records
        await offer.backlog(backlog)
        out["transport"] = await _consume(kw, backlog, decode=False)
        out["decode"] = await _consume(kw, backlog, decode=True)
        await log.start()
        proc = _batcher(bootstrap, args.batch_records, proc_log)
        cpu = _Cpu({"batcher": proc.pid, "this": os.getpid(), "broker": broker_pid})
        if await log.until(backlog, 60 + backlog / 500):
            (first, n0), last = log.batches[0], log.batches[-1][0]  # the clock starts at the first batch
            per_s = (backlog - n0) / max(last - first, 1e-3)
            out["drain"] = {"records": backlog, "seconds": round(last - first, 3), "records_per_s": round(per_s),
                            "tokens_per_s": round(per_s * tokens)}
        else:  # no levels then: what the batcher said instead is the figure
            out["error"] = (f"the batcher batched {log.records} of {backlog} records in {60 + backlog / 500:.0f} s; "
                            f"its last warning: {_last_warning(proc_log.name)}")
        for rate in args.rates if "drain" in out else ():
            level = await _level(kw, offer, log, cpu, rate, tokens, args)
            out["levels"].append(level)
            print(_row(level), flush=True)
            if level["state"] != "ok":
                break
    finally:
        if proc is not None:
            proc.terminate()
            await asyncio.to_thread(proc.wait, 30)
        await log.stop()
        await offer.prod.stop()
        proc_log.close()
        os.unlink(proc_log.name)
        await _delete_topics(kw, os.environ["ROLLOUT_TOPIC_PREFIX"])  # gigabytes: not until the run's end
    ok = [lv for lv in out["levels"] if lv["state"] == "ok"]
    out["sustained_records_per_s"] = max((lv["achieved_per_s"] for lv in ok), default=0)
    out["peak_records_per_s"] = max((lv["achieved_per_s"] for lv in out["levels"]), default=0)
    out["sustained_tokens_per_s"] = out["sustained_records_per_s"] * tokens
    out["peak_tokens_per_s"] = out["peak_records_per_s"] * tokens
    out["saturated_at"] = next((lv["offered_per_s"] for lv in out["levels"] if lv["state"] != "ok"), None)
    out["batch_path"] = await _batch_path(kw, pool, tokens, args)
    return out


async def _level(kw: dict[str, Any], offer: _Offer, log: _BatchLog, cpu: _Cpu, rate: int, tokens: int,
                 args: argparse.Namespace) -> dict[str, Any]:
    seconds = min(args.level_s, args.level_mb * 1e6 / (rate * len(offer.pool[0][1])))
    mark = cpu.mark()
    t0 = time.time()
    written, took = await offer.rate(rate, seconds)
    t1 = time.time()
    used = cpu.since(mark)
    lag = await _lag(kw)
    batched = log.between(t0 + WARM_S, t1)
    owed = offer.sent - (args.batch_records - 1)  # all but a partial batch, which waits for its flush timer
    allowed = GRACE_S + (1 / SATURATED - 1) * took  # achieved >= 90% of written, but for the last batch's trip
    caught_up = await log.until(owed, max(CATCH_UP_S, t1 + CATCH_UP_S + 2 * allowed - time.time()))
    behind_s = max(0.0, log.reached(owed) - t1) if caught_up else None
    state = ("producer-bound" if written / took < SATURATED * rate else
             "ok" if behind_s is not None and behind_s <= allowed else "saturated")
    in_window = batched / (t1 - t0 - WARM_S)
    # the level's records over the time until the last of them was batched; while it was still catching up when
    # the wait ended, what it batched while they were written
    achieved = written / (took + behind_s) if behind_s is not None else in_window
    return {"completion_tokens": tokens, "offered_per_s": rate, "seconds": round(took, 1),
            "written_per_s": round(written / took), "batched_per_s": round(in_window),
            "achieved_per_s": round(achieved), "tokens_per_s": round(achieved * tokens), "lag_at_end": lag,
            "behind_s": round(behind_s, 2) if behind_s is not None else None,
            "batcher_cpu_us_per_record": round(used["batcher"] / 100 * (t1 - t0) / max(log.between(t0, t1), 1) * 1e6),
            "cpu_pct": used, "load_avg_1m": round(os.getloadavg()[0], 1), "state": state}


HEADER = (f"{'tokens':>6} {'offered/s':>9} {'written/s':>9} {'batched/s':>9} {'achieved/s':>10} {'tokens/s':>11} "
          f"{'lag':>7} {'behind':>6} {'batcher%':>8} {'us/rec':>6} {'wait%':>6} {'this%':>6} {'broker%':>7} "
          f"{'load':>5}  state")


def _row(lv: dict[str, Any]) -> str:
    c, dash = lv["cpu_pct"], "-"
    lag = dash if lv["lag_at_end"] is None else lv["lag_at_end"]
    behind = dash if lv["behind_s"] is None else lv["behind_s"]
    return (f"{lv['completion_tokens']:>6} {lv['offered_per_s']:>9,} {lv['written_per_s']:>9,} "
            f"{lv['batched_per_s']:>9,} {lv['achieved_per_s']:>10,} {lv['tokens_per_s']:>11,} {lag:>7} {behind:>6} "
            f"{c.get('batcher', dash):>8} {lv['batcher_cpu_us_per_record']:>6} {c.get('wait', dash):>6} "
            f"{c.get('this', dash):>6} {c.get('broker', dash):>7} {lv['load_avg_1m']:>5}  {lv['state']}")


async def _batch_path(kw: dict[str, Any], pool: list[tuple[bytes, bytes, list]], tokens: int,
                      args: argparse.Namespace) -> dict[str, Any]:
    """One batch event's size, and how fast one trainer-batches partition carries such events."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from consumers import testing
    from schemas import codec
    from schemas.batch import assemble_batch
    from schemas.events import TrainerBatch
    from streams import serde, topics
    from streams.settings import FETCH_OPTIONS, MAX_MESSAGE_BYTES

    records = [codec.decode(v) for _, v, _ in pool[:args.batch_records]]
    batch = assemble_batch(records, testing.revision(0), 8, run_id="bench", producer="bench")
    k, v, h = serde.to_message(batch)
    out: dict[str, Any] = {"batch_records": args.batch_records, "batch_bytes": len(v),
                           "bytes_per_completion_token": round(len(v) / (tokens * args.batch_records), 2),
                           "max_message_bytes": MAX_MESSAGE_BYTES}
    os.environ["ROLLOUT_TOPIC_PREFIX"] = f"{args.prefix}b{tokens}."
    await topics.create_topics(kw, [topics.TRAINER_BATCHES])
    n = max(10, min(args.batch_events, int(args.level_mb * 1e6 / len(v))))
    prod = AIOKafkaProducer(**kw, acks="all", enable_idempotence=True, linger_ms=5, max_request_size=MAX_MESSAGE_BYTES,
                            max_batch_size=1024 * 1024)
    await prod.start()
    try:
        t0 = time.monotonic()
        futs = [await prod.send(topics.TRAINER_BATCHES.name, v, key=k, headers=h) for _ in range(n)]
        await asyncio.gather(*futs)
        produce_s = time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - a batch the topic refuses is a figure too
        out["refused"] = f"{type(e).__name__}: {e}"
        return out
    finally:
        await prod.stop()
    c = AIOKafkaConsumer(topics.TRAINER_BATCHES.name, **kw, group_id=None, isolation_level="read_committed",
                         auto_offset_reset="earliest", **FETCH_OPTIONS)
    await c.start()
    try:
        got, decode_s = 0, 0.0
        t0 = time.monotonic()
        while got < n and time.monotonic() - t0 < 120:
            for recs in (await c.getmany(timeout_ms=500)).values():
                for r in recs:
                    got += 1
                    d0 = time.perf_counter()
                    codec.decode(r.value, TrainerBatch)
                    decode_s += time.perf_counter() - d0
        consume_s = time.monotonic() - t0
    finally:
        await c.stop()
    per_s = n / (produce_s + consume_s)  # one after the other: a batch written and read, as batcher -> trainer
    out.update(events=n, produce_per_s=round(n / produce_s, 1), consume_per_s=round(got / consume_s, 1),
               decode_ms=round(1000 * decode_s / max(got, 1), 2), MB_per_s=round(per_s * len(v) / 1e6, 1),
               batches_per_s=round(per_s, 1), records_per_s=round(per_s * args.batch_records),
               tokens_per_s=round(per_s * args.batch_records * tokens))
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from streams import topics
    from streams.config import KafkaSettings
    from streams.local_broker import LocalBroker

    kw = args.settings.client_kwargs()
    local = KafkaSettings.from_env()  # args.settings names its bootstrap even when it is the local broker
    broker_pid = None if local.external else LocalBroker.from_env(port=local.local_port).pid()
    sizes = []
    print(HEADER, flush=True)
    try:
        for tokens in args.tokens:
            sizes.append(await _size(kw, args.settings.bootstrap, broker_pid, args, tokens))
    finally:
        await _delete_topics(kw, args.prefix)
    for s in sizes:
        b = s["batch_path"]
        if "error" in s:
            print(f"{s['completion_tokens']} tokens/record: {s['error']}; a batch of {b['batch_records']}: "
                  f"{b['batch_bytes']:,} B" + (f", refused ({b['refused']})" if "refused" in b else ""), flush=True)
            continue
        print(f"{s['completion_tokens']} tokens/record ({s['record_bytes']:,} B): transport "
              f"{s['transport']['records_per_s']:,}/s, decode {s['decode']['records_per_s']:,}/s, batcher drain "
              f"{s['drain']['records_per_s']:,}/s; sustained {s['sustained_records_per_s']:,} records/s = "
              f"{s['sustained_tokens_per_s']:,} tokens/s, peak {s['peak_records_per_s']:,} = "
              f"{s['peak_tokens_per_s']:,}, "
              f"saturated at {s['saturated_at'] or 'none of the levels'}; a batch of {b['batch_records']}: "
              f"{b['batch_bytes']:,} B, " + (f"refused ({b['refused']})" if "refused" in b else
                                             f"one partition carries {b['batches_per_s']}/s = {b['tokens_per_s']:,} "
                                             "tokens/s"), flush=True)
    return {"benchmark": "saturation", "batch_records": args.batch_records, "rates": args.rates,
            "level_s": args.level_s, "sizes": sizes, "topic": {"training_records_partitions":
            topics.TRAINING_RECORDS.partitions, "trainer_batches_partitions": topics.TRAINER_BATCHES.partitions},
            "machine": f"{os.cpu_count()} cpu", "load_avg_1m": round(os.getloadavg()[0], 1)}


async def _delete_topics(kw: dict[str, Any], prefix: str) -> None:
    """This run's topics, so the rates' gigabytes do not stay on the broker's disk."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**kw)
    await admin.start()
    try:
        mine = [t for t in await admin.list_topics() if t.startswith(prefix)]
        if mine:
            await admin.delete_topics(mine)
    finally:
        await admin.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks saturation", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short levels (under 3 minutes)")
    ap.add_argument("--tokens", default="256,1024", help="completion tokens per record, one run each")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--rates", default=None, help="records/s offered, rising (default 500,1000,2000,4000,6000,8000,"
                                                  "12000,16000,24000,32000; --quick: 1000,2000,4000,8000,16000)")
    ap.add_argument("--level-s", type=float, default=None, help="seconds per level (default 20; --quick 5)")
    ap.add_argument("--level-mb", type=float, default=800, help="at most this many MB written per level")
    ap.add_argument("--batch-records", type=int, default=None,
                    help="records per TrainerBatch (default: the services' default, the plan's batch_size)")
    ap.add_argument("--backlog", type=int, default=None, help="records drained first (default 20,000; --quick 4,000)")
    ap.add_argument("--batch-events", type=int, default=None, help="batch events for the batch path (default 300; "
                                                                   "--quick 100)")
    args = ap.parse_args(argv)
    from consumers.settings import ServiceSettings

    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.rates = [int(r) for r in (args.rates or ("1000,2000,4000,8000,16000" if args.quick else
                                                  "500,1000,2000,4000,6000,8000,12000,16000,24000,32000")).split(",")]
    args.level_s = args.level_s or (5.0 if args.quick else 20.0)
    args.batch_records = args.batch_records or ServiceSettings().batch_records
    args.backlog = args.backlog or (4000 if args.quick else 20000)
    args.batch_events = args.batch_events or (100 if args.quick else 300)

    import logging

    logging.basicConfig(level=logging.ERROR)
    args.settings = kafka_for("saturation")
    args.prefix = os.environ["ROLLOUT_TOPIC_PREFIX"]
    return report(run, args)
