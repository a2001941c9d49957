"""What a service instance does when its consumer group rebalances (aiokafka's ``ConsumerRebalanceListener``, on
the processor of ``streams.transactions``). Both callbacks wait for the transaction in flight (the processor's
lock), and both must be fast: the member sends no heartbeat while one runs."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from aiokafka import ConsumerRebalanceListener, TopicPartition

from streams.group_fencing import GroupMember

if TYPE_CHECKING:
    from streams.transactions import TransactionalProcessor

log = logging.getLogger("rollout.eos")


class Rebalance(ConsumerRebalanceListener):
    def __init__(self, proc: TransactionalProcessor) -> None:
        self.proc = proc

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:  # type: ignore[override]
        proc = self.proc
        async with proc.lock:  # waits for the in-flight transaction to commit or abort
            proc.epoch += 1
            proc.member = None
            proc._clear_inbox()
            log.info("%s revoked %s", proc.config.name, sorted({tp.partition for tp in revoked}))
            # Keep the tasks: if the next generation gives a partition back to us, nobody else can have owned it
            # in between, and its task is still exact (``on_partitions_assigned``).

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:  # type: ignore[override]
        """Partitions whose tasks are still exact resume at once; the others are paused and taken over by the
        processor's loop (``TransactionalProcessor._take``)."""
        proc = self.proc
        async with proc.lock:
            assert proc.consumer is not None
            proc.epoch += 1
            proc._clear_inbox()  # kept partitions are sought back to their committed offsets below
            coordinator = proc.consumer._coordinator
            now = GroupMember(coordinator.generation, coordinator.member_id)
            before = proc._tasks_member
            # Tasks are exact only if no generation came between theirs and this one (then nobody else owned
            # their partitions); a member that missed one (frozen past its session) rebuilds everything.
            if before is None or before.member_id != now.member_id or now.generation_id != before.generation_id + 1:
                proc._drop_all()
            ps = sorted({tp.partition for tp in assigned})
            for p in list(proc.tasks):
                if p not in ps:
                    proc._drop(p)
            proc.member = proc._tasks_member = now
            proc.pending = {p for p in ps if p not in proc.tasks}
            for p in ps:
                if p in proc.pending:
                    proc.consumer.pause(*[TopicPartition(t, p) for t in proc.config.inputs])
                else:
                    for topic, off in proc.committed[p].items():
                        proc.consumer.seek(TopicPartition(topic, p), off)
            log.info("%s assigned %s in generation %d (to take over: %s)", proc.config.name, ps,
                     now.generation_id, sorted(proc.pending))
