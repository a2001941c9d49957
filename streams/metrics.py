"""Prometheus metrics of every long-lived process, one ``/metrics`` endpoint each (``prometheus_client``).

Port scheme: ``ROLLOUT_METRICS_PORT`` is a base port (0, the default: no endpoint); each process serves on the
base plus its offset (``OFFSETS``: the arena +0, the policy server +1, the vLLM manager +2, the services +10 in
``consumers.registry`` order: verifier 10, credit 11, batcher 12, trainer 13). ``--metrics-port N`` on a
command sets that process's own port (a second instance of a service on one host needs it).

A service's counters are taken from what its transactions **committed** (``TransactionalProcessor.on_commit``),
so they agree with the log: an aborted transaction counts in ``rollout_aborts_total`` and nowhere else. Series
carry a ``service`` label (several services may share one process: ``consumers.runner.System``).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from schemas.events import DeadLetter, RolloutScored, TrainerBatch
from schemas.policy import PolicyRevision
from streams.settings import current

log = logging.getLogger("rollout.metrics")

OFFSETS = {"arena": 0, "policy": 1, "vllm": 2}
SERVICE_OFFSET = 10  # + the service's position in consumers.registry
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
REFUSALS = frozenset({"StaleRecordError", "CrossFamilyMixError", "DuplicateRecord", "GroupTimeout"})
"""Dead-letter reasons that are a pipeline rule refusing valid input (counted as refusals); the others are input
that could not be processed (undecodable, unscorable)."""


def learner_outcome(ev: RolloutScored) -> tuple[int, float, bool] | None:
    """(revision, reward, correct) of the learner in a scored rollout (None without trainable steps): the latest
    revision among its steps, and correct = the verifier's exact_match when it reports one, else reward >= 1 (the
    rule of replay's ``v_eval_answers``)."""
    if not ev.trainable_steps:
        return None
    member = ev.trainable_steps[0].member_id
    reward = ev.rewards.get(member, 0.0)
    exact = ev.metrics.get(f"{member}/metric/exact_match", ev.metrics.get(f"{member}/reward/exact_match"))
    return (max(st.policy.revision for st in ev.trainable_steps), reward,
            (exact if exact is not None else (1.0 if reward >= 1 else 0.0)) >= 1)


def port_for(offset: int, explicit: int | None = None) -> int:
    """The port a process serves its metrics on: ``explicit`` (its ``--metrics-port``), else the base + offset,
    else 0 (off)."""
    if explicit is not None:
        return explicit
    base = current().metrics_port
    return base + offset if base else 0


class Endpoint:
    """One registry served over HTTP by prometheus_client's own server (a daemon thread)."""

    def __init__(self, name: str, port: int, *, addr: str = "0.0.0.0") -> None:
        self.name, self.port, self.addr = name, port, addr
        self.registry = CollectorRegistry()
        self._server: Any = None

    def start(self) -> Endpoint:
        """Serve if a port is set. A port already taken is a warning, not the end of the service."""
        if self.port and self._server is None:
            try:
                self._server, _ = start_http_server(self.port, self.addr, registry=self.registry)
                log.info("metrics on http://%s:%d/metrics (%s)", self.addr, self.port, self.name)
            except OSError as e:
                log.warning("%s: cannot serve metrics on port %d (%s); give this process its own --metrics-port",
                            self.name, self.port, e)
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Reader(Collector):
    """Values read at scrape time from live objects (stats dataclasses, consumer positions)."""

    def __init__(self, fn: Callable[[], Iterable[Any]]) -> None:
        self.fn = fn

    def collect(self) -> Iterator[Any]:
        try:
            yield from self.fn()
        except RuntimeError:  # a dict changed size while read from the HTTP thread: the next scrape reads it
            return


_PROCESSOR_COUNTS = (
    ("transactions", "rollout_transactions", "committed transactions"),
    ("aborted", "rollout_aborts", "transactions aborted (the partitions are taken over again)"),
    ("fenced", "rollout_fences", "transactions fenced: the group moved on (its partitions were reassigned), or "
               "another producer took the transactional id"),
    ("rebuilt", "rollout_partition_rebuilds", "partition tasks rebuilt from the changelog"),
    ("recommitted", "rollout_recommits", "committed transactions found hanging and committed again"))


