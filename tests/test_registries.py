"""The open registries: a credit strategy or scoring kind defined outside consumers/ runs end to end without
editing any list, and the verifier service's questions (``needs_children``, ``child_member``) are answered
by what a kind declares. Pure, no Kafka."""

from __future__ import annotations

import argparse
from typing import Any, Mapping, Sequence

import numpy as np
import pytest
from pydantic import ValidationError

from consumers import credit, scoring, testing
from schemas.events import Rollout, RolloutScored, Step, StepTokens
from schemas.policy import PolicyRef
from schemas.scoring import ScoringSpec

POL = PolicyRef(family="tiny", revision=0)


# -- a user's credit strategies and scoring kind (registered by the fixtures, removed after) --------------
class GroupMax(credit.CreditStrategy):
    """Buffers: A = r - the group's best reward, per member."""

    name = "test_group_max"
    buffers = True

    def advantages(self, rollouts: Sequence[RolloutScored]) -> credit.Advantages:
        best = {m: max(s.rewards[m] for s in rollouts if m in s.rewards) for s in rollouts for m in s.rewards}
        return {s.rollout_id: {m: r - best[m] for m, r in s.rewards.items()} for s in rollouts}


class Counted(credit.CreditStrategy):
    """Per rollout: A = r * scale, counting rollouts in its state."""

    name = "test_counted"

    def __init__(self, params: Mapping[str, Any]) -> None:
        super().__init__(params)
        self.seen = 0

    def advantages(self, rollouts: Sequence[RolloutScored]) -> credit.Advantages:
        self.seen += len(rollouts)
        return {s.rollout_id: {m: r * float(self.params.get("scale", 1.0)) for m, r in s.rewards.items()}
                for s in rollouts}

    def state(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.seen = int(state.get("seen", 0))


class Brevity(scoring.Verifier):
    """1.0 for a completion within ``params.budget`` characters; records whether it was handed a judge."""

    kind = "test_brevity"

    def check(self, spec: ScoringSpec) -> None:
        if not isinstance(spec.params.get("budget"), int):
            raise scoring.ScoringError("test_brevity scoring needs an integer params.budget")

    async def score(self, rollout: Rollout, steps: Sequence[Step], spec: ScoringSpec, *, judge: scoring.Judge | None,
                    child_outcomes: Sequence[float] | None) -> scoring.Verdict:
        budget = spec.params["budget"]
        rewards = {m: float(sum(len(s.completion[-1].content or "") for s in scoring.member_steps(steps, m)) <= budget)
                   for m in scoring.scored_members(rollout)}
        return scoring.Verdict(rewards, {"judged": float(judge is not None)}, self.kind)


class Tournament(scoring.Verifier):
    """Scores a parent from its children: the best child outcome."""

    kind = "test_tournament"
    needs_children = True

    async def score(self, rollout: Rollout, steps: Sequence[Step], spec: ScoringSpec, *, judge: scoring.Judge | None,
                    child_outcomes: Sequence[float] | None) -> scoring.Verdict:
        return scoring.Verdict({m: max(child_outcomes or [0.0]) for m in rollout.members}, {}, self.kind)


@pytest.fixture
def user_strategies():
    for cls in (GroupMax, Counted):
        credit.register_strategy(cls)
    yield
    for cls in (GroupMax, Counted):
        credit.STRATEGIES.pop(cls.name)


@pytest.fixture
def user_kinds():
    for cls in (Brevity, Tournament):
        scoring.register_verifier(cls)
    yield
    for cls in (Brevity, Tournament):
        scoring.VERIFIERS.pop(cls.kind)


def scored(rid: str, group: str, reward: float, *, size: int) -> RolloutScored:
    tok = StepTokens(step_id=f"{rid}-s0", member_id="solver", policy=POL,
                     prompt_token_ids=np.arange(3, dtype=np.int32), completion_token_ids=np.arange(5, dtype=np.int32),
                     completion_logprobs=np.zeros(5, dtype=np.float32))
    return RolloutScored(run_id="run", producer="t", rollout_id=rid, group_id=group, root_group_id=group,
                         group_size=size, environment="arith@1", example_id="e", status="completed",
                         rewards={"solver": reward}, verifier="v", verifier_version="1", trainable_steps=[tok])


def rollout(spec: Any, text: str = "short", *, status: str = "completed", **kw: Any) -> tuple[Rollout, list[Step]]:
    steps = [testing.step("r1", "g1", 0, "solver", text, policy=POL)]
    artifacts = {} if spec is None else {"scoring": spec.model_dump(mode="json") if isinstance(spec, ScoringSpec)
                                         else spec}
    ro = Rollout(run_id="run", producer="t", rollout_id="r1", episode_type="single_turn", environment="arith@1",
                 example_id="e", seed={}, step_ids=[s.step_id for s in steps], members={"solver": True},
                 artifacts=artifacts, group_id="g1", root_group_id="g1", group_size=1, policy=POL, status=status,
                 failure_reason="crashed" if status == "failed" else None, **kw)
    return ro, steps


# -- credit ------------------------------------------------------------------------------------------------
def test_builtin_strategies_in_order_and_what_they_buffer():
    assert tuple(credit.STRATEGIES) == ("grpo", "reinforce_baseline", "ema_per_member", "per_step")
    assert {n: credit.CreditAssigner(n).buffers for n in credit.STRATEGIES} == {
        "grpo": True, "reinforce_baseline": False, "ema_per_member": False, "per_step": False}


def test_user_buffering_strategy_end_to_end(user_strategies):
    ca = credit.CreditAssigner("test_group_max", {"group_timeout_s": 10})
    assert ca.buffers
    assert ca.add(scored("a0", "ga", 1.0, size=2), now=0.0) == []
    recs = ca.add(scored("a1", "ga", 0.25, size=2), now=0.0)
    assert {r.rollout_id: r.advantage for r in recs} == {"a0": 0.0, "a1": -0.75}
    assert {r.credit for r in recs} == {"test_group_max"} and ca.groups.groups == {}
    ca.add(scored("b0", "gb", 1.0, size=3), now=0.0)
    ca.add(scored("b1", "gb", 0.5, size=3), now=1.0)
    flushed, refused = ca.flush_expired(now=10.0)
    assert refused == [] and {r.credit for r in flushed} == {"test_group_max:flushed(2/3,timeout)"}


def test_user_strategy_state_survives_a_restart(user_strategies):
    ca = credit.CreditAssigner("test_counted", {"scale": 2.0})
    assert not ca.buffers
    [rec] = ca.add(scored("x0", "g0", 0.5, size=4), now=0.0)
    assert (rec.advantage, rec.credit, ca.groups.groups) == (1.0, "test_counted", {})
    again = credit.CreditAssigner("test_counted")
    again.load_state(ca.state())
    assert again.state() == {"seen": 1}


def test_cli_choices_take_the_registry(user_strategies):
    p = argparse.ArgumentParser()
    p.add_argument("--credit", choices=credit.STRATEGIES)
    assert p.parse_args(["--credit", "test_counted"]).credit == "test_counted"
    with pytest.raises(SystemExit):
        p.parse_args(["--credit", "ppo-magic"])


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="already registered"):
        credit.register_strategy(credit.Grpo)
    with pytest.raises(ValueError, match="already registered"):
        scoring.register_verifier(scoring.ExactMatch)


