"""Unit tests of the pure logic: verifiers, credit strategies, batching (no broker)."""

from __future__ import annotations

import time

import asyncio
import math
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers import credit, scoring, testing
from consumers.batching import BatchPolicy, Batcher
from schemas.batch import verify_batch
from schemas.events import Rollout, RolloutScored, StepTokens
from schemas.policy import PolicyRef
from schemas.scoring import ScoringSpec

# -- reward functions for rubric tests (importable by path) ---------------------------------------------
mod = types.ModuleType("rubric_fns")


def _len_reward(completion):
    return min(1.0, len(completion[0]["content"]) / 100)


async def _async_correct(completion, answer):
    await asyncio.sleep(0)
    return 1.0 if answer in completion[-1]["content"] else 0.0


def _boom(**kwargs):
    raise RuntimeError("kaboom")


async def _slow(prompt):
    await asyncio.sleep(5)
    return 1.0


def _sees_state(state):
    return float(state["member"] == "solver")


mod.len_reward, mod.async_correct, mod.boom, mod.slow, mod.sees_state = (
    _len_reward, _async_correct, _boom, _slow, _sees_state)
sys.modules["rubric_fns"] = mod


def one(spec: dict | None = None, text: str = "The answer is 42", answer: str = "42", **kw):
    steps = [testing.step("r1", "g1", 0, "solver", text, policy=PolicyRef(family="tiny", revision=0))]
    ro = Rollout(run_id="run", producer="t", rollout_id="r1", episode_type="single_turn", environment="arith@1",
                 example_id="e", seed={}, step_ids=[s.step_id for s in steps], members={"solver": True},
                 artifacts={"scoring": spec or {"kind": "exact_match", "answer": answer}}, group_id="g1",
                 root_group_id="g1", group_size=1, policy=PolicyRef(family="tiny", revision=0), status="completed", **kw)
    return ro, steps


@pytest.mark.parametrize("text,want", [("The answer is 42", 1.0), ("I think 41", 0.0), ("\\boxed{42}", 1.0),
                                        ("#### 42.0", 1.0), ("forty-two", 0.0), ("7 * 6 = 42.", 1.0)])
async def test_exact_match(text, want):
    ro, steps = one(text=text)
    v = await scoring.score(ro, steps)
    assert v.rewards == {"solver": want}


async def test_rubric_weighted_sync_async_metrics_not_rewarded():
    spec = ScoringSpec(kind="rubric", answer="42", funcs=[{"fn": "rubric_fns:async_correct", "weight": 2.0},
                                                          {"fn": "rubric_fns:sees_state", "weight": 0.5}],
                       metrics=[{"fn": "rubric_fns:len_reward"}]).model_dump(mode="json")
    ro, steps = one(spec)
    v = await scoring.score(ro, steps)
    assert v.rewards == {"solver": 2.5}
    assert v.metrics["solver/metric/len_reward"] == pytest.approx(len("The answer is 42") / 100)


@pytest.mark.parametrize("fn,what", [("rubric_fns:boom", "raised RuntimeError: kaboom"), ("rubric_fns:slow", "timed out"),
                                      ("rubric_fns:missing", "raised AttributeError")])
async def test_rubric_failure_is_a_scoring_error(fn, what):
    spec = ScoringSpec(kind="rubric", funcs=[{"fn": fn}], params={"timeout_s": 0.2}).model_dump(mode="json")
    ro, steps = one(spec)
    with pytest.raises(scoring.ScoringError, match=what):
        await scoring.score(ro, steps)


async def test_missing_spec_is_a_scoring_error():
    ro, steps = one()
    ro = ro.model_copy(update={"artifacts": {}})
    with pytest.raises(scoring.ScoringError, match="no artifacts"):
        await scoring.score(ro, steps)


async def test_failed_rollout_scores_zero_without_scoring():
    ro, steps = one({"kind": "rubric", "funcs": [{"fn": "rubric_fns:boom"}]})
    ro = ro.model_copy(update={"status": "failed", "failure_reason": "env crashed"})
    v = await scoring.score(ro, steps)
    assert v.rewards == {"solver": 0.0}


async def test_llm_judge_uses_fixed_target_and_parses_score():
    asked = []

    async def judge(target, messages):
        asked.append(target)
        return "Reasoning... SCORE: 0.75"

    spec = ScoringSpec(kind="llm_judge", judge_target="judge", answer="42").model_dump(mode="json")
    ro, steps = one(spec)
    v = await scoring.score(ro, steps, judge=judge)
    assert v.rewards == {"solver": 0.75} and asked == ["judge"]
    scored = scoring.to_scored(ro, steps, v, producer="t")
    assert [s.member_id for s in scored.trainable_steps] == ["solver"]  # the judge's words never become tokens


async def test_zero_sum_judge_two_players():
    spec = ScoringSpec(kind="zero_sum_judge", judge_target="judge", players=["aff", "neg"]).model_dump(mode="json")
    pol = PolicyRef(family="tiny", revision=3)
    steps = [testing.step("d1", "g", 0, "aff", "I argue yes", policy=pol),
             testing.step("d1", "g", 1, "neg", "I argue no", trainable=False, target="opponent"),
             testing.step("d1", "g", 2, "aff", "Rebuttal", policy=pol)]
    ro = Rollout(run_id="run", producer="t", rollout_id="d1", episode_type="debate", environment="debate@1",
                 example_id="e", seed={}, step_ids=[s.step_id for s in steps], members={"aff": True, "neg": False},
                 artifacts={"scoring": spec}, group_id="g", root_group_id="g", group_size=1, policy=pol,
                 status="completed")

    async def judge(target, messages):
        return "WINNER: neg"

    v = await scoring.score(ro, steps, judge=judge)
    assert v.rewards == {"aff": -1.0, "neg": 1.0}
    ro2 = ro.model_copy(update={"artifacts": {"scoring": spec, "winner": "tie"}})
    assert (await scoring.score(ro2, steps)).rewards == {"aff": 0.0, "neg": 0.0}
    scored = scoring.to_scored(ro, steps, v, producer="t")
    # only the trainable seat's steps: the fixed opponent never produces training data
    assert [s.step_id for s in scored.trainable_steps] == ["d1-s0", "d1-s2"]
    recs = credit.records_for(scored, {"aff": -1.0}, "per_step", producer="t")
    assert {r.member_id for r in recs} == {"aff"} and all(r.reward == -1.0 for r in recs)


