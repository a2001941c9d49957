"""A single-node Apache Kafka (KRaft, combined broker+controller) run as a background java process.

The jars come from kafka/pom.xml via Maven into a cache outside git
(~/.cache/rollout-log/kafka-<version>/libs, or $ROLLOUT_CACHE_DIR/kafka-<version>/libs); `up` runs
Maven itself when they are missing. Data, config, pid and log live in the project-local state dir
(.state/kafka/, or $ROLLOUT_STATE_DIR/kafka/) and survive down -> up.

    rollout kafka up | down | status | logs      (rollout/kafka_cmd.py)
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streams.kafka_errors import KafkaError, KafkaUnreachable
from schemas.cache import cache_dir

# Keep in sync with <kafka.version> in kafka/pom.xml (tests/test_local_broker.py checks it).
KAFKA_VERSION = "4.4.0"
MAIN_CLASS = "kafka.Kafka"
REPO_ROOT = Path(__file__).resolve().parents[1]
POM = REPO_ROOT / "kafka" / "pom.xml"
DEFAULT_LOCAL_PORT = 9092  # the local broker's port unless ROLLOUT_KAFKA_PORT says otherwise
LOG4J_CONFIG = REPO_ROOT / "kafka" / "log4j2.xml"


class BrokerError(KafkaError):
    pass


def libs_dir(version: str = KAFKA_VERSION) -> Path:
    return cache_dir() / f"kafka-{version}" / "libs"


def state_root() -> Path:
    env = os.environ.get("ROLLOUT_STATE_DIR")
    if env:
        return Path(env)
    base = REPO_ROOT if (REPO_ROOT / "pyproject.toml").exists() else Path.cwd()
    return base / ".state"


def ensure_jars(version: str = KAFKA_VERSION, *, quiet: bool = True) -> Path:
    """The libs dir with the Kafka broker classpath, resolved with Maven if missing."""
    libs = libs_dir(version)
    if (libs / f"kafka_2.13-{version}.jar").is_file():
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError(f"mvn not found: it is needed once to fetch the Kafka {version} jars into {libs} "
                          "(apt-get install maven)")
    if not POM.is_file():
        raise BrokerError(f"{POM} not found: run from a checkout of rollout-log")
    cmd = [mvn, "-B", "-f", str(POM), "package", f"-Dlibs.dir={libs}", f"-Dkafka.version={version}"]
    if quiet:
        cmd.insert(1, "-q")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not (libs / f"kafka_2.13-{version}.jar").is_file():
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "ERROR" in ln] or ["(no output)"]
        raise BrokerError(f"resolving Kafka {version} jars with Maven failed: {lines[0].strip()}")
    return libs


def port_is_free(port: int) -> bool:
    """Nothing listens on localhost:port (IPv4 or IPv6) and the port can be bound."""
    if port_accepts("127.0.0.1", port) or port_accepts("::1", port):
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range: ports below it are never a client's local port."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(*, restartable: bool = False) -> int:
    """A port nothing listens on. ``restartable``: one for a server that stops and starts again on it (a broker
    restarted by a fault test), taken below the kernel's ephemeral range. While such a server is down, its
    clients keep connecting to an ephemeral port nobody listens on, and Linux sometimes connects one of them
    to itself on that very port (a TCP self-connect); the restart then finds its port in use."""
    if not restartable:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    low = ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        if port_is_free(port):
            return port
    raise BrokerError(f"no free port below the ephemeral range (< {low})")


def port_accepts(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine to completion from sync code, even when called inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")


async def fetch_metadata(client_kwargs: dict[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
    """Cluster metadata via aiokafka (proves the broker speaks Kafka, not just that a port is open)."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import KafkaError as AIOKafkaError

    kw = dict(client_kwargs)
    kw.setdefault("request_timeout_ms", int(timeout_s * 1000))
    admin = AIOKafkaAdminClient(**kw)
    # Failed probes are expected while a broker starts; the caller reports the outcome in one line.
    quiet = logging.getLogger("aiokafka")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        return await asyncio.wait_for(admin.describe_cluster(), timeout_s)
    except (AIOKafkaError, OSError, asyncio.TimeoutError) as e:
        why = str(e) if type(e).__name__ in str(e) else f"{type(e).__name__} {e}".strip()
        raise KafkaUnreachable(f"cannot reach Kafka at {kw.get('bootstrap_servers')}: {why}") from None
    finally:
        await admin.close()
        quiet.setLevel(level)


