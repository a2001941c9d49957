"""The arena's capture endpoint as verifiers' programs call it (narrow: the rollout behind a session is a recording
stand-in; the whole path runs in ``test_env_by_id::test_a_tool_recipe...`` on vLLM): a streamed request is
answered as the SSE stream verifiers' interception server reads to its terminal event, and a caller's tool
options reach the inference server with its tools, never without them."""

from __future__ import annotations

import httpx
import pytest

from producers.inference.echo_server import ScriptedServer
from producers.inference.client import Completion, InferenceClient
from schemas.events import ChatMessage, ToolCall

vf = pytest.importorskip("verifiers.v1")

from producers.environments.verifiers_v1 import SESSION_HEADER, CaptureProxy  # noqa: E402

CALL = ToolCall(id="call-1", name="words_lookup", arguments='{"word": "apple"}')


class Recorder:
    """Stands in for a rollout's context: records each call and answers with one tool call."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    async def call_model(self, member, messages, *, tools=None, sampling=None) -> Completion:
        self.calls.append({"member": member, "messages": messages, "tools": tools, "sampling": sampling})
        return Completion(message=ChatMessage(role="assistant", tool_calls=[CALL]), prompt_token_ids=[1, 2, 3],
                          completion_token_ids=[7, 8], logprobs=[-0.5, -0.25], finish_reason="tool_calls")


TOOLS = [{"type": "function", "function": {"name": "words_lookup", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("stream", [True, False])
async def test_streamed_and_whole_answers_carry_the_same_turn(stream):
    from verifiers.v1.dialects import ChatDialect

    proxy, ctx = await CaptureProxy().ensure_started(), Recorder()
    proxy.sessions["trace-1"] = (ctx, "policy", [])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "required",
            "temperature": 0.5, "stream": stream}
    try:
        async with httpx.AsyncClient() as http:
            r = await http.post(proxy.base_url + "/chat/completions", json=body, headers={SESSION_HEADER: "trace-1"})
    finally:
        await proxy.aclose()
    assert r.status_code == 200, r.text
    dialect = ChatDialect()
    if stream:  # read as the interception server reads a relayed stream: event by event, to the terminal one
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e + b"\n\n" for e in r.content.split(b"\n\n") if e.strip()]
        assert dialect.is_terminal_event(events[-1])
        parser = dialect.stream_parser()
        for e in events:
            parser.feed(e)
        message = parser.finish().message
    else:
        message = dialect.parse_response(dialect.validate_response(r.json())).message
    assert [(c.name, c.arguments) for c in message.tool_calls] == [(CALL.name, CALL.arguments)]
    # the caller's tool choice and sampling reached the rollout's call, with its tools
    assert ctx.calls[0]["sampling"] == {"tool_choice": "required", "temperature": 0.5}
    assert ctx.calls[0]["tools"] == TOOLS


async def test_tool_choice_goes_with_tools_only():
    async with ScriptedServer(lambda body: {"content": "ok"}) as server:
        client = InferenceClient(server.base_url, "m", seeded=False)
        try:
            msgs = [ChatMessage(role="user", content="hi")]
            await client.chat(msgs, sampling={"tool_choice": "required"}, tools=TOOLS)
            await client.chat(msgs, sampling={"tool_choice": "required"})
        finally:
            await client.aclose()
    with_tools, without = server.requests
    assert with_tools["tool_choice"] == "required" and with_tools["tools"] == TOOLS
    assert "tool_choice" not in without and "tools" not in without  # vLLM refuses a tool choice without tools