def test_monte_carlo_modes():
    assert scoring.monte_carlo_reward([1, 0, 1, 0], {}) == 0.5
    assert scoring.monte_carlo_reward([1, 1, 1, 0], {"mode": "inverse"}) == 0.25
    assert scoring.monte_carlo_reward([1, 1, 1, 1], {"mode": "band"}) == 0.0
    assert scoring.monte_carlo_reward([1, 0, 1, 0], {"mode": "band"}) == 1.0
    with pytest.raises(scoring.ScoringError):
        scoring.monte_carlo_reward([], {})


def scored(rid: str, group: str, reward: float, *, size: int = 4, member: str = "solver", env: str = "arith@1",
           rev: int = 0) -> RolloutScored:
    tok = StepTokens(step_id=f"{rid}-s0", member_id=member, policy=PolicyRef(family="tiny", revision=rev),
                     prompt_token_ids=np.arange(3, dtype=np.int32), completion_token_ids=np.arange(5, dtype=np.int32),
                     completion_logprobs=np.zeros(5, dtype=np.float32))
    return RolloutScored(run_id="run", producer="t", rollout_id=rid, group_id=group, root_group_id=group,
                         group_size=size, environment=env, example_id="e", status="completed", rewards={member: reward},
                         verifier="exact_match", verifier_version="1", trainable_steps=[tok])


def test_grpo_waits_for_whole_group_and_normalises():
    ca = credit.CreditAssigner("grpo")
    out = []
    for i, r in enumerate([1.0, 0.0, 1.0, 0.0]):
        got = ca.add(scored(f"r{i}", "g", r), now=0.0)
        if i < 3:
            assert got == []
        out += got
    assert len(out) == 4
    adv = [r.advantage for r in out]
    assert math.isclose(sum(adv), 0.0, abs_tol=1e-9) and adv[0] == pytest.approx(1.0, rel=1e-4)
    assert len({r.record_id for r in out}) == 4
    assert out[0].record_id == credit.record_id("r0", "r0-s0")


