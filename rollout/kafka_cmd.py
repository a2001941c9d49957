"""`rollout kafka up|down|status|logs`: the local single-node broker (streams/local_broker.py);
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
    up.set_defaults(func=cmd_up)
    ksub.add_parser("down", help="stop the broker (data is kept)").set_defaults(func=cmd_down)
    ksub.add_parser("status", help="show whether the broker runs and answers").set_defaults(func=cmd_status)
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


def cmd_up(args: argparse.Namespace) -> int:
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
    broker = _local_broker("no local broker to stop")
    if broker is None:
        return 0
    if broker.down():
        print(f"Kafka stopped (data kept in {broker.data_dir})")
    else:
        print("Kafka is not running")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
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
    from streams import security

    acls = security.all_acls()
    print(security.table(acls))
    if args.apply:
        from streams.local_broker import run_sync

        settings = _settings()
        if not settings.external:
            from streams.config import KafkaError

            raise KafkaError("rollout kafka acls --apply needs ROLLOUT_BOOTSTRAP_SERVERS (a cluster with an authorizer) "
                             "and an admin principal in ROLLOUT_KAFKA_SASL_USERNAME/PASSWORD")
        n = run_sync(security.apply_acls(settings.admin_kwargs(), acls))
        print(f"applied {n} ACLs to {settings.bootstrap}")
    return 0
