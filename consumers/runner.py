"""Running services: one supervised process per service (``serve``), or several in one process (``System``).

Each service is a consumer group (scale out by starting more instances), exactly-once through Kafka
transactions (``streams.transactions``), dead-letters what it cannot process inside the same
transaction as the offset commit, and stops gracefully on SIGTERM. Everything service-specific comes
from its ``Service`` declaration (``consumers.registry``).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from contextlib import AsyncExitStack
from typing import Any, Iterable

from consumers.registry import SERVICES
from consumers.service import Service
from consumers.settings import ServiceSettings
from streams import instances, topics
from streams.changelog import changelog_topic
from streams.errors import diagnose
from streams.kafka_errors import KafkaAccessError
from streams.metrics import SERVICE_OFFSET, Endpoint, ServiceMetrics, port_for
from streams.security import check_access
from streams.poison import ProcessMustRestart
from streams.processor_config import ProcessorConfig
from streams.settings import ProcessingSettings
from streams.transactions import TransactionalProcessor

log = logging.getLogger("rollout.services")


async def ensure_topics(service: Service, admin_kwargs: dict[str, Any]) -> None:
    """The service's changelog, inputs and outputs (a refusal to create one is its error), and the rest of the
    pipeline's topics where its principal may create them (``streams.topics.ensure``). Idempotent."""
    await topics.ensure(admin_kwargs, [changelog_topic(service.name, service.partitions), *service.inputs,
                                       *service.side_inputs, *service.outputs])


def tune_gc(processing: ProcessingSettings) -> None:
    """The cyclic collector's pace in a service process (``processing.gc_threshold``, ``ROLLOUT_GC_THRESHOLD``;
    0, the default, leaves Python's). A service allocates a few models a record and leaves almost no cycles, so at
    Python's pace (every 700 allocations) the collector mostly walks live objects: at 50,000, ~8% less CPU a
    rollout for the three services, and a median latency 15-35 ms higher in the runs measured
    (benchmarks/RESULTS.md, issue 14), hence off unless asked for."""
    threshold = processing.gc_threshold
    if threshold:
        gc.set_threshold(threshold, 20, 100)


def processor(service: Service, factory: Any, settings: ServiceSettings, client_kwargs: dict[str, Any],
              processing: ProcessingSettings) -> TransactionalProcessor:
    """The service's transactional processor: ``factory`` its partition tasks, ``settings`` the service's own
    (the instance, a derived run's topics), ``processing`` the process's stream-processing settings."""
    inputs = tuple(name for t in service.inputs for name in settings.reads(t))
    config = ProcessorConfig(service.name, inputs, service.partitions, instance=settings.instance,
                             settings=processing, max_process_s=service.max_process_s)
    return TransactionalProcessor(config, factory, client_kwargs, poison_dir=_poison_dir(service))


def _poison_dir(service: Service) -> Path | None:
    """Where a torchrun group's rank 0 keeps its poison counts (``streams.poison``): a batch that crashes a
    follower rank restarts the whole group, rank 0's memory with it. None for a service in one process."""
    if not service.data_parallel:
        return None
    from consumers.trainer.distributed import world_size

    return instances.slots_dir() if world_size() > 1 else None


def metrics_endpoint(service: Service, port: int | None = None) -> tuple[Endpoint, ServiceMetrics | None]:
    """The service's Prometheus endpoint (``streams.metrics``): ``port``, else ROLLOUT_METRICS_PORT + 10 + its
    place in the registry, started, and what counts for it; with no port, nothing counts (no cost when off)."""
    ep = Endpoint(service.name, port_for(SERVICE_OFFSET + list(SERVICES).index(service.name), port))
    return ep.start(), ServiceMetrics(service.name, ep.registry) if ep.port else None


