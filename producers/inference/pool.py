"""Several inference servers as one endpoint: each request goes to the server with the fewest requests
outstanding, and a server that fails is out of the pool until it answers again.

    pool = InferencePool(["http://gpu-1:8000/v1", "http://gpu-2:8000/v1"])
    server = pool.pick()                    # None while every server is out (see pick)
    with pool.sending(server): ...          # counted outstanding while its request runs
    pool.take_out(server, "ConnectError")   # a transport error or a 5xx: no more requests until it is back

Least outstanding rather than round-robin: generation time varies by request (prompt length, tokens to EOS)
and by server (a busier or slower host), and a server that answers slowly holds more requests open, so it
gets fewer new ones. Ties go in turn.

A server taken out is probed (``GET /health`` at its root: vLLM's, and the local policy server's) every
``probe_s``. When it answers (any status below 500: an endpoint without /health answers 404) the pool's
``rejoin`` runs first, holding ``membership``, and only then does the server take requests again: there
``producers.inference.weights.PoolWeights`` loads the current revision, so a restarted server never serves its old
weights. A weight swap holds ``membership`` too, so no server joins or rejoins while one is in progress.

A server that restarts while idle fails no request to say so: where the pool restores weights (``rejoin``), every
up server's ``/health`` is asked every ``probe_s`` too (``watch``), and one that does not answer is taken out, so
it rejoins with the current revision instead of serving its start-up weights. A restart shorter than ``probe_s``
is not seen (vLLM's takes tens of seconds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import httpx

log = logging.getLogger("rollout.pool")


def server_root(base_url: str) -> str:
    """``http://h:p/v1`` -> ``http://h:p`` (vLLM's admin routes and /health are not under /v1)."""
    url = base_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def answers(http: httpx.AsyncClient, url: str) -> bool:
    """Whether the server at ``url`` answers ``GET /health`` at its root with any status below 500 (an endpoint
    without /health answers 404: it is up)."""
    try:
        return (await http.get(server_root(url) + "/health", timeout=5.0)).status_code < 500
    except httpx.HTTPError:
        return False


async def await_servers(urls: Sequence[str], timeout_s: float, every_s: float = 0.25) -> list[str]:
    """Wait until every server answers ``GET /health`` (the pool's own test: any status below 500), at most
    ``timeout_s``: an arena started beside servers still loading (a demo's vLLM, a pod's sidecar) admits nothing
    before they can answer. The ones still silent at the end."""
    silent = list(urls)
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as http:
        while silent:
            silent = [url for url in silent if not await answers(http, url)]
            if not silent or time.monotonic() >= deadline:
                break
            await asyncio.sleep(every_s)
    return silent


@dataclass
class Server:
    url: str
    up: bool = True
    outstanding: int = 0  # requests sent and not yet answered
    served: int = 0  # requests answered (HTTP 200)
    errors: int = 0  # attempts that failed here: transport error, 429, 5xx
    taken_out: int = 0  # times it left the pool
    out_since: float | None = None  # monotonic time it last left the pool, while out
    reason: str = ""  # why it is out
    revision: int | None = None  # the revision whose weights it holds, when the arena loads them
    served_by_revision: Counter = field(default_factory=Counter)  # answers, by the revision it held then

    def snapshot(self) -> dict[str, Any]:
        return {"url": self.url, "up": self.up, "outstanding": self.outstanding, "served": self.served,
                "errors": self.errors, "taken_out": self.taken_out, "revision": self.revision,
                **({"reason": self.reason} if not self.up else {})}


