"""The GenerationPlan compiler: real prime-rl recipes unchanged, our example plans, and refusals."""

from __future__ import annotations

import hashlib
import re
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from schemas.errors import ContractError
from schemas.plan import (DEFAULT_MAX_OFF_POLICY_STEPS, LEARNER, AdmissionGate, GenerationPlan, PlanError,
                          admission_gates, credit_strategy, references)
from schemas.objectives import Reference
from schemas.plan_compiler import compile_plan, compile_plan_dict

REPO = Path(__file__).resolve().parents[1]
PEER = Path(__file__).resolve().parent / "fixtures" / "prime-rl"  # real recipes, vendored unchanged (see its README)
PEER_2026 = Path(__file__).resolve().parent / "fixtures" / "prime-rl-2026-08"  # today's format (see its README)
EXAMPLES = REPO / "examples" / "plans"


def peer(name: str) -> GenerationPlan:
    return compile_plan(PEER / name)


def test_all_peer_recipes_and_examples_compile() -> None:
    files = sorted(PEER.glob("*.toml")) + sorted(EXAMPLES.glob("*.toml"))
    assert len(files) >= 7
    for f in files:
        plan = compile_plan(f)
        assert plan.source == str(f)
        assert LEARNER in plan.targets and plan.targets[LEARNER].model == plan.family
        assert plan.environments


def test_legacy_orchestrator_only_recipe() -> None:
    plan = peer("orch-legacy-acereason-math.toml")
    assert plan.family == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    assert [e.id for e in plan.environments] == ["acereason-math"]
    assert plan.group_size == 8 and plan.batch_size == 1024
    assert plan.learner.sampling == {"temperature": 0.6, "max_tokens": 8192}
    assert plan.learner.base_urls == []  # the run's default endpoint
    assert plan.max_off_policy_steps == DEFAULT_MAX_OFF_POLICY_STEPS == 8
    assert plan.provenance["max_off_policy_steps"] == "default"
    assert plan.fixed_targets == {} and plan.train_one is None
    assert plan.ignored_keys == [] and plan.refused == []
    assert (plan.max_steps, plan.seq_len) == (500, 8192)  # applied: the run's length, the server's context
    target, trainable = plan.route("anyone", "r-1", 0)
    assert target.name == LEARNER and trainable


def test_unified_reverse_text_recipe() -> None:
    plan = peer("rl-unified-reverse-text.toml")
    assert plan.family == "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT"
    assert plan.group_size == 16 and plan.batch_size == 128
    assert plan.learner.sampling == {"max_tokens": 128}  # max_completion_tokens normalised
    env = plan.environments[0]
    assert env.id == "reverse-text" and env.name == "reverse-text"  # id from taskset.id
    assert env.options["harness"] == {"id": "null", "runtime": {"type": "subprocess"}}
    assert set(plan.ignored_sections) == {"deployment", "wandb", "ckpt", "inference", "orchestrator.renderer"}
    assert plan.trainer == {"lr": 3e-6} and plan.max_steps == 20 and plan.refused == []


def test_debate_external_opponent_recipe() -> None:
    plan = peer("rl-debate-external-opponent.toml")
    assert plan.family == "Qwen/Qwen3-4B-Instruct-2507"
    assert set(plan.targets) == {LEARNER, "opponent", "judge"}
    judge = plan.targets["judge"]
    assert judge.model == "gpt-4.1-mini" and judge.base_urls == ["https://api.openai.com/v1"]
    assert judge.api_key_var == "OPENAI_API_KEY" and judge.request_mode == "chat"
    assert judge.sampling == {"temperature": 0.0, "max_tokens": 1024}
    assert plan.targets["opponent"].sampling == {"temperature": 0.0}
    assert plan.members == {"judge": plan.members["judge"]} and not plan.members["judge"].trainable
    assert plan.train_one is not None and plan.train_one.members == ["debater_a", "debater_b"]
    assert plan.train_one.unselected == "opponent"
    assert plan.learner.timeout_s == 3600.0 and plan.learner.sampling == {"temperature": 1.0, "max_tokens": 8192}
    assert plan.advantage.type == "ema_per_member" and plan.advantage.params == {"momentum": 0.9}
    assert plan.group_size == 4 and plan.batch_size == 128
    assert {"wandb", "ckpt", "orchestrator.renderer"} <= set(plan.ignored_sections)
    # [inference.model] max_model_len is the server's context (applied); the rest of [inference] is prime-rl's GPUs
    assert plan.server == {"max_model_len": 8192} and "inference.gpu_memory_utilization" in plan.ignored_keys
    # run-changing keys nothing here applies: refused when a run starts, never listed as ignored
    assert any(r.startswith("orchestrator.oversampling_factor: ") for r in plan.refused)
    assert "orchestrator.oversampling_factor" not in plan.ignored_keys
    [ev] = plan.eval_environments  # evaluation, not training
    assert ev.evaluation and ev.name == "gpqa-debate-eval" and ev.options["group_size"] == 2
    assert ev.options["num_examples"] == 32 and "interval" not in ev.options  # the [eval] block's: the plan's
    assert plan.eval_interval == 25 and not plan.eval_skip_first_step
    assert credit_strategy(plan) == ("ema_per_member", {"alpha": 0.9})  # the fork's momentum is our alpha


def test_train_one_picks_exactly_one_learner_seat_deterministically() -> None:
    plan = peer("rl-debate-external-opponent.toml")
    seats = ["debater_a", "debater_b", "judge"]
    picks = Counter()
    for i in range(400):
        rid, seed = f"rollout-{i}", 7
        chosen = plan.selected_member(rid, seed)
        want = plan.train_one.members[int(hashlib.sha256(f"{seed}:{rid}".encode()).hexdigest(), 16) % 2]
        assert chosen == want == plan.selected_member(rid, seed)  # replay picks the same seat
        assert plan.trainable_members(seats, rid, seed) == {chosen}
        other = "debater_b" if chosen == "debater_a" else "debater_a"
        assert plan.route(chosen, rid, seed) == (plan.learner, True)
        assert plan.route(other, rid, seed) == (plan.targets["opponent"], False)
        assert plan.route("judge", rid, seed) == (plan.targets["judge"], False)
        picks[chosen] += 1
    assert 150 < picks["debater_a"] < 250  # both seats get trained


