"""How many episodes the arena keeps in flight: a cap sized while the run goes, as prime-rl's orchestrator sizes
its own from ``[orchestrator.concurrency]``, with the machine among the capacities.

On a small machine the engine's KV cache is rarely what runs out first: verifiers' glossary starts a tool server
(188 MB) and a bash harness (70 MB) for every episode, and 28 in flight on 2 cores held 7.3 GB beside vLLM's 4.8 GB
(issue 53), finishing no faster than 8 did. So the cap (``InflightCap``, pure: fed readings, it says
the cap) follows five signals:

* memory: the episodes' own cost, learned as (the arena's process tree less the servers it started, less what it
  held with nothing in flight) / episodes in flight; under ``MEMORY_RESERVE`` of the machine left, the cap is cut by
  as many episodes as would give it back (by ``CUT`` while the cost is unknown), and it never grows into memory
  the machine does not have;
* the engine (vLLM's ``/metrics``): a preemption cuts by ``CUT``; a KV cache fuller than ``KV_HIGH`` trims the cap to
  ``KV_TRIM_TO`` of it; the cap grows only while the cache is under ``KV_LOW`` and nothing waits in vLLM's queue;
* throughput: every change is a trial, judged on the second turnover after it (a turnover: as many episodes finished
  as the cap): growth is kept only if episodes finish ``TRIAL_GAIN`` faster, a shrink (tried only where an episode
  costs ``SHRINK_WORTH`` or more) unless they finish that much slower. A failed trial is undone and its kind held
  for ``HOLD_TURNOVERS``; a kept one holds the opposite kind as long, so the cap does not oscillate.
* the cores: episodes that run processes of their own (a tool server, a harness) spend the machine's cores, not
  only the engine's; on 2 cores glossary finished its 32 episodes in 267 s with 8 in flight as with 28, holding
  4.2 GB less. So a start the recipe does not set is held at ``PER_CORE`` episodes a core until the episodes are
  known: episodes that start processes (``Load.processes``) move from there by trials only; episodes that run in
  the arena (none seen after ``PROBE_POLLS`` polls, or one finished) open at once to the start below.
* the bounds: ``[orchestrator.concurrency]`` (``schemas.plan.Concurrency``); a plan without it opens at and never
  grows past the arena's ``--concurrency``. ``initial_inflight`` unset: the cap opens at the number of full-length
  sequences the engine's KV cache holds (``min_inflight`` until that is read); set, it starts there.

``Limiter`` is the semaphore whose limit moves; ``LoadProbe`` takes the readings (``/proc`` off the event loop,
vLLM's metrics over HTTP).
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from dataclasses import dataclass
from typing import Any

from producers.host import meminfo, tree_rss
from schemas.plan import Concurrency

MEMORY_RESERVE = 0.15  # of the machine's memory left to everything else: the cap never eats into it
KV_HIGH, KV_TRIM_TO, KV_LOW = 0.8, 0.7, 0.6
CUT, GROW = 0.8, 1.25
TRIAL_GAIN = 0.10  # a trial changes the finishing rate by this much, or it is not worth its memory
SHRINK_WORTH = 32 << 20  # an episode holding less is not worth a shrink trial: the engine, not memory, bounds it
HOLD_TURNOVERS = 8
POLL_S = 2.0
PROBE_POLLS = 2  # polls with episodes in flight and no process of theirs seen: they run in the arena
PER_CORE = 4  # episodes that run processes, held per core: glossary on 2 cores finished 0.12 episodes/s at 2-3 in
# flight, 0.18 at 8 and 0.19 at 28 (benchmarks/RESULTS.md); the trials move the cap from there


@dataclass(frozen=True)
class Load:
    """One poll's readings; None: not known (a server without vLLM's metrics, a system without /proc)."""

    available: int | None = None  # bytes the machine can still give (MemAvailable)
    total: int | None = None  # the machine's memory
    episodes: int | None = None  # bytes the episodes' processes and state hold now, beyond the arena at rest
    kv_usage: float | None = None  # the fullest learner server's KV cache, 0-1
    waiting: float | None = None  # requests queued in the learner's servers
    preemptions: float | None = None  # the servers' preemptions so far (a counter)
    kv_sequences: int | None = None  # full-length sequences the engines' KV caches hold
    processes: int | None = None  # processes the episodes run now, beyond the arena at rest


@dataclass
class _Trial:
    kind: str  # "grow" or "shrink"
    before: int  # the cap it changed
    base_rate: float  # episodes a second over the turnover before it
    started: int  # episodes finished when it started


class InflightCap:
    """The cap on episodes in flight (``cap``), moved by ``observe`` at each poll and ``completed`` per episode."""

    def __init__(self, bounds: Concurrency, cores: int | None = None, opening: int | None = None) -> None:
        """``cores``: the machine's; a start the recipe does not set is held to ``PER_CORE`` episodes each until the
        episodes are known (None: not held). ``opening``: where such a start opens (None: the engine's KV capacity,
        once read)."""
        self.bounds = bounds
        self.top = bounds.max_inflight if bounds.max_inflight is not None else math.inf
        self.opening = opening
        start = bounds.initial_inflight if bounds.initial_inflight is not None else opening if cores is None else None
        self.held_to = PER_CORE * cores if start is None and cores else None
        self.episodes: str | None = None  # "processes" or "in the arena", once known
        self.probed = 0  # polls with episodes in flight
        self.sized = start is not None
        self.cap = self._bounded(start if start is not None else self.held_to or bounds.min_inflight)
        self.cost: float | None = None  # bytes an episode holds, learned
        self.finished = 0
        self.finish_times: collections.deque[float] = collections.deque(maxlen=4096)
        self.trial: _Trial | None = None
        self.held: dict[str, int] = {}  # kind -> episodes finished until it may be tried again
        self.preemptions: float | None = None
        self.reason = "initial" if self.sized else "held to the cores until the episodes are known" \
            if self.held_to is not None else "min_inflight until the engine's KV capacity is read"

    @classmethod
    def fixed_start(cls, concurrency: int, cores: int | None = None) -> InflightCap:
        """A plan without ``[orchestrator.concurrency]``: the arena's own number is where it opens and its ceiling."""
        return cls(Concurrency(max_inflight=concurrency), cores=cores, opening=concurrency)

    def _bounded(self, n: float) -> int:
        return int(max(self.bounds.min_inflight, min(self.top, n)))

    def completed(self, now: float | None = None) -> None:
        self.finished += 1
        self.finish_times.append(time.monotonic() if now is None else now)

    def rate(self, over: int) -> float | None:
        """Episodes a second over the last ``over`` finished; None before that many."""
        if over < 1 or len(self.finish_times) <= over:
            return None
        span = self.finish_times[-1] - self.finish_times[-1 - over]
        return over / span if span > 0 else None

    def _set(self, cap: int, reason: str) -> int:
        self.cap, self.reason = cap, reason
        return cap

    def observe(self, load: Load, in_flight: int) -> int:
        """The cap after this poll's readings."""
        if load.episodes is not None and in_flight > 0:
            per = max(0.0, load.episodes / in_flight)
            self.cost = per if self.cost is None else 0.5 * self.cost + 0.5 * per
        if not self.sized:
            opened = self._open(load, in_flight)
            if opened is not None:
                return opened
        cut = self._cut(load, in_flight)
        if cut is not None:
            self.trial = None
            return cut
        if self.trial is not None:
            return self._judge()
        return self._try(load, in_flight)

    def _open(self, load: Load, in_flight: int) -> int | None:
        """A start the recipe did not set: opened once it is known (the episodes' kind, the engine's capacity), or
        kept where the cores hold it, to move by trials, for episodes that run processes; None while nothing
        changes."""
        if self.held_to is not None and self.episodes is None:
            if in_flight > 0:
                self.probed += 1
                if load.processes is not None and load.processes >= max(1, in_flight / 2):
                    self.episodes = "processes"
                    self.sized = True
                    return self._set(self.cap, "episodes run processes: held to the cores, moved by trials")
            if self.probed < PROBE_POLLS and not self.finished:
                return None
            self.episodes = "in the arena"
        start = self.opening if self.opening is not None else load.kv_sequences
        if not start:
            return None
        self.sized = True
        return self._set(self._bounded(start), "the arena's --concurrency" if self.opening is not None
                         else "the engine's KV capacity")

    def _headroom(self, load: Load) -> float | None:
        if load.available is None or not load.total:
            return None
        return load.available - MEMORY_RESERVE * load.total

    def _cut(self, load: Load, in_flight: int) -> int | None:
        """Cuts that do not wait for a trial: memory, preemption, a full KV cache."""
        headroom = self._headroom(load)
        if headroom is not None and headroom < 0:
            if self.cost is None:
                return self._set(self._bounded(self.cap * CUT), "memory under the reserve")
            if self.cost > 0:
                return self._set(self._bounded(in_flight - math.ceil(-headroom / self.cost)),
                                 "memory under the reserve")
        before, self.preemptions = self.preemptions, load.preemptions
        if before is not None and load.preemptions is not None and load.preemptions > before:
            return self._set(self._bounded(self.cap * CUT), "the engine preempted sequences")
        if load.kv_usage is not None and load.kv_usage > KV_HIGH and in_flight:
            return self._set(self._bounded(min(self.cap, in_flight * KV_TRIM_TO / load.kv_usage)), "KV cache full")
        return None

    def _try(self, load: Load, in_flight: int) -> int:
        base = self.rate(self.cap)
        if base is None:
            return self.cap
        grown = self._bounded(math.ceil(self.cap * GROW))
        headroom = self._headroom(load)
        fits = headroom is None or self.cost is None or headroom >= self.cost * (grown - in_flight)
        engine_free = (load.kv_usage is None or load.kv_usage < KV_LOW) and not load.waiting
        if (grown > self.cap and in_flight >= self.cap and engine_free and fits
                and self.held.get("grow", 0) <= self.finished):
            return self._start("grow", grown, base)
        shrunk = self._bounded(self.cap * CUT)
        if (shrunk < self.cap and (self.cost or 0) >= SHRINK_WORTH
                and self.held.get("shrink", 0) <= self.finished):
            return self._start("shrink", shrunk, base)
        return self.cap

    def _start(self, kind: str, cap: int, base: float) -> int:
        self.trial = _Trial(kind, self.cap, base, self.finished)
        return self._set(cap, f"trying {kind}")

    def _judge(self) -> int:
        t = self.trial
        assert t is not None
        if self.finished < t.started + 2 * self.cap:
            return self.cap
        rate = self.rate(self.cap) or 0.0
        kept = rate >= t.base_rate * (1 + TRIAL_GAIN) if t.kind == "grow" else rate >= t.base_rate * (1 - TRIAL_GAIN)
        self.trial = None
        hold = self.finished + HOLD_TURNOVERS * self.cap
        if kept:
            self.held["shrink" if t.kind == "grow" else "grow"] = hold
            return self._set(self.cap, f"{t.kind} kept ({t.base_rate:.2f} -> {rate:.2f} episodes/s)")
        self.held[t.kind] = hold
        return self._set(t.before, f"{t.kind} undone ({t.base_rate:.2f} -> {rate:.2f} episodes/s)")


