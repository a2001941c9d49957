"""Instant OpenAI-compatible endpoints for tests and benchmarks (same response shape as the policy server).

* ``EchoServer``: the completion is the last user message's bytes (at most ``max_tokens``), ended by
  ``<|end|>``. It is a deterministic policy, so each token's logprob is exactly 0.0. Used by the
  benchmark to measure the pipeline's own cost with no model in the way.
* ``ScriptedServer(respond)``: ``respond(request_body) -> assistant message dict`` decides the reply
  (text and/or ``tool_calls``), e.g. to drive tool-use episodes deterministically. Its token ids are the
  byte-level encoding of the reply; being deterministic, its logprobs are 0.0 too.
* ``FlakyServer``: answers ``fail_first`` requests with an HTTP error status, then echoes.

Both report ``policy_revision`` only when given one.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from policy.tokenizer import END, TOKENIZER
from producers.inference.asgi_server import JSON, AppServer, Request, body_json, error, json_app
from schemas.policy import PolicyRef


def _response(body: dict[str, Any], message: dict[str, Any], policy: PolicyRef | None,
              max_tokens: int | None = None) -> dict[str, Any]:
    prompt_ids = TOKENIZER.encode_chat(body.get("messages") or [])
    rendered = TOKENIZER.render_message({**message, "role": "assistant"})[1:]  # drop the role token
    if max_tokens is not None and len(rendered) > max_tokens:
        rendered = rendered[:max_tokens]
        message = {**message, "content": TOKENIZER.decode(rendered)}
    finish = "tool_calls" if message.get("tool_calls") else ("stop" if rendered and rendered[-1] == END else "length")
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}
    if body.get("logprobs"):
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choice["logprobs"] = {"content": [{"token": f"token_id:{t}" if as_ids else TOKENIZER.decode([t], skip_special=False),
                                           "logprob": 0.0, "bytes": [t] if t < 256 else [], "top_logprobs": []}
                                          for t in rendered]}
    if body.get("return_token_ids"):
        choice["token_ids"] = rendered
    out: dict[str, Any] = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                           "model": body.get("model", "echo"), "choices": [choice],
                           "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(rendered),
                                     "total_tokens": len(prompt_ids) + len(rendered)}}
    if body.get("return_token_ids"):
        out["prompt_token_ids"] = prompt_ids
    if policy is not None:
        out["policy_revision"] = policy.model_dump(mode="json")
    return out


class ScriptedServer:
    def __init__(self, respond: Callable[[dict[str, Any]], dict[str, Any]], *, policy: PolicyRef | None = None,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.respond = respond
        self.policy = policy
        self.requests: list[dict[str, Any]] = []
        self.http = AppServer(json_app({("POST", "/v1/chat/completions"): self._chat,
                                        ("GET", "/v1/models"): self._models}), host, port)

    @property
    def base_url(self) -> str:
        return self.http.base_url

    async def start(self):
        await self.http.start()
        return self

    async def stop(self) -> None:
        await self.http.stop()

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    async def _models(self, req: Request) -> JSON:
        return JSON({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    async def _chat(self, req: Request) -> JSON:
        body = await body_json(req)
        if not isinstance(body, dict) or not body.get("messages"):
            return error(400, "'messages' must be a non-empty list")
        self.requests.append(body)
        message = self.respond(body)
        return JSON(_response(body, message, self.policy,
                              body.get("max_tokens") if not message.get("tool_calls") else None))


def echo_reply(body: dict[str, Any]) -> dict[str, Any]:
    last = next((m for m in reversed(body["messages"]) if m.get("role") == "user"), body["messages"][-1])
    return {"content": str(last.get("content") or "")}


class EchoServer(ScriptedServer):
    def __init__(self, **kw: Any) -> None:
        super().__init__(echo_reply, **kw)

    async def _chat(self, req: Request) -> JSON:  # no request log: benchmarks run millions
        body = await body_json(req)
        if not isinstance(body, dict) or not body.get("messages"):
            return error(400, "'messages' must be a non-empty list")
        return JSON(_response(body, echo_reply(body), self.policy, body.get("max_tokens")))


class FlakyServer(ScriptedServer):
    """``fail_first`` requests get ``status`` (with ``Retry-After`` if given); later ones are echoed."""

    def __init__(self, fail_first: int, status: int = 503, retry_after: str | None = None, **kw: Any) -> None:
        super().__init__(echo_reply, **kw)
        self.fail_first, self.status, self.retry_after = fail_first, status, retry_after
        self.calls = 0

    async def _chat(self, req: Request) -> JSON:
        self.calls += 1
        if self.calls <= self.fail_first:
            return error(self.status, f"scripted failure {self.calls}/{self.fail_first}", "server_error",
                         None if self.retry_after is None else {"Retry-After": self.retry_after})
        return await super()._chat(req)


def tool_call(name: str, arguments: dict[str, Any], call_id: str | None = None) -> dict[str, Any]:
    return {"id": call_id or f"call_{uuid.uuid4().hex[:8]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}
