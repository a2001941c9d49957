"""What one service instance's transactional processor is (``streams.transactions``): its service, inputs,
partitions and instance, the process's stream settings, and the budgets derived from them. Frozen: read once,
when the processor is built, so every transaction of its life runs under the same rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from streams import topics
from streams.changelog import changelog_topic
from streams.settings import ProcessingSettings

TICK_S = 0.5  # how often every task's timers run (``PartitionTask.tick``), with or without input
MAX_RECORDS = 2000  # the most records one fetch hands the loop
LINGER_MS = 5  # the producer's wait to fill a batch: a transaction's sends go out together at its commit anyway


@dataclass(frozen=True)
class ProcessorConfig:
    service: str
    inputs: tuple[str, ...]  # co-partitioned: partition p of each is owned together
    partitions: int
    instance: str = ""  # --instance; "" for an unnamed one (``streams.instances``)
    settings: ProcessingSettings = field(default_factory=ProcessingSettings)
    # the longest one input record may take (``consumers.service.Service.max_process_s``)
    max_process_s: float = 120.0

    @cached_property
    def group_id(self) -> str:
        return topics.group_id(self.service)

    @cached_property
    def changelog(self) -> str:
        return changelog_topic(self.service, self.partitions).name

    @property
    def name(self) -> str:
        """How the logs name the instance."""
        return f"{self.service}{self.instance}"

    @property
    def max_process_ms(self) -> int:
        """No fetch while a transaction's input is processed, and a revocation waits for it: the group must wait as
        long for both (the consumer's poll interval and rebalance timeout)."""
        return int(self.max_process_s * 1000)

    @property
    def process_budget_s(self) -> float:
        """A transaction takes no more input after this long, so one more record as slow as the last still fits."""
        return self.max_process_s / 2

    @property
    def txn_timeout_s(self) -> float:
        return self.settings.txn_timeout_s

    @property
    def session_timeout_ms(self) -> int:
        return self.settings.session_timeout_ms

    @property
    def commit_interval_s(self) -> float:
        """A partition's input waits until its last commit is this old (``ROLLOUT_COMMIT_INTERVAL_MS``)."""
        return self.settings.commit_interval_ms / 1000