def test_length_penalty_is_prime_rls_linear_shaping_before_the_baseline():
    """prime-rl's own case (its GRPO test): rewards 1, 1, 0 with 10, 20, 20 completion tokens, output weight 0.25:
    advantages 7/18, 11/36, -25/36. Through the credit service's grpo, each rollout's completion and prompt tokens
    and turns taken from its trainable steps."""
    def lengths(rid, reward, completion, prompt, turns):
        s = scored(rid, "g", reward, size=3)
        tok = s.trainable_steps[0]
        steps = [tok.model_copy(update={"step_id": f"{rid}-s{t}", "prompt_token_ids": np.arange(prompt, dtype=np.int32),
                                        "completion_token_ids": np.arange(completion // turns, dtype=np.int32),
                                        "completion_logprobs": np.zeros(completion // turns, dtype=np.float32)})
                 for t in range(turns)]
        return s.model_copy(update={"trainable_steps": steps})

    group = [lengths("a", 1.0, 10, 5, 1), lengths("b", 1.0, 20, 5, 1), lengths("c", 0.0, 20, 5, 1)]
    adv = credit.group_advantages(group, scale_std=False, length_penalty={"output": 0.25, "input": 0.0, "turns": 0.0})
    assert [adv[r]["solver"] for r in "abc"] == pytest.approx([7 / 18, 11 / 36, -25 / 36])
    # the input and turns terms: the two-turn rollout with the longer context pays more, advantages stay centred
    group = [lengths("a", 1.0, 10, 5, 1), lengths("b", 1.0, 10, 40, 2)]
    ca = credit.CreditAssigner("grpo", {"scale_std": False, "length_penalty": {"output": 0.0, "input": 0.1,
                                                                               "turns": 0.1}})
    out = [r for s in group for r in ca.add(s.model_copy(update={"group_size": 2}), now=0.0)]
    by = {}
    for r in out:
        by[r.rollout_id] = r.advantage
    assert by["a"] > 0 > by["b"] and by["a"] + by["b"] == pytest.approx(0.0)
    # (b: 45 tokens of context of which 10 its own, 2 turns; a: 5 and 1) -> penalties 0.1 * (5/35 + 1/2), 0.1 * 2
    assert by["a"] == pytest.approx((0.2 - 0.1 * (5 / 35 + 0.5)) / 2)


def test_max_rl_divides_by_the_group_mean_and_gives_a_groups_without_success_nothing():
    group = [scored(f"r{i}", "g", r) for i, r in enumerate([1.0, 0.0, 0.0, 0.0])]
    adv = credit.group_advantages(group, scale_std=False, scale_mean=True)
    assert [adv[f"r{i}"]["solver"] for i in range(4)] == pytest.approx([3.0, -1.0, -1.0, -1.0])
    none = credit.group_advantages([scored(f"r{i}", "g", 0.0) for i in range(4)], scale_mean=True)
    assert all(a["solver"] == 0.0 for a in none.values())


def test_grpo_duplicate_rollout_does_not_complete_group():
    ca = credit.CreditAssigner("grpo")
    for _ in range(3):
        assert ca.add(scored("r0", "g", 1.0, size=2), now=0.0) == []


def test_grpo_timeout_flushes_with_reason():
    ca = credit.CreditAssigner("grpo", {"group_timeout_s": 10})
    ca.add(scored("a0", "ga", 1.0), now=0.0)
    ca.add(scored("a1", "ga", 0.0), now=1.0)
    ca.add(scored("b0", "gb", 1.0), now=2.0)
    recs, refused = ca.flush_expired(now=5.0)
    assert recs == [] and refused == []
    recs, refused = ca.flush_expired(now=12.5)
    assert {r.rollout_id for r in recs} == {"a0", "a1"} and recs[0].credit == "grpo:flushed(2/4,timeout)"
    assert len(refused) == 1 and "gb incomplete" in refused[0][1] and "1/4" in refused[0][1]
    assert ca.groups.groups == {}


def test_ema_per_member_baseline_and_state_roundtrip():
    ca = credit.CreditAssigner("ema_per_member", {"alpha": 0.5})
    a = ca.add(scored("x0", "g0", 1.0, size=1, member="aff"), 0)[0]
    b = ca.add(scored("x1", "g1", 1.0, size=1, member="aff"), 0)[0]
    c = ca.add(scored("x2", "g2", -1.0, size=1, member="neg"), 0)[0]
    assert (a.advantage, b.advantage, c.advantage) == (1.0, 0.0, -1.0)
    ca2 = credit.CreditAssigner("ema_per_member", {"alpha": 0.5})
    ca2.load_state(ca.state())
    assert ca2.add(scored("x3", "g3", 0.0, size=1, member="aff"), 0)[0].advantage == -1.0


def test_reinforce_baseline_per_environment():
    ca = credit.CreditAssigner("reinforce_baseline", {"alpha": 0.0})
    assert ca.add(scored("x0", "g0", 1.0, size=1), 0)[0].advantage == 1.0
    assert ca.add(scored("x1", "g1", 0.0, size=1), 0)[0].advantage == -1.0
    assert ca.add(scored("x2", "g2", 0.0, size=1, env="other@1"), 0)[0].advantage == 0.0


def test_admission_gates_keep_groups_without_signal_out_and_name_them():
    """prime-rl's advantage_range gate (its own cases: [0, 0] rejects all-zero advantages, admits [0, 0.2]; a
    tolerance rejects [-0.05, 0.05]; no advantages: admitted), then through the assigner: a group rewarded alike
    yields no record and is listed for its refund; a mixed one trains whole."""
    from schemas.plan import AdmissionGate

    zero, tolerance = AdmissionGate(name="zero_advantage"), AdmissionGate(name="low", reject_min=-0.1, reject_max=0.1)
    assert credit.gate_rejects([0.0, 0.0], [zero]) == "gate 'zero_advantage': all 2 advantages within [0, 0]"
    assert credit.gate_rejects([0.0, 0.2], [zero]) is None and credit.gate_rejects([], [zero]) is None
    assert credit.gate_rejects([-0.05, 0.0, 0.05], [zero, tolerance]).startswith("gate 'low'")
    with pytest.raises(ValueError, match="reject_min"):
        AdmissionGate(name="bad", reject_min=0.5, reject_max=0.1)

    ca = credit.CreditAssigner("grpo", gates=[zero])
    alike = [r for i in range(4) for r in ca.add(scored(f"a{i}", "ga", 1.0), now=0.0)]
    mixed = [r for i, rw in enumerate([1.0, 0.0, 1.0, 1.0]) for r in ca.add(scored(f"b{i}", "gb", rw), now=0.0)]
    assert alike == [] and len(mixed) == 4 and {r.group_id for r in mixed} == {"gb"}
    assert ca.withheld == [("ga", "run", "gate 'zero_advantage': all 4 advantages within [0, 0]")]
    # a group flushed on timeout is judged the same way
    ca.withheld.clear()
    ca.add(scored("c0", "gc", 0.0), now=0.0)
    ca.add(scored("c1", "gc", 0.0), now=0.0)
    assert ca.flush_expired(now=1e6) == ([], []) and [w[0] for w in ca.withheld] == ["gc"]
    with pytest.raises(ValueError, match="credits each rollout alone"):
        credit.CreditAssigner("reinforce_baseline", gates=[zero])


def test_a_group_whose_every_rollout_failed_gives_its_slots_back():
    """No record will ever come for it, so its batch slots go to another group (the service's AdmissionRefund);
    a group with one rollout that did not fail trains as before, and a per-rollout strategy refunds a group of
    one only (it cannot see the rest of a larger group)."""
    def failed(rid: str, group: str, size: int = 4):
        return scored(rid, group, 0.0, size=size).model_copy(update={"status": "failed", "trainable_steps": []})

    ca = credit.CreditAssigner("grpo")
    assert [r for i in range(4) for r in ca.add(failed(f"f{i}", "gf"), now=0.0)] == []
    assert [(g, why) for g, _, why in ca.withheld] == [
        ("gf", "every rollout of the group failed (4 of 4): nothing to train")]
    ca.withheld.clear()
    some = [r for i in range(3) for r in ca.add(failed(f"s{i}", "gs"), now=0.0)] + ca.add(scored("s3", "gs", 1.0), 0.0)
    assert len(some) == 1 and ca.withheld == []

    per_rollout = credit.CreditAssigner("reinforce_baseline")
    assert per_rollout.add(failed("p0", "gp", size=4), 0) == [] and per_rollout.withheld == []
    assert per_rollout.add(failed("p1", "g1", size=1), 0) == [] and [w[0] for w in per_rollout.withheld] == ["g1"]


def test_unknown_strategy_refused():
    with pytest.raises(ValueError, match="unknown credit strategy"):
        credit.CreditAssigner("ppo-magic")


# -- batching -------------------------------------------------------------------------------------------
def test_batcher_sizes_and_exactly_one_batch_per_record():
    b = Batcher(BatchPolicy(family="tiny", batch_records=4, flush_after_s=100))
    for i in range(10):
        assert b.add(testing.training_record(i), now=0.0) is None
    batches, refused = b.poll(testing.revision(0), now=1.0)
    assert [len(x.records) for x, _ in batches] == [4, 4] and refused == []
    batches2, _ = b.poll(testing.revision(0), now=200.0)  # flush the partial one
    ids = [r.record_id for x, _ in batches + batches2 for r in x.records]
    assert sorted(ids) == [f"rec-{i:06d}" for i in range(10)]
    assert all(verify_batch(x) == [] for x, _ in batches + batches2)


def test_a_partial_batch_waits_while_records_keep_arriving():
    """Records 4 s apart with flush_after_s 10: the batch fills (one step of 4) though its first record waited
    12 s; with no record for 10 s the short one is flushed. Before, the oldest record's wait flushed 3 at t=10."""
    b = Batcher(BatchPolicy(family="tiny", batch_records=4, flush_after_s=10))
    emitted = []
    for i, t in enumerate((0.0, 4.0, 8.0, 12.0, 16.0)):
        emitted += [len(x.records) for x, _ in b.poll(testing.revision(0), now=t)[0]]
        b.add(testing.training_record(i), now=t)
        emitted += [len(x.records) for x, _ in b.poll(testing.revision(0), now=t + 2.0)[0]]
    assert emitted == [4]
    assert b.poll(testing.revision(0), now=25.9)[0] == []  # the last record came at 16
    assert [len(x.records) for x, _ in b.poll(testing.revision(0), now=26.0)[0]] == [1]


def test_a_batch_waits_for_the_groups_it_owes_and_takes_the_oldest_records_first():
    """A slow admitted group (``owed``): the batch for its last target inside the bound is neither emitted nor
    flushed while it runs, then takes its records before newer ones, so they are not a batch late and refused."""
    b = Batcher(BatchPolicy(family="tiny", batch_records=4, max_off_policy_steps=1, flush_after_s=10))
    for i in range(3):
        b.add(testing.training_record(i, revision_=2), now=0.0)  # fast groups, generated at r2
    assert b.poll(testing.revision(2), now=20.0, owes=lambda r: 1) == ([], [])  # past flush_after_s: held
    b.add(testing.training_record(3, revision_=2), now=20.0)
    assert b.poll(testing.revision(2), now=20.0, owes=lambda r: 1) == ([], [])  # full: held
    for i in range(4, 6):
        b.add(testing.training_record(i, revision_=1), now=21.0)  # the slow group's, from r1 (1 behind r2)
    batches, refused = b.poll(testing.revision(2), now=21.0)
    assert refused == [] and [sorted(r.record_id for r in x.records) for x, _ in batches] == [
        ["rec-000000", "rec-000001", "rec-000004", "rec-000005"]]
    assert [it.record.record_id for it in b.items] == ["rec-000002", "rec-000003"]
    assert b.poll(testing.revision(2), now=40.0, coming=1) == ([], [])  # a partial batch waits for running groups
    assert b.poll(testing.revision(2), now=21.0, owes=lambda r: 1, flush=True)[0]  # a flush (the run's end) waits for nobody


def test_a_batch_ahead_of_the_trainer_is_held_for_what_its_own_revision_owes():
    """Pipelined, the batcher emits batches before the revision they are trained from is announced: each one asks
    ``owes`` with that revision (the target plus the batches ahead), else a second batch for target r1, trained
    from r2, would go out without the groups claimed at r1 and they would land in the third, past their bound. A
    batch the trainer dead-lettered is not ahead of it."""
    b = Batcher(BatchPolicy(family="tiny", batch_records=2, max_off_policy_steps=1, flush_after_s=100))
    asked: list[int] = []

    def owes(revision: int) -> int:
        asked.append(revision)
        return 0

    for i in range(4):
        b.add(testing.training_record(i, revision_=1), now=0.0)
    assert len(b.poll(testing.revision(1), now=0.0, owes=owes)[0]) == 2 and asked == [1, 2]
    for i in range(4, 6):
        b.add(testing.training_record(i, revision_=1), now=0.0)
    asked.clear()
    b.poll(testing.revision(2), now=0.0, owes=owes)  # r2 announced: one of the two trained, the other ahead
    assert asked[0] == 3 and b.ahead(testing.revision(2)) == 2
    assert b.ahead(testing.revision(2), dropped=1) == 1 and b.ahead(testing.revision(4)) == 0


async def test_the_batcher_task_owes_a_place_to_a_running_group_and_none_to_one_whose_records_came():
    """``BatcherTask`` over the admissions book (here a ``MemoryLedger``'s): a group claimed at r0 and still running
    holds the batch for r1; its records coming first, before the ledger folds its claim, still count as come."""
    from types import SimpleNamespace

    from consumers.settings import ServiceSettings
    from consumers.tasks.batcher import BatcherTask
    from schemas.admission import AdmissionClaim, AdmissionDone
    from streams.admissions import MemoryLedger

    ledger = MemoryLedger()
    cfg = ServiceSettings(family=testing.FAMILY, batch_records=4, flush_after_s=30, max_off_policy_steps=1)
    task = BatcherTask(0, cfg, SimpleNamespace(latest={testing.FAMILY: testing.revision(1)}, check=lambda: None),
                       SimpleNamespace(count=0, check=lambda: None), ledger=ledger)

    def claim(group: str) -> AdmissionClaim:
        return AdmissionClaim(run_id="run", producer="a", claim_id=group, arena_id="a", family=testing.FAMILY,
                              group_id=group, rollouts=4, seen_revision=0, batch_size=4, max_off_policy_steps=1,
                              lease_s=60)

    for i in range(3):  # group g-0's records come before the ledger has its claim
        task._add(SimpleNamespace(offset=i), testing.training_record(i, revision_=1))
    assert task.tick(0.0) == []  # not a whole batch
    await ledger.append(claim("g-0"))
    await ledger.append(claim("g-1"))  # running
    assert task.tick(0.0) == []
    await ledger.append(AdmissionDone(run_id="run", producer="a", claim_id="g-1", arena_id="a"))
    assert task.tick(0.0) == []  # done: its records are in scoring and credit
    for i in range(4, 8):
        task._add(SimpleNamespace(offset=i), testing.training_record(i, revision_=0))
    outs = task.tick(0.0)
    assert [{r.group_id for r in o.event.records} for o in outs] == [{"g-1"}]  # the oldest first; g-0 owed nothing


async def test_a_partial_batch_that_uses_up_every_admission_says_so_on_the_ledger():
    """Two groups of four, one rollout of the second failed: once nothing is coming, the three records left go out
    as a partial batch with an ``AdmissionRebase`` in the same outputs (the revision the next batch is trained from,
    the claims used up). Folded, the arenas' book counts from there, so the run's last revision gets its batch.
    Before, those slots still counted as a batch to come: the chaos run stopped at r4 of 5."""
    import time
    from types import SimpleNamespace

    from consumers.settings import ServiceSettings
    from consumers.tasks.batcher import BatcherTask
    from schemas.admission import AdmissionClaim, AdmissionDone, AdmissionRebase
    from streams.admissions import MemoryLedger
    from streams import topics

    ledger = MemoryLedger()
    cfg = ServiceSettings(family=testing.FAMILY, batch_records=4, flush_after_s=30, max_off_policy_steps=1)
    task = BatcherTask(0, cfg, SimpleNamespace(latest={testing.FAMILY: testing.revision(1)}, check=lambda: None),
                       SimpleNamespace(count=0, check=lambda: None), ledger=ledger)
    for g in ("g-0", "g-1"):
        await ledger.append(AdmissionClaim(run_id="run", producer="a", claim_id=g, arena_id="a", family=testing.FAMILY,
                                           group_id=g, rollouts=4, seen_revision=0, batch_size=4,
                                           max_off_policy_steps=1, lease_s=60))
        await ledger.append(AdmissionDone(run_id="run", producer="a", claim_id=g, arena_id="a"))
    for i in range(7):  # g-0 whole, g-1 without ro-7
        task._add(SimpleNamespace(offset=i), testing.training_record(i, revision_=1))
    outs = task.tick(time.monotonic())
    assert [len(o.event.records) for o in outs] == [4]  # the whole batch; no rebase: records still wait
    assert task.tick(time.monotonic()) == []  # the partial one waits for flush_after_s
    outs = task.tick(time.monotonic() + 31)
    assert [type(o.event).__name__ for o in outs] == ["TrainerBatch", "AdmissionRebase"]
    assert len(outs[0].event.records) == 3 and outs[1].topic == topics.ADMISSIONS.name
    rebase = outs[1].event
    assert (rebase.revision, rebase.claims, rebase.family) == (3, 2, testing.FAMILY)  # batches from r1 and r2
    await ledger.append(rebase)
    assert ledger.book.admitted(testing.FAMILY) == 0 and ledger.book.base_revision(testing.FAMILY, 0) == 3
    assert isinstance(rebase, AdmissionRebase)


def test_batcher_token_budget():
    b = Batcher(BatchPolicy(family="tiny", batch_records=None, batch_tokens=20, flush_after_s=100))
    for i in range(5):
        b.add(testing.training_record(i, n=8), now=0.0)
    batches, _ = b.poll(testing.revision(0), now=0.0)
    assert [x.completion_tokens for x, _ in batches] == [24]


def test_a_batch_never_outgrows_one_message():
    """128 records of 1,024 tokens are 1.4 MB encoded: with a message limit of 100 KB the batcher emits smaller
    steps at once (not waiting for a flush), each one message the broker takes, and every record exactly once. Before,
    a batch over the trainer-batches topic's limit was refused by the broker and retried for ever."""
    from schemas import codec

    limit = 100_000
    b = Batcher(BatchPolicy(family="tiny", batch_records=128, max_batch_bytes=limit, flush_after_s=100))
    for i in range(40):
        b.add(testing.training_record(i, n=1024), now=0.0)
    batches, _ = b.poll(testing.revision(0), now=0.0)
    sizes = [len(codec.encode(x)) for x, _ in batches]
    assert len(batches) == 4 and all(limit * 0.7 < n <= limit for n in sizes), sizes  # 8 records of ~10 KB each
    rest, _ = b.poll(testing.revision(0), now=200.0)
    assert sorted(r.record_id for x, _ in batches + rest for r in x.records) == [f"rec-{i:06d}" for i in range(40)]
    assert all(len(codec.encode(x)) <= limit for x, _ in rest)


def test_batcher_refuses_stale_and_cross_family_with_reasons_waits_for_future():
    b = Batcher(BatchPolicy(family="tiny", batch_records=2, max_off_policy_steps=1, flush_after_s=0))
    assert b.add(testing.training_record(0, revision_=0), 0) is None
    assert b.add(testing.training_record(1, revision_=2), 0) is None
    assert b.add(testing.training_record(2, revision_=3), 0) is None   # ahead of target r2: waits
    r = b.add(testing.training_record(3, family="other"), 0)
    assert r is not None and r.error_type == "CrossFamilyMixError"
    batches, refused = b.poll(testing.revision(2), now=1.0)
    assert [x.error_type for x in refused] == ["StaleRecordError"] and "2 revisions behind" in refused[0].reason
    assert [[r.record_id for r in x.records] for x, _ in batches] == [["rec-000001"]]
    assert [it.record.record_id for it in b.items] == ["rec-000002"]
    assert b.refused == {"stale": 1, "cross_family": 1}
    batches, _ = b.poll(testing.revision(3), now=2.0)
    assert batches[0][0].target.revision == 3


def test_batcher_refuses_a_record_whose_revision_is_never_announced():
    """Issue 24, hole 5: records ahead of the target (or with no target at all) wait ``ahead_timeout_s`` at most,
    then are refused with the reason: the buffer, and the snapshot of its offsets, cannot grow without bound."""
    b = Batcher(BatchPolicy(family="tiny", batch_records=2, flush_after_s=0, ahead_timeout_s=60))
    b.add(testing.training_record(0, revision_=5), 0)   # ahead of r2, for good
    b.add(testing.training_record(1, revision_=7), 30)  # arrives before any revision is known
    assert b.poll(None, now=59) == ([], [])
    _, refused = b.poll(None, now=61)
    assert [(r.error_type, r.item.record.record_id) for r in refused] == [("AheadOfTargetError", "rec-000000")]
    assert "target: none" in refused[0].reason and "waited 61s" in refused[0].reason
    assert b.poll(testing.revision(2), now=89) == ([], [])
    _, refused = b.poll(testing.revision(2), now=90)
    assert [r.item.record.record_id for r in refused] == ["rec-000001"] and "target: r2" in refused[0].reason
    assert b.items == [] and b.refused == {"ahead": 2}


def test_batcher_never_emits_empty_or_without_target():
    b = Batcher(BatchPolicy(family="tiny", batch_records=2, flush_after_s=0))
    assert b.poll(testing.revision(0), now=1.0, flush=True) == ([], [])
    assert b.refused["empty_batch"] == 1
    b.add(testing.training_record(0), 0)
    assert b.poll(None, now=10.0) == ([], [])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 30)), min_size=1, max_size=60), st.integers(1, 9))
