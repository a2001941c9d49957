"""What a partition task is to the transactional processor (``streams.transactions``): the ``PartitionTask`` it
runs for each partition number, the ``Out`` messages a task returns for the transaction, ``dead_letter``, the
output for an input record a task (or the processor) refuses, and ``EnvironmentFault``, what a task raises when the
fault is not the record's. The changelog's ``Restorer`` rebuilds tasks
through the same protocol."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from schemas.envelope import Event
from schemas.events import DeadLetter
from streams import serde, topics


@dataclass(frozen=True)
class Out:
    """One output message of a transaction."""

    topic: str
    event: Event


def dead_letter(rec: Any, service: str, error_type: str, message: str, run_id: str | None = None, *,
                raw: bytes | None = None, partial: bool = False) -> Out:
    """The dead letter for input record ``rec``: its bytes (or ``raw``, the part of it refused: one record of a
    batch), where it came from and why it was refused; ``partial``: the rest of ``rec`` was processed."""
    run = run_id or serde.header(rec.headers, "run_id") or "unknown"
    return Out(topics.DEAD_LETTERS.name, DeadLetter(
        run_id=run, producer=service, origin_topic=rec.topic, origin_partition=rec.partition,
        origin_offset=rec.offset, origin_key=rec.key, raw=(rec.value or b"") if raw is None else raw,
        error_type=error_type, error_message=message[:4000], service=service, partial=partial))


class EnvironmentFault(Exception):
    """Raised by a task for a fault of what it depends on, not of the record (a server it needs is down): the
    processor waits and tries the same record again, however often, and never dead-letters it for this."""


class PartitionTask(Protocol):
    """Per-partition-number processing state. Pure with respect to Kafka: the processor owns I/O."""

    async def process(self, record: Any) -> list[Out]:
        """Handle one input record (aiokafka ConsumerRecord); may buffer it instead of emitting."""

    def restore(self, record: Any) -> None:
        """Re-buffer a record listed in the snapshot (no outputs: it was processed before)."""

    def tick(self, now: float) -> list[Out]:
        """Time-based work (timeouts, partial-batch flushes)."""

    def input_read(self, now: float) -> list[Out]:
        """The transaction's input for this partition is processed (when ``tick`` is not called after it): work
        that waits for all of it, as an upstream transaction's records arrive together (a batch whose groups came
        in one credit transaction)."""

    def buffered(self) -> dict[str, list[int]]:
        """Input offsets still held in memory, by topic name."""

    def state(self) -> dict[str, Any]:
        """Small JSON state that must survive a crash."""

    def load_state(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """The task is dropped (its partition taken over again, or given away): stop the work it started."""

    def committed(self) -> None:
        """The transaction holding everything processed so far, and ``state()``, is committed: what only the state
        before it needed may go now (a trainer's older training states). Not called for an aborted one."""
