"""verifiers 0.4 (``verifiers.v1``) environments as arena episodes, on the real broker: a single-agent Taskset
env and a two-seat game whose seats are members of their own; every model call verifiers' interception server
forwards becomes a Step (token ids, logprobs, member, trainable), and the rewards are the env's own."""

from __future__ import annotations

import pytest
import torch

from policy import PolicyModel, token_logprobs
from producers.arena.config import ArenaConfig
from producers.arena.arena import Arena
from producers.inference.policy_server import PolicyServer
from schemas.events import Rollout, Step
from test_producers_kafka import _emitter, _plan, pipeline_topics, read_all  # noqa: F401 - fixture

vf = pytest.importorskip("verifiers.v1")

from consumers.scoring import score  # noqa: E402 - tests may use the verifier's scoring
from producers.environments.verifiers_v1 import chat_agent, register_plugin, verifiers_v1_environment  # noqa: E402

pytestmark = pytest.mark.integration


def last_reply(trace) -> str:
    for branch in reversed(trace.branches):
        for m in reversed(branch.messages):
            if m.role == "assistant":
                return m.content or ""
    return ""


# -- a single-agent taskset: @reward and @metric methods on the task ---------------------------------------

class QuestionData(vf.TaskData):
    answer: str


class QuestionTask(vf.Task[QuestionData]):
    @vf.reward
    async def mentions_answer(self, task, trace) -> float:
        return 1.0 if task.answer in last_reply(trace) else 0.0

    @vf.reward(weight=0.5)
    async def brevity(self, trace) -> float:
        return 1.0 / (1.0 + len(last_reply(trace)))

    @vf.metric
    async def reply_chars(self, trace) -> float:
        return float(len(last_reply(trace)))


class QuestionTaskset(vf.Taskset[QuestionTask]):
    def load(self):
        for i, (q, a) in enumerate([("What is 2+2?", "4"), ("What is 3+4?", "7")]):
            yield QuestionTask(QuestionData(id=f"q{i}", prompt=q, system_prompt="Answer briefly.", answer=a),
                               self.config.task)


register_plugin("rl_test_questions", QuestionTaskset)


def expected_question_reward(text: str, answer: str) -> float:
    return (1.0 if answer in text else 0.0) + 0.5 * (1.0 / (1.0 + len(text)))


# -- a two-seat game: each seat plays, the env's finalize() decides the winner -------------------------------

class GameTask(vf.Task[vf.TaskData]):
    @vf.reward(weight=0.25)
    async def spoke(self, trace) -> float:
        return 1.0 if last_reply(trace).strip() else 0.0


class GameTaskset(vf.Taskset[GameTask]):
    def load(self):
        yield GameTask(vf.TaskData(id="topic-0", prompt="Argue: cats are better than dogs."), self.config.task)


class GameConfig(vf.EnvConfig):
    debater_a: vf.AgentConfig = chat_agent()
    debater_b: vf.AgentConfig = chat_agent()


class GameEnv(vf.Env[GameConfig]):
    """debater_a opens, debater_b answers it; the longer argument wins (+1 / -1, 0 on a tie)."""

    async def run(self, task, agents) -> None:
        opening = await agents.debater_a.run(task)
        reply = f"{task.data.prompt}\nYour opponent said: {last_reply(opening)}\nAnswer them."
        await agents.debater_b.run(task.with_data(prompt=reply))

    async def finalize(self, task, episode) -> None:
        lengths = {t.agent.name: len(last_reply(t)) for t in episode.traces}
        for t in episode.traces:
            other = max(v for k, v in lengths.items() if k != t.agent.name)
            mine = lengths[t.agent.name]
            t.record_reward("win", 1.0 if mine > other else -1.0 if mine < other else 0.0)


register_plugin("rl_test_game", GameTaskset, GameEnv)


def expected_game_rewards(texts: dict[str, str]) -> dict[str, float]:
    a, b = len(texts["debater_a"]), len(texts["debater_b"])
    win = {"debater_a": (a > b) - (a < b), "debater_b": (b > a) - (b < a)}
    return {m: 0.25 * (1.0 if texts[m].strip() else 0.0) + win[m] for m in texts}


# -- helpers ---------------------------------------------------------------------------------------------------

async def _read_log(kafka_settings, topics, n_rollouts: int) -> tuple[list[Rollout], list[Step]]:
    kw = kafka_settings.client_kwargs()
    rollouts = [ev for *_, ev in await read_all(kw, topics[1], expect=n_rollouts)]
    steps = [ev for *_, ev in await read_all(kw, topics[0], expect=sum(len(r.step_ids) for r in rollouts))]
    return rollouts, steps


async def _run(environment, plan, emitter, policy_base_url: str, num_groups: int, weights="auto", **settings):
    """The arena's stats for ``num_groups`` groups of the env (its interception server closed even on failure)."""
    try:
        async with Arena(plan, {"vf": environment}, emitter=emitter, weights=weights,
                         config=ArenaConfig(policy_base_url=policy_base_url, **settings)) as arena:
            return await arena.run(num_groups=num_groups)
    finally:
        await environment.episode.aclose()


