"""Putting a PolicyRevision's weights into the learner's inference server, and knowing which weights
produced each token.

Two servers take new weights without a restart:

* the local policy server (``producers.inference.policy_server``): ``POST /v1/load_weights``; it also names the
  revision behind every response, so its Steps are exact by themselves;
* vLLM (``VLLM_SERVER_DEV_MODE=1``): ``POST /collective_rpc {"method": "reload_policy_weights"}`` with the
  checkpoint folder (vLLM's ``reload_weights``, then its LM head packed again: ``producers.inference.vllm_worker``; plain
  ``reload_weights`` on a server started without that worker extension), then ``/reset_prefix_cache`` (the
  prefix cache survives a reload: a cached prompt would otherwise reuse KV computed with the old weights) and
  ``/update_weight_version``. A LoRA run's revision
  that is its adapter alone (``CheckpointRef.adapter``, ``policy.lora``) is loaded as prime-rl loads it: ``POST
  /v1/load_lora_adapter`` with the PEFT folder, under the one adapter name of the plan (``LoraSpec.adapter_name``),
  over the base it names (reloaded first when the server does not hold it); the arena's learner requests then name
  the adapter as their model (``producers.arena.arena``).

vLLM's responses do not say which weights produced them, so the arena makes the stamp exact itself with a
``RevisionGate``: every learner call holds the gate shared; a swap holds it exclusively, so new calls wait
and calls in flight finish under the old weights before the reload starts. A Step is stamped with the
revision that was current while its call held the gate, so no token generated under one revision carries
another's name. A swap that fails leaves the server's weights unknown: the gate stays shut with that
error, and every later call fails with it (recorded as failed rollouts) instead of being stamped.

Several servers (``producers.inference.pool.InferencePool``) take each revision together: ``PoolWeights`` runs one loader
per server concurrently, behind the one gate, so every server in the pool holds the revision that calls are
stamped with. A server that fails to load is taken out of the pool, and loads the current revision before it
rejoins (its probe, ``InferencePool.rejoin``). The swap fails only when no server took the weights, or when the
revision itself is refused (``RevisionRefused``: its checkpoint is missing or not the bytes its digest names;
every server would refuse it).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from contextlib import asynccontextmanager
from collections.abc import Awaitable, Callable
from typing import Any, AsyncIterator, Protocol

import httpx

from producers.inference.pool import InferencePool, Server, server_root
from schemas.policy import CheckpointRef, PolicyRevision


#: the weight version vLLM reports before anything set one (``GET /weight_info``)
STARTED_VERSION = "default"


def probe_tolerance(dtype: str | None) -> float:
    """The mean |dlogp| over a revision's probe tokens (``PolicyRevision.probe``) within which a server serving
    ``dtype`` shows that it serves the revision's weights. float32: vLLM answered within 1e-5 (mean) of the
    trainer's float32 logprobs for the weights it loaded; a trained revision served with revision 0's LM head was
    1.8e-3 off (mean, over a run's steps). In bfloat16 (or an unknown dtype) rounding alone put vLLM 0.04-0.06 off
    (over 44-81 tokens of sampled answers, whole weights or a LoRA adapter; single tokens up to 0.34), as much as
    that stale head: only a grossly different model shows."""
    return 1e-4 if dtype == "float32" else 0.15


class WeightLoadError(RuntimeError):
    """The inference server did not take a revision's weights; what it serves now is unknown."""


class RevisionRefused(WeightLoadError):
    """The revision itself cannot be served (its checkpoint is missing or differs from its digest): no server of
    a pool would take it."""


class RevisionGate:
    """Shared for calls, exclusive for swaps (see the module docstring)."""

    def __init__(self) -> None:
        self._active = 0
        self._swapping = False
        self.broken: BaseException | None = None
        self._cond = asyncio.Condition()

    @asynccontextmanager
    async def call(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            if self.broken is not None:
                raise WeightLoadError(f"the learner's weights are unknown after a failed swap: {self.broken}")
            self._active += 1
        try:
            yield
        finally:
            async with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def swap(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            self._swapping = True
            await self._cond.wait_for(lambda: self._active == 0)
        try:
            yield
            self.broken = None  # a swap that succeeds makes the weights known again
        except BaseException as e:
            self.broken = e
            raise
        finally:
            async with self._cond:
                self._swapping = False
                self._cond.notify_all()


class WeightLoader(Protocol):
    """Loads a revision's checkpoint into one server; ``reports_revision``: its responses name the revision.
    ``load`` returns figures: ``reload_s``, and ``inexact`` (1.0) when the server answered the revision's probe
    other than the revision's weights would (``VllmWeights``): its calls are then not stamped exact."""

    reports_revision: bool

    async def load(self, http: httpx.AsyncClient, rev: PolicyRevision) -> dict[str, float]: ...


class LocalPolicyWeights:
    reports_revision = True

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    async def load(self, http: httpx.AsyncClient, rev: PolicyRevision) -> dict[str, float]:
        t0 = time.perf_counter()
        try:
            r = await http.post(self.base_url + "/load_weights", json={
                "family": rev.family, "revision": rev.revision, "checkpoint": rev.checkpoint.model_dump()})
        except httpx.HTTPError as e:
            raise WeightLoadError(f"policy server at {self.base_url} is unreachable: {type(e).__name__}: {e}") from None
        if r.status_code != 200:  # a 400 is the checkpoint's fault (missing, digest): any server would refuse it
            error = RevisionRefused if r.status_code < 500 else WeightLoadError
            raise error(f"policy server could not load {rev.family}@r{rev.revision}: {r.text[:300]}")
        return {"reload_s": time.perf_counter() - t0}


class VllmWeights:
    """vLLM's dev-mode weight reload (the server must run with ``VLLM_SERVER_DEV_MODE=1``), and its LoRA adapter
    loading for adapter revisions (``adapter``: the name they are served under; the server must run with
    ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, as ``VllmServer.for_plan`` starts it)."""

    reports_revision = False

    def __init__(self, base_url: str, *, adapter: str | None = None, timeout_s: float = 300.0) -> None:
        self.root = server_root(base_url)
        self.adapter = adapter
        self.timeout_s = timeout_s
        self.base: str | None = None  # the digest of the whole weights the server holds (what an adapter goes over)
        self.first = True  # no load yet: the server may still hold the weights it started on (``_started_on``)
        self.reload_method: str | None = None  # what the server is (``_server_info``): found once, when needed
        self.dtype: str | None = None

    @classmethod
    def for_plan(cls, plan: Any) -> Callable[[str], VllmWeights]:
        """A loader per server for ``plan``'s learner: its LoRA adapter served under the plan's name."""
        adapter = plan.lora.adapter_name if getattr(plan, "lora", None) is not None else None
        return lambda url: cls(url, adapter=adapter)

    async def _post(self, http: httpx.AsyncClient, path: str, rev: PolicyRevision, **kw: Any) -> Any:
        """Sent again once when the connection broke with no answer (a kept-alive connection the server closed as
        it was reused): every call here can be made twice."""
        for attempt in (1, 2):
            try:
                r = await http.post(self.root + path, timeout=self.timeout_s, **kw)
                break
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as e:
                if attempt == 2:
                    raise WeightLoadError(f"vLLM at {self.root}: {path} for {rev.family}@r{rev.revision} failed "
                                          f"twice: {type(e).__name__}: {e}") from None
            except httpx.HTTPError as e:
                raise WeightLoadError(f"vLLM at {self.root}: {path} for {rev.family}@r{rev.revision} failed: "
                                      f"{type(e).__name__}: {e}") from None
        if r.status_code == 404 and "lora" in path:
            raise WeightLoadError(f"vLLM at {self.root} has no {path}: start it with --enable-lora --max-lora-rank "
                                  "RANK and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (rollout serve vllm --lora-rank RANK "
                                  "does, and a run starts it so for a LoRA plan)")
        if r.status_code == 404:
            raise WeightLoadError(f"vLLM at {self.root} has no {path}: start it with VLLM_SERVER_DEV_MODE=1 "
                                  "(rollout serve vllm does)")
        if r.status_code != 200:
            raise WeightLoadError(f"vLLM at {self.root} refused {path} for {rev.family}@r{rev.revision}: "
                                  f"HTTP {r.status_code} {r.text[:300]}")
        return r

    async def load(self, http: httpx.AsyncClient, rev: PolicyRevision) -> dict[str, float]:
        from policy.hf import checkpoint_folder

        ck = rev.require_checkpoint()
        t0 = time.perf_counter()
        if ck.adapter:
            if self.adapter is None:
                raise RevisionRefused(f"{rev.family}@r{rev.revision} is a LoRA adapter, and this arena's plan has no "
                                      "[trainer.model.lora] to serve it under")
            base = await self._base_of(rev)
            if base.digest != self.base:  # a server started or last loaded on other weights
                await self._whole(http, rev, base)
            await self._checked(rev, ck, lambda: self._post(http, "/v1/load_lora_adapter", rev, json={
                "lora_name": self.adapter, "lora_path": str(checkpoint_folder(ck)), "load_inplace": True}))
        else:
            await self._whole(http, rev, ck)
        reload_s = time.perf_counter() - t0
        await self._post(http, "/reset_prefix_cache", rev)
        await self._post(http, "/update_weight_version", rev, json={"new_version": f"r{rev.revision}"})
        return {"reload_s": reload_s, **await self._probe(http, rev)}

    async def _whole(self, http: httpx.AsyncClient, rev: PolicyRevision, ck: CheckpointRef) -> None:
        """The server's weights replaced by ``ck``'s whole weights (a revision's, or an adapter's base); not read
        again by a server that still holds the folder it started on, when that is ``ck``'s (``_started_on``)."""
        from policy.hf import checkpoint_folder

        folder = checkpoint_folder(ck)
        first, self.first = self.first, False
        self.base = None  # unknown until the reload succeeds
        if first and await self._started_on(http) == folder.resolve():
            await self._checked(rev, ck, lambda: asyncio.sleep(0))
        else:
            await self._server_info(http)
            method = self.reload_method
            await self._checked(rev, ck, lambda: self._post(http, "/collective_rpc", rev, json={
                "method": method, "kwargs": {"weights_path": str(folder)}}))
        self.base = ck.digest

    async def _server_info(self, http: httpx.AsyncClient) -> None:
        """The server's configuration (``/server_info``, once: ~2 s on 2 cores): its dtype (``probe_tolerance``),
        and its reload: ``reload_policy_weights`` where it runs our worker extension (every server ``VllmServer``
        starts): vLLM's reload, then the LM head packed again (``producers.inference.vllm_worker``; without it a CPU server
        keeps computing logits with the head it started with). vLLM's own ``reload_weights`` on any other server
        (one started by hand, e.g. on a GPU, where no packed copy is kept): a method the server lacks would stop
        it."""
        from producers.inference.vllm_server import WORKER_EXTENSION

        if self.reload_method is not None:
            return
        try:
            r = await http.get(self.root + "/server_info", params={"config_format": "json"}, timeout=self.timeout_s)
            config = r.json()["vllm_config"]
            extension = config["parallel_config"].get("worker_extension_cls")
            self.dtype = str(config["model_config"]["dtype"]).removeprefix("torch.")
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            extension = None
        self.reload_method = "reload_policy_weights" if extension == WORKER_EXTENSION else "reload_weights"

    async def _probe(self, http: httpx.AsyncClient, rev: PolicyRevision) -> dict[str, float]:
        """What the server answers for the revision's probe tokens (their prompt logprobs) against what the trainer
        computed for them under its checkpoint: ``probe_dlogp``, the mean |difference|, and ``inexact`` (1.0) when it
        is beyond the server's dtype's rounding (``probe_tolerance``) or the server gave no answer to compare (which
        does not fail the swap: the revision is served, its calls not stamped exact)."""
        probe = rev.probe
        if probe is None:
            return {}
        await self._server_info(http)
        model = self.adapter if rev.require_checkpoint().adapter else await self._base_model(http)
        try:
            r = await self._post(http, "/v1/completions", rev, json={
                "model": model, "prompt": probe.token_ids, "max_tokens": 1, "prompt_logprobs": 0})
            answer = r.json()["choices"][0]["prompt_logprobs"]
            served = [answer[t][str(probe.token_ids[t])]["logprob"] for t in range(1, len(probe.token_ids))]
        except (WeightLoadError, ValueError, KeyError, IndexError, TypeError):
            return {"inexact": 1.0}
        dlogp = sum(abs(a - b) for a, b in zip(served, probe.logprobs)) / len(served)
        return {"probe_dlogp": dlogp, "inexact": float(not dlogp <= probe_tolerance(self.dtype))}

    async def _base_model(self, http: httpx.AsyncClient) -> str | None:
        """The name the server serves its whole weights under (no adapter's)."""
        try:
            models = (await http.get(self.root + "/v1/models", timeout=10.0)).json()["data"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        return next((m.get("id") for m in models if isinstance(m, dict) and m.get("parent") is None), None)

    async def _started_on(self, http: httpx.AsyncClient) -> Path | None:
        """The model folder the server started on, while it still holds those weights: its weight version is still
        vLLM's initial one (every load here sets it; ``load``). Then its first revision, when it is that folder
        (revision 0 of a run on the model as served, the common start), is checked by its digest, not reloaded:
        2 s of the start on 2 cores."""
        try:
            version = (await http.get(self.root + "/weight_info", timeout=10.0)).json().get("weight_version")
            models = (await http.get(self.root + "/v1/models", timeout=10.0)).json()["data"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return None
        roots = {m.get("root") for m in models if isinstance(m, dict)}
        if version != STARTED_VERSION or len(roots) != 1 or None in roots:
            return None
        return Path(roots.pop()).resolve()

    async def _checked(self, rev: PolicyRevision, ck: CheckpointRef, loading: Callable[[], Awaitable[Any]]) -> None:
        """``loading()`` (the server reading ``ck``'s folder) while its file is hashed (0.45 s a SmolLM2 revision):
        the swap holds the gate shut, so no call runs on these weights before the digest is checked; bytes that are
        not the digest refuse the revision whatever the server made of them, and leave its weights unknown (the gate
        stays shut)."""
        from policy.checkpoint import checkpoint_path, file_sha256

        path = checkpoint_path(ck)
        if not path.is_file():
            raise RevisionRefused(f"{rev.family}@r{rev.revision}: checkpoint {path} does not exist on this host")
        digest = asyncio.ensure_future(asyncio.to_thread(file_sha256, path))
        try:
            await loading()
        finally:
            try:
                found = await digest
            except OSError as e:  # pruned or unreadable since: the revision cannot be served here
                raise RevisionRefused(f"{rev.family}@r{rev.revision}: checkpoint {path} cannot be read: {e}") from None
            if found != ck.digest:
                raise RevisionRefused(f"{rev.family}@r{rev.revision}: checkpoint {path} has sha256 {found}, its "
                                      f"revision says {ck.digest}: refusing to serve different weights") from None

    async def _base_of(self, rev: PolicyRevision) -> CheckpointRef:
        """The base an adapter revision names (its file's metadata, covered by the digest ``_checked`` checks)."""
        from safetensors import SafetensorError

        from policy.lora import base_of

        try:
            return await asyncio.to_thread(base_of, rev.require_checkpoint())
        except (OSError, ValueError, SafetensorError) as e:
            raise RevisionRefused(f"{rev.family}@r{rev.revision}: its adapter names no base model here: {e}") from None


class PoolWeights:
    """Loads each revision into every server of a pool (one ``loader(url)`` per server, concurrently); see the
    module docstring. ``current``: the revision the pool's servers hold; a rejoining server loads it first."""

    def __init__(self, pool: InferencePool, loader: Callable[[str], WeightLoader]) -> None:
        self.pool = pool
        self.loader = loader
        self.loaders = {s.url: loader(s.url) for s in pool.servers}
        self.reports_revision = all(x.reports_revision for x in self.loaders.values())
        self.current: PolicyRevision | None = None
        pool.rejoin = self._rejoin

    async def load(self, http: httpx.AsyncClient, rev: PolicyRevision) -> dict[str, float]:
        self.pool.watch()  # from the first revision on, a server restarted while idle is seen and reloaded
        async with self.pool.membership:  # no server joins while the pool swaps
            servers = [s for s in self.pool.servers if s.up]
            results = await asyncio.gather(*(self.loaders[s.url].load(http, rev) for s in servers),
                                           return_exceptions=True)
            loaded: list[dict[str, float]] = []
            refused: RevisionRefused | None = None
            for server, result in zip(servers, results):
                if isinstance(result, RevisionRefused):
                    refused = refused or result
                elif isinstance(result, WeightLoadError):  # this server's failure: out until it loads the current
                    self.pool.take_out(server, f"could not load r{rev.revision}: {result}")
                elif isinstance(result, BaseException):
                    raise result
                else:
                    server.revision = rev.revision
                    loaded.append(result)
            if refused is not None:
                raise refused
            if not loaded:
                raise WeightLoadError(f"no server of the pool took {rev.family}@r{rev.revision}: "
                                      f"{self.pool.why_out() or 'the pool is empty'}")
            self.current = rev
        figures = {"reload_s": max(r.get("reload_s", 0.0) for r in loaded)}
        probed = [r["probe_dlogp"] for r in loaded if "probe_dlogp" in r]
        if probed:
            figures["probe_dlogp"] = max(probed)
        if any(r.get("inexact") for r in loaded):  # calls go to any server: the revision is exact on all or none
            figures["inexact"] = 1.0
        return figures

    async def _rejoin(self, server: Server, http: httpx.AsyncClient) -> None:
        if self.current is not None:
            # a fresh loader: what the server holds is unknown (a restart holds its start-up weights, not the base
            # an adapter was last loaded over)
            self.loaders[server.url] = self.loader(server.url)
            await self.loaders[server.url].load(http, self.current)
            server.revision = self.current.revision
