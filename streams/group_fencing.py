"""Offsets committed inside a transaction, fenced by the consumer group's generation (KIP-447).

With this, one transactional producer per service instance can commit the work of all its partitions in one
transaction: the group coordinator refuses a ``TxnOffsetCommit`` whose generation or member id is not the
group's current one, so a zombie that lost its partitions in a rebalance cannot commit their offsets, and the
transaction that carried its outputs is aborted. aiokafka 0.14 speaks ``TxnOffsetCommit`` v0 only (group id,
no generation), hence the v3 request here and ``fence_by_group``, which makes a producer send it.

The other half of KIP-447, a new owner waiting for the previous owner's pending offsets, is
``streams.group_offsets.committed`` (OffsetFetch v7, ``require_stable``).
"""

from __future__ import annotations

import collections
import logging
import types
from dataclasses import dataclass
from typing import Any, Callable

from aiokafka import AIOKafkaProducer
from aiokafka import errors as Errors
from aiokafka.client import CoordinationType
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import CompactString, Int16, Int32, Int64, Schema, TaggedFields
from aiokafka.producer.sender import TxnOffsetCommitHandler

from streams.group_offsets import partition_struct, per_topic

log = logging.getLogger("rollout.eos")


class TxnOffsetCommitResponse_v3(Response):
    API_KEY = 28
    API_VERSION = 3
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("topics", per_topic(partition_struct(("partition_index", Int32), ("error_code", Int16)))),
        ("tags", TaggedFields),
    )

    @property
    def errors(self) -> list[tuple[str, list[tuple[int, int]]]]:
        """The shape aiokafka's v0 handler reads: [(topic, [(partition, error_code)])]."""
        return [(name, [(p, e) for p, e, _ in parts]) for name, parts, _ in self.topics]


class TxnOffsetCommitRequest_v3(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 28
    API_VERSION = 3
    RESPONSE_TYPE = TxnOffsetCommitResponse_v3
    SCHEMA = Schema(
        ("transactional_id", CompactString("utf-8")),
        ("group_id", CompactString("utf-8")),
        ("producer_id", Int64),
        ("producer_epoch", Int16),
        ("generation_id", Int32),
        ("member_id", CompactString("utf-8")),
        ("group_instance_id", CompactString("utf-8")),
        ("topics", per_topic(partition_struct(
            ("partition_index", Int32), ("committed_offset", Int64), ("committed_leader_epoch", Int32),
            ("committed_metadata", CompactString("utf-8"))))),
        ("tags", TaggedFields),
    )


class TxnOffsetCommitRequest(Request[TxnOffsetCommitRequest_v3]):
    """Only v3: a broker that cannot fence by generation must not be used with one producer per instance."""

    API_KEY = 28

    def __init__(self, transactional_id: str, group_id: str, producer_id: int, producer_epoch: int,
                 generation_id: int, member_id: str, topics: list[tuple[str, list[tuple[int, int, str]]]]) -> None:
        self.args = (transactional_id, group_id, producer_id, producer_epoch, generation_id, member_id, None,
                     [(t, [(p, off, -1, meta, {}) for p, off, meta in parts], {}) for t, parts in topics], {})

    def build(self, request_struct_class: type[TxnOffsetCommitRequest_v3]) -> TxnOffsetCommitRequest_v3:
        return request_struct_class(*self.args)


@dataclass(frozen=True)
class GroupMember:
    """Who commits: the consumer group member and the generation its partitions were assigned in."""

    generation_id: int
    member_id: str


class GroupFenced(Errors.CommitFailedError):
    """The group has moved on (a rebalance this member missed): its partitions may be someone else's now."""


# the coordinator's answers that mean "not your partitions any more"
_FENCED = {22: "ILLEGAL_GENERATION", 25: "UNKNOWN_MEMBER_ID", 82: "FENCED_INSTANCE_ID",
           27: "REBALANCE_IN_PROGRESS"}


class _Handler(TxnOffsetCommitHandler):
    """aiokafka's handler (retries, coordinator moves, producer fencing), sending v3 with the member's
    generation, and turning a group fence into an abortable error of the transaction."""

    def __init__(self, sender: Any, offsets: Any, group_id: str, member: GroupMember) -> None:
        super().__init__(sender, offsets, group_id)
        self.member = member

    def create_request(self) -> TxnOffsetCommitRequest:
        txn = self._sender._txn_manager
        by_topic: dict[str, list[tuple[int, int, str]]] = collections.defaultdict(list)
        for tp, om in sorted(self._offsets.items()):
            by_topic[tp.topic].append((tp.partition, om.offset, om.metadata))
        return TxnOffsetCommitRequest(txn.transactional_id, self._group_id, txn.producer_id, txn.producer_epoch,
                                      self.member.generation_id, self.member.member_id, list(by_topic.items()))

    def handle_response(self, resp: TxnOffsetCommitResponse_v3) -> float | None:
        for _topic, partitions in resp.errors:
            for _partition, code in partitions:
                if code in _FENCED:
                    self._sender._txn_manager.error_transaction(GroupFenced(
                        f"group {self._group_id} refused the offsets of generation {self.member.generation_id} "
                        f"({_FENCED[code]}): this member's partitions have been reassigned"))
                    return None
        return super().handle_response(resp)


def fence_by_group(producer: AIOKafkaProducer, member: Callable[[], GroupMember]) -> None:
    """Make ``producer.send_offsets_to_transaction`` send TxnOffsetCommit v3 with ``member()``'s generation.

    The member is read once per transaction, when its offsets are queued (under the processor's lock), not when
    the sender (re)sends them: a producer stuck retrying (a stalled coordinator) and discarded meanwhile must
    not commit its stale offsets under the generation of a later rebalance (a broker without KIP-890 would
    take them). aiokafka's sender builds its v0 request in ``_do_txn_offset_commit``; this replaces that one
    method on this producer's sender (retries and coordinator lookup stay aiokafka's)."""
    sender, txn = producer._sender, producer._txn_manager
    queue_offsets = txn.add_offsets_to_txn
    queued_by: GroupMember | None = None  # the member when this transaction's offsets were queued

    def add_offsets_to_txn(offsets: Any, group_id: str) -> Any:
        nonlocal queued_by
        queued_by = member()
        return queue_offsets(offsets, group_id)

    async def _do_txn_offset_commit(self: Any, offsets: Any, group_id: str) -> None:
        if not offsets:
            return
        try:
            node_id = await self._find_coordinator(CoordinationType.GROUP, group_id)
        except Errors.GroupAuthorizationFailedError as exc:
            self._txn_manager.error_transaction(exc)
            return
        assert queued_by is not None
        await _Handler(self, offsets, group_id, queued_by).do(node_id)

    txn.add_offsets_to_txn = add_offsets_to_txn
    sender._do_txn_offset_commit = types.MethodType(_do_txn_offset_commit, sender)


def fence_error_seen(producer: AIOKafkaProducer) -> None:
    """The transaction's error is handled by the caller: mark it retrieved, so asyncio does not report the
    producer's internal waiter as "exception never retrieved" when the producer is discarded."""
    waiter = producer._txn_manager._transaction_waiter
    if waiter is not None and waiter.done() and not waiter.cancelled():
        waiter.exception()
