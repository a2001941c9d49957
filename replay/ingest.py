"""Read a run from the log into DuckDB.

The consumer has no group (``group_id=None``): it assigns every partition of every pipeline topic
by hand, starts at the earliest retained offset (or where the previous replay into this database
stopped) and reads ``read_committed`` up to the last stable offset seen at start. It never
commits offsets, so the live services' consumer groups are neither joined nor moved.

Runs are found under any topic prefix on the cluster (``demo-1a2b3c4d.steps`` as well as
``rollout.steps``) unless ``ROLLOUT_TOPIC_PREFIX`` is set, which restricts to that prefix; the prefix
a database was replayed from is kept in its ``_replay_meta`` so later replays read the same topics.

Messages of other runs are skipped on their ``run_id`` header, without decoding. Decoded events
are buffered per event type and flushed as Arrow tables; each flush inserts the data and the
per-partition next offsets in ONE DuckDB transaction, so a replay killed midway resumes exactly
where its last flush ended, never doubling a row.
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import duckdb
import pyarrow as pa

from replay import columns as C
from replay import frames, record_sets
from replay import tables as T
from schemas.errors import EventDecodeError
from streams.settings import FETCH_OPTIONS
from replay.runs import (assign_all, consumer_kwargs, explicit_prefix, list_runs, sources_of, started_consumer,
                         topics_for)
from replay.runs import FETCH_MAX_WAIT_MS, NO_RUN


class ReplayError(Exception):
    """A replay that cannot proceed (wrong run for this database, unknown run, bad --until)."""


@dataclass(frozen=True)
class Until:
    """Where to stop: a Kafka record timestamp (inclusive, ms since epoch) and/or end offsets per partition."""

    timestamp_ms: int | None = None
    offsets: Mapping[tuple[str, int], int] = field(default_factory=dict)  # (topic, partition) -> stop before

    @classmethod
    def parse(cls, text: str | None) -> Until | None:
        """``2026-11-22T10:00:00Z`` / ``@1795385142636`` (ms) / ``topic:partition:offset[,...]``."""
        if not text:
            return None
        text = text.strip()
        if text.startswith("@") and text[1:].isdigit():
            return cls(timestamp_ms=int(text[1:]))
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if all(p.count(":") >= 2 and p.rsplit(":", 2)[1].isdigit() and p.rsplit(":", 2)[2].isdigit() for p in parts):
            offsets = {}
            for p in parts:
                topic, partition, offset = p.rsplit(":", 2)
                offsets[(topic, int(partition))] = int(offset)
            return cls(offsets=offsets)
        try:
            when = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise ReplayError(f"--until {text!r}: expected an ISO time (2026-11-22T10:00:00Z), @epoch_ms, "
                              "or topic:partition:offset[,topic:partition:offset...]") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return cls(timestamp_ms=int(when.timestamp() * 1000))

    def describe(self) -> str:
        if self.timestamp_ms is not None:
            return datetime.fromtimestamp(self.timestamp_ms / 1000, UTC).isoformat()
        return ",".join(f"{t}:{p}:{o}" for (t, p), o in sorted(self.offsets.items()))


@dataclass
class ReplayResult:
    run_id: str
    db: str
    prefix: str | None  # the topic prefix read (None: events loaded without Kafka)
    rows: dict[str, int]
    messages: int = 0
    bytes: int = 0
    other_runs: int = 0
    errors: int = 0
    seconds: float = 0.0
    partitions: int = 0
    complete: bool = True
    retention_gap: int = 0  # offsets no longer on the log since the last replay (or never read)
    timings: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # seconds per phase

    def summary(self) -> str:
        added = ", ".join(f"{n} {t}" for t, n in self.rows.items() if n) or "nothing new"
        rate = self.bytes / self.seconds / 1e6 if self.seconds else 0.0
        return (f"replayed run {self.run_id} (topics {self.prefix}*) into {self.db}: {added} "
                f"({self.messages} messages of this run, {self.other_runs} of other runs skipped, "
                f"{self.errors} undecodable; {self.bytes / 1e6:.1f} MB in {self.seconds:.2f} s, {rate:.1f} MB/s)"
                + (f"; {self.retention_gap} offsets were already deleted by retention" if self.retention_gap else ""))


class _Buffer:
    def __init__(self) -> None:
        self.events: dict[str, list] = defaultdict(list)
        self.metas: dict[str, list] = defaultdict(list)
        self.bad: list[C.BadMessage] = []
        self.count = 0  # messages decoded in Python
        self.nbytes = 0
        native = record_sets.native_reader()
        self.steps = native.StepColumns() if native else None  # steps the compiled reader decoded
        self.taken = (0, 0)  # messages and bytes of the steps' rows once ``tables`` has taken them

    @property
    def messages(self) -> int:
        return self.count + self.taken[0] + (len(self.steps) if self.steps is not None else 0)

    @property
    def size(self) -> int:
        return self.nbytes + self.taken[1] + (self.steps.nbytes if self.steps is not None else 0)

    def tables(self) -> dict[str, list[pa.Table]]:
        out: dict[str, list[pa.Table]] = defaultdict(list)
        for event_type, events in self.events.items():
            for name, table in C.BUILDERS[event_type](events, self.metas[event_type]).items():
                out[name].append(table)
        if self.steps is not None and len(self.steps):
            self.taken = (self.taken[0] + len(self.steps), self.taken[1] + self.steps.nbytes)
            native = record_sets.step_table(self.steps)
            if out.get("steps"):  # steps of both decoders (a rare frame the compiled one left): in log order again
                native = pa.concat_tables([native, *out["steps"]]).sort_by(
                    [("_topic", "ascending"), ("_partition", "ascending"), ("_offset", "ascending")])
            out["steps"] = [native]
        if self.bad:
            for name, table in C.replay_errors(self.bad).items():
                out[name].append(table)
        return out


# Rows per DuckDB row group in the replay file (DuckDB's smallest). DuckDB writes a transaction's full row
# groups straight into the database file ("optimistic writes") and logs only the remainder in its WAL, to be
# written again by the checkpoint at close; at the default 122,880 rows no flush ever fills one (measured:
# DuckDB's share of a replay ~1.0 s -> ~0.65 s at 2,048).
ROW_GROUP_ROWS = 2048
# A flush is also cut as soon as one event type has this many rows, so the table it fills (steps, in a run's
# bulk) leaves no remainder for the WAL and the closing checkpoint: offline, the inserts of a 30,001-message
# replay took 0.33 s of CPU and the close 0.03 s, against 0.68 s and 0.25 s with flushes of 2,000 steps
# (benchmarks/RESULTS.md).
FLUSH_ROWS = 2 * ROW_GROUP_ROWS


# The writer thread spends its time in DuckDB, which gives up the GIL and takes it back many times an insert
# (each statement, each Arrow chunk it scans); every time, it waits for the fetch/decode loop to let go, which
# CPython forces only after the switch interval (5 ms by default). At 0.1 ms the insert of a replay's
# flushes took 0.46-0.48 s instead of 0.72-0.80 s of wall time (benchmarks/RESULTS.md). Process-wide, so it
# is set for the replay only and restored after.
WRITER_SWITCH_INTERVAL_S = 0.0001


def open_db(path: str, *, read_only: bool = False, schema: bool = True) -> duckdb.DuckDBPyConnection:
    """The replay database, its tables made or upgraded (``schema``)."""
    if read_only:
        return duckdb.connect(path, read_only=True)
    con = duckdb.connect()
    quoted = path.replace("'", "''")
    con.execute(f"ATTACH '{quoted}' AS replay_db (ROW_GROUP_SIZE {ROW_GROUP_ROWS})")
    con.execute("USE replay_db")
    if schema:
        T.ensure_schema(con)
    return con


def _is_new(con: duckdb.DuckDBPyConnection) -> bool:
    return con.execute("SELECT count(*) FROM duckdb_tables() WHERE database_name = current_database()").fetchone()[0] == 0


def _meta(con: duckdb.DuckDBPyConnection, key: str) -> str | None:
    row = con.execute("SELECT value FROM _replay_meta WHERE key = ?", [key]).fetchone()
    return row[0] if row else None


def stored_offsets(con: duckdb.DuckDBPyConnection) -> dict[tuple[str, int], int]:
    return {(t, p): o for t, p, o in con.execute('SELECT topic, "partition", next_offset FROM _replay_offsets').fetchall()}


def _max_ts_ms(con: duckdb.DuckDBPyConnection) -> int | None:
    parts = " UNION ALL ".join(f"SELECT max(_ts) AS t FROM {name}" for name, t in T.TABLES.items()
                               if "_ts" in t.schema.names)
    row = con.execute(f"SELECT epoch_ms(max(t)) FROM ({parts})").fetchone()
    return row[0] if row else None


class Replayer:
    """One replay of one run into one DuckDB file. ``await Replayer(...).run()``.

    ``prefix``: the topic prefix to read (default: the one stored in the database, else
    ROLLOUT_TOPIC_PREFIX when set, else the prefix the run is found under)."""

    def __init__(self, db: str, settings: Any, *, run_id: str | None = None, until: Until | None = None,
                 prefix: str | None = None, flush_messages: int = 8192,
                 flush_bytes: int = 32 * 1024 * 1024, progress: Callable[[ReplayResult], None] | None = None,
                 duckdb_threads: int | None = None, compress: bool | None = None,
                 stall_timeout_s: float = 60.0, writer_thread: bool = True) -> None:
        self.db = db
        self.settings = settings
        self.run_id = run_id
        self.until = until
        self.prefix = prefix
        self.flush_messages = flush_messages
        self.flush_bytes = flush_bytes
        self.progress = progress
        self.stall_timeout_s = stall_timeout_s
        self.writer_thread = writer_thread
        self.compress = compress if compress is not None else os.environ.get("ROLLOUT_REPLAY_COMPRESS") == "1"
        self.duckdb_threads = duckdb_threads or max(1, (os.cpu_count() or 2) // 2)

    async def run(self) -> ReplayResult:
        con = open_db(self.db, schema=False)
        # The writer thread shares the machine with the fetch/decode loop: one DuckDB thread for inserts,
        # and checkpoint (compress) rarely, not every 16 MB of WAL.
        con.execute(f"SET threads = {self.duckdb_threads}")
        con.execute("SET checkpoint_threshold = '256MB'")
        if not self.compress:  # lists of random-looking token ids barely compress; writing them raw is ~2x faster
            con.execute("SET force_compression = 'uncompressed'")
        # A new file's ~60 tables and views take 40-150 ms to make: on a thread, while Kafka is set up (a new file
        # holds no run, prefix or offsets to look up meanwhile); the first flush waits for them.
        schema = asyncio.get_running_loop().run_in_executor(None, T.ensure_schema, con) if _is_new(con) else None
        try:
            if schema is None:
                T.ensure_schema(con)
            return await self._run(con, schema)
        finally:
            if schema is not None:
                await asyncio.wait([schema])  # (never close the file under it)
            con.close()

    async def _resolve_run(self, con: duckdb.DuckDBPyConnection, new: bool) -> tuple[str, str]:
        """(run id, topic prefix): given, else stored in the database (unless ``new``), else found on the log."""
        stored, stored_prefix = (None, None) if new else (_meta(con, "run_id"), _meta(con, "topic_prefix"))
        if self.run_id and stored and self.run_id != stored:
            raise ReplayError(f"{self.db} holds run {stored}; replay run {self.run_id} into another --db")
        want = self.prefix if self.prefix is not None else explicit_prefix()
        if want is not None and stored_prefix is not None and want != stored_prefix:
            raise ReplayError(f"{self.db} holds run {stored} from topics {stored_prefix}*, not {want}* "
                              "(unset ROLLOUT_TOPIC_PREFIX, or replay into another --db)")
        run_id = self.run_id or stored
        prefix = want if want is not None else stored_prefix
        if run_id and prefix is not None:
            return run_id, prefix
        if run_id:  # under which prefix? (its revision 0 tells; else every topic is read)
            runs = [r for r in await list_runs(self.settings) if r.run_id == run_id] or \
                [r for r in await list_runs(self.settings, all_topics=True) if r.run_id == run_id]
            if not runs:
                raise ReplayError(f"run {run_id} is not on the log")
            if len({r.prefix for r in runs}) > 1:
                raise ReplayError(f"run {run_id} is on the log under several topic prefixes "
                                  f"({', '.join(sorted({r.prefix for r in runs}))}): set ROLLOUT_TOPIC_PREFIX")
        else:
            runs = [r for r in await list_runs(self.settings, prefixes=None if prefix is None else [prefix])
                    if r.run_id != NO_RUN]
            if not runs:
                raise ReplayError("no run found on the log" + (f" under topics {prefix}*" if prefix is not None else ""))
        return runs[0].run_id, runs[0].prefix

    async def _run(self, con: duckdb.DuckDBPyConnection, schema: asyncio.Future | None) -> ReplayResult:
        """``schema``: the new file's tables, still being made (nothing of this file is read until they are)."""
        from aiokafka import AIOKafkaConsumer

        t0 = time.perf_counter()
        run_id, prefix = await self._resolve_run(con, new=schema is not None)
        if schema is None and self.until and self.until.timestamp_ms is not None:
            newest = _max_ts_ms(con)
            if newest is not None and newest > self.until.timestamp_ms:
                raise ReplayError(f"{self.db} already holds events after --until {self.until.describe()}; "
                                  "replay into a fresh --db to see an earlier state")
        result = ReplayResult(run_id=run_id, db=self.db, prefix=prefix, rows={name: 0 for name in T.TABLES})
        tm = result.timings
        consumer = await started_consumer(AIOKafkaConsumer(**consumer_kwargs(self.settings)))
        try:  # the run's topics, and those of the runs it derives from, each read for its own run's events
            runs = await sources_of(consumer, run_id, prefix)
        except BaseException:
            await consumer.stop()
            raise
        accept = {name: (r, r.encode()) for r, p in runs for name in topics_for(p).values()}
        topic_names = list(accept)
        # DuckDB inserts run on one writer thread (DuckDB releases the GIL), one flush at a time and in order,
        # while this loop fetches, decodes and builds the Arrow tables of the next flush (building on the
        # writer thread left this loop waiting for it: 0.41 s of a 1.36 s replay, benchmarks/RESULTS.md).
        loop = asyncio.get_running_loop()
        writer = ThreadPoolExecutor(1, thread_name_prefix="replay-writer")
        pending: asyncio.Future | None = None
        fetching: asyncio.Future | None = None  # the next fetch, sent while the last one is read
        gc_was_enabled = gc.isenabled()
        gc.disable()  # decoded events are long-lived until flushed: cyclic GC passes over them cost, free nothing
        switch_interval = sys.getswitchinterval()
        if self.writer_thread:
            sys.setswitchinterval(WRITER_SWITCH_INTERVAL_S)
        try:
            tps = await assign_all(consumer, topic_names)
            result.partitions = len(tps)
            if not tps:
                raise ReplayError(f"none of the topics {sorted(topic_names)} exists")
            stored = {} if schema is not None else stored_offsets(con)
            consumer.assign(tps)  # before the offset lookups: they need the topics in the client's metadata
            consumer.pause(*tps)  # replay sends fetch requests of its own (replay.record_sets)
            begin = await consumer.beginning_offsets(tps)
            end = await consumer.end_offsets(tps)  # read_committed: the last stable offsets
            until_ts = self.until.timestamp_ms if self.until else None
            if self.until and self.until.offsets:
                by_name = {(tp.topic, tp.partition): tp for tp in tps}
                unknown = sorted(f"{t}:{p}" for t, p in self.until.offsets if (t, p) not in by_name)
                if unknown:
                    raise ReplayError(f"--until names partitions that are not part of the run's topics: "
                                      f"{', '.join(unknown)} (topics: {', '.join(sorted(topic_names))})")
                for key, off in self.until.offsets.items():
                    end[by_name[key]] = min(end[by_name[key]], off)
            next_off: dict[Any, int] = {}
            for tp in tps:
                want = stored.get((tp.topic, tp.partition), 0)
                if want < begin[tp]:
                    result.retention_gap += begin[tp] - want  # deleted by retention before we read them
                next_off[tp] = max(want, begin[tp])
            todo = set()
            for tp in tps:
                if next_off[tp] < end[tp]:
                    consumer.seek(tp, next_off[tp])
                    todo.add(tp)
            stopped: set[Any] = set()  # partitions stopped by --until TIME (their next offset is exact)
            buf = _Buffer()
            decode = frames.decode
            Meta = C.Meta
            t1 = time.perf_counter()
            tm["setup"] = t1 - t0

            async def flush() -> None:
                """Hand ``buf`` to the writer and start a new one."""
                nonlocal pending, buf, schema
                t = time.perf_counter()
                if schema is not None:
                    await schema
                    schema = None
                tables = build(buf, result)  # while the previous flush is being inserted
                if pending is not None:
                    tw = time.perf_counter()
                    await pending
                    tm["wait_writer"] += time.perf_counter() - tw
                offsets = {(tp.topic, tp.partition): off for tp, off in next_off.items()}
                if self.writer_thread:
                    pending = loop.run_in_executor(writer, write, con, buf, offsets, result, tables)
                else:
                    write(con, buf, offsets, result, tables)
                buf = _Buffer()
                if self.progress:
                    self.progress(result)
                tm["flush"] += time.perf_counter() - t

            fetcher = record_sets.Fetcher(consumer, max_wait_ms=FETCH_MAX_WAIT_MS, max_bytes=record_sets.FETCH_MAX_BYTES,
                                          partition_max_bytes=FETCH_OPTIONS["max_partition_fetch_bytes"])
            native = record_sets.native_reader()
            record_sets.check_columns()

            def take(tp: Any, off: int, ts: int, key: bytes | None, value: bytes | None, headers: Any) -> list | None:
                """One record of this run (by its header, if it has one) into ``buf``: its event list, or None."""
                topic = tp.topic
                want, want_b = accept[topic]
                hrun = None
                for k, v in headers:
                    if k == "run_id":
                        hrun = v
                        break
                if hrun is not None and hrun != want_b:
                    result.other_runs += 1
                    return None
                meta = Meta(topic, tp.partition, off, ts)
                buf.count += 1
                buf.nbytes += len(value) if value is not None else 0
                try:
                    if value is None:
                        raise EventDecodeError("message has no value (a tombstone?)")
                    event = decode(value)
                    if event.run_id != want:
                        if hrun is None:  # no header: the envelope decides
                            buf.count -= 1
                            result.other_runs += 1
                            return None
                        raise EventDecodeError(f"header run_id {want!r} but envelope run_id {event.run_id!r}")
                except EventDecodeError as exc:
                    buf.bad.append(C.BadMessage(meta, key, value, headers, f"{type(exc).__name__}: {exc}"))
                    return None
                et = event.event_type
                typed = buf.events[et]
                typed.append(event)
                buf.metas[et].append(meta)
                return typed

            async def read_records(tp: Any, records: Any, stop: int) -> str | None:
                """aiokafka's records of one partition, one by one: "end" at ``stop``, "until" past --until."""
                for r in records:
                    off = r.offset
                    if off >= stop:
                        return "end"
                    if until_ts is not None and r.timestamp > until_ts:
                        return "until"
                    next_off[tp] = off + 1
                    typed = take(tp, off, r.timestamp, r.key, r.value, r.headers)
                    if typed is not None and len(typed) == FLUSH_ROWS:
                        await flush()  # exact: every record below next_off is in buf
                return None

            async def read_set(tp: Any, reader: Any, fetched_at: int, stop: int) -> str | None:
                """A record set through the compiled reader: "end", "until", or None (all of it read)."""
                want = accept[tp.topic][0]
                while True:
                    limit = max(1, FLUSH_ROWS - len(buf.events.get("step", ())))
                    why, leftovers, *batch = reader.read(buf.steps, limit, stop, until_ts, want, tp.topic, tp.partition)
                    full = why == "full"
                    for off, ts, key, value, headers in leftovers:
                        typed = take(tp, off, ts, key, value, headers)
                        full = full or (typed is not None and len(typed) >= FLUSH_ROWS)
                    next_off[tp] = max(next_off[tp], reader.next_offset)
                    if full:  # only now: the reader's rows run up to next_off, past the leftovers
                        await flush()
                    if why == "batch":
                        (data,) = batch
                        records = record_sets.python_records(tp, data, fetched_at, [])  # (aborts: decided)
                        why = await read_records(tp, records, stop)
                        if why:
                            return why
                        reader.skip_batch()
                    elif why != "full":
                        return None if why == "done" else why

            position = {tp: next_off[tp] for tp in todo}
            fetching = asyncio.ensure_future(fetcher.fetch(position))
            last_progress = time.monotonic()
            while todo:
                tf = time.perf_counter()
                got = await fetching
                td = time.perf_counter()
                tm["fetch"] += td - tf
                readers = {}
                for tp, (data, aborted) in got.items():
                    if tp in todo:
                        readers[tp] = (native.RecordSet(data, position[tp], aborted, next_off[tp]) if native
                                       else record_sets.python_records(tp, data, position[tp], aborted), position[tp])
                        if native:
                            position[tp] = readers[tp][0].position
                if native:  # the next fetch is on its way while this one is read
                    ahead = {tp: position[tp] for tp in todo if position[tp] < end[tp]}
                    fetching = asyncio.ensure_future(fetcher.fetch(ahead))
                    await asyncio.sleep(0)  # (sends it)
                if readers:
                    last_progress = time.monotonic()
                elif time.monotonic() - last_progress > self.stall_timeout_s:
                    behind = ", ".join(f"{tp.topic}:{tp.partition} at {position[tp]} of {end[tp]}" for tp in sorted(todo)[:5])
                    raise ReplayError(f"no progress for {self.stall_timeout_s:.0f} s reading {behind} "
                                      "(broker unreachable?); what was flushed is kept: run the replay again to continue")
                t_in = time.perf_counter()
                flushed_before = tm["flush"]
                for tp, (reader, fetched_at) in readers.items():
                    if native:
                        why = await read_set(tp, reader, fetched_at, end[tp])
                        result.other_runs += reader.other_runs
                    else:
                        why = await read_records(tp, reader, end[tp])
                        position[tp] = reader.next_fetch_offset
                    if why == "until":
                        todo.discard(tp)
                        stopped.add(tp)
                    elif why == "end" or position[tp] >= end[tp]:
                        next_off[tp] = max(next_off[tp], end[tp])
                        todo.discard(tp)
                if not native and todo:
                    fetching = asyncio.ensure_future(fetcher.fetch({tp: position[tp] for tp in todo}))
                tm["decode"] += time.perf_counter() - t_in - (tm["flush"] - flushed_before)
                if buf.messages >= self.flush_messages or buf.size >= self.flush_bytes:
                    await flush()
            # the last flush also advances partitions with nothing of this run
            await flush()
            if pending is not None:
                tw = time.perf_counter()
                await pending
                tm["wait_writer"] += time.perf_counter() - tw
                pending = None
            result.complete = not stopped and not (self.until and self.until.offsets)
        finally:
            if fetching is not None and not fetching.done():
                fetching.cancel()
            if pending is not None:  # an error: let the writer finish its transaction before closing
                await asyncio.wait([pending])
            writer.shutdown(wait=True)
            if gc_was_enabled:
                gc.enable()
            sys.setswitchinterval(switch_interval)
            tc = time.perf_counter()
            await consumer.stop()
            tm["close"] = time.perf_counter() - tc
        result.seconds = time.perf_counter() - t0
        return result


