"""`rollout kafka up|down|status|logs`: the local single-node broker (streams/local_broker.py), or with
`up --brokers 3` / `down --cluster` / `status --cluster` a replicated cluster in Docker (streams/docker_cluster.py);
`rollout kafka acls [--apply]`: the ACLs of each service's principal (streams/security.py)."""

from __future__ import annotations

import argparse
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kafka", help="run a local single-node Apache Kafka broker (KRaft)")
    ksub = p.add_subparsers(dest="kafka_command", metavar="ACTION")
    ksub.required = True
    up = ksub.add_parser("up", help="start the broker in the background (fetches the jars on first use)")
    up.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for readiness")
    up.add_argument("--brokers", type=int, default=1,
                    help="1 (default): one java process from the Maven jars; 3: a KRaft cluster of three "
                         "broker+controller containers from the rollout-log/kafka:local image (needs Docker), "
                         "its topics replicated 3 times with min.insync.replicas=2")
    up.set_defaults(func=cmd_up)
    cluster_help = "the Docker cluster started with `up --brokers N`, not the single local broker"
    down = ksub.add_parser("down", help="stop the broker (data is kept; --cluster removes the containers and data)")
    down.add_argument("--cluster", action="store_true", help=cluster_help)
    down.set_defaults(func=cmd_down)
    status = ksub.add_parser("status", help="show whether the broker runs and answers")
    status.add_argument("--cluster", action="store_true", help=cluster_help)
    status.set_defaults(func=cmd_status)
    logs = ksub.add_parser("logs", help="print the end of the broker log")
    logs.add_argument("-n", "--lines", type=int, default=50)
    logs.add_argument("-f", "--follow", action="store_true")
    logs.set_defaults(func=cmd_logs)
    acls = ksub.add_parser("acls", help="print the ACLs each principal needs (derived from the services); "
                                        "--apply creates them on ROLLOUT_BOOTSTRAP_SERVERS as the admin in the env")
    acls.add_argument("--apply", action="store_true")
    acls.set_defaults(func=cmd_acls)


def _settings():
    from streams.config import KafkaSettings

    return KafkaSettings.from_env()


def _broker(settings):
    from streams.local_broker import LocalBroker

    return LocalBroker.from_env(port=settings.local_port)


def _local_broker(instead: str):
    """The local broker; None, after saying so, where ROLLOUT_BOOTSTRAP_SERVERS names another cluster."""
    settings = _settings()
    if settings.external:
        print(f"ROLLOUT_BOOTSTRAP_SERVERS={settings.bootstrap} is set: {instead}")
        return None
    return _broker(settings)


def _cluster(brokers: int = 3):
    import os

    from streams.docker_cluster import DockerCluster

    return DockerCluster(os.environ.get("ROLLOUT_CLUSTER_NAME") or "rollout-cluster", brokers=brokers,
                         image=os.environ.get("ROLLOUT_KAFKA_IMAGE") or "rollout-log/kafka:local")


def cmd_cluster_up(args: argparse.Namespace) -> int:
    cluster = _cluster(args.brokers)
    t0 = time.monotonic()
    cluster.up(timeout_s=max(args.timeout, 180.0))
    print(f"{cluster.brokers} Kafka brokers up in {time.monotonic() - t0:.1f}s (containers {cluster.container(1)}.., "
          f"network {cluster.name}; active controller: node {cluster.quorum_leader()}). Point the pipeline at it:")
    for k, v in cluster.client_env().items():
        print(f"  export {k}={v}")
    print("then `rollout topics create`; `rollout kafka down --cluster` removes it (and its data)")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    if args.brokers > 1:
        return cmd_cluster_up(args)
    broker = _local_broker("using that cluster, not starting a local broker")
    if broker is None:
        return 0
    was_running = broker.is_running()
    t0 = time.monotonic()
    broker.up(timeout_s=args.timeout)
    verb = "already running" if was_running else f"started in {time.monotonic() - t0:.1f}s"
    print(f"Kafka {broker.version} {verb} on {broker.bootstrap} (pid {broker.pid()}, data {broker.data_dir}, "
          f"log {broker.log_file})")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    if args.cluster:
        cluster = _cluster()
        existed = cluster.exists()
        cluster.down(remove=True)
        print(f"cluster {cluster.name} removed" if existed else f"no cluster {cluster.name}")
        return 0
    broker = _local_broker("no local broker to stop")
    if broker is None:
        return 0
    if broker.down():
        print(f"Kafka stopped (data kept in {broker.data_dir})")
    else:
        print("Kafka is not running")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    if args.cluster:
        cluster = _cluster().load()
        states = {n: cluster.state(n) for n in cluster.nodes}
        print(f"cluster {cluster.name}: " + ", ".join(f"node {n} {cluster.address(n)} {st}" for n, st in states.items())
              + f"; active controller: node {cluster.quorum_leader()}; bootstrap {cluster.bootstrap}")
        return 0 if set(states.values()) == {"running"} else 1
    settings = _settings()
    if settings.external:
        from streams.local_broker import fetch_metadata, run_sync

        md = run_sync(fetch_metadata(settings.client_kwargs()))
        print(f"external cluster {settings.bootstrap}: reachable, cluster id {md.get('cluster_id')}, "
              f"{len(md.get('brokers', []))} broker(s)")
        return 0
    st = _broker(settings).status()
    if not st["running"]:
        print(f"Kafka is not running (state {st['state_dir']})")
        return 3
    health = "reachable" if st["reachable"] else "NOT answering"
    print(f"Kafka {st['version']} running on {st['bootstrap']} (pid {st['pid']}), {health}; log {st['log_file']}")
    return 0 if st["reachable"] else 1


def cmd_logs(args: argparse.Namespace) -> int:
    broker = _broker(_settings())
    for line in broker.tail_log(args.lines):
        print(line)
    if args.follow:
        with broker.log_file.open() as f:
            f.seek(0, 2)
            try:
                while True:
                    line = f.readline()
                    if line:
                        sys.stdout.write(line)
                        sys.stdout.flush()
                    else:
                        time.sleep(0.5)
            except KeyboardInterrupt:
                pass
    return 0


def cmd_acls(args: argparse.Namespace) -> int:
    from consumers.registry import SERVICES
    from streams import security

    acls = security.all_acls(SERVICES)
    print(security.table(acls))
    if args.apply:
        from streams.local_broker import run_sync

        settings = _settings()
        if not settings.external:
            from streams.kafka_errors import KafkaError

            raise KafkaError("rollout kafka acls --apply needs ROLLOUT_BOOTSTRAP_SERVERS (a cluster with an authorizer) "
                             "and an admin principal in ROLLOUT_KAFKA_SASL_USERNAME/PASSWORD")
        n = run_sync(security.apply_acls(settings.admin_kwargs(), acls))
        print(f"applied {n} ACLs to {settings.bootstrap}")
    return 0