def test_debate_selfplay_recipe() -> None:
    plan = peer("rl-debate-selfplay.toml")
    assert plan.group_size == 4 and plan.learner.sampling == {"temperature": 1.0, "max_tokens": 1024}
    assert plan.environments[0].args["truth_member"] == "debater_a"
    assert plan.selected_member("r", 1) is None
    assert plan.trainable_members(["debater_a", "debater_b", "judge"], "r", 1) == {"debater_a", "debater_b"}
    assert plan.route("judge", "r", 1) == (plan.learner, False)  # drop_judge: served, never trained
    assert {r.split(":")[0] for r in plan.refused} >= {"orchestrator.buffer.easy_threshold",
                                                       "orchestrator.val.interval"}
    assert [e.name for e in plan.eval_environments] == ["gpqa-debate-eval"]
    assert plan.eval_environments[0].options["group_size"] == 2  # its rollouts_per_example


def test_example_plans() -> None:
    arith = compile_plan(EXAMPLES / "arithmetic.toml")
    assert arith.family == "tiny-byte-lm" and arith.environments[0].id == "arithmetic"
    assert arith.max_off_policy_steps == 2 and arith.learner.base_urls == []
    assert arith.ignored_sections == []

    debate = compile_plan(EXAMPLES / "debate.toml")
    assert debate.train_one.members == ["debater_a", "debater_b"] and debate.train_one.unselected == "opponent"
    assert debate.members["judge"].target == "judge"
    assert debate.targets["opponent"].base_urls == ["http://127.0.0.1:8000/v1"]
    for i in range(20):
        assert len(debate.trainable_members(["debater_a", "debater_b", "judge"], f"r{i}", 0)) == 1

    ps = compile_plan(EXAMPLES / "proposer_solver.toml")
    assert ps.trainable_members(["proposer", "solver"], "r", 0) == {"proposer", "solver"}
    assert all(ps.route(m, "r", 0)[0].name == LEARNER for m in ("proposer", "solver", "other"))


def test_plan_round_trips_through_json() -> None:
    plan = peer("rl-debate-external-opponent.toml")
    assert GenerationPlan.model_validate_json(plan.model_dump_json()) == plan


@pytest.mark.parametrize("train_one,expected", [
    ({"members": [], "unselected": "opponent"}, "train_one.members: empty"),
    ({"members": ["debater_a", "debater_a"], "unselected": "opponent"}, "train_one.members: repeats ['debater_a']"),
    ({"members": ["debater_a", "judge"], "unselected": "opponent"}, "['judge'] are train_one candidates"),
    ({"members": ["debater_a"], "unselected": LEARNER}, "train_one.unselected: 'learner' names no fixed target"),
])
def test_a_plan_from_json_is_held_to_the_compilers_train_one_rules(train_one: dict, expected: str) -> None:
    """The plan's validator and the compiler share one train_one check (TrainOne.problem)."""
    data = compile_plan(EXAMPLES / "debate.toml").model_dump(mode="json")
    with pytest.raises(ValueError, match=re.escape(expected)):
        GenerationPlan.model_validate({**data, "train_one": train_one})


def test_staleness_keys() -> None:
    base = {"model": {"name": "m"}, "environment": {"id": "e"}}
    assert compile_plan_dict({**base, "max_async_level": 3}, "x.toml").max_off_policy_steps == 3
    plan = compile_plan_dict({**base, "max_async_level": 1, "max_off_policy_steps": 4}, "x.toml")
    assert (plan.max_off_policy_steps, plan.max_async_level) == (4, 1)
    unified = {"model": {"name": "m"}, "max_async_level": 2,
               "orchestrator": {"train": {"env": [{"id": "e"}]}}}
    assert compile_plan_dict(unified, "u.toml").max_off_policy_steps == 2
    unified["orchestrator"]["max_off_policy_steps"] = 5
    assert compile_plan_dict(unified, "u.toml").max_off_policy_steps == 5


def test_learner_client_base_url() -> None:
    data = {"model": {"name": "m"}, "orchestrator": {"client": {"base_url": "http://h:1/v1", "api_key_var": "K",
                                                                 "max_connections": 4},
                                                      "env": [{"id": "e"}]}}
    plan = compile_plan_dict(data, "c.toml")
    assert plan.learner.base_urls == ["http://h:1/v1"] and plan.learner.api_key_var == "K"
    assert "orchestrator.client.max_connections" in plan.ignored_keys


# -- refusals: each names the field and the file --------------------------------------------------

GOOD_HEAD = """
[model]
name = "tiny-byte-lm"

[orchestrator]
group_size = 4

[[orchestrator.train.env]]
id = "arithmetic"
"""

DEBATE_TAIL = """
[orchestrator.multi_agent.fixed.opponent]
model = "m"
base_url = "http://127.0.0.1:8000/v1"
"""

