"""The verifiers adapter: environments built from verifiers' own classes (a SingleTurnEnv and a ToolEnv)
run as our episodes; every model call they make becomes a Step with token ids and logprobs."""

from __future__ import annotations

import pytest
import torch

from policy import PolicyModel, token_logprobs
from producers.arena import Arena
from producers.echo_server import ScriptedServer, tool_call
from producers.emitter import MemoryEmitter
from producers.policy_server import PolicyServer
from schemas.plan import compile_plan

import verifiers as vf  # noqa: E402
from datasets import Dataset  # noqa: E402


def correct_answer(completion, answer, **kwargs) -> float:
    text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
    return 1.0 if answer in str(text) else 0.0


def completion_length(completion, **kwargs) -> float:
    return float(len(str(completion)))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first addend
        b: second addend
    """
    return a + b


def _plan(group_size=2):
    return compile_plan("examples/plans/arithmetic.toml").model_copy(update={"group_size": group_size})


async def test_single_turn_verifiers_env_records_steps_with_real_logprobs():
    from producers.verifiers_adapter import verifiers_environment

    ds = Dataset.from_list([{"question": "What is 2+2?", "answer": "4"}, {"question": "What is 3+3?", "answer": "6"}])
    rubric = vf.Rubric(funcs=[correct_answer, completion_length], weights=[1.0, 0.0])
    env = verifiers_environment(vf.SingleTurnEnv(dataset=ds, rubric=rubric, system_prompt="Answer briefly."),
                                name="vf-single", version="0.1", member="solver")
    em = MemoryEmitter()
    async with PolicyServer(PolicyModel.from_seed(4), family="tiny-byte-lm") as server:
        async with Arena(_plan(), {"vf": env}, emitter=em, policy_base_url=server.base_url) as arena:
            stats = await arena.run(num_groups=2)
        model = server.model
    assert stats.failed == 0, [r.failure_reason for r in em.rollouts]
    assert len(em.rollouts) == 4 and len(em.steps) == 4
    for r in em.rollouts:
        assert r.environment == "vf-single@0.1" and r.episode_type == "verifiers" and r.members == {"solver": True}
        spec = r.artifacts["scoring"]
        assert spec["kind"] == "rubric" and spec["answer"] == r.seed["answer"]
        mod = correct_answer.__module__  # "test_verifiers_adapter" under pytest's rootdir-less import
        assert spec["funcs"] == [{"fn": f"{mod}:correct_answer", "weight": 1.0}]
        assert {"fn": f"{mod}:completion_length", "weight": 0.0} in spec["metrics"]
        assert "num_turns" in spec["params"]["not_importable"]  # verifiers' own bound-method monitor
        assert r.artifacts["verifiers"]["reward"] in (0.0, 1.0)
    for s in em.steps:
        assert s.prompt[0].role == "system" and s.prompt[0].content == "Answer briefly."
        lp = token_logprobs(model, s.prompt_token_ids.tolist(), s.completion_token_ids.tolist()).detach()
        assert torch.allclose(lp, torch.tensor(s.completion_logprobs.tolist()), atol=1e-4)


def _script(body):
    msgs = body["messages"]
    assert [t["function"]["name"] for t in body["tools"]] == ["add"]
    if msgs[-1]["role"] == "tool":
        return {"content": f"The sum is {msgs[-1]['content']}."}
    return {"content": None, "tool_calls": [tool_call("add", {"a": 19, "b": 23})]}


async def test_tool_verifiers_env_dispatches_through_verifiers_and_records_each_call():
    from producers.verifiers_adapter import verifiers_environment

    ds = Dataset.from_list([{"question": "What is 19+23? Use the add tool.", "answer": "42"}])
    vf_env = vf.ToolEnv(dataset=ds, tools=[add], max_turns=4,
                        rubric=vf.Rubric(funcs=[correct_answer], weights=[1.0]))
    env = verifiers_environment(vf_env, name="vf-tool", version="0.1")
    em = MemoryEmitter()
    async with ScriptedServer(_script) as server:
        async with Arena(_plan(group_size=3), {"vf": env}, emitter=em, policy_base_url=server.base_url) as arena:
            await arena.run(num_groups=1)
    assert len(em.rollouts) == 3
    for r in em.rollouts:
        assert r.status == "completed", r.failure_reason
        steps = [s for s in em.steps if s.rollout_id == r.rollout_id]
        assert len(steps) == 2 and steps[0].tool_calls[0].name == "add"
        assert steps[1].prompt[-1].role == "tool" and steps[1].prompt[-1].content == "42"
        assert r.artifacts["verifiers"]["reward"] == 1.0
        assert r.artifacts["final_text"] == "The sum is 42."
        assert r.artifacts["scoring"]["funcs"][0]["fn"].endswith("test_verifiers_adapter:correct_answer")


async def test_endpoint_down_fails_the_rollout_with_the_reason():
    from producers.http_server import free_port
    from producers.verifiers_adapter import verifiers_environment

    ds = Dataset.from_list([{"question": "1+1?", "answer": "2"}])
    env = verifiers_environment(vf.SingleTurnEnv(dataset=ds, rubric=vf.Rubric(funcs=[correct_answer])),
                                name="vf-down", version="0.1")
    em = MemoryEmitter()
    async with Arena(_plan(group_size=1), {"vf": env}, emitter=em, policy_base_url=f"http://127.0.0.1:{free_port()}/v1",
                     client_options={"max_attempts": 2, "backoff_s": 0.01}) as arena:
        await arena.run(num_groups=1)
    (r,) = em.rollouts
    assert r.status == "failed" and "endpoint unavailable" in r.failure_reason