def test_batcher_every_record_exactly_once_or_refused(recs, size):
    b = Batcher(BatchPolicy(family="tiny", batch_records=size, max_off_policy_steps=2, flush_after_s=1))
    for i, (rev, n) in enumerate(recs):
        b.add(testing.training_record(i, revision_=rev, n=n), now=0.0)
    out, refused = [], []
    for target, now in ((3, 0.5), (4, 0.5), (5, 10.0)):
        bs, rf = b.poll(testing.revision(target), now=now)
        out += [r.record_id for x, _ in bs for r in x.records]
        refused += [x.item.record.record_id for x in rf]
    assert len(out) == len(set(out))
    assert sorted(out + refused) == sorted(f"rec-{i:06d}" for i in range(len(recs)))


# -- the specs the arena's example environments write (producers/environments/examples) --------------------------------
async def test_exact_match_member_and_last_integer_params():
    spec = ScoringSpec(kind="exact_match", answer="12", params={"member": "solver", "extract": "last_integer"})
    ro, steps = one(spec.model_dump(mode="json"), text="3*4 gives 12, so the answer: 12.")
    assert (await scoring.score(ro, steps)).rewards == {"solver": 1.0}


def test_monte_carlo_target_pass_rate_and_invalid_proposal():
    spec = ScoringSpec(kind="monte_carlo", params={"proposer": "proposer", "child_member": "solver",
                                                   "target_pass_rate": 0.5, "proposal_valid": True})
    ro = Rollout(run_id="run", producer="t", rollout_id="p", episode_type="proposer", environment="ps@1",
                 example_id="e", seed={}, step_ids=[], child_rollout_ids=["c0", "c1"],
                 members={"proposer": True}, artifacts={"scoring": spec.model_dump(mode="json")}, group_id="g",
                 root_group_id="g", group_size=1, policy=PolicyRef(family="tiny", revision=0), status="completed")
    assert scoring.monte_carlo(ro, spec, [1.0, 0.0]).rewards == {"proposer": 1.0}
    assert scoring.monte_carlo(ro, spec, [1.0, 1.0]).rewards == {"proposer": 0.0}
    bad = spec.model_copy(update={"params": {**spec.params, "proposal_valid": False, "invalid_reward": -1.0}})
    assert scoring.monte_carlo(ro, bad, [1.0, 0.0]).rewards == {"proposer": -1.0}