class Limiter:
    """A semaphore whose limit moves: lowering it cancels nothing, new acquisitions wait until fewer are held."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self) -> bool:
        while self.held >= self.limit:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():  # woken, then cancelled: pass the wake-up on
                    self._wake()
                raise
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
        self.held += 1
        return True

    def release(self) -> None:
        self.held -= 1
        self._wake()

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        self._wake()

    def _wake(self) -> None:
        free = self.limit - self.held
        for fut in list(self._waiters):
            if free <= 0:
                break
            if not fut.done():
                fut.set_result(None)
                free -= 1


class LoadProbe:
    """Takes a ``Load``: the machine's memory and the arena's process tree from /proc (in a thread: walking /proc
    takes milliseconds the event loop should not wait), the learner servers' KV cache and queue from vLLM's
    ``/metrics`` (a server without them counts as unknown)."""

    def __init__(self, http: Any, base_urls: list[str], server_pids: set[int], root_pid: int) -> None:
        self.http, self.base_urls, self.server_pids, self.root_pid = http, base_urls, server_pids, root_pid
        self.kv_sequences: dict[str, int] = {}
        # the tree with nothing in flight, read now (the arena makes its probe before its first episode) and
        # lowered by any later reading with nothing in flight
        pids = tree_rss(root_pid, skip=frozenset(server_pids))
        self.at_rest: int = sum(pids.values())
        self.processes_at_rest: int = len(pids)

    def _memory(self) -> tuple[dict[str, int] | None, dict[int, int]]:
        return meminfo(), tree_rss(self.root_pid, skip=frozenset(self.server_pids))

    async def take(self, in_flight: int) -> Load:
        mem, pids = await asyncio.to_thread(self._memory)
        tree, processes = sum(pids.values()), len(pids)
        if in_flight == 0:
            self.at_rest, self.processes_at_rest = min(self.at_rest, tree), min(self.processes_at_rest, processes)
        kv: list[float] = []
        waiting = preemptions = 0.0
        known = False
        for url in self.base_urls:
            figures = await self._engine(url)
            if figures is None:
                continue
            known = True
            kv.append(figures.get("kv", 0.0))
            waiting += figures.get("waiting", 0.0)
            preemptions += figures.get("preemptions", 0.0)
        return Load(available=mem.get("MemAvailable") if mem else None, total=mem.get("MemTotal") if mem else None,
                    episodes=max(0, tree - self.at_rest), kv_usage=max(kv) if kv else None,
                    waiting=waiting if known else None, preemptions=preemptions if known else None,
                    kv_sequences=sum(self.kv_sequences.values()) or None,
                    processes=max(0, processes - self.processes_at_rest))

    async def _engine(self, base_url: str) -> dict[str, float] | None:
        from prometheus_client.parser import text_string_to_metric_families

        root = base_url.rstrip("/").removesuffix("/v1")
        try:
            r = await self.http.get(f"{root}/metrics", timeout=5.0)
            if r.status_code != 200:
                return None
            out: dict[str, float] = {}
            blocks = None
            for family in text_string_to_metric_families(r.text):
                for s in family.samples:
                    if s.name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                        out["kv"] = max(out.get("kv", 0.0), s.value)
                    elif s.name == "vllm:num_requests_waiting":
                        out["waiting"] = out.get("waiting", 0.0) + s.value
                    elif s.name == "vllm:num_preemptions_total":
                        out["preemptions"] = out.get("preemptions", 0.0) + s.value
                    elif s.name == "vllm:cache_config_info" and s.labels.get("num_gpu_blocks") not in (None, "None"):
                        blocks = int(s.labels["num_gpu_blocks"]) * int(s.labels.get("block_size", 16))
            if blocks and base_url not in self.kv_sequences:
                m = await self.http.get(f"{root}/v1/models", timeout=5.0)
                lengths = [d.get("max_model_len") for d in m.json().get("data", [])] if m.status_code == 200 else []
                longest = max((n for n in lengths if isinstance(n, int) and n > 0), default=None)
                if longest:
                    self.kv_sequences[base_url] = max(1, blocks // longest)
            return out if "kv" in out else None
        except Exception:  # noqa: BLE001 - a server not answering its metrics is unknown load, not an error
            return None
