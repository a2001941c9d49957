"""Prometheus metrics (streams/metrics.py): each service's endpoint answers during an exactly-once pipeline run
on a real broker, and its counters match what the log holds afterwards (records in/out, dead letters by reason).
"""

from __future__ import annotations

import asyncio
import random
import socket
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from consumers import testing
from consumers.registry import SERVICES
from consumers.runner import System
from consumers.settings import ServiceSettings
from schemas import codec
from schemas.events import DeadLetter, TrainerBatch
from streams import metrics, topics
from streams.local_broker import ephemeral_low
from tests.test_eos_pipeline import THREE, batch_record_ids, prefix, publish_revision, read_all, seed_groups  # noqa: F401

pytestmark = pytest.mark.integration


def free_base(offsets: list[int]) -> int:
    """A base port whose base + offset ports are all free now, below the kernel's ephemeral range: there, a
    Kafka client's outgoing connection could take one of them between this check and the server's bind (seen
    once in CI: the trainer's endpoint never bound, its scrape was refused)."""
    top = ephemeral_low() - max(offsets) - 1
    for _ in range(100):
        base = random.randrange(max(1024, top - 10000), top)
        socks = []
        try:
            for off in offsets:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + off))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from one /metrics answer."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lb), v in samples.items() if n == name and labels.items() <= dict(lb).items())


def test_port_scheme(monkeypatch):
    monkeypatch.setenv("ROLLOUT_METRICS_PORT", "9400")
    assert metrics.port_for(metrics.OFFSETS["arena"]) == 9400
    assert metrics.port_for(metrics.SERVICE_OFFSET + list(SERVICES).index("trainer")) == 9413
    assert metrics.port_for(0, explicit=9999) == 9999
    monkeypatch.setenv("ROLLOUT_METRICS_PORT", "0")
    assert metrics.port_for(5) == 0


def test_a_taken_port_is_a_warning_not_the_end():
    import logging

    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    metrics.log.addHandler(handler)
    try:
        with socket.socket() as taken:
            taken.bind(("0.0.0.0", 0))
            taken.listen()
            ep = metrics.Endpoint("verifier", taken.getsockname()[1]).start()
            assert ep._server is None and "give this process its own --metrics-port" in " ".join(warnings)
            ep.close()
    finally:
        metrics.log.removeHandler(handler)
    ep = metrics.Endpoint("verifier", free_base([0])).start()
    try:
        assert httpx.get(f"http://127.0.0.1:{ep.port}/metrics", timeout=5).status_code == 200
    finally:
        ep.close()


