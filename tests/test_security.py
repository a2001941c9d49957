"""Kafka security on a real broker: SASL_SSL (SCRAM-SHA-512) with TLS certificates made here, the
StandardAuthorizer with no access unless an ACL allows it, and one principal per service whose ACLs come
from the service declarations (streams.security). A broker of its own for this module (~15 s to start)."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
import subprocess
import sys
import time
import uuid

import pytest

from consumers import testing
from consumers.registry import SERVICES
from consumers.runner import System
from consumers.settings import ServiceSettings
from streams import security, topics
from streams.changelog import changelog_topic
from streams.config import KafkaSettings
from streams.errors import diagnose
from streams.kafka_errors import KafkaError
from streams.local_broker import free_port, run_sync
from tests._certs import make_ca, make_keystore
from tests.conftest import CLUSTER_ID, LABEL, LABEL_PID, _docker_client, kafka_image
from tests.test_eos_pipeline import THREE, batch_record_ids, publish_revision, read_all, seed_groups

pytestmark = pytest.mark.integration

USERS = {"admin": "admin-secret", **{n: f"{n}-secret" for n in (*SERVICES, security.ARENA)}}
KEYSTORE_PASSWORD = "keystore-secret"


def _server_properties(port: int) -> str:
    return f"""node.id=1