async def _on_the_broker(kafka_settings, topics, environment, plan_name: str, *, seed: int, group_size: int,
                         num_groups: int) -> tuple[PolicyModel, list[Rollout], list[Step]]:
    """The env's episodes against a tiny policy server, read back from the log (none of them failed)."""
    async with PolicyServer(PolicyModel.from_seed(seed), family="tiny-byte-lm") as server:
        stats = await _run(environment, _plan(plan_name, server.base_url, group_size=group_size),
                           _emitter(kafka_settings, topics), server.base_url, num_groups)
    rollouts, steps = await _read_log(kafka_settings, topics, group_size * num_groups)
    assert stats.failed == 0, [r.failure_reason for r in rollouts]
    return server.model, rollouts, steps


def _check_steps(rollout: Rollout, steps: list[Step], model) -> None:
    calls = rollout.artifacts["verifiers"]["model_calls"]
    assert len(steps) == sum(calls.values()) > 0
    for m, n in calls.items():
        assert len([s for s in steps if s.member_id == m]) == n, (m, calls)
    for s in steps:
        assert s.member_id in rollout.members and s.trainable == rollout.members[s.member_id]
        assert len(s.completion_token_ids) > 0 and len(s.completion_logprobs) == len(s.completion_token_ids)
        assert len(s.prompt_token_ids) > 0
        if s.trainable:
            assert s.policy is not None and s.policy.family == "tiny-byte-lm"
        lp = token_logprobs(model, s.prompt_token_ids.tolist(), s.completion_token_ids.tolist()).detach()
        assert torch.allclose(lp, torch.tensor(s.completion_logprobs.tolist()), atol=1e-4)


def _text(step: Step) -> str:
    return step.completion[0].content or ""


# -- tests -------------------------------------------------------------------------------------------------------

async def test_single_agent_taskset_env_on_the_broker(kafka_settings, pipeline_topics):  # noqa: F811
    env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset={"id": "rl_test_questions"}, agent=chat_agent()))
    environment = verifiers_v1_environment(env, name="vf-questions", version="0.1", member="solver")
    assert [e.id for e in environment.store] == ["q0", "q1"]
    model, rollouts, steps = await _on_the_broker(kafka_settings, pipeline_topics, environment, "arithmetic", seed=4,
                                                  group_size=2, num_groups=2)
    for r in rollouts:
        assert r.status == "completed" and r.environment == "vf-questions@0.1" and r.episode_type == "verifiers_v1"
        assert r.members == {"solver": True}
        rs = sorted((s for s in steps if s.rollout_id == r.rollout_id), key=lambda s: s.index)
        _check_steps(r, rs, model)
        assert len(rs) == 1 and rs[0].prompt[0].role == "system" and rs[0].prompt[0].content == "Answer briefly."
        assert rs[0].prompt[1].content == r.seed["prompt"]
        rec = r.artifacts["verifiers"]
        assert rec["ok"] and rec["seats"] == {"agent": "solver"} and rec["trainable"] == {"solver": True}
        # the env's own reward functions, on the reply verifiers received from the Step
        want = expected_question_reward(_text(rs[0]), r.seed["answer"])
        assert rec["rewards_by_member"]["solver"] == pytest.approx(want)
        assert set(rec["reward_components"]["solver"]) == {"mentions_answer", "brevity"}
        assert rec["metrics"]["solver"]["reply_chars"] == len(_text(rs[0]))
        assert r.artifacts["final_by_member"]["solver"] == _text(rs[0])
        # and the verifier service's rubric scores exactly that
        assert r.artifacts["scoring"]["funcs"] == [{"fn": "producers.environments.verifiers_v1:verifiers_reward", "weight": 1.0}]
        verdict = await score(r, rs)
        assert verdict.rewards == {"solver": pytest.approx(want)}


async def test_two_seat_game_each_seat_its_own_member(kafka_settings, pipeline_topics):  # noqa: F811
    env = GameEnv(GameConfig(taskset={"id": "rl_test_game"}))
    environment = verifiers_v1_environment(env, name="vf-game", version="0.1")
    assert environment.episode.members == ("debater_a", "debater_b")
    # the debate plan trains one seat (train_one), the other is fixed
    model, rollouts, steps = await _on_the_broker(kafka_settings, pipeline_topics, environment, "debate", seed=5,
                                                  group_size=4, num_groups=1)
    trained = set()
    for r in rollouts:
        assert r.status == "completed" and r.episode_type == "verifiers_v1"
        assert sorted(r.members) == ["debater_a", "debater_b"] and sum(r.members.values()) == 1
        trained |= {m for m, t in r.members.items() if t}
        rs = sorted((s for s in steps if s.rollout_id == r.rollout_id), key=lambda s: s.index)
        _check_steps(r, rs, model)
        assert [s.member_id for s in rs] == ["debater_a", "debater_b"]
        fixed = [s for s in rs if not s.trainable]
        assert len(fixed) == 1 and fixed[0].target == "opponent" and fixed[0].policy is None
        assert _text(rs[0]) in rs[1].prompt[-1].content  # b answered a's actual reply
        rec = r.artifacts["verifiers"]
        assert rec["seats"] == {"debater_a": "debater_a", "debater_b": "debater_b"}
        want = expected_game_rewards({s.member_id: _text(s) for s in rs})
        assert rec["rewards_by_member"] == pytest.approx(want)
        assert set(rec["reward_components"]["debater_a"]) == {"spoke", "win"}
        verdict = await score(r, rs)
        learner = next(m for m, t in r.members.items() if t)
        assert verdict.rewards == {learner: pytest.approx(want[learner])}
    assert trained <= {"debater_a", "debater_b"}


