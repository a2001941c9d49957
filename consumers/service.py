"""What a service is: one declaration each, listed in ``consumers.registry``.

Everything about a service is derived from its ``Service``: the processor that runs it
(``consumers.runner``), its consumer group and lag (``rollout status``), its AsyncAPI entry, its
``rollout serve`` sub-command and flags, its place in the demo and in compose.yaml (checked by a test).
The task module holds the partition task and its ``wiring``; nothing else names the service.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Callable

from streams import serde, topics
from streams.partition_task import Out, PartitionTask, dead_letter  # noqa: F401 - the tasks' dead letters

TaskFactory = Callable[[int], PartitionTask]
Wiring = Callable[[Any, dict[str, Any]], AbstractAsyncContextManager[TaskFactory]]
"""wiring(settings, client_kwargs): an async context that opens what the tasks share (side inputs, a judge
client, revision 0 on the log) and yields the per-partition task factory; it closes them on exit."""


@dataclass(frozen=True)
class Service:
    name: str
    help: str
    inputs: tuple[topics.Topic, ...]  # co-partitioned: one task per partition number owns all of them
    outputs: tuple[topics.Topic, ...]
    wiring: str  # "module:function" of a ``Wiring``, imported only when the service runs (torch stays lazy)
    options: tuple[str, ...] = ()  # ServiceSettings fields that are this service's own flags
    side_inputs: tuple[topics.Topic, ...] = ()  # read besides the inputs, without a consumer group
    runs_algorithm: bool = False  # refuses a plan whose algorithm nothing here runs
    # The longest one fetch's processing may take (a trainer step on a CPU: minutes). The group waits this long
    # for the member, polling or rebalancing, before it takes the partitions away; shorter would abort the work
    # and hand it to the next member, which would abort it again, forever.
    max_process_s: float = 120.0
    data_parallel: bool = False  # may run as a torchrun group (``consumers.trainer.distributed``): rank 0 is the service
    runs_when: str | None = None  # a ServiceSettings property: a run without it has no work here (left out of it)

    def needed(self, settings: Any) -> bool:
        """Whether a run with these settings has work for this service (the demo and ``rollout rl`` start those)."""
        return self.runs_when is None or bool(getattr(settings, self.runs_when))

    @property
    def partitions(self) -> int:
        counts = {t.partitions for t in self.inputs}
        if len(counts) != 1:
            raise ValueError(f"{self.name}: co-partitioned inputs must share a partition count, got {counts}")
        return counts.pop()

    @property
    def group_id(self) -> str:
        return topics.group_id(self.name)

    def open(self, settings: Any, client_kwargs: dict[str, Any]) -> AbstractAsyncContextManager[TaskFactory]:
        module, _, fn = self.wiring.partition(":")
        return getattr(importlib.import_module(module), fn)(settings, client_kwargs)


class TaskDefaults:
    """What a partition task that buffers no input, keeps no state, has no timers, nothing to do after a commit or
    nothing running when dropped inherits: override the rest."""

    def restore(self, rec: Any) -> None:
        raise AssertionError(f"{type(self).__name__} buffers nothing, so a snapshot never lists input to restore")

    def tick(self, now: float) -> list[Out]:
        return []

    def input_read(self, now: float) -> list[Out]:
        return []

    def buffered(self) -> dict[str, list[int]]:
        return {}

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        pass

    def committed(self) -> None:
        pass

    def close(self) -> None:
        pass


def decode(rec: Any, expect: type) -> Any:
    return serde.from_message(rec.value, expect)