async def test_zero_sum_judge_prompt_template_and_bare_name_reply():
    seen = {}

    async def judge(target, messages):
        seen["prompt"] = messages[-1]["content"]
        return "debater_b"

    spec = ScoringSpec(kind="zero_sum_judge", judge_target="judge", players=["debater_a", "debater_b"],
                       params={"topic": "cats", "judge_prompt": "Topic: {topic}\n{transcript}\nWho won?"})
    pol = PolicyRef(family="tiny", revision=0)
    steps = [testing.step("d", "g", 0, "debater_a", "yes", policy=pol),
             testing.step("d", "g", 1, "debater_b", "no", policy=pol)]
    ro = Rollout(run_id="run", producer="t", rollout_id="d", episode_type="debate", environment="debate@1",
                 example_id="e", seed={}, step_ids=[s.step_id for s in steps],
                 members={"debater_a": True, "debater_b": True}, artifacts={"scoring": spec.model_dump(mode="json")},
                 group_id="g", root_group_id="g", group_size=1, policy=pol, status="completed")
    v = await scoring.score(ro, steps, judge=judge)
    assert v.rewards == {"debater_a": -1.0, "debater_b": 1.0}
    assert seen["prompt"].startswith("Topic: cats\n[debater_a] yes")


async def test_verifier_task_scores_parent_after_children_and_dead_letters_bad_input():
    """VerifierTask joins steps with rollouts across records, in any order, and waits for children."""
    from consumers.settings import ServiceSettings
    from consumers.tasks.verifier import VerifierTask
    from schemas import codec
    from streams import topics

    pol = PolicyRef(family="tiny", revision=0)
    spec = ScoringSpec(kind="monte_carlo", params={"proposer": "proposer", "target_pass_rate": 0.5})
    pstep = testing.step("p", "g", 0, "proposer", "Q: 1+1 A: 2", policy=pol)
    parent = Rollout(run_id="run", producer="t", rollout_id="p", episode_type="proposer", environment="ps@1",
                     example_id="e", seed={}, step_ids=[pstep.step_id], child_rollout_ids=["c0", "c1"],
                     members={"proposer": True}, artifacts={"scoring": spec.model_dump(mode="json")}, group_id="g",
                     root_group_id="g", group_size=1, policy=pol, status="completed")
    kids = []
    for i, text in enumerate(["2", "3"]):
        st = testing.step(f"c{i}", "g", 0, "solver", text, policy=pol)
        kid = Rollout(run_id="run", producer="t", rollout_id=f"c{i}", episode_type="single", environment="ps@1",
                      example_id="e", seed={}, step_ids=[st.step_id], members={"solver": True},
                      artifacts={"scoring": {"kind": "exact_match", "answer": "2"}}, parent_rollout_id="p",
                      group_id="gc", root_group_id="g", group_size=2, policy=pol, status="completed")
        kids.append((st, kid))

    class Rec:
        def __init__(self, topic, offset, value):
            self.topic, self.partition, self.offset, self.value, self.key, self.headers = topic, 0, offset, value, b"g", []

    task = VerifierTask(0, ServiceSettings())
    order = [(topics.ROLLOUTS.name, parent), (topics.STEPS.name, kids[0][0]), (topics.ROLLOUTS.name, kids[0][1]),
             (topics.STEPS.name, pstep), (topics.ROLLOUTS.name, kids[1][1]), (topics.STEPS.name, kids[1][0])]
    outs = []
    for off, (t, ev) in enumerate(order):
        outs += await task.process(Rec(t, off, codec.encode(ev)))
    outs += await task.process(Rec(topics.STEPS.name, 99, b"not a frame"))
    scored = {o.event.rollout_id: o.event for o in outs if o.event.EVENT_TYPE == "rollout_scored"}
    assert scored["c0"].rewards == {"solver": 1.0} and scored["c1"].rewards == {"solver": 0.0}
    assert scored["p"].rewards == {"proposer": 1.0}  # pass rate 0.5 hits the target
    assert [o.event.EVENT_TYPE for o in outs][-1] == "dead_letter" and outs[-1].event.origin_offset == 99
    assert task.buffered() == {topics.STEPS.name: [], topics.ROLLOUTS.name: []} and task.state() == {}

    # Issue 24, hole 5: children whose parent never comes are forgotten after children_timeout_s; a parent that
    # times out takes its children's outcomes with it. Neither stays in the state (and its snapshots) for good.
    task = VerifierTask(0, ServiceSettings(children_timeout_s=60, step_timeout_s=30))
    await task.process(Rec(topics.STEPS.name, 0, codec.encode(kids[0][0])))
    await task.process(Rec(topics.ROLLOUTS.name, 1, codec.encode(kids[0][1])))
    assert task.state() == {"children": {"p": {"c0": 1.0}}}
    t0 = task.children_seen["p"]
    assert task.tick(t0 + 59) == [] and task.state() != {}
    assert task.tick(t0 + 60) == [] and task.state() == {}
    await task.process(Rec(topics.ROLLOUTS.name, 2, codec.encode(parent)))  # too late: waits, then times out
    await task.process(Rec(topics.STEPS.name, 3, codec.encode(pstep)))
    await task.process(Rec(topics.STEPS.name, 4, codec.encode(kids[1][0])))
    await task.process(Rec(topics.ROLLOUTS.name, 5, codec.encode(kids[1][1])))
    assert task.state() == {"children": {"p": {"c1": 0.0}}}
    outs = task.tick(time.monotonic() + 31)
    assert [(o.event.EVENT_TYPE, o.event.error_type) for o in outs] == [("dead_letter", "Timeout")]
    assert "1 children unscored" in outs[0].event.error_message
    assert task.state() == {} and task.buffered() == {topics.STEPS.name: [], topics.ROLLOUTS.name: []}