ABANDON_AFTER_S = 2.0  # a System stopped by a signal: what its services have not committed by then is abandoned
STOP_BOUND_S = 8.0
"""A service stopped by a signal exits within this, whatever it still waits on (a broker that is gone, a trainer
step in its torch thread): issue 36 asks every long-lived command to stop within 10 s of SIGTERM. What it has not
committed by then is abandoned, as a SIGKILL would abandon it: its next owner reads that input again."""


class System:
    """Several services in one process (the demo, tests, benchmarks): ``async with System(...) as s``
    creates the topics, opens each service's wiring, runs its processor, and on exit stops the
    processors and then closes the wiring. ``s.processors[name]`` is each service's processor.

    ``settings``: the services' own; ``client_kwargs``: aiokafka connection kwargs. The stream-processing settings
    (``streams.settings``) are read from the environment once, on entering, and handed to every processor."""

    def __init__(self, names: Iterable[str], settings: ServiceSettings, client_kwargs: dict[str, Any]) -> None:
        self.services = [SERVICES[n] for n in names]
        self.settings = settings
        self.kw = client_kwargs
        self.processors: dict[str, TransactionalProcessor] = {}
        self.metrics: dict[str, Endpoint] = {}  # each service's own /metrics (ROLLOUT_METRICS_PORT set)
        self._tasks: list[asyncio.Task] = []
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> System:
        processing = ProcessingSettings()
        tune_gc(processing)
        for svc in self.services:
            await ensure_topics(svc, self.kw)
        for svc in self.services:
            factory = await self._stack.enter_async_context(svc.open(self.settings, self.kw))
            self.processors[svc.name] = processor(svc, factory, self.settings, self.kw, processing)
            self.metrics[svc.name], observer = metrics_endpoint(svc)
            self._stack.callback(self.metrics[svc.name].close)
            if observer is not None:
                observer.attach(self.processors[svc.name])
        self._tasks = [asyncio.create_task(p.run(), name=n) for n, p in self.processors.items()]
        return self

    async def __aexit__(self, exc_type: Any, *exc: Any) -> None:
        """Each processor finishes its transaction in hand and stops; when the block ended by an exception (a
        signal cancelled it) they get ``ABANDON_AFTER_S``, then what is still open is abandoned uncommitted (its
        input is read again by the next owner: nothing committed is lost)."""
        for p in self.processors.values():
            p.stopping.set()
        if exc_type is not None and self._tasks:
            _, late = await asyncio.wait(self._tasks, timeout=ABANDON_AFTER_S)
            for t in late:
                t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._stack.aclose()


# -- one service, supervised -------------------------------------------------------------------------------
async def serve(service: Service, settings: ServiceSettings, client_kwargs: dict[str, Any], *,
                stats_every_s: float = 10.0, metrics_port: int | None = None) -> None:
    """Run one service until SIGTERM. Supervises its own Kafka clients: if the broker is unreachable at start,
    or the clients lose the cluster (aiokafka can be left with no known brokers after a broker restart), or
    partitions with input make no progress, the processor is torn down and built again; exactly-once is
    unaffected, since a new processor takes its partitions over from the log (fence, offsets, changelog).
    The stream-processing settings (``streams.settings``) are read from the environment once, here, and handed to
    every processor built."""
    import signal

    stop = asyncio.Event()
    fields = {"service": service.name, "instance": settings.instance}

    def on_signal() -> None:
        if not stop.is_set():
            _exit_at_the_bound(fields)
            stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    processing = ProcessingSettings()
    tune_gc(processing)
    endpoint, observer = metrics_endpoint(service, metrics_port)
    try:
        await _serve(service, settings, client_kwargs, stop, fields, processing, stats_every_s, observer)
    finally:
        endpoint.close()
    log.info("service stopped", extra={"fields": fields})