class ServiceMetrics:
    """The metrics of one stream service: ``observe_commit`` is its processors' ``on_commit``; ``attach`` each
    processor it runs (a supervised service rebuilds its processor: counters carry on across rebuilds)."""

    def __init__(self, service: str, registry: CollectorRegistry, *, refusals: frozenset[str] = REFUSALS) -> None:
        self.service = service
        self.refusals = refusals
        self._live: Any = None  # the processor running now
        self._before: dict[str, int] = {}  # what the processors it replaced counted
        self._lock = threading.Lock()
        lb = ("service",)
        self.records_in = Counter("rollout_records_in", "input records processed in committed transactions",
                                  (*lb, "topic"), registry=registry)
        self.records_out = Counter("rollout_records_out", "records written by committed transactions",
                                   (*lb, "topic", "event_type"), registry=registry)
        self.dead_letters = Counter("rollout_dead_letters", "dead letters written, by reason (error type)",
                                    (*lb, "reason"), registry=registry)
        self.refused = Counter("rollout_refusals", "valid input refused by a pipeline rule (stale, cross-family, "
                               "duplicate, group timeout), by reason; also counted in rollout_dead_letters",
                               (*lb, "reason"), registry=registry)
        self.staleness = Histogram("rollout_staleness_revisions", "batch target revision minus the revision that "
                                   "generated each record (off-policy lag)", lb, buckets=STALENESS_BUCKETS,
                                   registry=registry)
        self.tokens = Counter("rollout_tokens", "completion tokens, by stage (generated by the arena, batched "
                              "for the trainer)", (*lb, "stage"), registry=registry)
        self.reward = Summary("rollout_reward", "learner reward of scored training rollouts, by revision",
                              (*lb, "revision"), registry=registry)
        self.eval_answers = Counter("rollout_eval_answers", "scored held-out evaluation answers, by revision",
                                    (*lb, "revision"), registry=registry)
        self.eval_correct = Counter("rollout_eval_correct", "correct held-out answers (the verifier's exact_match, "
                                    "else reward >= 1), by revision", (*lb, "revision"), registry=registry)
        self.step_time = Histogram("rollout_trainer_step_seconds", "time of one optimizer step", lb,
                                   buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=registry)
        self.revision = Gauge("rollout_trainer_revision", "latest revision the trainer published", lb,
                              registry=registry)
        self.mismatch = Gauge("rollout_trainer_logprob_mismatch", "trainer-inference |logprob difference| over "
                              "the last step's tokens", (*lb, "stat"), registry=registry)
        registry.register(_Reader(self._collect))
        # children looked up once per label values: ``labels()`` validates and locks on every call, and a commit
        # of the batcher observes the staleness of every record of its batch
        self._children: dict[tuple[Any, ...], Any] = {}
        self._staleness = self.staleness.labels(service)
        self._batched = self.tokens.labels(service, "batched")

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (metric, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(self.service, *labels)
        return child

    def attach(self, proc: Any) -> None:
        proc.on_commit = self.observe_commit
        with self._lock:
            if self._live is not None:
                for attr, *_ in _PROCESSOR_COUNTS:
                    self._before[attr] = self._before.get(attr, 0) + getattr(self._live.stats, attr)
            self._live = proc

    def observe_commit(self, partition: int, records: list[Any], outs: list[Any]) -> None:
        child = self._child
        for topic, n in collections.Counter(r.topic for r in records).items():
            child(self.records_in, topic).inc(n)
        for (topic, kind), n in collections.Counter((o.topic, o.event.EVENT_TYPE) for o in outs).items():
            child(self.records_out, topic, kind).inc(n)
        for o in outs:
            ev = o.event
            if isinstance(ev, DeadLetter):
                child(self.dead_letters, ev.error_type).inc()
                if ev.error_type in self.refusals:
                    child(self.refused, ev.error_type).inc()
            elif isinstance(ev, TrainerBatch):
                self._batched.inc(ev.completion_tokens)
                observe = self._staleness.observe
                for src in ev.source_revisions:
                    lag = ev.target.revision - src.policy.revision
                    for _ in range(src.records):
                        observe(lag)
            elif isinstance(ev, RolloutScored):
                self._scored(ev)
            elif isinstance(ev, PolicyRevision):
                self._revision(ev)

    def _scored(self, ev: RolloutScored) -> None:
        outcome = learner_outcome(ev)
        if outcome is None:
            return
        rev, reward, correct = outcome
        if not ev.evaluation:
            self._child(self.reward, str(rev)).observe(reward)
            return
        self._child(self.eval_answers, str(rev)).inc()
        if correct:
            self._child(self.eval_correct, str(rev)).inc()

    def _revision(self, ev: PolicyRevision) -> None:
        self.revision.labels(self.service).set(ev.revision)
        m = ev.metrics
        if "step_s" in m:
            self.step_time.labels(self.service).observe(m["step_s"])
        for stat in ("mean", "max"):
            if f"mismatch_{stat}" in m:
                self.mismatch.labels(self.service, stat).set(m[f"mismatch_{stat}"])

    def _collect(self) -> Iterator[Any]:
        """What the processors count themselves (summed over every processor this service ran) and the
        consumer lag of the partitions the live one owns."""
        with self._lock:
            live, before = self._live, dict(self._before)
        for attr, name, doc in _PROCESSOR_COUNTS:
            c = CounterMetricFamily(name, doc, labels=("service",))
            c.add_metric((self.service,), float(before.get(attr, 0) + (getattr(live.stats, attr) if live else 0)))
            yield c
        lag = GaugeMetricFamily("rollout_consumer_lag", "committed records not yet consumed by this service "
                                "(last stable offset minus committed offset), per owned input partition",
                                labels=("service", "topic", "partition"))
        consumer = getattr(live, "consumer", None)
        if consumer is not None:
            from aiokafka import TopicPartition

            for p, offs in list(live.committed.items()):
                for topic, off in list(offs.items()):
                    lso = consumer.last_stable_offset(TopicPartition(topic, p))
                    if lso is not None and lso >= 0:
                        lag.add_metric((self.service, topic, str(p)), float(max(0, lso - off)))
        yield lag


Sample = tuple[str, str, str, dict[str, str], float]
"""(metric name, "counter" | "gauge", help, labels besides ``service``, value)"""


def stats_reader(registry: CollectorRegistry, service: str, read: Callable[[], Iterable[Sample]]) -> None:
    """Register metrics read from a process's own stats at scrape time (the arena, the policy server, the vLLM
    manager count for themselves; this only shows what they count)."""

    def collect() -> Iterator[Any]:
        families: dict[str, Any] = {}
        for name, kind, doc, labels, value in read():
            fam = families.get(name)
            if fam is None:
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                fam = families[name] = cls(name, doc, labels=("service", *labels))
            fam.add_metric((service, *labels.values()), float(value))
        yield from families.values()

    registry.register(_Reader(collect))
