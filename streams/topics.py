"""The one place where topic names, partition counts, replication factor and topic configs live.

    from streams import topics
    topics.STEPS.name           # "rollout.steps" (prefix: ROLLOUT_TOPIC_PREFIX, default "rollout.")
    topics.TOPICS["steps"]      # the same Topic
    await topics.create_topics(KafkaSettings.from_env().admin_kwargs())   # idempotent

Retention is infinite (-1) by default: the log is the source of truth. Only `steps` (the bulkiest)
has a configurable retention: ROLLOUT_STEPS_RETENTION_MS (default -1).
Replication factor: ROLLOUT_TOPIC_REPLICATION_FACTOR (default 1, the local single-node broker; use 3
on a real cluster) and ROLLOUT_TOPIC_MIN_INSYNC_REPLICAS (default 1; 2 with 3 replicas: one broker may be
down, and every acknowledged write is still on two). The Kafka protocol's "broker default" (-1) needs
CreateTopics v4, which aiokafka 0.14 does not speak, so it is always explicit. The prefix, replication factor and retention are read
from ``streams.settings`` at each use (a test or a benchmark sets its own prefix at run time).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas.events import DeadLetter, Rollout, RolloutReferenced, RolloutScored, Step, TrainerBatch, TrainingRecord
from schemas.policy import PolicyRevision
from streams import settings
from streams.kafka_errors import KafkaAccessError, KafkaError

INFINITE = "-1"
TOPIC_ALREADY_EXISTS = 36  # Kafka protocol error codes
TOPIC_AUTHORIZATION_FAILED = 29


class TopicMissing(RuntimeError):
    """A topic a reader needs is not on the cluster (not created yet, or another prefix's)."""


def topic_prefix() -> str:
    return settings.topic_prefix()


def replication_factor() -> int:
    return settings.current().topic_replication_factor


def group_id(service: str) -> str:
    """The consumer group of ``service``: prefixed like the topics, so runs under other prefixes never share it."""
    return topic_prefix() + service


@dataclass(frozen=True)
class Topic:
    key: str  # name without the prefix, e.g. "steps"
    partitions: int
    configs: Mapping[str, str] = field(default_factory=dict)
    doc: str = ""
    event: type | None = None  # the event type its records hold (None: internal, e.g. a changelog)

    @property
    def name(self) -> str:
        return topic_prefix() + self.key

    @property
    def replication_factor(self) -> int:
        return replication_factor()

    def topic_configs(self) -> dict[str, str]:
        cfg = {"cleanup.policy": "delete", "retention.ms": INFINITE, "retention.bytes": INFINITE,
               "min.insync.replicas": str(settings.current().topic_min_insync_replicas)}
        cfg.update(self.configs)
        if self.key == "steps":
            cfg["retention.ms"] = str(settings.current().steps_retention_ms)
        return cfg

    def __str__(self) -> str:
        return self.name


_BIG = {"max.message.bytes": str(settings.MAX_MESSAGE_BYTES)}

POLICY_REVISIONS = Topic("policy-revisions", 1, doc="policy/weights revisions, totally ordered", event=PolicyRevision)
STEPS = Topic("steps", 12, _BIG, doc="environment steps (retention: ROLLOUT_STEPS_RETENTION_MS)", event=Step)
ROLLOUTS = Topic("rollouts", 12, _BIG, doc="completed rollouts", event=Rollout)
SCORES = Topic("scores", 12, doc="rewards/scores per rollout", event=RolloutScored)
REFERENCED = Topic("scores-referenced", 12, _BIG, event=RolloutReferenced,
                   doc="the scores of ref_kl sources (prime-rl's opd) with the reference's logprob of every trainable "
                       "token; co-partitioned with scores, which credit reads beside it")
TRAINING_RECORDS = Topic("training-records", 1, event=TrainingRecord,
                         doc="rollouts joined with scores, ready for training; one partition, so one batcher "
                             "builds each optimizer step from all of them")
TRAINER_BATCHES = Topic("trainer-batches", 1, _BIG, event=TrainerBatch,
                        doc="batches handed to the trainer; 1 partition keeps batch order. A batch is one message: "
                            "128 records of 1,024 completion tokens are 1.4 MB, over the broker's 1 MiB default")
DEAD_LETTERS = Topic("dead-letters", 3, doc="records a stage could not process", event=DeadLetter)
ADMISSIONS = Topic("admissions", 1, {"message.timestamp.type": "LogAppendTime"},
                   doc="the arenas' admissions ledger (schemas.admission: the arenas' claims, credit's refunds of "
                       "gated groups, the batcher's rebases); 1 partition: one order every arena folds alike; broker timestamps time the "
                       "leases")

ARENA_READS = (ADMISSIONS, POLICY_REVISIONS)
ARENA_WRITES = (STEPS, ROLLOUTS, ADMISSIONS)
"""What an arena reads and writes (its ACLs in streams.security, the topics it makes sure of at start-up)."""

TOPICS: dict[str, Topic] = {
    t.key: t for t in (POLICY_REVISIONS, STEPS, ROLLOUTS, SCORES, REFERENCED, TRAINING_RECORDS, TRAINER_BATCHES, DEAD_LETTERS,
                        ADMISSIONS)
}


async def create_topics(
    admin_kwargs: Mapping[str, Any],
    topics: Iterable[Topic] | None = None,
    *,
    timeout_ms: int = 30000,
) -> dict[str, str]:
    """Create the topics (default: all of TOPICS). Idempotent: returns {name: "created" | "exists"}.

    An existing topic is left as it is (partitions/configs are not altered).
    """
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    wanted = list(TOPICS.values() if topics is None else topics)
    admin = AIOKafkaAdminClient(**admin_kwargs)
    await _start(admin, admin_kwargs)
    import asyncio

    # Topics the principal sees exist: no CreateTopics for them, which a principal without CREATE on a topic
    # would be refused even for a topic that exists (a secured cluster, whose admin created them).
    try:
        visible = set(await admin.list_topics())
    except BaseException:
        await admin.close()
        raise
    result: dict[str, str] = {t.name: "exists" for t in wanted if t.name in visible}
    wanted = [t for t in wanted if t.name not in visible]
    failures: list[str] = []
    denied = False  # a failure was the principal's missing permission (no retry fixes it)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_ms / 1000
    try:
        pending = wanted
        while pending:
            resp = await admin.create_topics(
                [NewTopic(t.name, t.partitions, t.replication_factor, topic_configs=t.topic_configs())
                 for t in pending],
                timeout_ms=timeout_ms,
            )
            failures, retry = [], set()
            for err in resp.topic_errors:
                name, code, message = err[0], err[1], (err[2] if len(err) > 2 else None)
                if code == 0:
                    result[name] = "created"
                elif code == TOPIC_ALREADY_EXISTS:
                    result[name] = "exists"
                else:
                    failures.append(f"{name}: error {code} {message or ''}".strip())
                    denied = denied or code == TOPIC_AUTHORIZATION_FAILED
                    # A broker that just (re)started is fenced until it re-registers: retry briefly.
                    if "fenced" in (message or "") and loop.time() < deadline:
                        retry.add(name)
            if failures and len(retry) == len(failures):
                pending = [t for t in pending if t.name in retry]
                await asyncio.sleep(0.5)
                continue
            break
        await _wait_visible(admin, list(result), timeout_ms / 1000)
    finally:
        await admin.close()
    if failures and denied:
        who = admin_kwargs.get("sasl_plain_username")
        who = f"User:{who}" if who else "this principal"
        raise KafkaAccessError("creating topics failed: " + "; ".join(failures) + f" ({who} may not create or see "
                               "them: grant it with `rollout kafka acls --apply` as an admin)")
    if failures:
        raise KafkaError("creating topics failed: " + "; ".join(failures))
    return result


async def ensure(admin_kwargs: Mapping[str, Any], own: Iterable[Topic]) -> None:
    """Make sure of a client's ``own`` topics (created when missing; a refusal is its error), then create the
    rest of the pipeline's where the principal may: with no authorizer any start order works, and on a secured
    cluster, whose admin creates the topics (``rollout topics create``), a principal needs no CREATE beyond
    what it alone creates (a service's changelog)."""
    own = list({t.name: t for t in own}.values())
    await create_topics(admin_kwargs, own)
    try:
        await create_topics(admin_kwargs, [t for t in TOPICS.values() if t.name not in {o.name for o in own}])
    except KafkaAccessError:
        pass  # not this principal's to create


async def _wait_visible(admin: Any, names: list[str], timeout_s: float) -> None:
    """KRaft acknowledges CreateTopics when the controller commits; wait until brokers serve the metadata."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        desc = await admin.describe_topics(names)
        if len(desc) == len(names) and all(d["error_code"] == 0 and d["partitions"] for d in desc):
            return
        if loop.time() > deadline:
            return  # errors, if any, surface on first use
        await asyncio.sleep(0.1)


async def partitions_of(client: Any, names: Iterable[str]) -> dict[str, list[int]]:
    """The partitions of each of ``names`` that exists (a missing name: no such topic, or not ready yet), from
    ``client`` (a started aiokafka consumer's or producer's ``_client``).

    One metadata request for these topics alone: aiokafka's ``fetch_all_metadata`` reads every topic of the
    cluster (25 ms at 713 topics, each time; benchmarks/RESULTS.md), and its per-topic requests ask the broker to
    create a missing topic where the broker allows it. Looking never creates a topic here."""
    from aiokafka.protocol.metadata import MetadataRequest

    wanted = sorted(set(names))
    if not wanted:  # (an empty list asks for every topic)
        return {}
    response = await client.send(client.get_random_node(),
                                 MetadataRequest(wanted, allow_auto_topic_creation=False))
    # each topic: (error_code, name, [is_internal,] partitions); each partition: (error_code, partition, ...)
    return {t[1]: sorted(p[1] for p in t[-1]) for t in response.topics if t[0] == 0 and t[1] in wanted}


async def describe_topics(admin_kwargs: Mapping[str, Any], names: Iterable[str] | None = None) -> dict[str, dict]:
    """{name: {"partitions": n, "replication_factor": r, "configs": {...}}} for existing topics."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = AIOKafkaAdminClient(**admin_kwargs)
    await _start(admin, admin_kwargs)
    try:
        existing = set(await admin.list_topics())
        names = sorted(existing if names is None else set(names) & existing)
        names = [n for n in names if not n.startswith("__")]
        out: dict[str, dict] = {}
        if not names:
            return out
        for t in await admin.describe_topics(names):
            parts = t["partitions"]
            out[t["topic"]] = {
                "partitions": len(parts),
                "replication_factor": len(parts[0]["replicas"]) if parts else 0,
                "configs": {},
            }
        responses = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in names])
        for resp in responses:
            for res in resp.resources:
                # (error_code, error_message, resource_type, resource_name, config_entries)
                name, entries = res[3], res[4]
                if name in out:
                    out[name]["configs"] = {e[0]: e[1] for e in entries}
        return out
    finally:
        await admin.close()


async def _start(admin: Any, admin_kwargs: Mapping[str, Any]) -> None:
    from aiokafka.errors import KafkaConnectionError, KafkaError as AIOKafkaError

    try:
        await admin.start()
    except (KafkaConnectionError, AIOKafkaError, OSError) as e:
        await admin.close()
        from streams.kafka_errors import KafkaUnreachable

        raise KafkaUnreachable(f"cannot reach Kafka at {admin_kwargs.get('bootstrap_servers')}: {e}") from None