def _offsets_table(next_offsets: Mapping[tuple[str, int], int]) -> pa.Table:
    keys = list(next_offsets)
    return pa.table({"topic": [t for t, _ in keys], "partition": pa.array([p for _, p in keys], pa.int32()),
                     "next_offset": pa.array(list(next_offsets.values()), pa.int64())})


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def build(buf: _Buffer, result: ReplayResult) -> dict[str, list[pa.Table]]:
    """The buffered events as Arrow tables, by table name."""
    t0 = time.perf_counter()
    tables = buf.tables()
    result.timings["build"] += time.perf_counter() - t0
    return tables


def write(con: duckdb.DuckDBPyConnection, buf: _Buffer, next_offsets: Mapping[tuple[str, int], int],
          result: ReplayResult, tables: dict[str, list[pa.Table]] | None = None) -> None:
    """Insert the buffered events (``tables``, when already built from ``buf``) and the next offsets in one
    transaction, sent to DuckDB as one multi-statement call.

    On the writer thread each DuckDB call gives up the GIL and must win it back from the fetch/decode loop
    (up to a switch interval, 5 ms, each time): one call per flush instead of ~25 halved the insert's wall
    time in a replay (benchmarks/RESULTS.md)."""
    if tables is None:
        tables = build(buf, result)
    t1 = time.perf_counter()
    views: dict[str, pa.Table] = {}
    sql = ["BEGIN TRANSACTION"]
    for name, parts in tables.items():
        for i, table in enumerate(parts):
            views[f"_arrow_{name}_{i}"] = table
            sql.append(f"INSERT INTO {name} BY NAME SELECT * FROM _arrow_{name}_{i}")
    if next_offsets:
        views["_arrow_offsets"] = _offsets_table(next_offsets)
        sql.append('INSERT OR REPLACE INTO _replay_offsets (topic, "partition", next_offset) '
                   'SELECT topic, "partition", next_offset FROM _arrow_offsets')
    for key, value in (("run_id", result.run_id), ("topic_prefix", result.prefix)):
        if value is not None:
            sql.append(f"INSERT OR REPLACE INTO _replay_meta VALUES ('{key}', {_literal(value)})")
    sql.append("COMMIT")
    for view, table in views.items():
        con.register(view, table)
    try:
        con.execute(";\n".join(sql))
    except BaseException:
        con.execute("ROLLBACK")
        raise
    finally:
        for view in views:
            con.unregister(view)
    for name, parts in tables.items():
        result.rows[name] += sum(t.num_rows for t in parts)
    result.timings["insert"] += time.perf_counter() - t1
    result.messages += buf.messages
    result.bytes += buf.size
    result.errors += len(buf.bad)


def load_events(con: duckdb.DuckDBPyConnection, run_id: str, items: Iterable[tuple[C.Meta, Any]],
                prefix: str | None = None) -> ReplayResult:
    """Load already-decoded events (with where they sat on the log) without Kafka: tests, fixtures, tools."""
    T.ensure_schema(con)
    buf = _Buffer()
    for meta, event in items:
        buf.events[event.event_type].append(event)
        buf.metas[event.event_type].append(meta)
        buf.count += 1
    result = ReplayResult(run_id=run_id, db="", prefix=prefix, rows={name: 0 for name in T.TABLES})
    write(con, buf, {}, result)
    return result


def replay(db: str, settings: Any, **kwargs: Any) -> ReplayResult:
    return asyncio.run(Replayer(db, settings, **kwargs).run())
