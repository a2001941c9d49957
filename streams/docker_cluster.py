"""A three-broker KRaft cluster in Docker containers, from the local image (rollout-log/kafka:local, or any
image that follows the official apache/kafka KAFKA_* convention).

Each node is a combined broker+controller (a 3-voter quorum) on its own Docker network, with two listeners:
CLIENT on a host port of its own (advertised as ``localhost:<port>``: what clients and the tests use) and
INTERNAL on ``kafka-<n>:19092`` (the network's DNS name: what the brokers use between themselves). Internal
topics are replicated 3 times with ``min.insync.replicas=2``; the pipeline's topics get the same when
ROLLOUT_TOPIC_REPLICATION_FACTOR=3 and ROLLOUT_TOPIC_MIN_INSYNC_REPLICAS=2 (``client_env``).

    rollout kafka up --brokers 3            (rollout/kafka_cmd.py)
    cluster = DockerCluster("mytest"); cluster.up(); cluster.kill(2); cluster.start(2); cluster.down()

``security`` (``ScramTls``) puts CLIENT behind SASL_SSL with SCRAM-SHA-512 users made when the nodes format
their storage, and the StandardAuthorizer denying what no ACL allows; INTERNAL and CONTROLLER stay plaintext on
the cluster's own network (their principal, ANONYMOUS, is a super user), so securing the clients changes nothing
between the brokers. ``client_env(user)`` is then what that user's processes set.

Faults for the tests: ``kill`` (SIGKILL), ``stop`` (SIGTERM: a controlled shutdown), ``isolate``/``heal``
(every packet to and from the node dropped, in its network namespace, with the host's iptables: a network
partition from the other brokers and from the clients alike). Only the docker CLI is used: no SDK.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streams.config import KafkaSettings
from streams.kafka_errors import KafkaError, KafkaUnreachable
from streams.local_broker import fetch_metadata, free_port, run_sync

DEFAULT_IMAGE = "rollout-log/kafka:local"
CLUSTER_ID = "5L6g3nShT-eMCtK--X86sw"
INTERNAL_PORT = 19092
CONTROLLER_PORT = 9093
CLIENT_PORT = 9092
LABEL = "rollout-log.cluster"
QUORUM_STATE = "/var/lib/kafka/data/__cluster_metadata-0/quorum-state"


class ClusterError(KafkaError):
    pass


TLS_MOUNT = "/etc/rollout-tls"


@dataclass(frozen=True)
class ScramTls:
    """SASL_SSL (SCRAM-SHA-512) on the CLIENT listener. ``tls_dir`` holds ``broker.p12`` (a PKCS12 keystore whose
    certificate names ``localhost``, readable by the image's uid 1000) and ``ca.pem`` (its CA, for the clients).
    ``users``: name -> password, made at format time (so only on a cluster's first start); ``admin`` is the one
    super user among them, for topics and ACLs."""

    tls_dir: Path
    keystore_password: str
    users: dict[str, str]
    admin: str = "admin"
    mechanism: str = "SCRAM-SHA-512"

    def node_env(self) -> dict[str, str]:
        for name, pw in self.users.items():
            if not name.isidentifier() or any(c in pw for c in " ,=[]"):
                raise ClusterError(f"SCRAM user {name!r}: names must be identifiers and passwords free of ' ,=[]'")
        return {
            "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CLIENT:SASL_SSL,INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "KAFKA_SASL_ENABLED_MECHANISMS": self.mechanism,
            f"KAFKA_LISTENER_NAME_CLIENT_{self.mechanism.replace('-', '___')}_SASL_JAAS_CONFIG":
                "org.apache.kafka.common.security.scram.ScramLoginModule required;",
            "KAFKA_SSL_KEYSTORE_TYPE": "PKCS12",
            "KAFKA_SSL_KEYSTORE_LOCATION": f"{TLS_MOUNT}/broker.p12",
            "KAFKA_SSL_KEYSTORE_PASSWORD": self.keystore_password,
            "KAFKA_SSL_KEY_PASSWORD": self.keystore_password,
            "KAFKA_AUTHORIZER_CLASS_NAME": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "KAFKA_ALLOW_EVERYONE_IF_NO_ACL_FOUND": "false",
            "KAFKA_SUPER_USERS": f"User:{self.admin};User:ANONYMOUS",
            "KAFKA_ADD_SCRAM": " ".join(f"{self.mechanism}=[name={u},password={pw}]" for u, pw in self.users.items()),
        }

    def client_env(self, user: str) -> dict[str, str]:
        return {"ROLLOUT_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "ROLLOUT_KAFKA_SASL_MECHANISM": self.mechanism,
                "ROLLOUT_KAFKA_SASL_USERNAME": user, "ROLLOUT_KAFKA_SASL_PASSWORD": self.users[user],
                "ROLLOUT_KAFKA_SSL_CAFILE": str(self.tls_dir / "ca.pem")}


def docker(*args: str, check: bool = True, timeout: float = 120.0) -> str:
    try:
        out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise ClusterError("the docker CLI is not installed: a multi-broker cluster runs in Docker containers "
                           "(bash .ci/setup installs docker.io)") from None
    if check and out.returncode != 0:
        raise ClusterError(f"docker {' '.join(args[:3])}: {(out.stderr or out.stdout).strip()[:400]}")
    return out.stdout.strip()


@dataclass
class DockerCluster:
    """``brokers`` nodes named ``<name>-kafka-<n>`` on the network ``<name>``; host ports picked at ``up``
    (or given), kept in the containers' labels so a later process (``rollout kafka status``) finds them."""

    name: str = "rollout-cluster"
    brokers: int = 3
    image: str = DEFAULT_IMAGE
    ports: list[int] = field(default_factory=list)
    heap: str = "-Xmx512m -Xms256m"
    security: ScramTls | None = None  # not kept in labels: ``load`` finds a secured cluster's ports, not its users

    def container(self, node: int) -> str:
        return f"{self.name}-kafka-{node}"

    @property
    def nodes(self) -> list[int]:
        return list(range(1, self.brokers + 1))

    @property
    def bootstrap(self) -> str:
        return ",".join(f"localhost:{p}" for p in self.ports)

    def address(self, node: int) -> str:
        return f"localhost:{self.ports[node - 1]}"

    def client_env(self, user: str | None = None) -> dict[str, str]:
        """What a client of this cluster sets: the bootstrap list, the replication of created topics, and on a
        secured cluster the credentials of ``user`` (default: the admin)."""
        env = {"ROLLOUT_BOOTSTRAP_SERVERS": self.bootstrap, "ROLLOUT_TOPIC_REPLICATION_FACTOR": str(min(3, self.brokers)),
               "ROLLOUT_TOPIC_MIN_INSYNC_REPLICAS": str(min(2, self.brokers))}
        if self.security:
            env.update(self.security.client_env(user or self.security.admin))
        return env

    def client_kwargs(self, user: str | None = None, node: int | None = None) -> dict[str, Any]:
        """aiokafka keyword arguments of ``user`` (default: the admin), bootstrapped from one node or all."""
        settings = KafkaSettings.from_env(self.client_env(user))
        return settings.with_bootstrap(self.address(node) if node else self.bootstrap).client_kwargs()

    def node_env(self, node: int) -> dict[str, str]:
        """The node's server properties, in the official image's KAFKA_* convention."""
        rf, isr = min(3, self.brokers), min(2, self.brokers)
        voters = ",".join(f"{n}@kafka-{n}:{CONTROLLER_PORT}" for n in self.nodes)
        return {
            "CLUSTER_ID": CLUSTER_ID,
            "KAFKA_NODE_ID": str(node),
            "KAFKA_PROCESS_ROLES": "broker,controller",
            "KAFKA_LISTENERS": f"CLIENT://:{CLIENT_PORT},INTERNAL://:{INTERNAL_PORT},CONTROLLER://:{CONTROLLER_PORT}",
            "KAFKA_ADVERTISED_LISTENERS": f"CLIENT://localhost:{self.ports[node - 1]},INTERNAL://kafka-{node}:{INTERNAL_PORT}",
            "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CLIENT:PLAINTEXT,INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "KAFKA_INTER_BROKER_LISTENER_NAME": "INTERNAL",
            "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
            "KAFKA_CONTROLLER_QUORUM_VOTERS": voters,
            "KAFKA_DEFAULT_REPLICATION_FACTOR": str(rf),
            "KAFKA_MIN_INSYNC_REPLICAS": str(isr),
            "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": str(rf),
            "KAFKA_OFFSETS_TOPIC_NUM_PARTITIONS": "6",
            "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": str(rf),
            "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": str(isr),
            "KAFKA_TRANSACTION_STATE_LOG_NUM_PARTITIONS": "6",
            "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": str(rf),
            "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": str(isr),
            "KAFKA_UNCLEAN_LEADER_ELECTION_ENABLE": "false",
            "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
            "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
            "KAFKA_NUM_PARTITIONS": "1",
            "KAFKA_LOG_RETENTION_HOURS": "-1",
            "KAFKA_HEAP_OPTS": self.heap,
            **(self.security.node_env() if self.security else {}),
        }

    # -- lifecycle -------------------------------------------------------------------------------------------

    def exists(self) -> bool:
        return bool(docker("ps", "-aq", "--filter", f"label={LABEL}={self.name}"))

    def load(self) -> DockerCluster:
        """Ports and size of the cluster ``name`` that is already there (created by another process)."""
        ids = docker("ps", "-aq", "--filter", f"label={LABEL}={self.name}").split()
        if not ids:
            raise ClusterError(f"no cluster {self.name!r}: start it with `rollout kafka up --brokers 3`")
        info = json.loads(docker("inspect", *ids))
        by_node = {int(c["Config"]["Labels"][f"{LABEL}.node"]): int(c["Config"]["Labels"][f"{LABEL}.port"])
                   for c in info}
        self.brokers = len(by_node)
        self.ports = [by_node[n] for n in sorted(by_node)]
        return self

    def up(self, timeout_s: float = 180.0) -> str:
        """Create the network and the nodes (or start the stopped ones), wait until every broker answers and
        the metadata lists them all; returns the bootstrap list."""
        if self.exists():
            self.load()
            for n in self.nodes:
                self.start(n)
        else:
            if not self.ports:
                self.ports = [free_port(restartable=True) for _ in self.nodes]
            if not docker("network", "ls", "-q", "--filter", f"name=^{self.name}$"):
                docker("network", "create", "--label", f"{LABEL}={self.name}", self.name)
            for n in self.nodes:
                opts = [a for k, v in self.node_env(n).items() for a in ("-e", f"{k}={v}")]
                if self.security:
                    opts += ["-v", f"{self.security.tls_dir}:{TLS_MOUNT}:ro"]
                docker("run", "-d", "--name", self.container(n), "--hostname", f"kafka-{n}", "--network", self.name,
                       "--network-alias", f"kafka-{n}", "-p", f"{self.ports[n - 1]}:{CLIENT_PORT}",
                       "--label", f"{LABEL}={self.name}", "--label", f"{LABEL}.node={n}",
                       "--label", f"{LABEL}.port={self.ports[n - 1]}", *opts, self.image)
        self.wait_ready(timeout_s)
        return self.bootstrap

    def wait_ready(self, timeout_s: float = 180.0, nodes: list[int] | None = None) -> None:
        """Every node in ``nodes`` (default all) answers on its own address and is in the cluster metadata."""
        deadline = time.monotonic() + timeout_s
        want = set(nodes or self.nodes)
        last = ""
        while time.monotonic() < deadline:
            try:
                for n in want:
                    md = run_sync(fetch_metadata(self.client_kwargs(node=n), timeout_s=5))
                    if not want <= {b["node_id"] for b in md.get("brokers", [])}:
                        raise KafkaUnreachable(f"brokers registered: {md.get('brokers')}")
                return
            except KafkaUnreachable as e:
                last = str(e)
                for n in want:
                    if self.state(n) in ("exited", "dead"):
                        raise ClusterError(f"{self.container(n)} exited:\n{self.logs(n, 15)}") from None
                time.sleep(1.0)
        raise ClusterError(f"cluster {self.name} not ready after {timeout_s:.0f}s: {last}")

    def down(self, remove: bool = True) -> None:
        """Stop the nodes; with ``remove``, delete them, their data and the network."""
        ids = docker("ps", "-aq", "--filter", f"label={LABEL}={self.name}").split()
        if ids:
            docker(*(("rm", "-f", "-v") if remove else ("stop",)), *ids)
        if remove and docker("network", "ls", "-q", "--filter", f"name=^{self.name}$"):
            docker("network", "rm", self.name, check=False)

    # -- faults ----------------------------------------------------------------------------------------------

    def state(self, node: int) -> str:
        return docker("inspect", "-f", "{{.State.Status}}", self.container(node), check=False)

    def kill(self, node: int) -> None:
        """SIGKILL the node's JVM: no controlled shutdown, nothing flushed."""
        docker("kill", "-s", "KILL", self.container(node))

    def stop(self, node: int, timeout_s: int = 60) -> None:
        """SIGTERM: a controlled shutdown (leadership moved away first), as in a rolling restart."""
        docker("stop", "-t", str(timeout_s), self.container(node), timeout=timeout_s + 30)

    def start(self, node: int) -> None:
        docker("start", self.container(node))

    def _pid(self, node: int) -> str:
        return docker("inspect", "-f", "{{.State.Pid}}", self.container(node))

    def _iptables(self, node: int, *rule: str) -> None:
        subprocess.run(["nsenter", "-t", self._pid(node), "-n", "iptables", *rule], check=True, capture_output=True)

    def isolate(self, node: int) -> None:
        """Drop every packet to and from the node except its loopback: the other brokers and the clients (whose
        traffic reaches it through the published port) see silence, not refused connections. Needs root."""
        for chain in ("INPUT", "OUTPUT"):
            self._iptables(node, "-I", chain, "!", "-i" if chain == "INPUT" else "-o", "lo", "-j", "DROP")

    def heal(self, node: int) -> None:
        for chain in ("INPUT", "OUTPUT"):
            self._iptables(node, "-D", chain, "!", "-i" if chain == "INPUT" else "-o", "lo", "-j", "DROP")

    # -- what the cluster says about itself ------------------------------------------------------------------

    def logs(self, node: int, lines: int = 50) -> str:
        out = subprocess.run(["docker", "logs", "--tail", str(lines), self.container(node)], capture_output=True,
                             text=True)
        return (out.stdout + out.stderr).strip()

    def quorum_leader(self) -> int:
        """The active KRaft controller: the leader of the highest epoch any running node has written to its
        quorum-state file. (DescribeCluster's "controller" in KRaft is any broker, not the quorum leader.)"""
        seen = []
        for n in self.nodes:
            if self.state(n) == "running":
                raw = docker("exec", self.container(n), "cat", QUORUM_STATE, check=False)
                if raw.startswith("{"):
                    st = json.loads(raw)
                    if st.get("leaderId", -1) >= 0:
                        seen.append((st["leaderEpoch"], st["leaderId"]))
        if not seen:
            raise ClusterError(f"no running node of {self.name} names a quorum leader")
        return max(seen)[1]
