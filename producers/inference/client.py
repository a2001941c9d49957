"""An OpenAI-compatible async chat client for vLLM servers and the local policy server.

    client = InferenceClient(["http://127.0.0.1:8000/v1"], model="tiny-byte-lm")
    out = await client.chat(messages, sampling={"temperature": 1.0, "max_tokens": 32}, seed=7)
    out.completion_token_ids, out.logprobs, out.prompt_token_ids, out.policy

Every request asks for ``logprobs: true`` and vLLM's ``return_token_ids: true`` (top-level
``prompt_token_ids``, ``choices[0].token_ids``) plus ``return_tokens_as_token_ids: true`` (logprob
entries named ``"token_id:<id>"``): ids come from ``token_ids`` when present, else from the logprob
entries. ``require_tokens=True`` (trainable calls) refuses a response without ids and logprobs.

Failures: a transport error (connect, read timeout), 429 or 5xx is retried with exponential
backoff and jitter (``Retry-After`` honoured, capped); after ``max_attempts`` it raises
``InferenceUnavailable`` with the last reason. Another 4xx raises ``InferenceRequestError`` at once.
Several ``base_urls`` are one ``producers.inference.pool.InferencePool``: each attempt goes to the server with the fewest
requests outstanding; a transport error or a 5xx takes that server out of the pool and the retry goes at once to
another one (backing off only when none is left).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from producers.inference.pool import InferencePool, Server
from schemas.events import ChatMessage, ToolCall
from schemas.policy import PolicyRef


def _hint(refusal: str) -> str:
    """What to do about a refusal whose cure is in the recipe."""
    if "--enable-auto-tool-choice" in refusal or "--tool-call-parser" in refusal:
        return (" (the environment calls tools: name the model's parser in the recipe, [inference.vllm] "
                "tool_call_parser = \"hermes\" or another vLLM parser, and the vLLM a run starts gets it)")
    return ""


class InferenceError(Exception):
    """A model call that did not produce a usable completion."""


class InferenceUnavailable(InferenceError):
    """The endpoint stayed down (transport errors, 429, 5xx) through every retry."""


class InferenceRequestError(InferenceError):
    """The endpoint refused the request (4xx other than 429) or answered something unusable."""


@dataclass
class Completion:
    message: ChatMessage
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy: PolicyRef | None = None
    latency_s: float = 0.0
    attempts: int = 1
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self.message.tool_calls)


def to_openai_message(m: ChatMessage | dict[str, Any]) -> dict[str, Any]:
    if isinstance(m, dict):
        return m
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def from_openai_message(d: dict[str, Any]) -> ChatMessage:
    calls = []
    for i, c in enumerate(d.get("tool_calls") or []):
        c = c.model_dump() if hasattr(c, "model_dump") else json.loads(c) if isinstance(c, str) else c
        fn = c.get("function") or c  # OpenAI {"function": {name, arguments}} or flat {name, arguments}
        args = fn.get("arguments")
        calls.append(ToolCall(id=str(c.get("id") or f"call_{i}"), name=str(fn["name"]),
                              arguments=args if isinstance(args, str) else json.dumps(args or {})))
    content = d.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ChatMessage(role=d.get("role") or "assistant", content=content, name=d.get("name"), tool_calls=calls,
                       tool_call_id=d.get("tool_call_id"))


def _token_id(entry: dict[str, Any]) -> int | None:
    tok = entry.get("token")
    if isinstance(tok, str) and tok.startswith("token_id:"):
        try:
            return int(tok.split(":", 1)[1])
        except ValueError:
            return None
    return None


REQUEST_TIMEOUT_S = 1200.0
"""How long a request may wait for its answer when the plan's client sets no ``timeout``: prime-rl's client default
(its recipes that set one set 3600). A server answers a request only after those queued ahead of it: on a 2-core CPU
a LoRA run's 48 held-out questions took 24 s alone and past 60 s beside another test's load, so a 60 s default
failed 46 of them there, each retry queued again at the back. A dead server still fails at once (its connection
is refused or reset); connecting is bounded by 10 s."""

SAMPLING_KEYS = {"temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "stop",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "n"}
TOOL_KEYS = {"tool_choice", "parallel_tool_calls"}
"""How a caller asks for tool calls (OpenAI's chat API): sent with its tools, never without (vLLM refuses them)."""


class InferenceClient:
    def __init__(self, base_urls: Sequence[str] | str | InferencePool, model: str, *, api_key: str | None = None,
                 timeout_s: float = REQUEST_TIMEOUT_S, max_attempts: int = 5, backoff_s: float = 0.25,
                 max_backoff_s: float = 8.0,
                 http: httpx.AsyncClient | None = None, max_connections: int = 256, seeded: bool = True) -> None:
        """``base_urls``: one URL, several, or a pool shared with others (the arena's learner pool, whose servers
        its weight swaps load)."""
        if isinstance(base_urls, InferencePool):
            self.pool, self._own_pool = base_urls, False
        else:
            self.pool, self._own_pool = InferencePool([base_urls] if isinstance(base_urls, str) else base_urls), True
        if not len(self.pool):
            raise ValueError("InferenceClient needs at least one base_url")
        self.model = model
        self.api_key = api_key
        self.seeded = seeded  # False: per-call seeds are not sent (see producers.inference.vllm_server.CPU_CLIENT_OPTIONS)
        self.timeout_s = timeout_s
        self.max_attempts = max(1, max_attempts)
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._own_http = http is None
        self.http = http or httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections))

    @classmethod
    def for_target(cls, target: Any, default_base_urls: Sequence[str] | InferencePool = (),
                   **kw: Any) -> InferenceClient:
        """A client for a ``schemas.plan.Target``: its base_urls, else ``default_base_urls`` (the arena's policy
        servers); a pool given there serves the target whatever its base_urls (the arena's learner pool)."""
        if isinstance(default_base_urls, InferencePool):
            urls: Sequence[str] | InferencePool = default_base_urls
        else:
            urls = list(target.base_urls) or list(default_base_urls)
        if not len(urls):
            raise ValueError(f"target {target.name!r} has no base_url and no local policy server was given")
        key = os.environ.get(target.api_key_var) if getattr(target, "api_key_var", None) else None
        if target.timeout_s:
            kw.setdefault("timeout_s", float(target.timeout_s))
        return cls(urls, target.model, api_key=key, **kw)

    async def aclose(self) -> None:
        if self._own_pool:
            await self.pool.aclose()
        if self._own_http:
            await self.http.aclose()

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        if retry_after:
            try:
                return min(float(retry_after), self.max_backoff_s)
            except ValueError:
                pass
        base = min(self.backoff_s * (2 ** (attempt - 1)), self.max_backoff_s)
        return base * (0.5 + random.random() / 2)

    async def post(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], int, float]:
        """POST with retries; returns (json, attempts, latency of the successful attempt)."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        last = "no attempt made"
        failed: Server | None = None
        for attempt in range(1, self.max_attempts + 1):
            server = self.pool.pick(avoid=failed)
            retry_after = None
            if server is None:
                last = f"every server is out of the pool ({self.pool.why_out()})"
            else:
                url = server.url + path
                t0 = time.perf_counter()
                try:
                    with self.pool.sending(server):
                        r = await self.http.post(url, json=body, headers=headers)
                except httpx.TransportError as e:
                    last = f"{type(e).__name__} from {url}: {e}".strip()
                    self.pool.failed(server, last, take_out=True)
                else:
                    if r.status_code == 200:
                        self.pool.answered(server)
                        try:
                            return r.json(), attempt, time.perf_counter() - t0
                        except ValueError as e:
                            raise InferenceRequestError(f"{url} returned invalid JSON: {e}") from None
                    snippet = r.text[:300]
                    if r.status_code == 429 or r.status_code >= 500:
                        last = f"HTTP {r.status_code} from {url}: {snippet}"
                        retry_after = r.headers.get("retry-after")
                        self.pool.failed(server, last, take_out=r.status_code != 429)  # 429: busy, not broken
                    else:
                        raise InferenceRequestError(f"HTTP {r.status_code} from {url}: {snippet}{_hint(snippet)}")
                failed = server
            if attempt < self.max_attempts:
                if server is not None and not server.up and any(s.up for s in self.pool.servers):
                    continue  # it is out: another server takes the retry at once
                await self.pool.wait(self._delay(attempt, retry_after))
        raise InferenceUnavailable(f"endpoint unavailable after {self.max_attempts} attempts; last: {last}")

    async def chat(self, messages: Sequence[ChatMessage | dict[str, Any]], *, sampling: dict[str, Any] | None = None,
                   tools: list[dict[str, Any]] | None = None, seed: int | None = None,
                   require_tokens: bool = True, extra_body: dict[str, Any] | None = None,
                   model: str | None = None) -> Completion:
        """``model``: the name this call asks for instead of the client's (the learner's LoRA adapter)."""
        body: dict[str, Any] = {"model": model or self.model, "messages": [to_openai_message(m) for m in messages],
                                "logprobs": True, "top_logprobs": 0, "return_token_ids": True,
                                "return_tokens_as_token_ids": True}
        for k, v in (sampling or {}).items():
            if k in SAMPLING_KEYS and v is not None:
                body[k] = v
        # sampling keys the plan passes through (vLLM's extra sampling parameters: top_k, min_p, ...)
        body.update((sampling or {}).get("extra_body") or {})
        if body.get("n", 1) != 1:
            raise ValueError("one completion per call: a group is n separate calls, each its own Step")
        if tools:
            body["tools"] = tools
            body.update((k, v) for k, v in (sampling or {}).items() if k in TOOL_KEYS and v is not None)
        if seed is not None and self.seeded:
            body["seed"] = int(seed)
        if extra_body:
            body.update(extra_body)
        data, attempts, latency = await self.post("/chat/completions", body)
        return parse_chat_response(data, require_tokens=require_tokens, latency_s=latency, attempts=attempts)


def parse_chat_response(data: dict[str, Any], *, require_tokens: bool = True, latency_s: float = 0.0,
                        attempts: int = 1) -> Completion:
    try:
        choice = data["choices"][0]
        message = from_openai_message(choice["message"])
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise InferenceRequestError(f"malformed chat completion: {type(e).__name__}: {e}") from None
    entries = ((choice.get("logprobs") or {}).get("content")) or []
    logprobs = [float(e["logprob"]) for e in entries]
    ids = choice.get("token_ids")
    if ids is None and entries and all(_token_id(e) is not None for e in entries):
        ids = [_token_id(e) for e in entries]
    prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids") or []
    ids = list(ids or [])
    if require_tokens:
        if not ids or not prompt_ids:
            raise InferenceRequestError("the endpoint returned no token ids (a vLLM server needs return_token_ids "
                                        "support; an endpoint without it can only serve fixed, untrained members)")
        if len(logprobs) != len(ids):
            raise InferenceRequestError(f"{len(ids)} token ids but {len(logprobs)} logprobs in the response")
    elif len(logprobs) != len(ids):
        ids, logprobs = [], []  # fixed target without usable token data: keep the text only
    policy = None
    if isinstance(data.get("policy_revision"), dict):
        try:
            policy = PolicyRef.model_validate(data["policy_revision"])
        except ValueError:
            policy = None
    return Completion(message=message, prompt_token_ids=[int(i) for i in prompt_ids],
                      completion_token_ids=[int(i) for i in ids], logprobs=logprobs,
                      finish_reason=str(choice.get("finish_reason") or "stop"), policy=policy,
                      latency_s=latency_s, attempts=attempts, usage=data.get("usage") or {})