async def test_a_derived_verifier_scores_its_own_held_out_answers_and_not_its_sources():
    """A derived run's verifier reads its source's topics and its own: the source's training rollouts are
    re-scored (and name their source), the source's held-out answers are left to the source run, and the derived
    run's own held-out answers are scored as the environment scores them (not re-scored)."""
    from consumers.settings import ServiceSettings
    from consumers.tasks.verifier import VerifierTask
    from schemas import codec
    from schemas.history import Derivation, Rescore
    from schemas.scoring import WeightedFunc
    from streams import topics

    pol = PolicyRef(family="tiny", revision=0)
    derivation = Derivation(run_id="b", source_run_id="a", source_prefix="src.", fork=pol,
                            rescore=Rescore(kind="rubric", funcs=[WeightedFunc(fn="tests._rewards:buggy_sum")]))
    task = VerifierTask(0, ServiceSettings(derivation=derivation))
    src_steps, src_rollouts = "src." + topics.STEPS.key, "src." + topics.ROLLOUTS.key
    assert task.steps_topics == (src_steps, topics.STEPS.name)

    def rollout(rid: str, run: str, evaluation: bool) -> tuple[Step, Rollout]:
        st = testing.step(rid, rid, 0, "solver", "2", policy=pol, run_id=run, prompt_text="1+1=")
        return st, Rollout(run_id=run, producer="t", rollout_id=rid, episode_type="single", environment="e@1",
                           example_id="x", seed={}, step_ids=[st.step_id], members={"solver": True},
                           artifacts={"scoring": {"kind": "exact_match", "answer": "2"}}, group_id=rid,
                           root_group_id=rid, group_size=1, policy=pol, status="completed", evaluation=evaluation)

    class Rec:
        def __init__(self, topic, offset, value):
            self.topic, self.partition, self.offset, self.value, self.key, self.headers = topic, 0, offset, value, b"g", []

    cases = [(src_steps, src_rollouts, rollout("train", "a", False)), (src_steps, src_rollouts, rollout("held", "a", True)),
             (topics.STEPS.name, topics.ROLLOUTS.name, rollout("own", "b", True)),
             (topics.STEPS.name, topics.ROLLOUTS.name, rollout("other", "c", True))]
    outs = []
    for off, (steps_topic, rollouts_topic, (st, ro)) in enumerate(cases):
        outs += await task.process(Rec(steps_topic, off, codec.encode(st)))
        outs += await task.process(Rec(rollouts_topic, off, codec.encode(ro)))
    assert [o.event.EVENT_TYPE for o in outs] == ["rollout_scored"] * 2, [getattr(o.event, "error_message", "")
                                                                         for o in outs]
    scored = {o.event.rollout_id: o.event for o in outs}
    assert set(scored) == {"train", "own"}  # the source's held-out answer and another run's are not taken
    assert scored["train"].source is not None and scored["train"].source.topic == src_rollouts
    assert scored["own"].source is None and scored["own"].run_id == "b" and scored["own"].evaluation
    assert scored["train"].rewards == {"solver": 0.0}  # re-scored (the buggy sum never rewards the sum)
    assert scored["own"].rewards == {"solver": 1.0}  # the environment's exact match, not the re-scoring
    assert all(not offsets for offsets in task.buffered().values())


