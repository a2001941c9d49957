"""Which runs the log holds and where: topic names under a prefix, the prefixes on a cluster, a run's sources,
and the runs listed from their first and last events (``rollout runs``). Shared by the replayer and the CLI."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from streams.settings import FETCH_OPTIONS

NO_RUN = "?"  # the run of messages without a run_id header, as listed
FETCH_MAX_WAIT_MS = 50  # how long the broker may hold a fetch for more data (replay reads what is there)


def topics_for(prefix: str) -> dict[str, str]:
    """topic key (streams.topics, e.g. "steps") -> topic name under ``prefix``."""
    from streams import topics

    return {key: prefix + key for key in topics.TOPICS}


async def sources_of(consumer: Any, run_id: str, prefix: str) -> list[tuple[str, str]]:
    """(run id, topic prefix) of the run and of every run it derives from (``rollout derive``), whose events
    its lineage walks back into: a derived run's fork revision names the source revision it started from.

    The fork revision is a derived run's first on its policy-revisions topic (one partition: totally ordered;
    ``rollout derive`` publishes it before any service starts), so each run's first revision decides and the
    topic is read no further (a replay read it to the end: 30-80 ms of a 0.7 s replay, benchmarks/RESULTS.md)."""
    from schemas import codec
    from schemas.policy import PolicyRevision
    from streams import topics

    out = [(run_id, prefix)]
    while True:
        run, at = out[-1]
        tps = await assign_all(consumer, [at + topics.POLICY_REVISIONS.key])
        fork = None
        if tps:
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            end = await consumer.end_offsets(tps)
            idle = 0  # a trailing transaction marker can keep the position short of the end
            first = None  # this run's first revision
            while first is None and idle < 2 and any([await consumer.position(tp) < end[tp] for tp in tps]):
                got = await consumer.getmany(*tps, timeout_ms=500)
                idle = 0 if got else idle + 1
                first = next((r for recs in got.values() for r in recs
                              if dict(r.headers).get("run_id") == run.encode()), None)
            if first is not None:
                fork = codec.decode(first.value, PolicyRevision).source
        if fork is None or any(r == fork.run_id for r, _ in out):
            return out
        out.append((fork.run_id, fork.topic.removesuffix(topics.POLICY_REVISIONS.key)))


def default_topics() -> dict[str, str]:
    """topic key -> topic name under the current ROLLOUT_TOPIC_PREFIX (streams.topics' default when unset)."""
    from streams import topics

    return topics_for(topics.topic_prefix())


def explicit_prefix() -> str | None:
    """ROLLOUT_TOPIC_PREFIX when set (even to ""): then runs are looked for under that prefix only."""
    return os.environ.get("ROLLOUT_TOPIC_PREFIX")


def split_topic(name: str) -> tuple[str, str] | None:
    """(prefix, key) of a pipeline topic name: the prefix is whatever precedes a known topic key."""
    from streams import topics

    if name.startswith("__"):  # Kafka's internal topics
        return None
    for key in topics.TOPICS:
        if name.endswith(key):
            return name[:-len(key)], key
    return None


def discover_prefixes(topic_names: Iterable[str]) -> list[str]:
    """Every topic prefix with at least one pipeline topic among ``topic_names``, sorted."""
    return sorted({sp[0] for sp in map(split_topic, topic_names) if sp is not None})


async def started_consumer(consumer: Any) -> Any:
    """``consumer`` started; stopped again when it cannot start (an unreachable broker), so the command's one-line
    error is not followed by aiokafka's "Unclosed AIOKafkaConsumer"."""
    try:
        await consumer.start()
    except BaseException:
        await consumer.stop()
        raise
    return consumer


def consumer_kwargs(settings: Any, **extra: Any) -> dict[str, Any]:
    kw = settings.client_kwargs()
    kw["client_id"] = f"{kw.get('client_id', 'rollout-log')}-replay"
    kw.update(group_id=None, enable_auto_commit=False, isolation_level="read_committed",
              auto_offset_reset="earliest", fetch_max_wait_ms=FETCH_MAX_WAIT_MS, **FETCH_OPTIONS)
    kw.update(extra)
    return kw


def header_value(headers: Iterable[tuple[str, bytes]], name: str) -> bytes | None:
    for k, v in headers:
        if k == name:
            return v
    return None


async def assign_all(consumer: Any, topic_names: Iterable[str]) -> list[Any]:
    """Every partition of each of ``topic_names`` that exists, in the names' order (the consumer is not assigned)."""
    from aiokafka import TopicPartition

    from streams.topics import partitions_of

    topic_names = list(topic_names)
    parts = await partitions_of(consumer._client, topic_names)
    return [TopicPartition(name, p) for name in topic_names for p in parts.get(name, ())]


# ---------------------------------------------------------------------------------------------- runs

@dataclass
class RunInfo:
    run_id: str
    prefix: str  # the topic prefix the run was found under
    first_ts: int
    last_ts: int
    messages: dict[str, int]  # topic key -> messages of this run read

    @property
    def first(self) -> datetime:
        return datetime.fromtimestamp(self.first_ts / 1000, UTC)

    @property
    def last(self) -> datetime:
        return datetime.fromtimestamp(self.last_ts / 1000, UTC)


async def list_runs(settings: Any, *, prefixes: Iterable[str] | None = None, all_topics: bool = False) -> list[RunInfo]:
    """Runs under the given topic prefixes (default: ROLLOUT_TOPIC_PREFIX when set, else every prefix found
    on the cluster), most recently started first. Per prefix, its policy-revisions topic is read (every run
    seeds its revision 0 there); a prefix with no run there, or ``all_topics``, has every pipeline topic
    read. Reads headers only."""
    from aiokafka import AIOKafkaConsumer

    from streams import topics

    consumer = await started_consumer(AIOKafkaConsumer(**consumer_kwargs(settings)))
    try:
        if prefixes is None:
            prefixes = [explicit_prefix()] if explicit_prefix() is not None else \
                discover_prefixes((await consumer._client.fetch_all_metadata()).topics())
        prefixes = list(prefixes)
        runs = [] if all_topics else await _scan_runs(consumer, [p + topics.POLICY_REVISIONS.key for p in prefixes])
        found = {r.prefix for r in runs}
        runs += await _scan_runs(consumer, [name for p in prefixes if p not in found for name in topics_for(p).values()])
        return sorted(runs, key=lambda r: r.first_ts, reverse=True)
    finally:
        await consumer.stop()


async def _scan_runs(consumer: Any, topic_names: list[str]) -> list[RunInfo]:
    """Every (prefix, run_id) on these topics, from the run_id headers up to the current end offsets."""
    tps = await assign_all(consumer, topic_names)
    if not tps:
        return []
    consumer.assign(tps)
    start = await consumer.beginning_offsets(tps)
    end = await consumer.end_offsets(tps)
    todo = {tp for tp in tps if end[tp] > start[tp]}
    for tp in tps:
        consumer.seek(tp, start[tp])
    split = {tp.topic: split_topic(tp.topic) for tp in tps}
    runs: dict[tuple[str, str], RunInfo] = {}
    while todo:
        batch = await consumer.getmany(*todo, timeout_ms=500, max_records=10000)
        for tp, records in batch.items():
            prefix, key = split[tp.topic]
            for r in records:
                if r.offset >= end[tp]:
                    break
                raw = header_value(r.headers, "run_id")
                run = raw.decode(errors="replace") if raw is not None else NO_RUN
                info = runs.get((prefix, run))
                if info is None:
                    info = runs[(prefix, run)] = RunInfo(run, prefix, r.timestamp, r.timestamp, defaultdict(int))
                info.first_ts = min(info.first_ts, r.timestamp)
                info.last_ts = max(info.last_ts, r.timestamp)
                info.messages[key] += 1
        for tp in list(todo):
            if await consumer.position(tp) >= end[tp]:
                todo.discard(tp)
    return list(runs.values())