MALFORMED = {
    "typo_in_sampling": ("""
[model]
name = "m"
[orchestrator.sampling]
temprature = 1
[[orchestrator.env]]
id = "e"
""", ["orchestrator.sampling.temprature", "did you mean 'temperature'"]),
    "typo_in_train_sampling": (GOOD_HEAD + """
[orchestrator.train.sampling]
max_token = 3
""", ["orchestrator.train.sampling.max_token", "max_tokens"]),
    "near_miss_in_orchestrator": (GOOD_HEAD.replace("group_size = 4", "group_szie = 4"),
                                  ["orchestrator.group_szie", "group_size"]),
    "typo_in_legacy_top_level": ("""
rollouts_per_exmaple = 8
[model]
name = "m"
[environment]
id = "e"
""", ["rollouts_per_exmaple", "rollouts_per_example"]),
    "unknown_env_key": (GOOD_HEAD.replace('id = "arithmetic"', 'id = "arithmetic"\nnmae = "x"'),
                        ["orchestrator.train.env[0].nmae", "'name'"]),
    "train_one_empty": (GOOD_HEAD + DEBATE_TAIL + """
[orchestrator.multi_agent.train_one]
members = []
unselected = "opponent"
""", ["orchestrator.multi_agent.train_one.members", "empty"]),
    "train_one_repeated": (GOOD_HEAD + DEBATE_TAIL + """
[orchestrator.multi_agent.train_one]
members = ["a", "b", "a"]
unselected = "opponent"
""", ["orchestrator.multi_agent.train_one.members", "repeats ['a']"]),
    "candidate_also_fixed": (GOOD_HEAD + DEBATE_TAIL + """
members = ["a"]
[orchestrator.multi_agent.train_one]
members = ["a", "b"]
unselected = "opponent"
""", ["orchestrator.multi_agent.train_one.members", "['a']", "statically routed"]),
    "unselected_names_no_fixed_target": (GOOD_HEAD + DEBATE_TAIL + """
[orchestrator.multi_agent.train_one]
members = ["a", "b"]
unselected = "opponnent"
""", ["orchestrator.multi_agent.train_one.unselected", "'opponnent' names no fixed target"]),
    "unselected_is_the_learner": (GOOD_HEAD + """
[orchestrator.multi_agent.train_one]
members = ["a", "b"]
unselected = "learner"
""", ["orchestrator.multi_agent.train_one.unselected", "names no fixed target"]),
    "member_with_no_target": (GOOD_HEAD + DEBATE_TAIL + """
[orchestrator.multi_agent.routes]
judge = "referee"
""", ["orchestrator.multi_agent.routes.judge", "has no target", "'referee'"]),
    "fixed_target_without_model": (GOOD_HEAD + """
[orchestrator.multi_agent.fixed.judge]
members = ["judge"]
base_url = "http://127.0.0.1:8000/v1"
""", ["orchestrator.multi_agent.fixed.judge.model", "no model"]),
    "member_in_two_fixed_targets": (GOOD_HEAD + DEBATE_TAIL + """
members = ["judge"]
[orchestrator.multi_agent.fixed.judge]
model = "m"
members = ["judge"]
""", ["orchestrator.multi_agent.fixed.judge.members", "already routed"]),
    "fixed_named_learner": (GOOD_HEAD + """
[orchestrator.multi_agent.fixed.learner]
model = "m"
""", ["orchestrator.multi_agent.fixed.learner", "reserved"]),
    "unknown_fixed_key": (GOOD_HEAD + DEBATE_TAIL + 'api_key = "sk-123"\n',
                          ["orchestrator.multi_agent.fixed.opponent.api_key", "api_key_var"]),
    "unknown_multi_agent_key": (GOOD_HEAD + """
[orchestrator.multi_agent]
train_onne = { members = ["a"] }
""", ["orchestrator.multi_agent.train_onne", "train_one"]),
    "no_model": ("""
[orchestrator]
[[orchestrator.train.env]]
id = "e"
""", ["model.name"]),
    "no_environment": ("""
[model]
name = "m"
[orchestrator]
batch_size = 8
""", ["orchestrator.train.source", "no training source"]),
    "group_size_not_integer": (GOOD_HEAD.replace("group_size = 4", 'group_size = "4"'),
                               ["orchestrator.group_size", "expected an integer"]),
    "group_size_conflict": (GOOD_HEAD.replace("group_size = 4", "group_size = 4\nrollouts_per_example = 8"),
                            ["orchestrator.group_size", "rollouts_per_example"]),
    "negative_staleness": (GOOD_HEAD.replace("group_size = 4", "max_off_policy_steps = -1"),
                           ["orchestrator.max_off_policy_steps", ">= 0"]),
    "max_tokens_conflict": (GOOD_HEAD + """
[orchestrator.train.sampling]
max_tokens = 8
max_completion_tokens = 16
""", ["orchestrator.train.sampling.max_completion_tokens", "conflicts"]),
    "two_sampling_sections": (GOOD_HEAD + """
[orchestrator.sampling]
temperature = 1.0
[orchestrator.train.sampling]
temperature = 0.5
""", ["orchestrator.sampling", "set only one"]),
    "env_without_id": (GOOD_HEAD.replace('id = "arithmetic"', 'name = "arith"'),
                       ["orchestrator.train.env[0].id", "no id"]),
    "not_toml": ("[model\nname = 1", ["not valid TOML"]),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_plans_name_field_and_file(case: str, tmp_path: Path) -> None:
    text, expected = MALFORMED[case]
    path = tmp_path / f"{case}.toml"
    path.write_text(textwrap.dedent(text))
    with pytest.raises(PlanError) as info:
        compile_plan(path)
    message = str(info.value)
    assert str(path) in message, message
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"
    assert isinstance(info.value, ContractError)


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="nope.toml"):
        compile_plan(tmp_path / "nope.toml")


def test_good_head_itself_compiles(tmp_path: Path) -> None:
    """The malformed cases above differ from a valid plan only by the broken part."""
    path = tmp_path / "good.toml"
    path.write_text(GOOD_HEAD + DEBATE_TAIL + "members = ['judge']\n[orchestrator.multi_agent.train_one]\n"
                    "members = ['a', 'b']\nunselected = 'opponent'\n")
    plan = compile_plan(path)
    assert plan.members["judge"].target == "opponent" and plan.train_one.members == ["a", "b"]


# -- the CLI: rollout plan FILE [--json] ----------------------------------------------------------