@pytest.mark.parametrize("credit, held", [("grpo", False), ("per_step", True), ("reinforce_baseline", True)])
async def test_a_group_credited_rollout_by_rollout_is_owed_until_all_its_rollouts_came(credit: str, held: bool):
    """Per-rollout strategies emit each rollout as it is scored: two rollouts of a four-rollout group on hand do
    not make the group come, so the batch for r1 waits for the other two (before, the group stopped being owed at
    its first record, and its other rollouts landed a batch later, refused as stale). A group strategy credits the
    group in one transaction: its first record is the whole group."""
    from types import SimpleNamespace

    from consumers.settings import ServiceSettings
    from consumers.tasks.batcher import BatcherTask
    from schemas.admission import AdmissionClaim, AdmissionDone
    from streams.admissions import MemoryLedger

    ledger = MemoryLedger()
    cfg = ServiceSettings(family=testing.FAMILY, batch_records=2, flush_after_s=30, max_off_policy_steps=1,
                          credit=credit)
    task = BatcherTask(0, cfg, SimpleNamespace(latest={testing.FAMILY: testing.revision(1)}, check=lambda: None),
                       SimpleNamespace(count=0, check=lambda: None), ledger=ledger)
    await ledger.append(AdmissionClaim(run_id="run", producer="a", claim_id="c0", arena_id="a", family=testing.FAMILY,
                                       group_id="g-0", rollouts=4, seen_revision=0, batch_size=2,
                                       max_off_policy_steps=1, lease_s=60))
    await ledger.append(AdmissionDone(run_id="run", producer="a", claim_id="c0", arena_id="a"))
    for i in range(2):  # rollouts ro-0, ro-1 of g-0: a whole batch of two records
        task._add(SimpleNamespace(offset=i), testing.training_record(i, revision_=0))
    assert (task.tick(0.0) == []) is held
    if held:
        for i in (2, 3):
            task._add(SimpleNamespace(offset=i), testing.training_record(i, revision_=0))
        outs = task.tick(0.0)
        assert sorted(r.rollout_id for o in outs for r in o.event.records) == ["ro-0", "ro-1", "ro-2", "ro-3"]