async def test_endpoint_down_fails_the_rollout_with_the_reason():
    from producers.arena.emitter import MemoryEmitter
    from streams.local_broker import free_port

    env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset={"id": "rl_test_questions"}, agent=chat_agent()))
    environment = verifiers_v1_environment(env, name="vf-down", version="0.1")
    dead = f"http://127.0.0.1:{free_port()}/v1"
    em = MemoryEmitter()
    await _run(environment, _plan("arithmetic", dead, group_size=1), em, dead, 1,
               client_options={"max_attempts": 2, "backoff_s": 0.01})
    (r,) = em.rollouts
    assert r.status == "failed" and "endpoint unavailable" in r.failure_reason, r.failure_reason
    assert not em.steps


class ChatConfig(vf.EnvConfig):
    agent: vf.AgentConfig = chat_agent()


class TwoTurnsEnv(vf.Env[ChatConfig]):
    """The env is the seat's user: it opens the exchange, then asks for more (one trace, two model calls)."""

    async def run(self, task, agents) -> None:
        async with agents.agent.interaction(task) as chat:
            await chat.turn()
            await chat.turn("Say more.")


register_plugin("rl_test_two_turns", GameTaskset, TwoTurnsEnv)


async def test_interaction_turns_of_one_seat_are_steps_of_one_member(policy_server_for_v1):
    from producers.arena.emitter import MemoryEmitter

    env = TwoTurnsEnv(ChatConfig(taskset={"id": "rl_test_two_turns"}))
    environment = verifiers_v1_environment(env, name="vf-two-turns", version="0.1", member="talker")
    em = MemoryEmitter()
    url = policy_server_for_v1.base_url
    await _run(environment, _plan("arithmetic", url, group_size=2), em, url, 1)
    assert len(em.rollouts) == 2
    for r in em.rollouts:
        assert r.status == "completed", r.failure_reason
        first, second = sorted((s for s in em.steps if s.rollout_id == r.rollout_id), key=lambda s: s.index)
        assert first.member_id == second.member_id == "talker"
        assert r.artifacts["verifiers"]["model_calls"] == {"talker": 2}
        assert second.prompt[-1].content == "Say more." and second.prompt[-2].content == _text(first)
        assert r.artifacts["verifiers"]["rewards_by_member"]["talker"] == pytest.approx(0.25 * bool(_text(second).strip()))


@pytest.fixture
async def policy_server_for_v1():
    async with PolicyServer(PolicyModel.from_seed(6), family="tiny-byte-lm") as server:
        yield server

async def test_single_agent_env_on_real_vllm(vllm_server, kafka_settings, pipeline_topics):  # noqa: F811
    from transformers import AutoTokenizer

    from policy.hf import prepare_model
    from producers.inference.vllm_server import CPU_CLIENT_OPTIONS
    from schemas.plan_compiler import compile_plan
    from test_producers_kafka import ROOT

    plan = compile_plan(ROOT / "examples/plans/arithmetic-smollm2.toml")
    targets = {k: t.model_copy(update={"base_urls": [vllm_server.base_url]}) for k, t in plan.targets.items()}
    plan = plan.model_copy(update={"targets": targets, "group_size": 2})
    env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset={"id": "rl_test_questions"}, agent=chat_agent()))
    environment = verifiers_v1_environment(env, name="vf-questions", version="0.1", member="solver")
    stats = await _run(environment, plan, _emitter(kafka_settings, pipeline_topics), vllm_server.base_url, 1,
                       weights=None, client_options=CPU_CLIENT_OPTIONS)
    rollouts, steps = await _read_log(kafka_settings, pipeline_topics, 2)
    assert stats.failed == 0, [r.failure_reason for r in rollouts]
    tok = AutoTokenizer.from_pretrained(prepare_model().path)
    for r in rollouts:
        (s,) = [s for s in steps if s.rollout_id == r.rollout_id]
        assert s.trainable and s.member_id == "solver" and len(s.completion_logprobs) == len(s.completion_token_ids) > 0
        assert all(lp <= 0.0 for lp in s.completion_logprobs.tolist())
        assert tok.decode(s.completion_token_ids.tolist(), skip_special_tokens=True).strip() == _text(s).strip()
        want = expected_question_reward(_text(s), r.seed["answer"])
        assert r.artifacts["verifiers"]["rewards_by_member"]["solver"] == pytest.approx(want)
        assert (await score(r, [s])).rewards == {"solver": pytest.approx(want)}
