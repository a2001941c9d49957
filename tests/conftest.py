"""Shared fixtures. Kafka for integration tests (@pytest.mark.integration):

* ROLLOUT_BOOTSTRAP_SERVERS set  -> that cluster is used as-is (SASL/TLS from ROLLOUT_KAFKA_* vars).
* otherwise                      -> one broker container per test session via testcontainers, from
  ROLLOUT_KAFKA_IMAGE (default rollout-log/kafka:local, built by kafka/build-image.sh / .ci/setup).
  It is configured only through the KAFKA_* environment convention of the official apache/kafka
  image, so ROLLOUT_KAFKA_IMAGE=apache/kafka:<version> works with the same fixture.

Port choice: a free host port P is picked before the container starts and published 1:1 (host P ->
container P); the PLAINTEXT listener listens on :P and is advertised as <docker host>:P, so the address
the broker hands out in metadata is reachable from the tests. Broker-to-itself traffic (e.g. the
transaction coordinator's AddPartitionsToTxn verification in Kafka 4) goes over a separate BROKER
listener advertised as localhost:9092 inside the container; without it, transactional produce fails
with NotEnoughReplicas when the advertised host:port is not reachable from inside the container.

No Docker engine is a test failure with a one-line reason, never a skip.

Fixtures: kafka_bootstrap (str), kafka_settings (streams.config.KafkaSettings), topic_name (str, unique
per test), make_topic (async factory creating a unique topic). Helper: unique_topic_name(request, suffix).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
import uuid
from typing import Any

import pytest

from streams.config import KafkaSettings
from streams.kafka_errors import KafkaUnreachable
from streams.local_broker import fetch_metadata, free_port, run_sync
from streams.topics import replication_factor

DEFAULT_IMAGE = "rollout-log/kafka:local"
LABEL = "rollout-log.tests"  # value: "kafka"; plus LABEL_PID = pid of the pytest process that owns it
LABEL_PID = "rollout-log.tests.pid"
CLUSTER_ID = "5L6g3nShT-eMCtK--X86sw"

_kafka_info: dict[str, Any] = {}


def kafka_image() -> str:
    return os.environ.get("ROLLOUT_KAFKA_IMAGE") or DEFAULT_IMAGE


def _external() -> str | None:
    return os.environ.get("ROLLOUT_BOOTSTRAP_SERVERS") or None


def _docker_client():
    """A docker SDK client for a live engine, or pytest.fail with a one-line reason."""
    try:
        import docker

        client = docker.from_env(timeout=20)
        client.ping()
        return client
    except Exception as e:  # noqa: BLE001 - any failure here means "no usable engine"
        reason = " ".join(str(e).split())[:300]
        pytest.fail(
            f"Docker engine not reachable ({reason}). Integration tests need Docker for the Kafka test "
            "container: run `bash .ci/setup` (installs docker.io and starts dockerd), or point the tests "
            "at a cluster with ROLLOUT_BOOTSTRAP_SERVERS.",
            pytrace=False,
        )


def _remove_orphans(client) -> None:
    """Remove broker containers left behind by earlier pytest processes that are gone (crash, kill -9)."""
    for c in client.containers.list(all=True, filters={"label": f"{LABEL}=kafka"}):
        pid = c.labels.get(LABEL_PID, "")
        if pid.isdigit() and os.path.exists(f"/proc/{pid}") and int(pid) != os.getpid():
            continue  # another live test session owns it
        try:
            c.remove(force=True, v=True)
        except Exception:  # noqa: BLE001
            pass


def _ryuk_available(client) -> bool:
    from testcontainers.core.config import testcontainers_config

    try:
        client.images.get(testcontainers_config.ryuk_image)
        return True
    except Exception:  # noqa: BLE001
        return False


def pytest_report_header(config) -> list[str]:
    if _external():
        return [f"kafka: external cluster ROLLOUT_BOOTSTRAP_SERVERS={_external()} (no container)"]
    line = f"kafka: testcontainers image {kafka_image()}"
    try:
        import docker

        img = docker.from_env(timeout=5).images.get(kafka_image())
        version = (img.labels or {}).get("org.opencontainers.image.version") or img.attrs["Config"].get("Env")
        line += f" ({img.short_id}; image version label: {version if isinstance(version, str) else '?'})"
    except Exception as e:  # noqa: BLE001
        line += f" (not inspectable now: {type(e).__name__})"
    return [line]


# The modules that run vLLM: the suite's vLLM (the ``vllm_server`` fixture) or servers of their own.
VLLM_MODULES = frozenset({"test_demo", "test_env_by_id", "test_pool", "test_reference", "test_verifiers_v1",
                          "test_vllm", "test_vllm_server"})


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown where it is not installed
def pytest_xdist_make_scheduler(config, log):
    """How the suite splits over pytest-xdist's two workers (``-n 2``, the README's command): a module's tests run
    on one worker (its module fixtures, a three-broker cluster, start once), and every module of ``VLLM_MODULES``
    on the same one, so the suite starts one vLLM, not one a worker, and no two model-heavy modules run at once on
    a 2-core, 24 GB machine; the other worker takes the rest meanwhile. (A scheduler of our own: pytest-xdist's
    ``--dist loadgroup`` renames node ids in a way pytest 9.2 no longer reads.)"""
    from pathlib import PurePosixPath

    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "vllm" if PurePosixPath(path).stem in VLLM_MODULES else path

    return ByModule(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    unlisted = sorted({item.path.stem for item in items if "vllm_server" in getattr(item, "fixturenames", ())}
                      - VLLM_MODULES)
    if unlisted:
        raise pytest.UsageError(f"{', '.join(unlisted)} use(s) the vllm_server fixture: add it to "
                                "tests/conftest.py's VLLM_MODULES (the worker that runs the suite's vLLM)")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    from policy.hf import cpu_kind

    terminalreporter.write_sep("-", "cpu")  # the suite's times depend on it: the kind is named with them
    terminalreporter.write_line(cpu_kind())
    if _kafka_info:
        items = ", ".join(f"{k}={v}" for k, v in _kafka_info.items())
        terminalreporter.write_sep("-", "kafka broker used")
        terminalreporter.write_line(items)


def _kafka_env(host_port: int, advertised_host: str) -> dict[str, str]:
    """Single-node KRaft combined broker+controller, in the official apache/kafka image's convention."""
    return {
        "CLUSTER_ID": CLUSTER_ID,
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_LISTENERS": f"PLAINTEXT://:{host_port},BROKER://:9092,CONTROLLER://:9093",
        "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://{advertised_host}:{host_port},BROKER://localhost:9092",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,BROKER:PLAINTEXT",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_INTER_BROKER_LISTENER_NAME": "BROKER",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_OFFSETS_TOPIC_NUM_PARTITIONS": "6",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
        "KAFKA_MIN_INSYNC_REPLICAS": "1",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
        "KAFKA_NUM_PARTITIONS": "1",
        "KAFKA_HEAP_OPTS": "-Xmx768m -Xms256m",
    }