process.roles=broker,controller
listeners=SASL_SSL://:{port},BROKER://:9092,CONTROLLER://:9093
advertised.listeners=SASL_SSL://localhost:{port},BROKER://localhost:9092
listener.security.protocol.map=SASL_SSL:SASL_SSL,BROKER:PLAINTEXT,CONTROLLER:PLAINTEXT
controller.listener.names=CONTROLLER
inter.broker.listener.name=BROKER
controller.quorum.voters=1@localhost:9093
log.dirs=/var/lib/kafka/data
offsets.topic.replication.factor=1
offsets.topic.num.partitions=6
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
sasl.enabled.mechanisms=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
ssl.keystore.type=PKCS12
ssl.keystore.location=/etc/rollout-test/broker.p12
ssl.keystore.password={KEYSTORE_PASSWORD}
ssl.key.password={KEYSTORE_PASSWORD}
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:admin;User:ANONYMOUS
"""
# User:ANONYMOUS is the broker's and controller's own traffic on BROKER/CONTROLLER, listeners not published.


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory):
    """(bootstrap, certificate dir) of a SASL_SSL broker; SCRAM users are added when its storage is formatted."""
    client = _docker_client()
    d = tmp_path_factory.mktemp("tls")
    d.chmod(0o755)  # the broker runs as uid 1000
    ca = make_ca(d, "test-ca")
    make_ca(d, "other-ca")
    make_keystore(d, ca, ["localhost", "127.0.0.1"], KEYSTORE_PASSWORD)
    port = free_port()
    (d / "server.properties").write_text(_server_properties(port))
    for f in d.iterdir():
        f.chmod(0o644)
    scram = " ".join(f"--add-scram 'SCRAM-SHA-512=[name={u},password={p}]'" for u, p in USERS.items())
    java = "java -cp '/opt/kafka/libs/*' -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.xml"
    cmd = (f"{java} kafka.tools.StorageTool format --cluster-id={CLUSTER_ID} -c /etc/rollout-test/server.properties "
           f"{scram} && exec {java} -Xmx512m kafka.Kafka /etc/rollout-test/server.properties")
    container = client.containers.run(
        kafka_image(), entrypoint=["bash", "-c", cmd], detach=True, ports={f"{port}/tcp": port},
        volumes={str(d): {"bind": "/etc/rollout-test", "mode": "ro"}},
        labels={LABEL: "kafka", LABEL_PID: str(os.getpid())}, name=f"rollout-log-test-kafka-sasl-{uuid.uuid4().hex[:6]}")
    try:
        admin = settings(f"localhost:{port}", d, "admin")
        deadline = time.monotonic() + 120
        while True:
            try:
                run_sync(_ping(admin.admin_kwargs()))
                break
            except Exception as e:  # noqa: BLE001
                container.reload()
                if container.status != "running" or time.monotonic() > deadline:
                    tail = container.logs().decode(errors="replace").splitlines()[-15:]
                    pytest.fail(f"SASL_SSL broker not ready ({e}):\n" + "\n".join(tail), pytrace=False)
                time.sleep(0.5)
        yield f"localhost:{port}", d
    finally:
        container.remove(force=True, v=True)


async def _ping(kw):
    from aiokafka.admin import AIOKafkaAdminClient

    a = AIOKafkaAdminClient(**kw, request_timeout_ms=5000)
    try:
        await asyncio.wait_for(a.start(), 10)
        await a.list_topics()
    finally:
        await a.close()


def settings(bootstrap, certs, user, *, password=None, ca="test-ca") -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=bootstrap, security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512",
                         sasl_username=user, sasl_password=password or USERS[user], ssl_cafile=str(certs / f"{ca}.pem"))


@pytest.fixture
def secured(secure_broker, monkeypatch):
    """A fresh topic prefix with the pipeline's topics, changelogs and every principal's ACLs applied by the admin.
    Returns kw(user) -> client kwargs of that principal."""
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", f"s{uuid.uuid4().hex[:8]}.")
    bootstrap, certs = secure_broker
    admin = settings(bootstrap, certs, "admin").admin_kwargs()
    changelogs = [changelog_topic(s.name, s.partitions) for s in SERVICES.values()]
    run_sync(topics.create_topics(admin, [*topics.TOPICS.values(), *changelogs]))
    run_sync(security.apply_acls(admin, security.all_acls(SERVICES)))
    return lambda user, **kw: settings(bootstrap, certs, user, **kw).client_kwargs()


async def test_pipeline_runs_with_one_principal_per_service(secured):
    cfg = ServiceSettings(family=testing.FAMILY, batch_records=32, flush_after_s=1.0)
    systems = [System([name], cfg, secured(name)) for name in THREE]
    for s in systems:
        await s.__aenter__()
    try:
        await publish_revision(secured("trainer"), 0)
        expected = await seed_groups(secured("arena"), 20, transactional_id=f"arena-{uuid.uuid4().hex[:6]}")
        recs = await read_all(secured("admin"), topics.TRAINER_BATCHES.name,
                              until=lambda rs: sum(batch_record_ids(rs).values()) >= len(expected), timeout_s=90)
    finally:
        for s in systems:
            await s.__aexit__(None, None, None)
    got = batch_record_ids(recs)
    assert set(got) == expected and max(got.values()) == 1


async def _admin_start_error(kw) -> str:
    from aiokafka.admin import AIOKafkaAdminClient

    a = AIOKafkaAdminClient(**kw, request_timeout_ms=5000)
    try:
        await a.start()
    except Exception as e:  # noqa: BLE001
        return str(await diagnose(e, kw))
    finally:
        await a.close()
    raise AssertionError("connected")


async def test_wrong_password_one_line(secured):
    msg = await _admin_start_error(secured("credit", password="wrong"))
    assert msg.startswith("SASL authentication of User:credit (SCRAM-SHA-512)") and "\n" not in msg
    assert "ROLLOUT_KAFKA_SASL_PASSWORD" in msg


async def test_unknown_ca_one_line(secured):
    msg = await _admin_start_error(secured("credit", ca="other-ca"))
    assert msg.startswith("TLS: the certificate of the Kafka broker") and "ROLLOUT_KAFKA_SSL_CAFILE" in msg
    assert "\n" not in msg


async def test_unauthorized_write_fails_and_nothing_is_visible(secured):
    """The verifier may not write training-records: its transaction fails with one line, and a read_committed
    reader sees none of it (the records it did write to scores, in the same transaction, are aborted)."""
    from aiokafka import AIOKafkaProducer

    kw = secured("verifier")
    prod = AIOKafkaProducer(**kw, transactional_id=f"{topics.group_id('verifier')}-0", enable_idempotence=True)
    await prod.start()
    try:
        with pytest.raises(Exception) as info:
            async with prod.transaction():
                await prod.send(topics.SCORES.name, b"half", key=b"k")
                await (await prod.send(topics.TRAINING_RECORDS.name, b"not allowed", key=b"k"))
    finally:
        await prod.stop()
    msg = str(await diagnose(info.value, kw))
    assert msg == (f"User:verifier is not allowed this on topic(s) {topics.TRAINING_RECORDS.name}: grant it with "
                   "`rollout kafka acls --apply` (as an admin) or fix the principal's ACLs")
    admin = secured("admin")
    assert await read_all(admin, topics.SCORES.name, idle_s=2, timeout_s=10) == []
    assert await read_all(admin, topics.TRAINING_RECORDS.name, idle_s=2, timeout_s=10) == []


async def test_service_without_read_permission_says_so_at_start(secured):
    """credit run as a principal without READ on its input (batcher's: no ACL on scores): the start-up check
    names the topic and the principal."""
    await security.check_access(SERVICES["credit"], secured("credit"))  # all granted: passes
    kw = secured("batcher")
    with pytest.raises(KafkaError) as info:
        await security.check_access(SERVICES["credit"], kw)
    assert str(info.value) == (
        f"service credit: User:batcher may not read input topic(s) {topics.SCORES.name}, {topics.REFERENCED.name} "
        "(or they do not exist): "
        "grant it with `rollout kafka acls --apply` as an admin")


def test_acls_cli_prints_and_applies(secured, secure_broker):
    """`rollout kafka acls --apply` as the admin (idempotent: the fixture applied them already); a wrong
    password ends it with one line."""
    bootstrap, certs = secure_broker
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": bootstrap, "ROLLOUT_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
           "ROLLOUT_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512", "ROLLOUT_KAFKA_SASL_USERNAME": "admin",
           "ROLLOUT_KAFKA_SASL_PASSWORD": USERS["admin"], "ROLLOUT_KAFKA_SSL_CAFILE": str(certs / "test-ca.pem")}
    out = subprocess.run([sys.executable, "-m", "rollout.cli", "kafka", "acls", "--apply"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"User:credit      READ   GROUP            {topics.group_id('credit')}" in out.stdout
    assert "User:arena       WRITE  TRANSACTIONAL_ID arena-*" in out.stdout
    assert out.stdout.rstrip().endswith(f"applied {len(security.all_acls(SERVICES))} ACLs to {bootstrap}")
    bad = subprocess.run([sys.executable, "-m", "rollout.cli", "kafka", "acls", "--apply"],
                         env={**env, "ROLLOUT_KAFKA_SASL_PASSWORD": "wrong"}, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith("rollout: error: SASL authentication of User:admin (SCRAM-SHA-512)")


def test_a_service_started_with_wrong_credentials_or_permissions_stops_with_one_line(secured, secure_broker):
    """`rollout serve`: a wrong password, or a principal without read permission on the service's input, ends
    the service at start-up with the cause in one line (exit 1) instead of retrying forever."""
    bootstrap, certs = secure_broker
    env = {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": bootstrap, "ROLLOUT_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
           "ROLLOUT_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512", "ROLLOUT_KAFKA_SSL_CAFILE": str(certs / "test-ca.pem")}
    cases = {("credit", "wrong"): "rollout serve credit: error: SASL authentication of User:credit",
             # a service first makes sure of its own topics: the batcher's principal may not create the credit
             # changelog (nor see its input, when no earlier test created it)
             ("batcher", USERS["batcher"]): "rollout serve credit: error: creating topics failed: "}
    for (user, password), expected in cases.items():
        out = subprocess.run([sys.executable, "-m", "consumers", "serve", "credit", "--log-level", "ERROR"],
                             env={**env, "ROLLOUT_KAFKA_SASL_USERNAME": user, "ROLLOUT_KAFKA_SASL_PASSWORD": password},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out.stderr[-2000:]
        lines = [line for line in out.stderr.splitlines() if line.startswith("rollout serve")]
        assert len(lines) == 1 and lines[0].startswith(expected), out.stderr[-2000:]
        if user == "batcher":
            assert f"{changelog_topic('credit', 12).name}: error 29 Authorization failed" in lines[0], lines[0]
        assert "rollout kafka acls --apply" in lines[0] or "ROLLOUT_KAFKA_SASL_PASSWORD" in lines[0]
        assert "Traceback" not in out.stderr


def _sasl_env(bootstrap, certs, user) -> dict[str, str]:
    return {**os.environ, "ROLLOUT_BOOTSTRAP_SERVERS": bootstrap, "ROLLOUT_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "ROLLOUT_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512", "ROLLOUT_KAFKA_SASL_USERNAME": user,
            "ROLLOUT_KAFKA_SASL_PASSWORD": USERS[user], "ROLLOUT_KAFKA_SSL_CAFILE": str(certs / "test-ca.pem")}


async def test_whole_pipeline_arena_to_trainer_each_under_its_own_principal(secured, secure_broker, tmp_path):
    """A real arena (`rollout arena`, its local policy server, transactional id arena-<id>) as User:arena, the four
    services in-process each as its own principal, the trainer publishing every revision as User:trainer; the
    ACLs are exactly `rollout kafka acls` (no CREATE but on each service's changelog). Every record is trained
    once or refused as stale with its reason, and the replayed run's audit is clean."""
    from consumers import settings as service_settings
    from consumers.trainer.step import initial_revision
    from replay.audit import run_audit
    from replay.ingest import Replayer
    from schemas import codec
    from schemas.events import DeadLetter, TrainerBatch, TrainingRecord
    from schemas.plan_compiler import compile_plan
    from schemas.policy import PolicyRevision
    from streams.revisions import publish
    from tests.test_arena_fleet import PLAN, RUN

    bootstrap, certs = secure_broker
    (tmp_path / "plan.toml").write_text(PLAN)
    plan = compile_plan(str(tmp_path / "plan.toml"))
    rev0 = initial_revision(plan.family, tmp_path / "ckpt", seed=0, run_id=RUN)
    await publish(secured("trainer"), rev0)  # revision 0 as the trainer: it writes every revision
    cfg = service_settings.build(plan=plan, credit=True, checkpoint_dir=str(tmp_path / "ckpt"), lr=1e-3,
                                 flush_after_s=3.0, group_timeout_s=5.0)
    systems = [System([name], cfg, secured(name)) for name in SERVICES]
    for s in systems:
        await s.__aenter__()
    admin = secured("admin")

    async def topic(t: topics.Topic, cls) -> list:
        return [codec.decode(r.value, cls) for r in await read_all(admin, t.name, idle_s=0.5, timeout_s=10)]

    try:
        arena = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rollout.cli", "arena", str(tmp_path / "plan.toml"), "--groups", "8",
            "--follow-revisions", "--no-progress", "--policy", "local", "--policy-port", "0",
            "--checkpoint", rev0.checkpoint.uri.removeprefix("file://"), "--concurrency", "4", "--run-id", RUN,
            "--arena-id", "secured", env=_sasl_env(bootstrap, certs, "arena"), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT)
        out, _ = await asyncio.wait_for(arena.communicate(), 180)
        assert arena.returncode == 0, out.decode()[-3000:]
        for _ in range(60):  # until every record is in a batch or refused, and every batch trained
            records = await topic(topics.TRAINING_RECORDS, TrainingRecord)
            batches = await topic(topics.TRAINER_BATCHES, TrainerBatch)
            letters = await topic(topics.DEAD_LETTERS, DeadLetter)
            revs = await topic(topics.POLICY_REVISIONS, PolicyRevision)
            stale = [d for d in letters if d.error_type == "StaleRecordError"]
            if (records and sum(len(b.records) for b in batches) + len(stale) >= len(records)
                    and len(revs) - 1 >= len(batches)):
                break
            await asyncio.sleep(1)
    finally:
        for s in systems:
            await s.__aexit__(None, None, None)
    assert len(records) == 8 * 4, len(records)  # 8 groups of 4 rollouts, one step each
    assert [d for d in letters if d.error_type != "StaleRecordError"] == []
    batched = Counter(x.record_id for b in batches for x in b.records)
    refused = {who: Counter(codec.decode(d.raw, TrainingRecord).record_id for d in stale if d.service == who)
               for who in ("batcher", "trainer")}
    # each record: in one batch, or refused by the batcher; of those batched, the trainer refuses what its
    # revision finds too stale and trains the rest
    assert max((batched + refused["batcher"]).values()) == 1
    assert set(batched + refused["batcher"]) == {r.record_id for r in records}
    assert set(refused["trainer"]) <= set(batched) and max(refused["trainer"].values(), default=1) == 1
    assert all(d.error_message for d in stale)
    print(f"records={len(records)} batches={len(batches)} revisions={len(revs) - 1} "
          f"refused_by_batcher={len(refused['batcher'])} refused_by_trainer={len(refused['trainer'])}")
    # revisions 1.. are the trainer's, each naming one batch: written as User:trainer through its ACLs
    assert [r.revision for r in revs] == list(range(len(revs))) and len(revs) - 1 == len(batches) >= 2
    assert {r.batch_id for r in revs[1:]} == {b.batch_id for b in batches}
    db = str(tmp_path / "run.duckdb")
    await Replayer(db, settings(bootstrap, certs, "admin")).run()
    report = run_audit(db)
    assert report.ok, [f.message for f in report.violations][:5]
