"""``python -m benchmarks peers``: the job both sides run comes from one place, and maps onto TRL's GRPOConfig
field by field (no TRL needed here: the mapping is a pure function)."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.peers import Job, chart, exact_reward, grpo_config_kwargs, job, verdict


def _job(**kw) -> Job:
    base = dict(plan="p.toml", steps=5, group_size=4, batch_records=12, lr=3e-5, epochs=2, clip=0.25,
                max_grad_norm=0.5, weight_decay=0.01, temperature=0.7, max_tokens=24, max_off_policy_steps=1, seed=3)
    return Job(**{**base, **kw})


def test_grpo_config_kwargs_maps_every_setting():
    j = _job()
    k = grpo_config_kwargs(j, "/tmp/out")
    assert k["num_generations"] == 4 and k["per_device_train_batch_size"] == 12
    assert k["gradient_accumulation_steps"] == 1 and k["steps_per_generation"] == 1  # one step = one batch
    assert k["num_iterations"] == 2 and k["max_steps"] == 10  # TRL counts each epoch as a step
    assert k["max_completion_length"] == 24 and k["temperature"] == 0.7
    assert k["top_p"] == 1.0 and k["top_k"] == 0  # the plan samples from the whole distribution
    assert k["learning_rate"] == 3e-5 and k["lr_scheduler_type"] == "constant" and k["warmup_steps"] == 0
    assert k["weight_decay"] == 0.01 and k["max_grad_norm"] == 0.5 and k["optim"] == "adamw_torch"
    assert k["beta"] == 0.0 and k["epsilon"] == k["epsilon_high"] == 0.25
    assert k["loss_type"] == "dapo" and k["scale_rewards"] == "group"  # token sum / batch tokens; group-normalised
    assert k["gradient_checkpointing"] is False and k["seed"] == 3 and k["output_dir"] == "/tmp/out"
    assert k["use_cpu"] is True and k["bf16"] is True


def test_grpo_config_kwargs_refuses_a_batch_that_splits_a_group():
    with pytest.raises(ValueError, match="multiple of group_size"):
        grpo_config_kwargs(_job(batch_records=10), "/tmp/out")


def test_job_is_the_demos():
    from rollout.demo import PROFILES
    from schemas.plan_compiler import compile_plan

    j = job()
    plan = compile_plan(PROFILES["vllm"].plan)
    assert (j.group_size, j.batch_records) == (plan.group_size, plan.batch_size)
    assert j.groups == PROFILES["vllm"].groups  # default steps: the demo's own run
    assert j.lr == PROFILES["vllm"].lr and j.epochs == PROFILES["vllm"].epochs
    assert j.max_tokens == plan.learner.sampling["max_tokens"] and j.temperature == plan.learner.sampling["temperature"]
    assert job(3).groups == 3 * plan.batch_size // plan.group_size
    assert dataclasses.replace(j, steps=3) == job(3)


def test_exact_reward_is_the_verifiers_last_integer():
    assert exact_reward("The answer is 1,234.", "1234") == 1.0
    assert exact_reward("12, or maybe 13", "12") == 0.0
    assert exact_reward("no number", "0") == 0.0


def test_chart_has_one_point_per_step_for_each_side():
    j = _job(steps=2, epochs=1)
    ours = {"eval_accuracy": {0: 0.25, 1: 0.5, 2: 0.75}, "wall_s": 10.0}
    trl = {"eval_accuracy": {0: 0.25, 1: 0.25, 2: 0.5}, "wall_s": 20.0}
    text = chart(j, ours, trl)
    assert "xychart-beta" in text and "line [25.0, 50.0, 75.0]" in text and "line [25.0, 25.0, 50.0]" in text
    assert verdict(j, ours, trl) == {"final_step": 2, "rollout_log_final": 0.75, "trl_final": 0.5,
                                     "accuracy_met": True, "wall_met": True}