async def test_service_metrics_match_the_log(kafka_settings, prefix, monkeypatch):
    offsets = [metrics.SERVICE_OFFSET + list(SERVICES).index(n) for n in THREE]
    base = free_base(offsets)
    monkeypatch.setenv("ROLLOUT_METRICS_PORT", str(base))
    ports = dict(zip(THREE, (base + o for o in offsets)))
    kw = kafka_settings.client_kwargs()
    cfg = ServiceSettings(family=testing.FAMILY, batch_records=16, flush_after_s=1.0)
    bad = [b"garbage", b"RLEV\x01\x04rollxxxxxxxx"]
    injected = {t.name: len(bad) for t in (topics.STEPS, topics.ROLLOUTS, topics.SCORES, topics.TRAINING_RECORDS)}
    extra = [(t, b"k", v) for t in injected for v in bad]
    async with System(THREE, cfg, kw):
        # during the run: every service's endpoint answers
        during = {n: await asyncio.to_thread(scrape, p) for n, p in ports.items()}
        await publish_revision(kw, 0)
        expected = await seed_groups(kw, 30, extra=extra)
        await read_all(kw, topics.TRAINER_BATCHES.name,
                       until=lambda rs: sum(batch_record_ids(rs).values()) >= len(expected), timeout_s=90)
        await read_all(kw, topics.DEAD_LETTERS.name, until=lambda rs: len(rs) >= len(extra), timeout_s=30)
        await asyncio.sleep(2.0)  # the last transactions' on_commit ran before their outputs were readable
        after = {n: await asyncio.to_thread(scrape, p) for n, p in ports.items()}
    for n in THREE:
        assert ("rollout_transactions_total", (("service", n),)) in during[n]

    log = {t: await read_all(kw, t, idle_s=2) for t in (topics.STEPS.name, topics.ROLLOUTS.name, topics.SCORES.name,
                                                         topics.TRAINING_RECORDS.name, topics.TRAINER_BATCHES.name,
                                                         topics.DEAD_LETTERS.name)}
    n_log = {t: len(rs) for t, rs in log.items()}
    v, c, b = (after[n] for n in THREE)
    # records in: every record of the service's input topics (the malformed ones too)
    assert total(v, "rollout_records_in_total") == n_log[topics.STEPS.name] + n_log[topics.ROLLOUTS.name]
    assert total(c, "rollout_records_in_total") == n_log[topics.SCORES.name]
    assert total(b, "rollout_records_in_total") == n_log[topics.TRAINING_RECORDS.name]
    # records out: what the log holds of each output topic, less what the test wrote there itself
    assert total(v, "rollout_records_out_total", topic=topics.SCORES.name) == \
        n_log[topics.SCORES.name] - injected[topics.SCORES.name] > 0
    assert total(c, "rollout_records_out_total", topic=topics.TRAINING_RECORDS.name) == \
        n_log[topics.TRAINING_RECORDS.name] - injected[topics.TRAINING_RECORDS.name] > 0
    assert total(b, "rollout_records_out_total", topic=topics.TRAINER_BATCHES.name) == \
        n_log[topics.TRAINER_BATCHES.name] > 0
    # dead letters by service and reason
    letters = Counter((d.service, d.error_type) for d in
                      (codec.decode(r.value, DeadLetter) for r in log[topics.DEAD_LETTERS.name]))
    scraped = Counter({(n, dict(lb)["reason"]): int(val) for n in THREE for (name, lb), val in after[n].items()
                       if name == "rollout_dead_letters_total" and val})
    assert scraped == letters and sum(letters.values()) == len(extra)
    for n in THREE:
        assert total(after[n], "rollout_records_out_total", topic=topics.DEAD_LETTERS.name) == \
            sum(k for (svc, _), k in letters.items() if svc == n)
    # staleness: one observation per batched record; tokens batched = the batches' completion tokens
    batches = [codec.decode(r.value, TrainerBatch) for r in log[topics.TRAINER_BATCHES.name]]
    assert total(b, "rollout_staleness_revisions_count") == sum(len(x.records) for x in batches) == len(expected)
    assert total(b, "rollout_tokens_total", stage="batched") == sum(x.completion_tokens for x in batches)
    # the verifier's reward by revision: one observation per scored training rollout
    assert total(v, "rollout_reward_count", revision="0") == \
        n_log[topics.SCORES.name] - injected[topics.SCORES.name]
    # everything consumed: no lag left on any owned partition
    assert all(val == 0 for n in THREE for (name, _), val in after[n].items() if name == "rollout_consumer_lag")
    assert total(v, "rollout_aborts_total") == total(v, "rollout_fences_total") == 0


def test_arena_and_policy_server_metrics(kafka_bootstrap, prefix, tmp_path):
    """`rollout arena` (with its local policy server) answers on its metrics port while it generates."""
    import os
    import signal
    import subprocess
    import sys
    import time

    base = free_base([0, 1])
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": kafka_bootstrap}
    log_file = (tmp_path / "arena.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "rollout.cli", "arena", "examples/plans/arithmetic.toml",
                             "--groups", "0", "--no-progress", "--policy-port", str(base + 1),
                             "--metrics-port", str(base)], env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline, got = time.monotonic() + 120, {}
        committed = {"service": "arena", "topic": topics.ROLLOUTS.name}
        while time.monotonic() < deadline and total(got, "rollout_records_out_total", **committed) < 8:
            assert proc.poll() is None, (tmp_path / "arena.log").read_text()[-3000:]
            try:
                got = scrape(base)
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        # finished rollouts are counted when generated, records when their transaction commits
        assert total(got, "rollout_arena_rollouts_total", status="all") >= total(got, "rollout_records_out_total",
                                                                                 **committed) >= 8
        assert total(got, "rollout_tokens_total", stage="generated") > 0
        assert total(got, "rollout_policy_requests_total", service="policy") >= 8
        learner = {"server": f"http://127.0.0.1:{base + 1}/v1"}  # its pool of one: the server it started
        assert total(got, "rollout_learner_requests_total", **learner) >= 8
        assert total(got, "rollout_learner_up", **learner) == 1 and total(got, "rollout_learner_errors_total") == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