def _kafka_uuid() -> str:
    """A cluster id as Kafka makes them; never starting with '-' (the storage tool would read it as an option,
    which is why Kafka's own Uuid.randomUuid() skips those too)."""
    while True:
        out = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not out.startswith("-"):
            return out


@dataclass
class LocalBroker:
    state_dir: Path  # .state/kafka
    port: int = DEFAULT_LOCAL_PORT
    controller_port: int | None = None
    version: str = KAFKA_VERSION
    heap: str = "768m"
    overrides: dict[str, str] = field(default_factory=dict)  # extra server.properties (tests)

    @classmethod
    def from_env(cls, port: int | None = None, state_dir: Path | None = None) -> LocalBroker:
        if port is None:
            port = int(os.environ.get("ROLLOUT_KAFKA_PORT") or DEFAULT_LOCAL_PORT)
        cport = os.environ.get("ROLLOUT_KAFKA_CONTROLLER_PORT")
        return cls(state_dir=state_dir or state_root() / "kafka", port=port,
                   controller_port=int(cport) if cport else None)

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir)
        if self.controller_port is None:
            self.controller_port = self.port + 1

    # paths
    @property
    def data_dir(self) -> Path:
        return self.state_dir / "data"

    @property
    def config_file(self) -> Path:
        return self.state_dir / "server.properties"

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "kafka.pid"

    @property
    def log_file(self) -> Path:
        return self.state_dir / "kafka.log"

    @property
    def bootstrap(self) -> str:
        return f"localhost:{self.port}"

    # process
    def pid(self) -> int | None:
        """Pid of our running broker, or None (a stale pid file is removed)."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            cmdline, stat = [], ""
        zombie = stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]
        if MAIN_CLASS.encode() in cmdline and str(self.config_file).encode() in cmdline and not zombie:
            return pid
        self.pid_file.unlink(missing_ok=True)
        return None

    def is_running(self) -> bool:
        return self.pid() is not None

    def configured_port(self) -> int | None:
        """The PLAINTEXT port in the server.properties last written to the state dir."""
        try:
            for line in self.config_file.read_text().splitlines():
                if line.startswith("advertised.listeners="):
                    return int(line.rsplit(":", 1)[1])
        except (OSError, ValueError):
            pass
        return None

    def properties(self) -> dict[str, str]:
        return {
            "process.roles": "broker,controller",
            "node.id": "1",
            "listeners": f"PLAINTEXT://localhost:{self.port},CONTROLLER://localhost:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://localhost:{self.port}",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            "controller.quorum.bootstrap.servers": f"localhost:{self.controller_port}",
            "log.dirs": str(self.data_dir),
            "num.partitions": "1",
            "default.replication.factor": "1",
            "min.insync.replicas": "1",
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            # The log is the source of truth: no broker-wide time/size expiry unless a topic sets it.
            "log.retention.hours": "-1",
            **self.overrides,
        }

    def _java(self) -> str:
        java = shutil.which("java")
        if java is None:
            raise BrokerError("java not found: Kafka needs a Java 17+ runtime (apt-get install openjdk-17-jre-headless)")
        return java

    def _jvm_args(self, libs: Path) -> list[str]:
        return [f"-Dlog4j2.configurationFile={LOG4J_CONFIG}", "-cp", f"{libs}/*"]

    def up(self, timeout_s: float = 90.0) -> str:
        """Start the broker (no-op when already running) and wait until it serves metadata."""
        if self.is_running():
            running_port = self.configured_port()
            if running_port is not None and running_port != self.port:
                raise BrokerError(f"the local broker of {self.state_dir} already runs on localhost:{running_port}, "
                                  f"not {self.port}; run `rollout kafka down` first")
            self.wait_ready(timeout_s)
            return self.bootstrap
        java = self._java()
        for p in (self.port, self.controller_port):
            if not port_is_free(p):
                raise BrokerError(f"port {p} is busy: something else listens on localhost:{p} "
                                  "(stop it, or choose another port with ROLLOUT_KAFKA_PORT)")
        libs = ensure_jars(self.version)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(
            "# written by streams/local_broker.py on every `up`; edit that file instead\n"
            + "".join(f"{k}={v}\n" for k, v in self.properties().items())
        )
        if not (self.data_dir / "meta.properties").exists():
            cluster_id_file = self.state_dir / "cluster.id"
            if not cluster_id_file.exists():
                cluster_id_file.write_text(_kafka_uuid() + "\n")
            fmt = subprocess.run(
                [java, *self._jvm_args(libs), "kafka.tools.StorageTool", "format", "--ignore-formatted",
                 "--standalone", f"--cluster-id={cluster_id_file.read_text().strip()}", "-c", str(self.config_file)],
                capture_output=True, text=True,
            )
            with self.log_file.open("a") as log:
                log.write(fmt.stdout + fmt.stderr)
            if fmt.returncode != 0:
                raise BrokerError(f"formatting Kafka storage in {self.data_dir} failed; see {self.log_file}")
        with self.log_file.open("ab") as log:
            log.write(f"\n=== rollout kafka up {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n".encode())
            log.flush()
            proc = subprocess.Popen(
                [java, f"-Xmx{self.heap}", "-Xms128m", "-XX:+UseG1GC", "-Djava.awt.headless=true",
                 *self._jvm_args(libs), MAIN_CLASS, str(self.config_file)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.state_dir, start_new_session=True,
            )
        self.pid_file.write_text(f"{proc.pid}\n")
        try:
            self.wait_ready(timeout_s, proc=proc)
        except BrokerError:
            if proc.poll() is None:
                self.down()
            raise
        return self.bootstrap

    def wait_ready(self, timeout_s: float = 90.0, proc: subprocess.Popen | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                self.pid_file.unlink(missing_ok=True)
                raise BrokerError(f"Kafka broker exited with code {proc.returncode} while starting; "
                                  f"see {self.log_file}")
            if proc is None and not self.is_running():
                raise BrokerError(f"Kafka broker is not running; see {self.log_file}")
            if port_accepts("127.0.0.1", self.port):
                try:
                    run_sync(fetch_metadata({"bootstrap_servers": self.bootstrap}, timeout_s=5))
                    return
                except KafkaUnreachable as e:
                    last = str(e)
            time.sleep(0.3)
        raise BrokerError(f"Kafka broker did not become ready on {self.bootstrap} within {timeout_s:.0f}s "
                          f"({last or 'port closed'}); see {self.log_file}")

    def down(self, timeout_s: float = 30.0) -> bool:
        """Stop the broker: SIGTERM (clean shutdown), then SIGKILL after timeout_s. False if not running."""
        pid = self.pid()
        if pid is None:
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._alive(pid):
            time.sleep(0.2)
        if self._alive(pid):
            os.kill(pid, signal.SIGKILL)
            while self._alive(pid):
                time.sleep(0.1)
        self.pid_file.unlink(missing_ok=True)
        return True

    @staticmethod
    def _alive(pid: int) -> bool:
        try:
            # Reap it if it is our child, then check it exists and is not a zombie.
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]

    def status(self) -> dict[str, Any]:
        pid = self.pid()
        info: dict[str, Any] = {
            "running": pid is not None, "pid": pid, "bootstrap": self.bootstrap, "version": self.version,
            "state_dir": str(self.state_dir), "log_file": str(self.log_file), "reachable": False,
        }
        if pid is not None:
            try:
                md = run_sync(fetch_metadata({"bootstrap_servers": self.bootstrap}, timeout_s=5))
                info.update(reachable=True, cluster_id=md.get("cluster_id"))
            except KafkaUnreachable:
                pass
        return info

    def tail_log(self, lines: int = 50) -> list[str]:
        if not self.log_file.exists():
            return []
        with self.log_file.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 256 * 1024))
            data = f.read().decode(errors="replace")
        return data.splitlines()[-lines:]
