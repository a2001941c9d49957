"""The GenerationPlan compiler: real prime-rl recipes unchanged, our example plans, and refusals."""

from __future__ import annotations

import hashlib
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from schemas.errors import ContractError
from schemas.plan import (DEFAULT_MAX_OFF_POLICY_STEPS, LEARNER, GenerationPlan, PlanError, compile_plan,
                          compile_plan_dict)

REPO = Path(__file__).resolve().parents[1]
PEER = Path(__file__).resolve().parent / "fixtures" / "prime-rl"  # real recipes, vendored unchanged (see its README)
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
    assert set(plan.ignored_keys) == {"max_steps", "seq_len"}
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
    assert set(plan.ignored_sections) == {"deployment", "wandb", "trainer", "ckpt", "inference",
                                          "orchestrator.renderer"}


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
    assert {"wandb", "ckpt", "trainer", "inference", "orchestrator.renderer", "orchestrator.eval"} <= set(
        plan.ignored_sections)
    assert "orchestrator.oversampling_factor" in plan.ignored_keys


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
    assert {"orchestrator.buffer", "orchestrator.val", "orchestrator.eval"} <= set(plan.ignored_sections)


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
""", ["orchestrator.train.env", "no environment"]),
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
    assert "ignored sections: wandb, ckpt, trainer, inference, orchestrator.renderer, orchestrator.eval" in out
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
