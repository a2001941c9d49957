"""The local-process broker (streams/local_broker.py, `rollout kafka ...`): real java, real Kafka."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from rollout.cli import main as rollout_main
from streams.local_broker import KAFKA_VERSION, POM, BrokerError, LocalBroker, free_port, port_accepts


def _free_pair() -> int:
    """A port p with p+1 also free (broker + controller listener)."""
    for _ in range(50):
        p = free_port()
        if p < 65535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p + 1))
                except OSError:
                    continue
            return p
    raise RuntimeError("no free port pair")


def test_pom_and_module_agree_on_kafka_version():
    pom_version = re.search(r"<kafka.version>([^<]+)</kafka.version>", POM.read_text()).group(1)
    assert pom_version == KAFKA_VERSION
    assert KAFKA_VERSION.startswith("4.")


@pytest.mark.integration
async def test_up_produce_down_up_consume(tmp_path: Path):
    broker = LocalBroker(state_dir=tmp_path / "kafka", port=_free_pair())
    topic = "local-broker-durability"
    payloads = [f"record-{i}".encode() for i in range(20)]
    try:
        broker.up()
        assert broker.is_running() and broker.pid_file.exists()
        assert broker.status()["reachable"]
        admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, 3, 1)])
        finally:
            await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap, acks="all")
        await producer.start()
        try:
            for i, p in enumerate(payloads):
                await producer.send_and_wait(topic, p, key=str(i).encode())
        finally:
            await producer.stop()

        assert broker.down() is True
        assert not broker.is_running()
        assert not port_accepts("127.0.0.1", broker.port)
        assert broker.down() is False  # idempotent

        broker.up()  # same state dir: data must still be there
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=broker.bootstrap, auto_offset_reset="earliest",
                                    group_id="durability-check")
        await consumer.start()
        try:
            got = []
            while len(got) < len(payloads):
                batch = await consumer.getmany(timeout_ms=10_000)
                assert batch, f"no records after restart (got {len(got)})"
                got += [r.value for recs in batch.values() for r in recs]
        finally:
            await consumer.stop()
        assert sorted(got) == sorted(payloads)
        assert "Kafka version: " + KAFKA_VERSION in broker.log_file.read_text()
    finally:
        broker.down()


def test_busy_port_is_a_clear_error(tmp_path: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(BrokerError, match=rf"port {port} is busy"):
            LocalBroker(state_dir=tmp_path / "kafka", port=port).up()


@pytest.mark.integration
def test_broker_that_cannot_start_points_at_log(tmp_path: Path):
    broker = LocalBroker(state_dir=tmp_path / "kafka", port=_free_pair(), heap="1k")  # JVM refuses this heap
    with pytest.raises(BrokerError, match=r"exited with code \d+ while starting; see .*kafka\.log"):
        broker.up(timeout_s=60)
    assert not broker.is_running()


def test_missing_java_is_a_clear_error(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BrokerError, match="java not found"):
        LocalBroker(state_dir=tmp_path / "kafka", port=_free_pair()).up()


def test_up_with_external_cluster_starts_nothing(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setenv("ROLLOUT_BOOTSTRAP_SERVERS", "kafka.example.internal:9092")
    monkeypatch.setenv("ROLLOUT_STATE_DIR", str(tmp_path))
    assert rollout_main(["kafka", "up"]) == 0
    assert "not starting a local broker" in capsys.readouterr().out
    assert not (tmp_path / "kafka").exists()


def test_unreachable_bootstrap_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("ROLLOUT_BOOTSTRAP_SERVERS", f"localhost:{free_port()}")
    assert rollout_main(["topics", "list"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("rollout: error: cannot reach Kafka at localhost:") and "\n" not in err


def test_cluster_ids_never_look_like_options():
    """1 in 64 random ids starts with '-', which the storage tool took for an option (a CI run failed so)."""
    from streams.local_broker import _kafka_uuid

    ids = [_kafka_uuid() for _ in range(3000)]
    assert all(len(i) == 22 and not i.startswith("-") for i in ids) and len(set(ids)) == len(ids)


def test_a_demo_whose_broker_cannot_start_stops_with_its_reason_in_one_line(tmp_path: Path, monkeypatch, capsys):
    """The broker starts beside the demo's first steps (the plan, the model, vLLM: ``streams.config.broker_starting``);
    its failure still ends the command with one line, once the run reaches the step that needs Kafka."""
    monkeypatch.delenv("ROLLOUT_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.setenv("ROLLOUT_STATE_DIR", str(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        monkeypatch.setenv("ROLLOUT_KAFKA_PORT", str(port))
        assert rollout_main(["demo", "--policy", "tiny", "--no-progress", "--keep-runs", "100"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"rollout: error: port {port} is busy: something else listens on localhost:{port} " \
                  "(stop it, or choose another port with ROLLOUT_KAFKA_PORT)", err
