"""The three-broker cluster of ``test_cluster_faults`` secured as a production cluster is: clients on SASL_SSL
(SCRAM-SHA-512 over TLS, certificates made here), the StandardAuthorizer denying what no ACL allows, and each
service its own principal with the ACLs its declaration derives (``streams.security``). The fault is the one
that moves the most: SIGKILL of the broker leading most of the pipeline's partitions, restarted after a while.
The same checks as the plain cluster's (0 lost, 0 doubled, every batch named by a revision, a clean audit), and
its figures (stall, catch-up) printed beside them. A module of its own, so the plain cluster is down before
this one starts."""

from __future__ import annotations

import pytest

from consumers.registry import SERVICES
from streams import security
from streams.docker_cluster import ScramTls
from tests._certs import make_ca, make_keystore
from tests.test_cluster_faults import _kill_and_restart, _leaders, _run, running_cluster

pytestmark = pytest.mark.integration

USERS = {"admin": "admin-secret", **{n: f"{n}-secret" for n in (*SERVICES, security.ARENA)}}


@pytest.fixture(scope="module")
def secured_cluster(tmp_path_factory):
    tls = tmp_path_factory.mktemp("cluster-tls")
    tls.chmod(0o755)  # the brokers run as uid 1000
    ca = make_ca(tls, "ca")
    make_keystore(tls, ca, ["localhost", "127.0.0.1"], "keystore-secret")
    for f in tls.iterdir():
        f.chmod(0o644)
    yield from running_cluster(ScramTls(tls, "keystore-secret", USERS))


async def test_secured_cluster_refuses_a_plaintext_client_and_a_wrong_password(secured_cluster):
    """What makes the run below a secured one: the listener speaks only SASL_SSL, and only to known users."""
    from streams.local_broker import fetch_metadata
    from streams.kafka_errors import KafkaUnreachable

    node = secured_cluster.nodes[0]
    with pytest.raises(KafkaUnreachable):
        await fetch_metadata({"bootstrap_servers": secured_cluster.address(node)}, timeout_s=5)
    wrong = {**secured_cluster.client_kwargs("credit", node=node), "sasl_plain_password": "wrong"}
    with pytest.raises(KafkaUnreachable):
        await fetch_metadata(wrong, timeout_s=5)
    md = await fetch_metadata(secured_cluster.client_kwargs("credit", node=node), timeout_s=10)
    assert {b["node_id"] for b in md["brokers"]} == set(secured_cluster.nodes)


async def test_sigkill_partition_leader_secured(secured_cluster, monkeypatch, tmp_path):
    async def fault(c, kw):
        leaders = await _leaders(kw)
        node = leaders.most_common(1)[0][0]
        print(f"partition leaders {dict(leaders)}: SIGKILL node {node}")
        return await _kill_and_restart(c, node)

    await _run(secured_cluster, fault, "secured: leader SIGKILL", monkeypatch, tmp_path)