def test_cli_plan_prints_routes_and_ignored_sections(capsys: pytest.CaptureFixture) -> None:
    from rollout.cli import main

    assert main(["plan", str(PEER / "rl-debate-external-opponent.toml"), "--rollout", "r-1", "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert "debater_a  learner | opponent  when selected  train_one" in out
    assert "ignored sections: wandb, ckpt, orchestrator.renderer" in out
    assert "inference server (the vLLM a run starts is given): max_model_len=8192" in out
    assert "environments (evaluation: scored, never trained)\n  gpqa-debate-eval: id gpqa-debate" in out
    plan = peer("rl-debate-external-opponent.toml")
    chosen = plan.selected_member("r-1", 5)
    assert f"rollout 'r-1' seed 5: selected '{chosen}'" in out
    assert f"{chosen:<9}  -> learner (Qwen/Qwen3-4B-Instruct-2507)  trainable" in out


def test_cli_plan_json_is_the_plan(capsys: pytest.CaptureFixture) -> None:
    from rollout.cli import main

    assert main(["plan", str(EXAMPLES / "debate.toml"), "--json"]) == 0
    assert GenerationPlan.model_validate_json(capsys.readouterr().out) == compile_plan(EXAMPLES / "debate.toml")


def test_cli_plan_error_names_field_and_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from rollout.cli import main

    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nname = 'm'\n[environment]\nid = 'e'\n[sampling]\ntemprature = 1\n")
    assert main(["plan", str(bad)]) == 1
    err = capsys.readouterr().err
    assert str(bad) in err and "sampling.temprature" in err and "did you mean 'temperature'" in err


# -- today's prime-rl (2026-08): [[train.source]] with seats, [algo], ratio, eval sources -----------


def peer26(name: str) -> GenerationPlan:
    return compile_plan(PEER_2026 / name)


def test_all_2026_samples_compile_and_the_trainer_only_one_is_refused() -> None:
    files = sorted(PEER_2026.glob("*.toml"))
    assert len(files) == 14
    for f in files:
        if f.name == "configs_debug_fake_rl.toml":
            with pytest.raises(PlanError, match=r"trainer-only config with fake data .*not a generation recipe"):
                compile_plan(f)
            continue
        plan = compile_plan(f)
        assert plan.environments and all(not e.evaluation for e in plan.environments)
        assert all(e.evaluation for e in plan.eval_environments)
        assert GenerationPlan.model_validate_json(plan.model_dump_json()) == plan


def test_two_seat_recipe_routes_both_seats() -> None:
    plan = peer26("configs_debug_algo_rae.toml")
    [env] = plan.environments
    assert env.id == "kuhn-poker" and env.name == "kuhn-poker"
    assert set(env.seats) == {"player0", "player1"}
    for seat in ("player0", "player1"):
        assert env.seats[seat].target == LEARNER and env.seats[seat].trainable
        assert env.seats[seat].options["harness"] == {"id": "null"}
        assert plan.route(seat, "r-1", 3) == (plan.learner, True)
    assert plan.trainable_members(["player0", "player1"], "r-1", 3) == {"player0", "player1"}
    rows = {r["member"]: r for r in plan.route_table()}
    assert rows["player0"]["rule"] == "seat of kuhn-poker, kuhn-poker (eval)" and rows["player1"]["trainable"] is True
    # rae is role-conditioned advantage estimation: our ema_per_member, alpha = decay (default 0.95)
    assert plan.advantage.type == "rae" and plan.advantage.origin == "orchestrator.algo"
    assert credit_strategy(plan) == ("ema_per_member", {"alpha": 0.95})
    assert plan.group_size == 1 and plan.batch_size == 32
    assert plan.learner.sampling == {"max_tokens": 512}
    assert plan.eval_environments[0].sampling == {"max_tokens": 512}


def test_sources_ratio_is_the_weight_and_eval_sources_are_evaluation() -> None:
    plan = peer26("examples_advanced_intellect-3.1_rl.toml")
    assert [(e.name, e.id, e.options["weight"]) for e in plan.environments] == [
        ("swe", "r2e-gym", 0.3), ("deepdive", "deepdive", 0.2), ("math", "i3_math", 0.3),
        ("logic", "i3_logic", 0.2), ("code", "i3_code", 0.2)]
    assert plan.environments[3].args == {"filter": {"max": 0.874}}  # taskset knobs are the env's args
    # its zero-advantage admission gates run (prime-rl's advantage_range defaults), one set for every source
    assert not plan.refused
    assert admission_gates(plan) == [AdmissionGate(name="zero_advantage", reject_min=0.0, reject_max=0.0)]
    assert [(e.name, e.id) for e in plan.eval_environments] == [("swe-bench-verified", "swebench-verified"),
                                                                ("aime2025", "aime25")]
    assert plan.eval_interval == 25 and plan.eval_due(50, plan.eval_environments[0])
    assert plan.batch_size == 2048 and plan.group_size == 1
    assert credit_strategy(plan) == ("grpo", {"scale_std": False})  # prime-rl's default algorithm


def test_admission_gates_as_prime_rl_writes_them_and_what_is_refused(tmp_path) -> None:
    """``curriculum.gates.<name>``: advantage_range with its bounds; another gate type is refused when a run starts;
    bounds out of order, or unknown keys, fail at compile; sources with different gates cannot share one credit
    service (refused by the services' settings, as different algorithms are)."""
    from consumers.settings import PlanRefused, build

    def recipe(gates: str, second: str | None = None) -> Path:
        p = tmp_path / "r.toml"
        src = '[[orchestrator.train.source]]\nname = "{n}"\nenv = {{ taskset = {{ id = "arithmetic" }} }}\n'
        text = 'max_steps = 2\n[model]\nname = "tiny-byte-lm"\n' + src.format(n="a") + gates + "\n"
        if second is not None:
            text += src.format(n="b") + second + "\n"
        p.write_text(text)
        return p

    low = 'curriculum = { gates = { low = { type = "advantage_range", reject_min = -0.05, reject_max = 0.05 } } }'
    plan = compile_plan(str(recipe(low)))
    assert plan.environments[0].gates == [AdmissionGate(name="low", reject_min=-0.05, reject_max=0.05)]
    assert build(plan=plan, credit=True).admission_gates == plan.environments[0].gates
    plan = compile_plan(str(recipe('curriculum = { gates = { pass_rate = { type = "pass_rate" } } }')))
    assert plan.refused == ["orchestrator.train.source[0].curriculum.gates.pass_rate: admission gate type "
                            "'pass_rate': only prime-rl's advantage_range runs here"]
    with pytest.raises(PlanError, match="reject_min"):
        compile_plan(str(recipe('curriculum = { gates = { z = { reject_min = 1.0 } } }')))
    with pytest.raises(PlanError, match="unknown keys"):
        compile_plan(str(recipe('curriculum = { gates = { z = { reject_max = 1.0, threshold = 2 } } }')))
    with pytest.raises(PlanRefused, match="different admission gates"):
        build(plan=compile_plan(str(recipe(low, ""))), credit=True)


def test_orchestrator_only_form() -> None:
    plan = peer26("k8s_prime-rl_examples_reverse-text_orch.toml")
    assert plan.family == "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT"
    assert (plan.batch_size, plan.group_size) == (128, 16)
    assert plan.provenance["batch_size"] == "batch_size"
    assert plan.environments[0].id == "reverse-text" and plan.learner.sampling == {"max_tokens": 128}
    assert "renderer" in plan.ignored_sections


def test_single_seat_named_player_and_wordle() -> None:
    plan = peer26("examples_basic_wordle_rl.toml")
    assert set(plan.environments[0].seats) == {"player"}
    assert plan.learner.sampling == {"max_tokens": 1024}


def test_per_source_algorithms_compile_and_an_opd_source_trains_from_its_teacher_beside_grpo() -> None:
    plan = peer26("configs_debug_algo_mixed_grpo_opd.toml")
    grpo, opd = plan.environments
    assert grpo.algorithm.type == "grpo" and grpo.algorithm.credit == "grpo"
    assert opd.algorithm.type == "opd" and opd.algorithm.credit == "ref_kl"
    assert opd.algorithm.origin == "orchestrator.train.source[1].algo"
    assert credit_strategy(plan) == ("grpo", {"scale_std": False})  # the grpo source's; opd needs none
    refs = references(plan)
    teacher = Reference(model="PrimeIntellect/Qwen3-0.6B-Reverse-Text-RL", base_url="http://localhost:8001/v1")
    assert refs.by_source == {"reverse-text-grpo": None, "reverse-text-opd": teacher}
    assert refs.of("reverse-text-opd") == teacher and refs.of("reverse-text-grpo") is None
    with pytest.raises(PlanError, match="differ in their reference"):
        refs.of(None)  # a score naming no source, in a plan whose sources differ: not guessed
    only = references(compile_plan_dict(_src(algo='[orchestrator.algo]\ntype = "opd"\nteacher = { name = "t", '
                                                  'base_url = "http://h/v1", api_key_var = "T_KEY" }'), "a.toml"))
    [source] = only.by_source
    assert only.of(None) == only.of(source) == Reference(model="t", base_url="http://h/v1", api_key_var="T_KEY")


def test_fork_recipe_passes_unknown_sampling_keys_to_the_server() -> None:
    plan = peer26("fork-debate-pcd4.toml")
    assert plan.passthrough_sampling == ["orchestrator.train.sampling.thinking_token_budget"]
    assert plan.learner.sampling["extra_body"] == {"thinking_token_budget": 8192, "top_k": 20, "min_p": 0.0,
                                                   "presence_penalty": 1.5}
    assert plan.learner.sampling["max_tokens"] == 16384
    judge = plan.targets["judge"]
    assert judge.model == "qwen/qwen3.5-9b" and judge.base_urls == ["https://openrouter.ai/api/v1"]
    assert plan.route("judge", "r", 0) == (judge, False)
    assert [e.name for e in plan.eval_environments] == ["gpqa-openended-debate-bs512-eval"]
    assert plan.eval_environments[0].options["group_size"] == 8
    # the fork's [advantage] type = "rae" comes with a length penalty the credit service cannot apply: refused
    assert plan.advantage.type == "rae" and plan.advantage.credit is None
    with pytest.raises(PlanError, match="rae with a length_penalty: the credit service has no length shaping"):
        credit_strategy(plan)
    # without it, "rae" names a strategy: the credit registry (open) decides, where the plan is run
    from consumers.settings import PlanRefused, plan_values

    import tomllib

    plain = compile_plan_dict(tomllib.loads(GOOD_HEAD + '[orchestrator.advantage]\ntype = "rae"\n'), "plain-rae.toml")
    assert plain.advantage.credit == "rae"
    with pytest.raises(PlanRefused, match="advantage type 'rae' is not a registered credit strategy"):
        plan_values(plain, credit=True)


def _src(extra: str = "", algo: str = "") -> dict:
    import tomllib
    return tomllib.loads(textwrap.dedent(f"""
        [model]
        name = "m"
        [orchestrator]
        batch_size = 8
        {algo}
        [[orchestrator.train.source]]
        name = "s"
        [orchestrator.train.source.env.taskset]
        id = "t"
        {extra}
        """))


ALGOS = {  # prime-rl type -> what the credit service runs (None: refused, with this reason)
    'type = "grpo"': ("grpo", {"scale_std": False}),
    'type = "rae"\ndecay = 0.8': ("ema_per_member", {"alpha": 0.8}),
    'type = "max_rl"': ("grpo", {"scale_std": False, "scale_mean": True}),
    'type = "echo"': ("grpo", {"scale_std": False, "echo_roles": {"tool": 0.1}}),  # prime-rl's default: tool
    'type = "echo"\nroles = { user = { alpha = 0.5 }, system = {} }': (  # a role set replaces the table
        "grpo", {"scale_std": False, "echo_roles": {"system": 0.1, "user": 0.5}}),
    'type = "hierarchical_grpo"\nepisode_agents = ["solver"]': "per proposed problem",
    'type = "opd"\nteacher = { name = "t", base_url = "http://h/v1" }': ("per_step", {}),  # no source credited
    'type = "opsd"': ("per_step", {}),  # trained from the live policy's scores under the demonstration
    'type = "sft"\nsampling = { source = { name = "t", base_url = "http://h/v1" } }': "from a frozen model",
    'type = "grpo"\nlength_penalty = { type = "linear" }': (
        "grpo", {"scale_std": False, "length_penalty": {"output": 0.25, "input": 0.1, "turns": 0.1}}),
    'type = "my_fork_algo"': "not one of prime-rl's",
}


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_algorithm_mapping_never_falls_back_to_grpo(algo: str) -> None:
    plan = compile_plan_dict(_src(algo="[orchestrator.algo]\n" + algo), "a.toml")
    want = ALGOS[algo]
    if isinstance(want, tuple):
        assert credit_strategy(plan) == want
    else:
        assert plan.advantage.credit is None and want in plan.advantage.note
        with pytest.raises(PlanError, match="cannot run here") as info:
            credit_strategy(plan)
        assert want in str(info.value) and plan.advantage.type in str(info.value)


@pytest.mark.parametrize("algo,why", [
    ('roles = { tool = { alpha = 0.0 } }', "must be > 0"),
    ('roles = { }', "at least one role"),
    ('roles = { observer = {} }', "observer"),
    ('filter = { import_path = "m.f" }', "verifiers v1 Trace"),
])
def test_an_echo_table_prime_rl_refuses_or_nothing_here_applies_is_one_clear_line(algo: str, why: str) -> None:
    with pytest.raises(PlanError, match=why):
        compile_plan_dict(_src(algo='[orchestrator.algo]\ntype = "echo"\n' + algo), "e.toml")


def test_pinned_seat_is_a_fixed_target() -> None:
    plan = compile_plan_dict(_src(extra="""
        [orchestrator.train.source.env.player0]
        harness = { id = "null" }
        [orchestrator.train.source.env.player1]
        model = "gpt-4.1-mini"
        client = { base_url = "https://api.openai.com/v1", api_key_var = "OPENAI_API_KEY" }
        sampling = { temperature = 0.0 }
        """), "s.toml")
    seats = plan.environments[0].seats
    assert seats["player0"].target == LEARNER and seats["player0"].trainable
    assert seats["player1"].target == "player1" and not seats["player1"].trainable
    fixed = plan.targets["player1"]
    assert (fixed.model, fixed.base_urls, fixed.api_key_var) == ("gpt-4.1-mini", ["https://api.openai.com/v1"],
                                                                 "OPENAI_API_KEY")
    assert fixed.sampling == {"temperature": 0.0}
    assert plan.route("player1", "r", 0) == (fixed, False) and plan.route("player0", "r", 0) == (plan.learner, True)


# -- evaluation cadence: prime-rl's [orchestrator.eval] interval / skip_first_step, one place in the plan ----------

def _recipe(eval_toml: str = "") -> GenerationPlan:
    import tomllib

    return compile_plan_dict(tomllib.loads("[model]\nname = 'm'\n[orchestrator]\nbatch_size = 8\n"
                                           "[[orchestrator.train.source]]\nname = 's'\n"
                                           "env = { taskset = { id = 't' } }\n" + eval_toml), "r.toml")


def _due(plan: GenerationPlan, revisions: int, source=None, last: int | None = None) -> list[int]:
    return [r for r in range(revisions + 1) if plan.eval_due(r, source, last)]


def test_without_an_eval_block_every_revision_is_evaluated() -> None:
    plan = _recipe()
    assert (plan.eval_interval, plan.eval_skip_first_step) == (1, False)
    assert plan.provenance["eval_interval"].startswith("default") and _due(plan, 4) == [0, 1, 2, 3, 4]


def test_an_eval_block_without_a_source_is_the_held_out_sets_cadence() -> None:
    plan = _recipe("[orchestrator.eval]\ninterval = 4\nskip_first_step = true\n")
    assert plan.eval_environments == [] and plan.provenance["eval_interval"] == "orchestrator.eval.interval"
    assert _due(plan, 10) == [4, 8]  # revision 0 skipped
    assert _due(plan, 10, last=10) == [4, 8, 10] and _due(plan, 0, last=0) == [0]  # the run's last, always


def test_eval_sources_inherit_the_blocks_cadence_unless_they_set_their_own() -> None:
    plan = _recipe("[orchestrator.eval]\nskip_first_step = true\n"
                   "[[orchestrator.eval.source]]\nname = 'a'\nenv = { taskset = { id = 't' } }\n"
                   "[[orchestrator.eval.source]]\nname = 'b'\ninterval = 3\nskip_first_step = false\n"
                   "env = { taskset = { id = 't' } }\n")
    a, b = plan.eval_environments
    assert plan.eval_interval == 100 and plan.provenance["eval_interval"] == "default (prime-rl's)"
    assert _due(plan, 200) == _due(plan, 200, a) == [100, 200]  # held-out sets and source a: the block's
    assert _due(plan, 7, b) == [0, 3, 6] and _due(plan, 7, b, last=7) == [0, 3, 6, 7]


def test_an_older_eval_envs_interval_is_checked() -> None:
    with pytest.raises(PlanError, match=r"orchestrator\.eval\.env\[0\]\.interval: expected an integer"):
        _recipe("[orchestrator.eval]\n[[orchestrator.eval.env]]\nid = 't'\ninterval = 'often'\n")


def test_the_demo_plan_evaluates_every_8_revisions_and_the_last() -> None:
    from rollout.demo import PROFILES

    plan = compile_plan(PROFILES["vllm"].plan)
    revisions = PROFILES["vllm"].groups * plan.group_size // plan.batch_size
    assert revisions == 24 and _due(plan, revisions, last=revisions) == [0, 8, 16, 24]
    assert _due(plan, 20, last=20) == [0, 8, 16, 20]  # a shorter run still ends on an evaluated revision


REFUSED_2026 = {
    "near_miss_sampling": ('[orchestrator.train.sampling]\ntemprature = 0.5',
                           ["orchestrator.train.sampling.temprature", "did you mean 'temperature'"]),
    "near_miss_source_key": ('ratoi = 2', ["orchestrator.train.source[0].ratoi", "'ratio'"]),
    "near_miss_seat_key": ('[orchestrator.train.source.env.agent]\nharnes = { id = "null" }\nruntime = {}',
                           ["orchestrator.train.source[0].env.agent.harnes", "'harness'"]),
    "near_miss_algo_type": ('[orchestrator.algo]\ntype = "gpro"', ["orchestrator.algo.type", "did you mean 'grpo'"]),
    "algo_unknown_param": ('[orchestrator.algo]\ntype = "rae"\ndecya = 0.9', ["orchestrator.algo.decya", "'decay'"]),
    "opd_without_teacher": ('[orchestrator.algo]\ntype = "opd"', ["orchestrator.algo.teacher", "teacher"]),
    "env_level_harness": ('[orchestrator.train.source.env.harness]\nid = "null"',
                          ["orchestrator.train.source[0].env.harness", "belongs to a seat"]),
    "eval_without_source": ('[orchestrator.eval]\ninterval = 5\nnum_examples = 8',
                            ["orchestrator.eval.source", "sets num_examples", "at least one"]),
    "eval_interval_zero": ('[orchestrator.eval]\ninterval = 0', ["orchestrator.eval.interval", "must be >= 1"]),
}


@pytest.mark.parametrize("case", sorted(REFUSED_2026))
def test_2026_refusals_name_the_field(case: str, tmp_path: Path) -> None:
    extra, expected = REFUSED_2026[case]
    text = ("[model]\nname = 'm'\n[orchestrator]\nbatch_size = 8\n[[orchestrator.train.source]]\nname = 's'\n"
            "env = { taskset = { id = 't' } }\n")
    if extra.startswith("[orchestrator.train.source.env"):
        text = text.replace("env = { taskset = { id = 't' } }\n", "[orchestrator.train.source.env.taskset]\nid = 't'\n")
    path = tmp_path / f"{case}.toml"
    path.write_text(text + extra + "\n")
    with pytest.raises(PlanError) as info:
        compile_plan(path)
    for part in [str(path), *expected]:
        assert part in str(info.value), f"{part!r} not in {info.value}"


@pytest.mark.parametrize("text,what", [
    ("[data]\nname = 'ds'\n[optim]\nlr = 1e-5\n", "an SFT trainer config"),
    ("[vllm]\ntensor_parallel_size = 8\n", "an inference-server config"),
    ("model = 'x'\n[[eval.source]]\nname = 'e'\nenv = { taskset = { id = 't' } }\n", "an eval-only config"),
    ("[model]\nname = 'm'\n", "a config with only [model]"),
])
def test_files_that_are_not_recipes_say_what_they_are(text: str, what: str, tmp_path: Path) -> None:
    path = tmp_path / "x.toml"
    path.write_text(text)
    with pytest.raises(PlanError, match=f"{re.escape(what)}.*not a generation recipe"):
        compile_plan(path)


def test_unknown_sampling_key_in_a_seat_and_eval_source_passes_through() -> None:
    plan = compile_plan_dict(_src(extra="""
        [orchestrator.train.source.env.agent]
        sampling = { skip_special_tokens = false }
        """), "p.toml")
    assert plan.environments[0].seats["agent"].sampling == {"extra_body": {"skip_special_tokens": False}}
    assert plan.passthrough_sampling == ["orchestrator.train.source[0].env.agent.sampling.skip_special_tokens"]


def test_cli_shows_algorithm_refusal_and_passthrough(capsys: pytest.CaptureFixture) -> None:
    from rollout.cli import main

    assert main(["plan", str(PEER_2026 / "fork-debate-pcd4.toml")]) == 0
    out = capsys.readouterr().out
    assert "CANNOT RUN HERE (services refuse it)" in out
    assert "passed to the inference server as is (extra_body): orchestrator.train.sampling.thinking_token_budget" in out
    assert main(["plan", str(PEER_2026 / "configs_debug_algo_rae.toml")]) == 0
    out = capsys.readouterr().out
    assert "player0  learner  yes        seat of kuhn-poker, kuhn-poker (eval)" in out
    assert "rae (orchestrator.algo) -> credit ema_per_member (alpha=0.95)" in out


def test_credit_and_trainer_services_refuse_an_algorithm_they_cannot_run(tmp_path: Path) -> None:
    import argparse

    from consumers.cli import register_serve, settings_from_args

    parser = argparse.ArgumentParser()
    register_serve(parser.add_subparsers())
    echo = tmp_path / "hierarchical.toml"  # an algorithm nothing here runs
    echo.write_text('[model]\nname = "m"\n[orchestrator.algo]\ntype = "hierarchical_grpo"\nepisode_agents = ["s"]\n'
                    '[[orchestrator.train.source]]\nname = "s"\n[orchestrator.train.source.env.taskset]\nid = "t"\n')
    mixed = str(PEER_2026 / "configs_debug_algo_mixed_grpo_opd.toml")
    for service in ("credit", "trainer", "reference"):  # grpo beside opd: each runs it
        settings_from_args(parser.parse_args([service, "--plan", mixed]))
    for service in ("credit", "trainer"):
        with pytest.raises(SystemExit, match=f"rollout serve {service}: refusing the plan: .*'hierarchical_grpo'"):
            settings_from_args(parser.parse_args([service, "--plan", str(echo)]))
    settings_from_args(parser.parse_args(["verifier", "--plan", str(echo)]))  # does not assign credit: unaffected
    rae = str(PEER_2026 / "configs_debug_algo_rae.toml")
    cfg = settings_from_args(parser.parse_args(["credit", "--plan", rae]))
    assert (cfg.credit, cfg.strategy_params["alpha"]) == ("ema_per_member", 0.95)
    # an explicit flag beats the plan, which beats the environment, which beats the default
    cfg = settings_from_args(parser.parse_args(["credit", "--plan", rae, "--alpha", "0.5"]))
    assert (cfg.credit, cfg.strategy_params["alpha"]) == ("ema_per_member", 0.5)


def test_a_lora_recipe_compiles_its_adapter_with_prime_rls_defaults_and_the_runs_override() -> None:
    """``[trainer.model.lora]`` is applied (not refused): what the recipe sets, prime-rl's defaults for the rest,
    ``[orchestrator.model.lora]``'s rank, alpha and adapter name over it; ``modules_to_save`` (not applied here) is
    refused."""
    from schemas.plan import LORA_TARGETS

    plan = compile_plan_dict(_src(extra="[trainer.model.lora]\nrank = 32\nalpha = 64\n"), "p.toml")
    assert plan.lora is not None and (plan.lora.rank, plan.lora.alpha, plan.lora.dropout) == (32, 64.0, 0.0)
    assert plan.lora.target_modules == list(LORA_TARGETS) and not plan.refused
    assert plan.lora.adapter_name == "r32-a64.0" and plan.lora.serving == "adapter"  # prime-rl's default name
    plan = compile_plan_dict(_src(extra="[trainer.model.lora]\nrank = 8\ntarget_modules = ['q_proj']\n"
                                        "[orchestrator.model.lora]\nname = 'r4'\nrank = 4\n"), "p.toml")
    assert (plan.lora.rank, plan.lora.alpha, plan.lora.target_modules) == (4, 32.0, ["q_proj"])
    assert plan.provenance["lora.rank"] == "orchestrator.model.lora.rank" and not plan.refused
    assert plan.lora.adapter_name == "r4"  # [orchestrator.model.lora] name: what vLLM serves the adapter as
    plan = compile_plan_dict(_src(extra="[trainer.model.lora]\nmodules_to_save = ['lm_head']\n"), "p.toml")
    assert [r.split(":")[0] for r in plan.refused] == ["trainer.model.lora.modules_to_save"]
    assert compile_plan_dict(_src(), "p.toml").lora is None


def test_the_recipes_optimizer_and_length_penalty_are_applied_with_prime_rls_defaults() -> None:
    """[trainer.optim] type muon / sign_sgd and [orchestrator.algo.length_penalty] (prime-rl recipes, unchanged):
    the plan carries the optimizer with prime-rl's defaults for what the recipe leaves out, and the grpo credit
    its length-penalty weights; neither is refused."""
    from consumers.settings import plan_values

    search = peer26("examples_advanced_glm-4.5-air_search.toml")
    assert search.optimizer.type == "muon" and search.optimizer.betas == (0.9, 0.95)
    assert search.optimizer.momentum == 0.95 and search.optimizer.max_norm == 1.0
    assert search.advantage.credit == "grpo" and search.advantage.credit_params == {
        "scale_std": False, "length_penalty": {"output": 0.0, "input": 0.1, "turns": 0.0}}
    assert not any("optim" in r or "length_penalty" in r for r in search.refused)
    values = plan_values(search, credit=True)
    assert values["optimizer"].type == "muon" and values["credit_params"]["length_penalty"]["input"] == 0.1

    concurrency = peer26("configs_debug_concurrency.toml")
    assert concurrency.optimizer.type == "sign_sgd"
    assert concurrency.advantage.credit_params["length_penalty"] == {"output": 0.0, "input": 0.1, "turns": 0.1}

    max_rl = peer26("configs_debug_algo_max_rl.toml")
    assert max_rl.advantage.credit == "grpo" and max_rl.advantage.credit_params == {"scale_std": False,
                                                                                    "scale_mean": True}


@pytest.mark.parametrize("optim, says", [
    ('type = "sgd"', "trainer.optim.type: optimizer 'sgd'"),
    ('type = "muon"\nmu = "fast"', "trainer.optim.mu: expected a number"),
])
def test_an_optimizer_not_run_here_is_refused_naming_the_key(tmp_path: Path, optim: str, says: str) -> None:
    f = tmp_path / "r.toml"
    f.write_text('[model]\nname = "tiny"\n[[orchestrator.env]]\nid = "arithmetic"\n[trainer.optim]\n' + optim + "\n")
    try:
        plan = compile_plan(f)
    except PlanError as e:
        assert says in str(e)
    else:
        assert any(says in r for r in plan.refused), plan.refused


def test_a_length_penalty_of_another_type_fails_naming_it(tmp_path: Path) -> None:
    f = tmp_path / "r.toml"
    f.write_text('[model]\nname = "tiny"\n[[orchestrator.env]]\nid = "arithmetic"\n[orchestrator.algo]\n'
                 'type = "grpo"\n[orchestrator.algo.length_penalty]\ntype = "tokens"\n')
    with pytest.raises(PlanError, match=r"length_penalty.type: 'tokens': prime-rl's length penalty is 'linear'"):
        compile_plan(f)


def test_opsd_takes_prime_rls_demo_key_and_template_and_refuses_what_it_cannot_score() -> None:
    """``[orchestrator.algo] type = "opsd"`` (prime-rl's ``OPSDAlgoConfig``): ``demo_key`` and ``template`` as
    written, prime-rl's defaults otherwise; a template that does not format with ``{demonstration}`` alone is
    refused at its key; a LoRA run (which serves adapters under another name) is refused with what to do."""
    from schemas.objectives import OPSD_TEMPLATE
    from schemas.plan import references

    plan = compile_plan_dict(_src(algo='[orchestrator.algo]\ntype = "opsd"'), "p.toml")
    demo = references(plan).of("s").demonstration
    assert (demo.key, demo.template) == ("demonstration", OPSD_TEMPLATE)
    plan = compile_plan_dict(_src(algo='[orchestrator.algo]\ntype = "opsd"\ndemo_key = "answer"\n'
                                       'template = "Solution: {demonstration} {{not a field}}"'), "p.toml")
    demo = references(plan).of("s").demonstration
    assert demo.key == "answer" and demo.hint("42") == "Solution: 42 {not a field}"
    with pytest.raises(PlanError, match=r"orchestrator\.algo\.template: .*format with \{demonstration\} alone"):
        compile_plan_dict(_src(algo='[orchestrator.algo]\ntype = "opsd"\ntemplate = "{answer}"'), "p.toml")
    lora = compile_plan_dict(_src(algo='[orchestrator.algo]\ntype = "opsd"',
                                  extra="[trainer.model.lora]\nrank = 8\n"), "p.toml")
    with pytest.raises(PlanError, match=r"opsd .* without \[trainer\.model\.lora\]"):
        credit_strategy(lora)