def _start_container(timeout_s: float = 120.0) -> str:
    client = _docker_client()
    image = kafka_image()
    if image.startswith("rollout-log/"):
        try:
            client.images.get(image)
        except Exception:  # noqa: BLE001
            pytest.fail(f"Kafka test image {image} is not built: run `bash kafka/build-image.sh` "
                        "(or `bash .ci/setup`)", pytrace=False)
    _remove_orphans(client)

    from testcontainers.core.config import testcontainers_config
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.docker_client import DockerClient

    ryuk = _ryuk_available(client) and os.environ.get("TESTCONTAINERS_RYUK_DISABLED", "").lower() != "true"
    if not ryuk:
        # The Ryuk reaper image cannot be pulled here; we remove our container ourselves (finalizer
        # below, and _remove_orphans on the next session after a crash).
        os.environ["TESTCONTAINERS_RYUK_DISABLED"] = "true"
        testcontainers_config.ryuk_disabled = True

    host = DockerClient().host()
    port = free_port()
    container = (
        DockerContainer(image, labels={LABEL: "kafka", LABEL_PID: str(os.getpid())})
        .with_envs(**_kafka_env(port, host))
        .with_bind_ports(port, port)
        .with_name(f"rollout-log-test-kafka-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    )
    t0 = time.monotonic()
    container.start()
    _containers.append(container)
    bootstrap = f"{host}:{port}"
    deadline = t0 + timeout_s
    last = ""
    while time.monotonic() < deadline:
        container.reload()
        if container.status in ("exited", "dead"):
            out, err = container.get_logs()
            tail = (out + err).decode(errors="replace").strip().splitlines()[-15:]
            pytest.fail(f"Kafka container {image} exited during startup:\n" + "\n".join(tail), pytrace=False)
        try:
            md = run_sync(fetch_metadata({"bootstrap_servers": bootstrap}, timeout_s=5))
            break
        except KafkaUnreachable as e:
            last = str(e)
            time.sleep(0.5)
    else:
        pytest.fail(f"Kafka container {image} not ready on {bootstrap} after {timeout_s:.0f}s: {last}", pytrace=False)

    out, err = container.get_logs()
    m = re.search(r"Kafka version: (\S+)", (out + err).decode(errors="replace"))
    _kafka_info.update(
        path="testcontainers", image=image, image_id=container.get_wrapped_container().image.short_id,
        kafka_version=m.group(1) if m else "unknown", bootstrap=bootstrap, cluster_id=md.get("cluster_id"),
        ryuk="on" if ryuk else "off (containers removed by conftest)",
        startup_s=f"{time.monotonic() - t0:.1f}",
    )
    print(f"\n[kafka] testcontainers broker: image={image} version={_kafka_info['kafka_version']} "
          f"bootstrap={bootstrap} ready in {_kafka_info['startup_s']}s")
    return bootstrap


_containers: list[Any] = []


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Any:
    """host:port of a ready Kafka broker for this test session."""
    external = _external()
    if external:
        settings = KafkaSettings.from_env()
        try:
            md = run_sync(fetch_metadata(settings.client_kwargs(), timeout_s=15))
        except KafkaUnreachable as e:
            pytest.fail(f"{e} (ROLLOUT_BOOTSTRAP_SERVERS)", pytrace=False)
        _kafka_info.update(path="external", bootstrap=external, cluster_id=md.get("cluster_id"))
        yield external
        return
    try:
        yield _start_container()
    finally:
        while _containers:
            c = _containers.pop()
            try:
                c.stop()
            except Exception:  # noqa: BLE001
                pass


@pytest.fixture(scope="session")
def kafka_settings(kafka_bootstrap: str) -> KafkaSettings:
    """KafkaSettings pointing at the test broker (SASL/TLS kept from the environment for external clusters)."""
    return KafkaSettings.from_env().with_bootstrap(kafka_bootstrap)


def unique_topic_name(request: pytest.FixtureRequest, suffix: str = "") -> str:
    """A topic name unique to this test (and this run): test.<test name>.<suffix>.<random>."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name)[:120].strip("-")
    parts = ["test", slug] + ([suffix] if suffix else []) + [uuid.uuid4().hex[:8]]
    return ".".join(parts)


@pytest.fixture
def topic_name(request: pytest.FixtureRequest) -> str:
    return unique_topic_name(request)


@pytest.fixture
def make_topic(request: pytest.FixtureRequest, kafka_settings: KafkaSettings):
    """async make_topic(partitions=1, suffix="", configs=None) -> name: creates a unique topic and waits for it."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    async def _make(partitions: int = 1, suffix: str = "", configs: dict[str, str] | None = None) -> str:
        name = unique_topic_name(request, suffix)
        admin = AIOKafkaAdminClient(**kafka_settings.admin_kwargs())
        await admin.start()
        try:
            await admin.create_topics([NewTopic(name, partitions, replication_factor(), topic_configs=configs or {})])
            for _ in range(100):  # metadata propagation
                desc = await admin.describe_topics([name])
                if desc and desc[0]["error_code"] == 0 and len(desc[0]["partitions"]) == partitions:
                    break
                await asyncio.sleep(0.1)
        finally:
            await admin.close()
        return name

    return _make


@pytest.fixture(scope="session")
async def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real vLLM server on the packaged SmolLM2-135M-Instruct, started once per test session (~35 s on 2
    cores). ROLLOUT_VLLM_URL=http://host:port/v1 uses a running one instead (started with
    VLLM_SERVER_DEV_MODE=1, able to read this machine's checkpoint paths). Tests that swap weights load the
    revision they need first: the server is shared."""
    from policy.hf import FAMILY, prepare_model
    from producers.inference.vllm_server import VllmServer

    model = prepare_model()
    external = os.environ.get("ROLLOUT_VLLM_URL")
    if external:
        yield type("External", (), {"base_url": external.rstrip("/"), "served_model_name": FAMILY,
                                    "model_dir": model.path})()
        return
    server = VllmServer(model.path, port=free_port(), log_path=tmp_path_factory.mktemp("vllm") / "vllm.log")
    t0 = time.monotonic()
    await server.start()
    print(f"\n[vllm] {server.base_url} ready in {time.monotonic() - t0:.0f}s (log {server.log_path})")
    try:
        yield server
    finally:
        await server.stop()
