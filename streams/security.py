"""Kafka ACLs derived from the service declarations: one principal per service, allowed exactly what it needs.

    rollout kafka acls            the table (principal, operation, resource)
    rollout kafka acls --apply    create them on ROLLOUT_BOOTSTRAP_SERVERS, as the admin principal in the env

Each service in ``consumers.registry`` (passed in by the caller; principal ``User:<service name>``) reads its inputs, side inputs
and its changelog, writes its outputs and its changelog, creates its changelog (the admin creates the
pipeline's topics: ``rollout topics create``), uses its consumer group ``group_id(name)`` and
the transactional ids ``group_id(name)-<instance>`` (a PREFIXED pattern). The arena (``User:arena``)
writes steps, rollouts and admissions, reads admissions and policy-revisions, and uses the transactional
ids ``arena-*``. ``check_access`` says at a service's start-up which of its topics its principal cannot
read or write. Read/Write imply Describe; idempotent producers need no cluster ACL since Kafka 3.0.

aiokafka 0.14's admin client has no create_acls: ``apply_acls`` sends the protocol's CreateAcls
request (aiokafka.protocol.admin.CreateAclsRequest) itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from streams import topics
from streams.kafka_errors import KafkaAccessError, KafkaError

ARENA = "arena"

# Kafka protocol enums (org.apache.kafka.common.resource / acl)
_RESOURCE = {"TOPIC": 2, "GROUP": 3, "CLUSTER": 4, "TRANSACTIONAL_ID": 5}
_PATTERN = {"LITERAL": 3, "PREFIXED": 4}
_OPERATION = {"READ": 3, "WRITE": 4, "CREATE": 5, "DESCRIBE": 8, "IDEMPOTENT_WRITE": 12}
_ALLOW = 3


@dataclass(frozen=True, order=True)
class Acl:
    principal: str  # "User:verifier"
    operation: str  # READ | WRITE | ...
    resource_type: str  # TOPIC | GROUP | TRANSACTIONAL_ID | CLUSTER
    resource: str
    pattern: str = "LITERAL"  # LITERAL | PREFIXED

    def row(self) -> str:
        star = "*" if self.pattern == "PREFIXED" else ""
        return f"{self.principal:<16} {self.operation:<6} {self.resource_type:<16} {self.resource}{star}"


def _topic_acls(principal: str, reads: Iterable[topics.Topic], writes: Iterable[topics.Topic]) -> set[Acl]:
    return ({Acl(principal, "READ", "TOPIC", t.name) for t in reads}
            | {Acl(principal, "WRITE", "TOPIC", t.name) for t in writes})


def service_acls(service: Any) -> set[Acl]:
    """What one ``consumers.service.Service`` needs, from its declaration."""
    from streams.changelog import changelog_topic

    p = f"User:{service.name}"
    changelog = changelog_topic(service.name, service.partitions)
    # CREATE on its changelog only: the admin creates the pipeline's topics (`rollout topics create`); a service
    # creates its changelog at its first start (consumers.runner.ensure_topics, streams.topics.ensure).
    return (_topic_acls(p, [*service.inputs, *service.side_inputs, changelog], [*service.outputs, changelog])
            | {Acl(p, "CREATE", "TOPIC", changelog.name)}
            | {Acl(p, "READ", "GROUP", service.group_id),
               Acl(p, "WRITE", "TRANSACTIONAL_ID", f"{service.group_id}-", "PREFIXED")})


def arena_acls() -> set[Acl]:
    p = f"User:{ARENA}"
    return (_topic_acls(p, topics.ARENA_READS, topics.ARENA_WRITES)
            | {Acl(p, "WRITE", "TRANSACTIONAL_ID", f"{ARENA}-", "PREFIXED")})


def all_acls(services: Mapping[str, Any]) -> list[Acl]:
    """Every principal's ACLs: the services given (``consumers.registry.SERVICES``: the caller passes them, streams
    knows no service) and the arena, sorted."""
    out = arena_acls()
    for svc in services.values():
        out |= service_acls(svc)
    return sorted(out)


def table(acls: Iterable[Acl]) -> str:
    return "\n".join([f"{'PRINCIPAL':<16} {'OP':<6} {'RESOURCE TYPE':<16} RESOURCE (* = prefix)",
                      *(a.row() for a in acls)])


async def apply_acls(admin_kwargs: Mapping[str, Any], acls: Iterable[Acl]) -> int:
    """Create the ACLs (idempotent: the broker keeps one copy of each). Returns how many were sent."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.protocol.admin import CreateAclsRequest

    from streams.errors import diagnose

    admin = AIOKafkaAdminClient(**admin_kwargs)
    n = 0
    try:
        await admin.start()
        for a in acls:
            resp = await admin._send_request(CreateAclsRequest(  # noqa: SLF001 - no public CreateAcls in 0.14
                _RESOURCE[a.resource_type], a.resource, _PATTERN[a.pattern], a.principal, "*",
                _OPERATION[a.operation], _ALLOW))
            for code, message in resp.creation_responses:
                if code:
                    raise KafkaError(f"creating ACL {a.row().split()} failed: error {code} {message or ''}".strip()
                                     + " (the admin principal needs ALTER on the cluster: a super user)")
            n += 1
    except KafkaError:
        raise
    except Exception as e:  # noqa: BLE001 - mapped to one line
        raise await diagnose(e, admin_kwargs) from None
    finally:
        await admin.close()
    return n


async def check_access(service: Any, client_kwargs: Mapping[str, Any]) -> None:
    """Raise one KafkaError line when the service's principal cannot see a topic it reads or writes
    (no Read/Write ACL on it: the broker hides the topic's metadata)."""
    from aiokafka import AIOKafkaClient

    from streams.errors import diagnose, principal

    reads = [t.name for t in (*service.inputs, *service.side_inputs)]
    writes = [t.name for t in service.outputs]
    client = AIOKafkaClient(**{k: v for k, v in client_kwargs.items() if k != "client_id"},
                            client_id=client_kwargs.get("client_id", "rollout-log"))
    try:
        await client.bootstrap()
        md = await client.fetch_all_metadata()
    except Exception as e:  # noqa: BLE001 - mapped to one line
        raise await diagnose(e, client_kwargs) from None
    finally:
        await client.close()
    visible = md.topics()  # a topic its principal has no ACL on is left out
    for verb, names in (("read input", reads), ("write output", writes)):
        denied = [n for n in names if n not in visible]
        if denied:
            raise KafkaAccessError(f"service {service.name}: {principal(client_kwargs)} may not {verb} topic(s) "
                             f"{', '.join(denied)} (or they do not exist): grant it with `rollout kafka acls --apply` "
                             "as an admin")