def test_echo_spans_are_the_environments_tokens_since_the_members_previous_call():
    """prime-rl's echo, per member: a later call's prompt tokens after what it shares with the previous call's
    prompt and completion, weighted by their role's alpha. A first call, a role not enabled, a turn of roles with
    different weights, and a prompt that re-renders the history get none."""
    from consumers.credit import echo_spans
    from schemas.events import ChatMessage, Step, StepTokens
    from schemas.policy import PolicyRef

    def st(sid, member, prompt, completion, roles=None):
        return StepTokens(step_id=sid, member_id=member, policy=PolicyRef(family="f", revision=0),
                          prompt_token_ids=np.array(prompt, np.int32), completion_token_ids=np.array(completion, np.int32),
                          completion_logprobs=np.zeros(len(completion), np.float32), observation_roles=roles)

    steps = [st("a1", "a", [1, 2, 3], [4, 5]), st("b1", "b", [1, 2], [8]),
             st("a2", "a", [1, 2, 3, 4, 5, 20, 21, 22], [6], ["user"]),  # feedback 20-22
             st("b2", "b", [1, 2, 8, 30, 31], [9], ["tool", "user"]),  # mixed roles, one weight each
             st("a3", "a", [1, 2, 3, 4, 5, 20, 21, 22, 6, 40], [7], ["tool"]),  # tool not enabled below
             st("a4", "a", [1, 2, 99, 6, 7, 50], [8], ["user"])]  # history re-rendered
    assert {k: [(s.start, s.end, s.weight) for s in v] for k, v in echo_spans(steps, {"user": 0.5}).items()} == {
        "a2": [(5, 8, 0.5)]}
    same = echo_spans(steps, {"user": 0.1, "tool": 0.1})
    assert [(s.start, s.end) for s in same["b2"]] == [(3, 5)] and [(s.start, s.end) for s in same["a3"]] == [(9, 10)]
    assert "b2" not in echo_spans(steps, {"user": 0.1, "tool": 0.2})  # no token boundary between the two roles
    # the roles come from the Step's prompt: the messages after its last assistant message
    msgs = [ChatMessage(role="system", content="s"), ChatMessage(role="user", content="q"),
            ChatMessage(role="assistant", content="a"), ChatMessage(role="tool", content="t"),
            ChatMessage(role="user", content="u")]
    base = testing.step("ro", "g", 1, "a", "x", policy=PolicyRef(family="f", revision=0))
    assert StepTokens.of(base.model_copy(update={"prompt": msgs})).observation_roles == ["tool", "user"]
    assert StepTokens.of(base.model_copy(update={"prompt": msgs[:2]})).observation_roles is None
    assert isinstance(base, Step)