def _exit_at_the_bound(fields: dict[str, Any]) -> None:
    """Armed by the first signal: a daemon timer that ends the process ``STOP_BOUND_S`` later if the graceful stop
    has not (an await on a broker that is gone, the interpreter's join of a torch thread mid-step); it outlives the
    event loop, so it bounds the whole shutdown."""

    def abandon() -> None:
        log.warning("not stopped %.0f s after the signal: exiting now; what was not committed is read again by the "
                    "next owner", STOP_BOUND_S, extra={"fields": fields})
        logging.shutdown()
        sys.stdout.flush()
        os._exit(0)

    timer = threading.Timer(STOP_BOUND_S, abandon)
    timer.daemon = True
    timer.start()


async def _serve(service: Service, settings: ServiceSettings, client_kwargs: dict[str, Any], stop: asyncio.Event,
                 fields: dict[str, Any], processing: ProcessingSettings, stats_every_s: float,
                 observer: ServiceMetrics | None) -> None:
    checked = False
    while not stop.is_set():
        if not await _retry(lambda: ensure_topics(service, client_kwargs), stop, client_kwargs):
            break
        if not checked:  # once: the principal may read its inputs and write its outputs (KafkaError if not)
            await check_access(service, client_kwargs)
            checked = True
        try:
            async with service.open(settings, client_kwargs) as factory:
                proc = processor(service, factory, settings, client_kwargs, processing)
                proc.stopping = stop
                if observer is not None:
                    observer.attach(proc)
                try:
                    await _supervise(proc, fields, stop, processing.stall_s, stats_every_s)
                finally:
                    try:
                        await asyncio.wait_for(proc.stop(), 5)  # a broker that is away must not keep us spinning
                    except Exception as e:  # noqa: BLE001
                        log.warning("closing clients: %s", e)
        except ProcessMustRestart:
            raise
        except Exception as e:  # noqa: BLE001 - rebuild the clients and carry on
            log.warning("restarting the Kafka clients", extra={"fields": {
                **fields, "error": f"{type(e).__name__}: {e}"}})
            await asyncio.sleep(1.0)


async def _supervise(proc: TransactionalProcessor, fields: dict[str, Any], stop: asyncio.Event, stall_s: float,
                     stats_every_s: float) -> None:
    await proc.start()
    log.info("service started", extra={"fields": {**fields, "group": proc.config.group_id}})
    last = time.monotonic()
    lost_since: float | None = None
    while not stop.is_set():
        await proc.safe_step()
        if proc.lost_cluster():
            lost_since = lost_since or time.monotonic()
            if time.monotonic() - lost_since > 3:
                raise ConnectionError("Kafka clients lost the cluster metadata")
        else:
            lost_since = None
        if time.monotonic() - last >= stats_every_s:
            last = time.monotonic()
            stuck = await proc.stalled(stall_s)
            if stuck:
                raise ConnectionError(f"partitions {stuck} have input but made no progress")
            s = proc.stats
            log.info("stats", extra={"fields": {
                **fields, "partitions": sorted(proc.tasks), "in": s.records_in, "out": s.records_out,
                "txns": s.transactions, "aborted": s.aborted, "fenced": s.fenced, "rebuilt": s.rebuilt,
                "recommitted": s.recommitted, "by_type": dict(s.by_type)}})


async def _retry(fn, stop: asyncio.Event, client_kwargs: dict[str, Any], *, every_s: float = 2.0) -> bool:
    """Until ``fn`` succeeds: a broker not up yet is waited for; credentials, certificates or permissions
    that are wrong end the service with their one-line ``KafkaError`` (waiting would not fix them)."""
    while not stop.is_set():
        try:
            await fn()
            return True
        except Exception as e:  # noqa: BLE001 - broker not there yet, or a cause named below
            why = await diagnose(e, client_kwargs)
            if isinstance(why, KafkaAccessError):
                raise why from None
            log.warning("Kafka not ready yet: %s", why)
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except asyncio.TimeoutError:
                pass
    return False


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        d = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
             "msg": record.getMessage()}
        extra = getattr(record, "fields", None)
        if extra:
            d.update(extra)
        return json.dumps(d)


def setup_logging(level: str = "INFO") -> None:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(level)
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