# -- scoring -----------------------------------------------------------------------------------------------
async def test_user_kind_end_to_end(user_kinds):
    spec = ScoringSpec(kind="test_brevity", params={"budget": 10})

    async def judge(target, messages):
        raise AssertionError("a kind that does not declare needs_judge is never handed the judge")

    v = await scoring.score(*rollout(spec, "short"), judge=judge)
    assert (v.rewards, v.metrics, v.verifier) == ({"solver": 1.0}, {"judged": 0.0}, "test_brevity")
    assert (await scoring.score(*rollout(spec, "far too long an answer"))).rewards == {"solver": 0.0}
    with pytest.raises(scoring.ScoringError, match="integer params.budget"):
        await scoring.score(*rollout(ScoringSpec(kind="test_brevity")))


async def test_user_kind_with_children(user_kinds):
    ro, steps = rollout(ScoringSpec(kind="test_tournament", params={"child_member": "solver"}))
    assert scoring.needs_children(ro) and scoring.child_member(ro) == "solver"
    with pytest.raises(scoring.ScoringError, match="test_tournament scoring needs the children's outcomes"):
        await scoring.score(ro, steps)
    assert (await scoring.score(ro, steps, child_outcomes=[0.25, 0.75])).rewards == {"solver": 0.75}


async def test_unknown_kind_lists_the_known_ones():
    with pytest.raises(scoring.ScoringError, match="unknown scoring kind 'nope'; known: exact_match, rubric"):
        await scoring.score(*rollout({"kind": "nope"}))


@pytest.mark.parametrize("spec,why", [
    ({"kind": "exact_match"}, "exact_match scoring needs an answer"),
    ({"kind": "rubric"}, "rubric scoring needs at least one reward function"),
    ({"kind": "llm_judge"}, "llm_judge scoring needs judge_target"),
    ({"kind": "zero_sum_judge", "judge_target": "judge"}, "zero_sum_judge scoring needs exactly two players"),
    ({"kind": "zero_sum_judge", "players": ["a", "b"]}, "zero_sum_judge scoring needs judge_target"),
])
async def test_each_kind_refuses_a_spec_without_what_it_needs(spec, why):
    with pytest.raises(scoring.ScoringError, match=why):
        await scoring.score(*rollout(spec))


@pytest.mark.parametrize("kind", ["", "two words", "1st", "a-b"])
def test_kind_is_an_identifier(kind):
    with pytest.raises(ValidationError):
        ScoringSpec(kind=kind)


def test_needs_children_from_the_declared_kind():
    mc = ScoringSpec(kind="monte_carlo", params={"child_member": "solver"})
    assert scoring.needs_children(rollout(mc)[0])
    assert not scoring.needs_children(rollout(mc, status="failed")[0])  # a failed parent scores 0 at once
    assert not scoring.needs_children(rollout(ScoringSpec(kind="exact_match", answer="1"))[0])
    for bad in (None, "not a dict", {"kind": "nope"}, {"kind": "monte_carlo", "extra": 1}):
        assert not scoring.needs_children(rollout(bad)[0])


def test_child_member_reads_the_parent_spec():
    assert scoring.child_member(rollout(ScoringSpec(kind="monte_carlo", params={"child_member": "solver"}))[0]) \
        == "solver"
    assert scoring.child_member(rollout(ScoringSpec(kind="monte_carlo"))[0]) is None
    assert scoring.child_member(rollout(ScoringSpec(kind="monte_carlo", params={"child_member": 3}))[0]) is None
    for bad in (None, "not a dict", [1, 2]):
        assert scoring.child_member(rollout(bad)[0]) is None
