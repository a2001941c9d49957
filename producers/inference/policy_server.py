"""The local policy server: the tiny torch LM of ``policy/`` behind an OpenAI/vLLM-compatible HTTP API.

For machines without a GPU, and the default learner target (a plan's learner with no base_url).
The same ``producers.inference.client.InferenceClient`` talks to it and to vLLM.

    rollout serve policy --port 8000 [--checkpoint PATH] [--family tiny-byte-lm] [--seed 0]
    server = PolicyServer(PolicyModel.from_seed(0), family="tiny-byte-lm"); await server.start()

Endpoints
---------
``GET /v1/models``
``POST /v1/chat/completions``: ``messages``, ``max_tokens`` (or ``max_completion_tokens``),
  ``temperature``, ``seed``, ``n``, ``logprobs``, ``top_logprobs`` (0 only), ``tools`` (accepted;
  a completion containing ``<tool_call>{"name":..,"arguments":..}</tool_call>`` is parsed into
  ``tool_calls`` like vLLM's tool parsers do), ``return_token_ids`` and
  ``return_tokens_as_token_ids`` (vLLM's extensions). The response mirrors vLLM:
  ``choices[i].logprobs.content[j] = {token, logprob, bytes, top_logprobs: []}`` (``token`` is
  ``"token_id:<id>"`` when ``return_tokens_as_token_ids``), top-level ``prompt_token_ids`` and
  ``choices[i].token_ids`` when ``return_token_ids``. Logprobs are the model's own, for the sampled
  token, under the tempered distribution it was sampled from (see ``policy.model``).
  Extension: ``policy_revision: {family, revision, checkpoint_digest}`` (also header
  ``x-policy-revision: family@rN``) names the weights that produced the response.
``POST /v1/load_weights``: ``{"family", "revision", "checkpoint": {"uri", "digest"}}`` loads a
  revision's checkpoint (digest verified) and serves it from the next batch on; or
  ``{"family", "revision", "seed"}`` for a seeded random init (revision 0 of a fresh run).
``GET /v1/policy``: the revision being served.

Requests arriving together are generated as one batch (``max_batch`` rows), so throughput grows
with the arena's concurrency. Generation runs in a worker thread; the event loop stays free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from policy.checkpoint import load_checkpoint_info
from policy.model import PolicyModel, generate_batch
from policy.tokenizer import END, EOS, TOKENIZER
from producers.inference.asgi_server import JSON, AppServer, Request, body_json, error, json_app
from schemas.policy import TINY_FAMILY, CheckpointRef, PolicyRef

DEFAULT_MAX_TOKENS = 64
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@dataclass
class _Job:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int | None
    future: asyncio.Future = field(repr=False)


class PolicyServer:
    def __init__(self, model: PolicyModel | None = None, *, family: str = TINY_FAMILY, revision: int = 0,
                 checkpoint_digest: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 max_batch: int = 64, model_name: str | None = None, torch_threads: int | None = 1) -> None:
        self.model = model or PolicyModel.from_seed(0)
        self.policy = PolicyRef(family=family, revision=revision, checkpoint_digest=checkpoint_digest)
        self.model_name = model_name or family
        self.max_batch = max_batch
        self.torch_threads = torch_threads
        self.http = AppServer(json_app({
            ("GET", "/v1/models"): self._models, ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/load_weights"): self._load_weights, ("GET", "/v1/policy"): self._policy,
            ("GET", "/health"): self._health}), host, port)
        self._queue: asyncio.Queue[_Job] | None = None
        self._worker: asyncio.Task | None = None
        # One long-lived generation thread: a fresh thread's first torch call costs ~1 s, and batches
        # run one at a time anyway.
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.requests_served = 0
        self.batches_run = 0

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return self.http.base_url

    async def start(self) -> PolicyServer:
        self._queue = asyncio.Queue()
        if self.torch_threads:
            # Tiny matrices: intra-op parallelism only adds synchronisation, and on a busy machine it
            # costs seconds per batch. This sets torch's process-wide setting.
            import torch

            torch.set_num_threads(self.torch_threads)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="policy-generate")
        await asyncio.get_running_loop().run_in_executor(  # warm the thread up
            self._executor, generate_batch, self.model, [[0]], 1, 1.0, [0])
        self._worker = asyncio.create_task(self._batch_loop(), name="policy-server-batcher")
        await self.http.start()
        return self

    async def stop(self) -> None:
        await self.http.stop()
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    async def __aenter__(self) -> PolicyServer:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    def set_policy(self, model: PolicyModel, policy: PolicyRef) -> None:
        """Swap weights: batches started after this call use them (a running batch finishes on the old)."""
        self.model, self.policy = model, policy

    def load_revision(self, family: str, revision: int, checkpoint: CheckpointRef | None = None,
                      seed: int | None = None) -> PolicyRef:
        if checkpoint is not None:
            model, info = load_checkpoint_info(checkpoint)
            ref = PolicyRef(family=family, revision=revision, checkpoint_digest=info["digest"])
        else:
            model = PolicyModel.from_seed(seed or 0, self.model.config)
            ref = PolicyRef(family=family, revision=revision)
        self.set_policy(model, ref)
        return ref

    # -- batching ------------------------------------------------------------------------------

    async def _batch_loop(self) -> None:
        assert self._queue is not None
        while True:
            jobs = [await self._queue.get()]
            while len(jobs) < self.max_batch and not self._queue.empty():
                jobs.append(self._queue.get_nowait())
            model, policy = self.model, self.policy
            try:
                results = await asyncio.get_running_loop().run_in_executor(
                    self._executor, generate_batch, model, [j.prompt_ids for j in jobs], [j.max_tokens for j in jobs],
                    [j.temperature for j in jobs], [j.seed for j in jobs])
            except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(e)
                continue
            self.batches_run += 1
            for j, r in zip(jobs, results):
                if not j.future.done():
                    j.future.set_result((r, policy))

    async def _generate(self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int | None):
        assert self._queue is not None
        fut = asyncio.get_running_loop().create_future()
        await self._queue.put(_Job(prompt_ids, max_tokens, temperature, seed, fut))
        return await fut

    # -- handlers ------------------------------------------------------------------------------

    async def _health(self, req: Request) -> JSON:
        return JSON({"status": "ok"})

    async def _models(self, req: Request) -> JSON:
        return JSON({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "owned_by": "rollout-log", "root": self.policy.family,
             "policy_revision": self.policy.model_dump(mode="json")}]})

    async def _policy(self, req: Request) -> JSON:
        return JSON(self.policy.model_dump(mode="json"))

    async def _load_weights(self, req: Request) -> JSON:
        body = await body_json(req) or {}
        try:
            ckpt = CheckpointRef.model_validate(body["checkpoint"]) if body.get("checkpoint") else None
            ref = await asyncio.to_thread(self.load_revision, str(body.get("family", self.policy.family)),
                                          int(body["revision"]), ckpt, body.get("seed"))
        except (KeyError, ValueError, OSError) as e:
            return error(400, f"cannot load weights: {type(e).__name__}: {e}")
        return JSON(ref.model_dump(mode="json"))

    async def _chat(self, req: Request) -> JSON:
        t0 = time.perf_counter()
        body = await body_json(req)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            return error(400, "'messages' must be a non-empty list")
        try:
            prompt_ids = TOKENIZER.encode_chat(body["messages"])
        except (ValueError, TypeError, AttributeError) as e:
            return error(400, f"bad messages: {e}")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or DEFAULT_MAX_TOKENS
        temperature = body.get("temperature")
        temperature = 1.0 if temperature is None else float(temperature)
        n = int(body.get("n") or 1)
        if not (1 <= n <= 64) or int(max_tokens) < 1 or temperature < 0:
            return error(400, "need 1 <= n <= 64, max_tokens >= 1, temperature >= 0")
        seed = body.get("seed")
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        outs = await asyncio.gather(*(self._generate(prompt_ids, int(max_tokens), temperature,
                                                     None if seed is None else int(seed) + i) for i in range(n)))
        policy = outs[0][1]
        choices = []
        completion_tokens = 0
        for i, ((ids, lps), _) in enumerate(outs):
            completion_tokens += len(ids)
            text = TOKENIZER.decode(ids)
            finish = "stop" if ids and ids[-1] in (END, EOS) else "length"
            message: dict[str, Any] = {"role": "assistant", "content": text}
            calls = _parse_tool_calls(text) if body.get("tools") else []
            if calls:
                message["tool_calls"] = calls
                message["content"] = TOOL_CALL.sub("", text).strip() or None
                finish = "tool_calls"
            choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [
                    {"token": f"token_id:{t}" if as_ids else TOKENIZER.decode([t], skip_special=False),
                     "logprob": lp, "bytes": [t] if t < 256 else [], "top_logprobs": []}
                    for t, lp in zip(ids, lps)]}
            else:
                choice["logprobs"] = None
            if body.get("return_token_ids"):
                choice["token_ids"] = ids
            choices.append(choice)
        self.requests_served += 1
        resp: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt_ids) + completion_tokens},
            "policy_revision": policy.model_dump(mode="json"),
        }
        if body.get("return_token_ids"):
            resp["prompt_token_ids"] = prompt_ids
        return JSON(resp, headers={"x-policy-revision": str(policy),
                                   "x-generation-ms": f"{(time.perf_counter() - t0) * 1000:.1f}"})


def _parse_tool_calls(text: str) -> list[dict[str, Any]]:
    calls = []
    for raw in TOOL_CALL.findall(text):
        try:
            obj = json.loads(raw)
            name = obj["name"]
            args = obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        calls.append({"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                      "function": {"name": str(name), "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return calls


async def serve(host: str = "127.0.0.1", port: int = 8000, *, checkpoint: str | None = None,
                family: str = TINY_FAMILY, revision: int = 0, seed: int = 0, max_batch: int = 64,
                metrics_port: int | None = None) -> None:
    """Run until cancelled (the ``rollout serve policy`` entry point); Prometheus metrics as ``producers.metrics``."""
    from producers.metrics import endpoint, policy_server_samples

    if checkpoint:
        model, info = load_checkpoint_info(checkpoint)
        server = PolicyServer(model, family=info["family"], revision=info["revision"],
                              checkpoint_digest=info["digest"], host=host, port=port, max_batch=max_batch)
    else:
        server = PolicyServer(PolicyModel.from_seed(seed), family=family, revision=revision, host=host, port=port,
                              max_batch=max_batch)
    await server.start()
    metrics = endpoint("policy", metrics_port, ("policy", lambda: policy_server_samples(server)))
    print(f"policy server: {server.base_url} serving {server.policy} "
          f"({server.model.num_parameters():,} parameters)", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        metrics.close()
        await server.stop()
