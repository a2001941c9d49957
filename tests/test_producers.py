"""producers/ without a broker: tool schemas, the HTTP client against real local servers (retries,
real logprobs from the local policy server), every episode kind run by the arena, pacing."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
import torch

from policy import PolicyModel, save_checkpoint, token_logprobs
from policy.tokenizer import TOKENIZER
from producers.arena.config import ArenaConfig
from producers.arena.arena import Arena
from producers.inference.echo_server import FlakyServer, ScriptedServer, tool_call
from producers.arena.emitter import MemoryEmitter
from producers.environments.dataset import ArtifactStore, Example
from producers.environments.loader import load_environment
from producers.environments.types import Environment
from producers.environments.episodes import (MultiTurnEpisode, StatefulToolEpisode, ToolEpisode, stop,
                                user)
from producers.inference.client import InferenceClient, InferenceRequestError, InferenceUnavailable
from producers.arena.pacer import AdmissionPacer
from producers.inference.policy_server import PolicyServer
from producers.environments.tools import ToolRegistry, tool_schema
from schemas.plan import GenerationPlan
from schemas.plan_compiler import compile_plan
from schemas.scoring import ScoringSpec
from streams.local_broker import free_port


# -- tools ---------------------------------------------------------------------------------------------

def lookup(city: str, units: Literal["metric", "imperial"] = "metric", days: int | None = None) -> str:
    """Look up the weather.

    Args:
        city: name of the city
        units: unit system
            for temperatures
        days (int): forecast length
    """
    return f"{city}:{units}:{days}"


def sandbox_write(key: str, value: str, sandbox: dict) -> str:
    """Store a value in the rollout's sandbox.

    :param key: where to store it
    :param value: what to store
    """
    sandbox["items"][key] = value
    return "ok"


def test_tool_schema_from_hints_and_docstring():
    s = tool_schema(lookup)["function"]
    assert s["name"] == "lookup" and s["description"] == "Look up the weather."
    props = s["parameters"]["properties"]
    assert props["city"] == {"type": "string", "description": "name of the city"}
    assert props["units"]["enum"] == ["metric", "imperial"] and props["units"]["default"] == "metric"
    assert props["units"]["description"] == "unit system for temperatures"
    assert {"type": "integer"} in props["days"]["anyOf"] and props["days"]["description"] == "forecast length"
    assert s["parameters"]["required"] == ["city"]
    hidden = tool_schema(sandbox_write, hidden={"sandbox"})["function"]["parameters"]
    assert set(hidden["properties"]) == {"key", "value"} and hidden["required"] == ["key", "value"]
    assert hidden["properties"]["key"]["description"] == "where to store it"


async def test_tool_registry_dispatch_and_errors():
    reg = ToolRegistry([lookup])
    assert await reg.call("lookup", reg.parse_arguments("lookup", '{"city": "Oslo", "days": 2}')) == "Oslo:metric:2"
    with pytest.raises(Exception, match="unknown tool"):
        reg.parse_arguments("nope", "{}")
    with pytest.raises(Exception, match="not valid JSON"):
        reg.parse_arguments("lookup", "{oops")
    with pytest.raises(Exception, match="bad arguments"):
        await reg.call("lookup", {"town": "x"})


# -- inference client ----------------------------------------------------------------------------------

MSG = [{"role": "user", "content": "What is 2 + 2?"}]


async def test_client_against_policy_server_returns_the_models_logprobs():
    async with PolicyServer(PolicyModel.from_seed(3), family="tiny") as server:
        async with InferenceClient(server.base_url, "tiny") as client:
            out = await client.chat(MSG, sampling={"temperature": 0.8, "max_tokens": 24}, seed=11)
            assert out.prompt_token_ids == TOKENIZER.encode_chat(MSG)
            assert 1 <= len(out.completion_token_ids) <= 24 and len(out.logprobs) == len(out.completion_token_ids)
            recomputed = token_logprobs(server.model, out.prompt_token_ids, out.completion_token_ids, 0.8).detach()
            assert torch.allclose(recomputed, torch.tensor(out.logprobs), atol=1e-4)
            assert out.policy is not None and (out.policy.family, out.policy.revision) == ("tiny", 0)
            # same seed, same sample; ids also parse from "token_id:N" logprob entries alone
            raw, _, _ = await client.post("/chat/completions", {"messages": MSG, "max_tokens": 24, "temperature": 0.8,
                                                                "seed": 11, "logprobs": True,
                                                                "return_tokens_as_token_ids": True})
            assert "token_ids" not in raw["choices"][0]
            ids = [int(e["token"].split(":")[1]) for e in raw["choices"][0]["logprobs"]["content"]]
            assert ids == out.completion_token_ids


async def test_policy_server_loads_a_revision_and_reports_it(tmp_path):
    new = PolicyModel.from_seed(99)
    ref = save_checkpoint(new, tmp_path, "tiny", 1)
    async with PolicyServer(PolicyModel.from_seed(3), family="tiny") as server:
        async with InferenceClient(server.base_url, "tiny") as client:
            loaded, _, _ = await client.post("/load_weights", {"family": "tiny", "revision": 1,
                                                               "checkpoint": ref.model_dump()})
            assert loaded == {"family": "tiny", "revision": 1, "checkpoint_digest": ref.digest}
            out = await client.chat(MSG, sampling={"max_tokens": 16}, seed=1)
            assert out.policy.revision == 1 and out.policy.checkpoint_digest == ref.digest
            lp = token_logprobs(new, out.prompt_token_ids, out.completion_token_ids).detach()
            assert torch.allclose(lp, torch.tensor(out.logprobs), atol=1e-4)
            with pytest.raises(InferenceRequestError, match="400"):
                await client.post("/load_weights", {"family": "tiny", "revision": 2,
                                                    "checkpoint": {"uri": ref.uri, "digest": "0" * 64}})


async def test_client_retries_503_then_succeeds():
    async with FlakyServer(fail_first=2, status=503) as server:
        async with InferenceClient(server.base_url, "m", backoff_s=0.01) as client:
            out = await client.chat(MSG, sampling={"max_tokens": 64})
            assert out.attempts == 3 and server.calls == 3
            assert TOKENIZER.decode(out.completion_token_ids) == "What is 2 + 2?"


async def test_client_honours_retry_after_on_429():
    async with FlakyServer(fail_first=1, status=429, retry_after="0.3") as server:
        async with InferenceClient(server.base_url, "m", backoff_s=0.01) as client:
            t0 = asyncio.get_running_loop().time()
            out = await client.chat(MSG)
            assert out.attempts == 2 and asyncio.get_running_loop().time() - t0 >= 0.29


async def test_client_gives_up_with_a_typed_error():
    async with FlakyServer(fail_first=100, status=502) as server:
        async with InferenceClient(server.base_url, "m", max_attempts=3, backoff_s=0.01) as client:
            with pytest.raises(InferenceUnavailable, match="after 3 attempts; last: HTTP 502"):
                await client.chat(MSG)
    async with InferenceClient(f"http://127.0.0.1:{free_port()}/v1", "m", max_attempts=2, backoff_s=0.01) as client:
        with pytest.raises(InferenceUnavailable, match="ConnectError"):
            await client.chat(MSG)
    async with FlakyServer(fail_first=5, status=400) as server:
        async with InferenceClient(server.base_url, "m", backoff_s=0.01) as client:
            with pytest.raises(InferenceRequestError):
                await client.chat(MSG)
            assert server.calls == 1  # a 4xx is not retried


# -- episodes through the arena ------------------------------------------------------------------------

def _plan(name: str, url: str) -> GenerationPlan:
    plan = compile_plan(f"examples/plans/{name}.toml")
    targets = {k: t.model_copy(update={"base_urls": [url]}) if t.base_urls else t for k, t in plan.targets.items()}
    return plan.model_copy(update={"targets": targets})


def single_plan(group_size: int = 2, batch_size: int = 4, max_off_policy_steps: int = 1) -> GenerationPlan:
    plan = compile_plan("examples/plans/arithmetic.toml")
    return plan.model_copy(update={"group_size": group_size, "batch_size": batch_size,
                                   "max_off_policy_steps": max_off_policy_steps})


@pytest.fixture(scope="module")
async def policy_server():
    async with PolicyServer(PolicyModel.from_seed(0), family="tiny-byte-lm") as server:
        yield server


async def test_single_turn_arithmetic_rollouts(policy_server):
    em = MemoryEmitter()
    async with Arena(_plan("arithmetic", policy_server.base_url), emitter=em,
                     config=ArenaConfig(policy_base_url=policy_server.base_url)) as arena:
        stats = await arena.run(num_groups=2)
    assert stats.rollouts == 16 and stats.failed == 0
    by_group: dict[str, list] = {}
    for r in em.rollouts:
        by_group.setdefault(r.group_id, []).append(r)
        assert r.environment == "arithmetic@1.2.0" and r.episode_type == "single_turn"
        assert r.members == {"solver": True} and len(r.step_ids) == 1 and r.root_group_id == r.group_id
        assert r.artifacts["scoring"]["kind"] == "rubric" and r.artifacts["scoring"]["answer"] == r.seed["answer"]
        assert r.policy.family == "tiny-byte-lm"
    assert sorted(len(v) for v in by_group.values()) == [8, 8]
    assert all(len({r.example_id for r in v}) == 1 for v in by_group.values())
    for s in em.steps:
        assert s.trainable and s.policy.revision == 0 and len(s.completion_token_ids) == len(s.completion_logprobs)
        assert s.prompt[-1].role == "user" and s.completion[0].name == "solver"


async def test_each_rollout_names_the_training_source_it_was_sampled_for_and_its_score_carries_it(policy_server):
    """Two sources of one environment (prime-rl's mixed grpo + opd recipe): only the source's name tells which
    algorithm trains a rollout, so every rollout, a sub-episode's too, and its score name it."""
    import tomllib

    from consumers import scoring
    from schemas.plan_compiler import compile_plan_dict

    source = ('[[orchestrator.train.source]]\nname = "{0}"\n[orchestrator.train.source.env.taskset]\n'
              'id = "arithmetic"\nnum_examples = 20\n')
    plan = compile_plan_dict(tomllib.loads('[model]\nname = "m"\n[orchestrator]\ngroup_size = 2\n'
                                           + source.format("a-grpo") + source.format("a-opd")
                                           + '[orchestrator.train.source.algo]\ntype = "opd"\n'
                                             'teacher = { name = "t", base_url = "http://t/v1" }\n'), "mixed.toml")
    em = MemoryEmitter()
    async with Arena(plan, emitter=em, config=ArenaConfig(policy_base_url=policy_server.base_url, seed=1)) as arena:
        await arena.run(num_groups=6)
    by_group = {r.group_id: r.train_source for r in em.rollouts}
    assert set(by_group.values()) == {"a-grpo", "a-opd"} and len(by_group) == 6
    ro = em.rollouts[0]
    steps = [s for s in em.steps if s.rollout_id == ro.rollout_id]
    scored = scoring.to_scored(ro, steps, await scoring.score(ro, steps), producer="test")
    assert scored.train_source == ro.train_source


async def test_debate_alternates_and_routes_train_one(policy_server):
    em = MemoryEmitter()
    async with Arena(_plan("debate", policy_server.base_url), emitter=em,
                     config=ArenaConfig(policy_base_url=policy_server.base_url, seed=5)) as arena:
        await arena.run(num_groups=2)
    assert len(em.rollouts) == 8
    for r in em.rollouts:
        assert sorted(r.members) == ["debater_a", "debater_b"] and sum(r.members.values()) == 1
        assert r.artifacts["scoring"]["kind"] == "zero_sum_judge" and r.artifacts["scoring"]["judge_target"] == "judge"
        steps = [s for s in em.steps if s.rollout_id == r.rollout_id]
        assert [s.member_id for s in steps] == ["debater_a", "debater_b"] * 2
        for s in steps:
            assert s.trainable == r.members[s.member_id]
            assert s.target == ("learner" if s.trainable else "opponent")
            assert (s.policy is None) == (not s.trainable)
        # each debater sees its own turns as assistant, the other's as user
        last_a = steps[2]
        assert [m.role for m in last_a.prompt][-2:] == ["assistant", "user"]
        assert last_a.prompt[-1].content.startswith("debater_b: ")


async def test_proposer_solver_hierarchy_links(policy_server):
    em = MemoryEmitter()
    async with Arena(_plan("proposer_solver", policy_server.base_url), emitter=em,
                     config=ArenaConfig(policy_base_url=policy_server.base_url)) as arena:
        await arena.run(num_groups=1)
    parents = [r for r in em.rollouts if r.parent_rollout_id is None]
    children = [r for r in em.rollouts if r.parent_rollout_id is not None]
    assert len(parents) == 4 and len(children) == 16
    for p in parents:
        kids = [c for c in children if c.parent_rollout_id == p.rollout_id]
        assert sorted(p.child_rollout_ids) == sorted(c.rollout_id for c in kids) and len(kids) == 4
        assert {c.root_group_id for c in kids} == {p.root_group_id} and len({c.group_id for c in kids}) == 1
        assert kids[0].group_id != p.group_id and all(c.group_size == 4 for c in kids)
        assert p.artifacts["scoring"]["kind"] == "monte_carlo" and p.members == {"proposer": True}
        assert all(c.artifacts["scoring"]["kind"] == "exact_match" and c.members == {"solver": True} for c in kids)
    # a tree is emitted as one unit: children then the parent
    assert all(len(list(res.walk())) == 5 for res in em.results)
    [source] = {r.train_source for r in em.rollouts}  # a sub-episode trains as its source does
    assert source is not None


class CountdownEpisode(MultiTurnEpisode):
    episode_type = "countdown"

    async def env_response(self, messages, state):
        state.data["env_calls"] = state.data.get("env_calls", 0) + 1
        return [user(f"turn {state.turn} done")]

    @stop
    def enough(self, state) -> bool:
        return state.data.get("env_calls", 0) >= 2


def _env(episode, n=4, scoring=None) -> Environment:
    return Environment(name="unit", version="0", dataset=[Example(id=f"e{i}", prompt=f"token-{i}") for i in range(n)],
                       episode=episode, scoring=scoring or ScoringSpec(kind="rubric", funcs=[{"fn": "m:f"}]),
                       sampling={"max_tokens": 256})


async def test_multi_turn_env_response_and_stop_condition(policy_server):
    em = MemoryEmitter()
    env = _env(CountdownEpisode(max_turns=10))
    async with Arena(single_plan(), {"unit": env}, emitter=em,
                     config=ArenaConfig(policy_base_url=policy_server.base_url)) as arena:
        await arena.run(num_groups=1)
    for r in em.rollouts:
        assert r.status == "completed" and r.artifacts["stop_reason"] == "enough" and len(r.step_ids) == 2
    env2 = _env(CountdownEpisode(max_turns=1))
    em2 = MemoryEmitter()
    async with Arena(single_plan(), {"unit": env2}, emitter=em2,
                     config=ArenaConfig(policy_base_url=policy_server.base_url)) as arena:
        await arena.run(num_groups=1)
    assert all(r.artifacts["stop_reason"] == "max_turns" and len(r.step_ids) == 1 for r in em2.rollouts)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first
        b: second
    """
    return a + b


def _tool_script(body):
    msgs = body["messages"]
    assert body["tools"][0]["function"]["name"] in ("add", "sandbox_write")
    if msgs[-1]["role"] == "tool":
        return {"content": f"the answer is {msgs[-1]['content']}"}
    return {"content": None, "tool_calls": [tool_call("add", {"a": 2, "b": 3})]}


async def test_tool_episode_dispatches_and_feeds_results_back():
    em = MemoryEmitter()
    async with ScriptedServer(_tool_script) as server:
        env = _env(ToolEpisode([add], max_turns=4))
        async with Arena(single_plan(), {"unit": env}, emitter=em,
                         config=ArenaConfig(policy_base_url=server.base_url)) as arena:
            await arena.run(num_groups=1)
    for r in em.rollouts:
        assert r.status == "completed" and r.episode_type == "tool_use" and r.artifacts["tool_calls_made"] == 1
        steps = [s for s in em.steps if s.rollout_id == r.rollout_id]
        assert steps[0].tool_calls[0].name == "add" and steps[0].finish_reason == "tool_calls"
        assert steps[1].prompt[-1].role == "tool" and steps[1].prompt[-1].content == "5"
        assert steps[1].prompt[-1].tool_call_id == steps[0].tool_calls[0].id
        assert r.artifacts["final_text"] == "the answer is 5"


async def test_tool_episode_truncates_at_max_turns():
    em = MemoryEmitter()
    always = lambda body: {"content": None, "tool_calls": [tool_call("add", {"a": 1, "b": 1})]}  # noqa: E731
    async with ScriptedServer(always) as server:
        async with Arena(single_plan(), {"unit": _env(ToolEpisode([add], max_turns=3))}, emitter=em,
                         config=ArenaConfig(policy_base_url=server.base_url)) as arena:
            await arena.run(num_groups=1)
    assert all(r.status == "truncated" and len(r.step_ids) == 3 for r in em.rollouts)


def sandbox_read(sandbox: dict) -> str:
    """Everything in the sandbox."""
    return json.dumps(sandbox["items"], sort_keys=True)


class SandboxEpisode(StatefulToolEpisode):
    injected_args = ("sandbox",)
    opened: list[dict] = []

    async def setup_state(self, state):
        state.data["sandbox"] = {"owner": state.rollout_id, "items": {}, "closed": False}
        self.opened.append(state.data["sandbox"])

    async def cleanup_state(self, state):
        state.data["sandbox"]["closed"] = True


def _sandbox_script(body):
    msgs = body["messages"]
    mine = msgs[0]["content"]  # the example prompt: token-<i>
    tools_done = sum(1 for m in msgs if m["role"] == "tool")
    if tools_done == 0:  # the model also tries to smuggle in a sandbox: injected values win
        return {"content": None, "tool_calls": [tool_call("sandbox_write", {"key": "k", "value": mine,
                                                                            "sandbox": {"items": {}}})]}
    if tools_done == 1:
        return {"content": None, "tool_calls": [tool_call("sandbox_read", {})]}
    return {"content": msgs[-1]["content"]}


async def test_stateful_tools_never_leak_between_concurrent_rollouts():
    SandboxEpisode.opened = []
    em = MemoryEmitter()
    async with ScriptedServer(_sandbox_script) as server:
        env = _env(SandboxEpisode([sandbox_write, sandbox_read], max_turns=5), n=12)
        schema = env.episode.registry.schemas
        assert all("sandbox" not in s["function"]["parameters"]["properties"] for s in schema)
        plan = single_plan(group_size=3, batch_size=100)
        async with Arena(plan, {"unit": env}, emitter=em,
                         config=ArenaConfig(policy_base_url=server.base_url, concurrency=24)) as arena:
            await arena.run(num_groups=8)
    assert len(em.rollouts) == 24 and len(SandboxEpisode.opened) == 24
    assert len({id(s) for s in SandboxEpisode.opened}) == 24 and all(s["closed"] for s in SandboxEpisode.opened)
    for r in em.rollouts:
        assert r.status == "completed"
        assert json.loads(r.artifacts["final_text"]) == {"k": r.seed["prompt"]}


async def test_dead_endpoint_gives_failed_rollouts_that_are_still_emitted():
    em = MemoryEmitter()
    dead = f"http://127.0.0.1:{free_port()}/v1"
    async with Arena(single_plan(), {"unit": _env(CountdownEpisode(max_turns=2))}, emitter=em,
                     config=ArenaConfig(policy_base_url=dead, client_options={"max_attempts": 2,
                                        "backoff_s": 0.01})) as arena:
        stats = await arena.run(num_groups=1)
    assert stats.failed == 2 and len(em.rollouts) == 2
    for r in em.rollouts:
        assert r.status == "failed" and "endpoint unavailable after 2 attempts" in r.failure_reason
        assert r.step_ids == [] and r.artifacts["scoring"]["kind"] == "rubric"


# -- environments and stores -----------------------------------------------------------------------------

def test_load_environment_by_module_path_and_short_name():
    env = load_environment("producers.environments.examples.arithmetic:load_environment", num_examples=5)
    assert env.ref == "arithmetic@1.2.0" and len(env.store) == 5
    assert load_environment("proposer-solver", num_solvers=2).ref == "proposer-solver@1.0.0"
    with pytest.raises(ImportError):
        load_environment("no_such_pkg.mod:load_environment")


def test_arithmetic_reward_modes_and_shaped_parts():
    from producers.environments.examples import arithmetic as ar

    ex = ar.make_dataset(1)[0]
    assert load_environment("arithmetic").scoring(ex).kind == "exact_match"
    shaped = load_environment("arithmetic", reward="shaped").scoring(ex)
    assert shaped.kind == "rubric" and shaped.answer == ex.answer and [f.weight for f in shaped.funcs] == [1.0, 0.5, 0.5]
    with pytest.raises(ValueError, match="reward must be"):
        load_environment("arithmetic", reward="partial")
    say = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    assert (ar.exact_answer(say("it is 12"), "12"), ar.exact_answer(say("12 or 13"), "12")) == (1.0, 0.0)
    assert ar.numeric_reply(say("-12")) == 1.0 and ar.numeric_reply(say("a1")) == 0.5 and ar.numeric_reply(say("")) == 0.0
    assert ar.closeness(say("10"), "12") == pytest.approx(1 / 3) and ar.closeness(say("123456"), "12") == 0.0


def test_artifact_store_is_weighted():
    import random

    store = ArtifactStore([Example(id="a", prompt="a"), Example(id="b", prompt="b")], weights=[1.0, 0.0])
    rng = random.Random(0)
    assert {store.sample(rng).id for _ in range(50)} == {"a"}
    store.set_weight("b", 9.0)
    draws = [store.sample(rng).id for _ in range(1000)]
    assert 850 < draws.count("b") < 950


# -- pacing ----------------------------------------------------------------------------------------------

async def test_admission_pacer_pauses_and_resumes():
    pacer = AdmissionPacer(batch_size=4, max_off_policy_steps=1)
    await pacer.admit(4)   # batch 0
    await pacer.admit(4)   # batch 1: lead 1 <= 1
    assert not pacer.may_admit() and pacer.lead() == 2
    waiter = asyncio.create_task(pacer.admit(4))
    await asyncio.sleep(0.05)
    assert not waiter.done() and pacer.paused
    await pacer.on_revision(1)
    await asyncio.wait_for(waiter, 1)
    assert pacer.admitted == 12 and pacer.pauses == 1 and not pacer.paused


async def test_admission_pacer_abort_wakes_waiters():
    pacer = AdmissionPacer(batch_size=1, max_off_policy_steps=0)
    await pacer.admit(1)
    waiter = asyncio.create_task(pacer.admit(1))
    await asyncio.sleep(0.02)
    await pacer.abort(ValueError("revision feed died"))
    with pytest.raises(RuntimeError, match="revision feed died"):
        await asyncio.wait_for(waiter, 1)


async def test_json_endpoints_answer_errors_in_the_openai_shape_and_keep_serving():
    import httpx

    from producers.inference.asgi_server import JSON, MAX_BODY, AppServer, body_json, json_app

    async def echo(req):
        return JSON({"got": await body_json(req), "x": float("-inf")})

    async def bug(req):
        raise KeyError("boom")

    async with AppServer(json_app({("POST", "/v1/echo"): echo, ("GET", "/v1/bug"): bug})) as server:
        async with httpx.AsyncClient(base_url=server.base_url) as http:
            r = await http.post("/echo", json={"a": [1, 2]})
            assert r.status_code == 200 and r.json()["got"] == {"a": [1, 2]} and r.json()["x"] == float("-inf")
            for (method, path, body), (status, kind, says) in {
                    ("POST", "/nope", None): (404, "not_found", "no route POST /v1/nope"),
                    ("GET", "/echo", None): (405, "not_found", "no route GET /v1/echo"),
                    ("POST", "/echo", b"{not json"): (400, "invalid_request_error", "invalid JSON body"),
                    ("GET", "/bug", None): (500, "server_error", "KeyError: 'boom'")}.items():
                r = await http.request(method, path, content=body)
                assert r.status_code == status and r.json()["error"]["type"] == kind, r.text
                assert says in r.json()["error"]["message"] and r.json()["error"]["code"] == status
        # a body announced over the limit is refused before it is read
        reader, writer = await asyncio.open_connection(server.host, server.port)
        writer.write(f"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode())
        assert (await reader.readline()).startswith(b"HTTP/1.1 413")
        writer.close()
    async with FlakyServer(fail_first=1, status=429, retry_after="7") as flaky:
        async with httpx.AsyncClient() as http:
            r = await http.post(flaky.base_url + "/chat/completions", json={"messages": MSG})
            assert (r.status_code, r.headers["retry-after"], r.json()["error"]["type"]) == (429, "7", "server_error")
            r = await http.post(flaky.base_url + "/chat/completions", json={"messages": MSG})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


async def test_client_times_out_and_retries_a_slow_endpoint():
    from producers.inference.asgi_server import JSON, AppServer, json_app

    calls = []

    async def slow(req):
        calls.append(1)
        await asyncio.sleep(2.0)
        return JSON({})

    async with AppServer(json_app({("POST", "/v1/chat/completions"): slow})) as server:
        async with InferenceClient(server.base_url, "m", timeout_s=0.2, max_attempts=2, backoff_s=0.01) as client:
            with pytest.raises(InferenceUnavailable, match="ReadTimeout"):
                await client.chat(MSG)
    assert len(calls) == 2


async def test_evaluation_answers_held_out_and_eval_sources_greedily_without_pacing(policy_server):
    from schemas.plan import EnvSpec

    plan = single_plan()
    train = plan.environments[0].model_copy(update={"args": {"num_examples": 20, "eval_examples": 2}})
    source = EnvSpec(id="arithmetic", name="arith-eval", args={"num_examples": 3, "seed": 99}, evaluation=True)
    plan = plan.model_copy(update={"environments": [train], "eval_environments": [source]})
    em = MemoryEmitter()
    async with Arena(plan, emitter=em,
                     config=ArenaConfig(policy_base_url=policy_server.base_url, evaluate=True)) as arena:
        assert await arena.run_evaluation() == 5  # 2 held out by the training env + the eval source's 3
        assert await arena.run_evaluation() == 5
    assert arena.stats.evaluations == 10 and arena.stats.rollouts == 0 and arena.pacer.admitted == 0
    assert all(r.evaluation and r.group_size == 1 for r in em.rollouts)
    training_prompts = {e.prompt for e in arena.environments["arithmetic"].store}
    asked = [s.prompt[-1].content for s in em.steps]
    assert not training_prompts & set(asked)
    first, second = em.steps[:5], em.steps[5:]  # greedy: the same revision answers the same way
    assert sorted((s.prompt[-1].content, s.completion[0].content) for s in first) == \
        sorted((s.prompt[-1].content, s.completion[0].content) for s in second)


async def test_evaluation_answers_its_held_out_set_at_its_own_concurrency(policy_server):
    """The held-out answers go out ``eval_concurrency`` at once, not at the training rollouts' ``concurrency``: a
    set larger than the latter is answered in one wave (the demo's 48 at 32 took two)."""
    plan = single_plan()
    train = plan.environments[0].model_copy(update={"args": {"num_examples": 20, "eval_examples": 5}})
    plan = plan.model_copy(update={"environments": [train]})
    for eval_concurrency, expected in ((5, 5), (2, 2)):
        async with Arena(plan, emitter=MemoryEmitter(),
                         config=ArenaConfig(policy_base_url=policy_server.base_url, evaluate=True, concurrency=2,
                                            eval_concurrency=eval_concurrency)) as arena:
            peak, run = [0, 0], arena.run_rollout

            async def counted(req):
                peak[0] += 1
                peak[1] = max(peak)
                try:
                    return await run(req)
                finally:
                    peak[0] -= 1
            arena.run_rollout = counted
            assert await arena.run_evaluation() == 5
        assert peak[1] == expected


async def test_evaluation_follows_the_plans_cadence_and_takes_the_runs_last_revision(policy_server):
    """The held-out set every ``plan.eval_interval`` revisions, an eval source at its own ``interval``, everything at
    the run's last revision; a revision with nothing due is neither evaluated nor waited on."""
    from schemas.plan import EnvSpec

    plan = single_plan(max_off_policy_steps=10)  # admission never waits for a revision here: none comes
    train = plan.environments[0].model_copy(update={"args": {"num_examples": 20, "eval_examples": 2}})
    source = EnvSpec(id="arithmetic", name="arith-eval", args={"num_examples": 3, "seed": 99}, evaluation=True,
                     options={"interval": 3})
    plan = plan.model_copy(update={"environments": [train], "eval_environments": [source], "eval_interval": 2})
    async with Arena(plan, emitter=MemoryEmitter(),
                     config=ArenaConfig(policy_base_url=policy_server.base_url, evaluate=True)) as arena:
        # held out (2) at 0, 2, 4, 6; the source (3) at 0, 3, 6
        assert [len(arena.eval_due(r)) for r in range(7)] == [5, 0, 2, 3, 2, 0, 5]
        assert not arena._evaluates(5)
        await arena.run(num_groups=10)  # 20 rollouts, 5 batches of 4: revision 5 is the run's last
        assert arena.last_revision == 5 and len(arena.eval_due(5)) == 5 and arena._evaluates(5)
        arena.current_policy = arena.current_policy.model_copy(update={"revision": 1})
        assert await arena.run_evaluation() == 0 and arena.stats.eval_s == 0.0
        assert await arena.wait_for_revision(1, timeout_s=5.0)  # nothing due at 1: being current is enough
        arena.current_policy = arena.current_policy.model_copy(update={"revision": 2})
        assert not await arena.wait_for_revision(2, timeout_s=0.5)  # due at 2 and not evaluated yet
        assert await arena.run_evaluation() == 2 and arena.stats.eval_s > 0
        assert await arena.wait_for_revision(2, timeout_s=5.0)
    assert arena.stats.evaluated_revisions == [2] and arena.stats.evaluations == 2 and arena.stats.rollouts == 20


async def test_two_sources_of_one_environment_stay_two(policy_server):
    plan = single_plan()
    a = plan.environments[0].model_copy(update={"name": "easy", "args": {"max_operand": 5, "num_examples": 50},
                                                "options": {"weight": 3}})
    b = plan.environments[0].model_copy(update={"name": "hard", "args": {"max_operand": 99}})
    arena = Arena(plan.model_copy(update={"environments": [a, b]}), emitter=MemoryEmitter(),
                  config=ArenaConfig(policy_base_url=policy_server.base_url))
    assert sorted(arena.environments) == ["easy", "hard"] and arena.env_weights == {"easy": 3.0, "hard": 1.0}

    with pytest.raises(ValueError, match="only 72 distinct questions"):  # 6 x 6 operands x 2 ops: never a hang
        load_environment("arithmetic", max_operand=5, num_examples=100)


def test_a_reader_behind_skips_superseded_revisions_it_has_no_use_for():
    """The arena follows revisions with ``skippable`` = no evaluation due: with r1..r4 in one poll and an eval
    every 2 revisions, it loads r2 (evaluated, though superseded) and r4 (the newest), never r1 or r3."""
    from streams.revisions import without_superseded
    from tests._contract_factories import revision

    revs = [revision(r) for r in (1, 2, 3, 4)] + [revision(1, "other")]
    kept = without_superseded(revs, skippable=lambda rev: rev.revision % 2 == 1)
    assert [(r.family, r.revision) for r in kept] == [(revs[1].family, 2), (revs[3].family, 4), ("other", 1)]
    assert without_superseded(revs, skippable=lambda rev: False) == revs