class InferencePool:
    def __init__(self, base_urls: Sequence[str], *, probe_s: float = 0.5, rejoin_timeout_s: float = 300.0) -> None:
        self.servers = [Server(u.rstrip("/")) for u in dict.fromkeys(base_urls)]
        self.probe_s = probe_s
        self.rejoin_timeout_s = rejoin_timeout_s
        # run, holding membership, before a server that answers its probe takes requests again (PoolWeights')
        self.rejoin: Callable[[Server, httpx.AsyncClient], Awaitable[None]] | None = None
        self.membership = asyncio.Lock()
        self._turn = 0
        self._probes: set[asyncio.Task] = set()
        self._rejoined = asyncio.Event()
        self._watching: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self.servers)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def pick(self, avoid: Server | None = None) -> Server | None:
        """The up server with the fewest requests outstanding (``avoid``, the one that just failed, only if it is
        the last up); ties in turn. None while every server is out, except in a pool with nothing to restore on
        rejoin (no ``rejoin``: the arena loads no weights into it), where an out server is still tried, as a
        single endpoint always was: its answer is as good as a probe's."""
        candidates = [s for s in self.servers if s.up] or ([] if self.rejoin else list(self.servers))
        if avoid is not None and len(candidates) > 1:
            candidates = [s for s in candidates if s is not avoid]
        if not candidates:
            return None
        least = min(s.outstanding for s in candidates)
        tied = [s for s in candidates if s.outstanding == least]
        self._turn += 1
        return tied[self._turn % len(tied)]

    @contextmanager
    def sending(self, server: Server) -> Iterator[None]:
        server.outstanding += 1
        try:
            yield
        finally:
            server.outstanding -= 1

    def answered(self, server: Server) -> None:
        server.served += 1
        server.served_by_revision[server.revision] += 1
        if not server.up and self.rejoin is None:
            self._back(server)  # a pool with nothing to restore: an answer is proof enough

    def failed(self, server: Server, reason: str, *, take_out: bool) -> None:
        server.errors += 1
        if take_out:
            self.take_out(server, reason)

    def take_out(self, server: Server, reason: str) -> None:
        """No more requests to ``server`` until its probe finds it answering (and ``rejoin`` has run)."""
        if not server.up:
            return
        server.up, server.reason, server.out_since = False, reason, time.monotonic()
        server.taken_out += 1
        log.warning("%s is out of the pool: %s", server.url, reason)
        task = asyncio.get_running_loop().create_task(self._probe(server), name=f"probe-{server.url}")
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    def _back(self, server: Server) -> None:
        server.up, server.reason, server.out_since = True, "", None
        self._rejoined.set()
        self._rejoined = asyncio.Event()
        log.warning("%s is back in the pool", server.url)

    async def _probe(self, server: Server) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.rejoin_timeout_s, connect=5.0)) as http:
            while not server.up:
                await asyncio.sleep(self.probe_s)
                if not await answers(http, server.url):
                    continue
                try:
                    async with self.membership:
                        if self.rejoin is not None:
                            await self.rejoin(server, http)
                        if not server.up:
                            self._back(server)
                except Exception as e:  # noqa: BLE001 - it stays out; the next probe tries again
                    log.warning("%s answers but could not rejoin the pool: %s", server.url, e)

    def watch(self) -> None:
        """Start asking the up servers' ``/health`` (once; ``aclose`` stops it)."""
        if self._watching is None:
            self._watching = asyncio.get_running_loop().create_task(self._watch(), name="pool-watch")

    async def _watch(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=5.0)) as http:
            while True:
                await asyncio.sleep(self.probe_s)
                for server in [s for s in self.servers if s.up]:
                    if not await answers(http, server.url):
                        self.take_out(server, "its /health stopped answering (restarted, or gone): it rejoins "
                                              "holding the current revision")

    async def wait(self, delay: float) -> None:
        """Sleep ``delay`` before a retry; while every server is out, only until one is back."""
        if any(s.up for s in self.servers):
            await asyncio.sleep(delay)
            return
        with suppress(TimeoutError):
            await asyncio.wait_for(self._rejoined.wait(), delay)

    def why_out(self) -> str:
        return "; ".join(f"{s.url}: {s.reason}" for s in self.servers if not s.up)

    def snapshot(self) -> list[dict[str, Any]]:
        return [s.snapshot() for s in self.servers]

    async def aclose(self) -> None:
        tasks = [*self._probes, *([self._watching] if self._watching else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._watching = None
