"""The stream-processing knobs: one settings object, read from ``ROLLOUT_<FIELD>`` environment variables.

    ProcessingSettings().confirm_s          # ROLLOUT_CONFIRM_S, default 10
    current().topic_prefix                  # the environment as it is now, cheaply (topic names use it)

An empty variable means the default, except ``ROLLOUT_TOPIC_PREFIX``, where "" is a prefix like any other.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator

from pydantic import Field, ValidationInfo, field_validator
from pydantic_core import PydanticUseDefault
from pydantic_settings import BaseSettings, SettingsConfigDict

MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""The largest message (an episode's steps, a trainer batch): topics' ``max.message.bytes`` and every
producer's ``max_request_size`` must agree on it, or a record the producer accepts is refused by the topic."""

FETCH_MAX_BYTES = 4 * 1024 * 1024
"""The most one fetch response brings (a larger first record batch still comes whole: KIP-74); a partition's own
limit is MAX_MESSAGE_BYTES. A response is read into fresh buffers and copied a few times on its way to records: at
64 MB glibc mmap'd them anew for every fetch (~100,000 page faults to read 119 MB), at 4 MB it reuses them: replay
and its raw-consume baseline use 10-30% less CPU; the services' benchmark moved within its noise
(benchmarks/RESULTS.md), and each fetch holds 16x less memory."""

FETCH_OPTIONS = {"fetch_max_bytes": FETCH_MAX_BYTES, "max_partition_fetch_bytes": MAX_MESSAGE_BYTES}
"""The fetch sizes of every pipeline consumer (services, replay), as AIOKafkaConsumer keyword arguments."""


class ProcessingSettings(BaseSettings):
    """What the transactional processor, the topics and the service supervisor read from the environment."""

    model_config = SettingsConfigDict(env_prefix="ROLLOUT_", frozen=True)

    session_timeout_ms: int = Field(10000, description="consumer group session timeout")
    txn_timeout_s: float = Field(30.0, description="give up on a takeover or a transaction after this long")
    transaction_timeout_ms: int = Field(10000, description="the broker aborts a transaction left open this long (a "
                                        "crashed instance's): its partitions' new owner waits for that")
    confirm_s: float = Field(10.0, description="re-commit a committed transaction not visible after this long")
    fetch_max_wait_ms: int = Field(100, description="how long a fetch waits for input to arrive")
    commit_interval_ms: int = Field(0, ge=0, description="a service commits a partition's work at most this often "
                                    "(0: after every fetch); more: fewer, larger transactions, later outputs")
    stall_s: float = Field(30.0, description="rebuild the clients when input waits this long with no commit")
    topic_prefix: str = Field("rollout.", description="prefix of every topic, consumer group and transactional id")
    topic_replication_factor: int = Field(1, description="replication factor of created topics")
    topic_min_insync_replicas: int = Field(1, description="min.insync.replicas of created topics: replicas that "
                                           "must have a write before acks=all succeeds (2 on a 3-broker cluster)")
    steps_retention_ms: int = Field(-1, description="retention of the steps topic (-1: forever)")
    metrics_port: int = Field(0, ge=0, description="base port of the Prometheus endpoints: each process serves on "
                              "base + its offset (streams.metrics.OFFSETS); 0: none")
    gc_threshold: int = Field(0, ge=0, description="a service process runs Python's cyclic garbage collector "
                              "after this many net allocations (older generations every 20 and 100 of those); 0: "
                              "Python's settings (700, 10, 10). 50000 saves ~8% of the services' CPU; the median "
                              "latency came out 15-35 ms higher with it (benchmarks/RESULTS.md)")

    @field_validator("*", mode="before")
    @classmethod
    def _empty_is_unset(cls, v: object, info: ValidationInfo) -> object:
        if v == "" and info.field_name != "topic_prefix":
            raise PydanticUseDefault()
        return v


_ENV_NAMES = tuple(f"ROLLOUT_{name.upper()}" for name in ProcessingSettings.model_fields)


_OVERRIDES: contextvars.ContextVar[dict[str, object]] = contextvars.ContextVar("rollout_settings", default={})


def current() -> ProcessingSettings:
    """The settings the environment holds now, with any ``overridden`` values. Tests change
    ROLLOUT_TOPIC_PREFIX per test and topic names are looked up per record, so this re-reads the variables on
    every call but parses them only when they changed."""
    parsed = _parsed(tuple(os.environ.get(name) for name in _ENV_NAMES))
    overrides = _OVERRIDES.get()
    return parsed.model_copy(update=overrides) if overrides else parsed


@contextlib.contextmanager
def overridden(**values: object) -> Iterator[None]:
    """Settings for the code run inside (and the tasks and threads it starts), e.g. the demo's own topic
    prefix for its in-process services, without changing the process environment."""
    unknown = set(values) - set(ProcessingSettings.model_fields)
    if unknown:
        raise TypeError(f"not processing settings: {sorted(unknown)}")
    token = _OVERRIDES.set({**_OVERRIDES.get(), **values})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)


def topic_prefix() -> str:
    """``current().topic_prefix`` for the price of one variable: topic names are looked up for every record, and
    reading every ROLLOUT_ variable on each lookup was ~5% of a service's CPU (benchmarks/RESULTS.md)."""
    overrides = _OVERRIDES.get()
    if "topic_prefix" in overrides:
        return overrides["topic_prefix"]  # type: ignore[return-value]
    value = os.environ.get("ROLLOUT_TOPIC_PREFIX")
    return _DEFAULT_PREFIX if value is None else value


_DEFAULT_PREFIX: str = ProcessingSettings.model_fields["topic_prefix"].default


@functools.lru_cache(maxsize=16)
def _parsed(values: tuple[str | None, ...]) -> ProcessingSettings:
    """``values`` is only the cache key: the settings are read from the environment that holds them."""
    return ProcessingSettings()
