"""``python -m benchmarks peers``: the job both sides run comes from one place (evaluation cadence included) and
maps onto TRL's GRPOConfig field by field (no TRL needed here: the mapping is a pure function); runs summarise
as min / median / max; a side's memory is its whole process tree's."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from benchmarks.peers import (Job, chart, exact_reward, grpo_config_kwargs, job, measure, summarize, table,
                              verdict)


def _job(**kw) -> Job:
    base = dict(plan="p.toml", steps=5, group_size=4, batch_records=12, lr=3e-5, epochs=2, clip=0.25,
                max_grad_norm=0.5, weight_decay=0.01, temperature=0.7, max_tokens=24, max_off_policy_steps=1,
                eval_interval=1, eval_skip_first_step=False, bf16=True, seed=3)
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
    assert grpo_config_kwargs(_job(bf16=False), "/tmp/out")["bf16"] is False  # float32 where the CPU emulates bf16


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


def test_both_sides_evaluate_at_the_demo_arenas_steps():
    from rollout.demo import PROFILES
    from schemas.plan_compiler import compile_plan

    j = job()
    assert j.eval_interval == compile_plan(PROFILES["vllm"].plan).eval_interval == 8
    assert j.eval_steps == [0, 8, 16, 24]
    assert job(2).eval_steps == [0, 2] and job(20).eval_steps == [0, 8, 16, 20]  # the last step, always
    assert job(4, eval_interval=1).eval_steps == [0, 1, 2, 3, 4]
    assert _job(steps=6, eval_interval=3, eval_skip_first_step=True).eval_steps == [3, 6]


def test_exact_reward_is_the_verifiers_last_integer():
    assert exact_reward("The answer is 1,234.", "1234") == 1.0
    assert exact_reward("12, or maybe 13", "12") == 0.0
    assert exact_reward("no number", "0") == 0.0


def _run(accuracy: dict[int, float], wall: float, **kw) -> dict:
    return {"eval_accuracy": accuracy, "wall_s": wall, "loop_s": wall - 5, "eval_s": 2.0, "train_s": wall - 7,
            "step_s_mean": 1.5, "peak_rss_mb": 900, "peak_rss_process_mb": 600, "train_completion_tokens": 100,
            "tokens_per_s": 100 / wall, "load_before": [1.0, 1.0, 1.0], "load_after": [2.0, 1.0, 1.0], **kw}


def test_runs_summarise_as_min_median_max_and_the_chart_has_one_point_per_evaluated_step():
    j = _job(steps=4, epochs=1, eval_interval=2)
    ours = summarize(j, [_run({0: 0.25, 2: 0.5, 4: 0.75}, 10.0), _run({0: 0.25, 2: 0.75, 4: 0.5}, 30.0),
                         _run({0: 0.25, 2: 0.25, 4: 1.0}, 20.0, peak_rss_mb=1200)])
    trl = summarize(j, [_run({0: 0.25, 2: 0.25, 4: 0.5}, 40.0)])
    assert ours["wall_s"] == {"min": 10.0, "median": 20.0, "max": 30.0}
    assert ours["eval_accuracy"][4] == {"min": 0.5, "median": 0.75, "max": 1.0}
    assert ours["peak_rss_mb"] == {"min": 900, "median": 900, "max": 1200} and summarize(j, []) is None
    text = chart(j, ours, trl)
    assert 'x-axis "step" [0, 2, 4]' in text and "line [25.0, 50.0, 75.0]" in text and "line [25.0, 25.0, 50.0]" in text
    rows = table(j, ours, trl).splitlines()
    assert "| 4 | 75.0% (50.0%–100.0%) | 50.0% |" in rows and not any(r.startswith("| 1 |") for r in rows)
    assert "| wall time, whole run (s) | 20.0 (10.0–30.0) | 40.0 |" in rows
    assert "| peak RSS, all processes summed (MB) | 900 (900–1200) | 900 |" in rows
    assert verdict(j, ours, trl) == {"final_step": 4, "rollout_log_final": 0.75, "trl_final": 0.5, "questions": None,
                                     "accuracy_met": True, "wall_met": True, "memory_met": True}
    # one question of 48 below TRL's, as the rounded fractions the sides report it: met; two below: not
    close = {**ours, "eval_accuracy": {4: {"median": 0.5833}}}
    assert verdict(j, close, {**trl, "eval_accuracy": {4: {"median": 29 / 48}}}, 48)["accuracy_met"]
    assert not verdict(j, close, {**trl, "eval_accuracy": {4: {"median": 30 / 48}}}, 48)["accuracy_met"]
    assert not verdict(j, {**ours, "peak_rss_mb": {"median": 1351}}, trl)["memory_met"]


GRANDCHILD = "b = b'x' * (64 * 2**20); import time; time.sleep(1.5)  # peers-rss-marker"


def test_a_sides_memory_is_its_whole_process_tree():
    """The command's own process holds little; the child it starts holds 64 MB: the sum counts both."""
    parent = (f"import subprocess, sys; subprocess.run([sys.executable, '-c', {GRANDCHILD!r}], check=True); "
              "print('{\"done\": true}')")
    m = measure([sys.executable, "-c", parent], 60, dict(os.environ), "the tree")
    assert m["json"] == {"done": True} and m["wall_s"] >= 1.5
    assert "peers-rss-marker" in m["peak_rss_process"] and m["peak_rss_process_mb"] >= 64
    assert m["peak_rss_mb"] >= m["peak_rss_process_mb"] + 5  # the parent interpreter's own RSS on top
    assert 64 <= m["peak_pss_mb"] <= m["peak_rss_mb"]  # the child's 64 MB its own; the interpreters share pages


def test_a_failing_side_says_so_with_its_output():
    with pytest.raises(RuntimeError, match="the side exited 3:\n.*boom"):
        measure([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], 60, dict(os.environ), "the side")


def test_runs_alternate_which_side_goes_first_and_the_json_line_holds_every_run(monkeypatch, tmp_path, capsys):
    import json

    import benchmarks.peers as peers

    order, allocators = [], []

    def side(name: str, wall: float):
        def run(j: Job, timeout: float, **kw) -> dict:
            order.append(name)
            allocators.append(kw.get("allocator"))
            return _run({k: 0.5 for k in j.eval_steps}, wall + len(order))
        return run

    monkeypatch.setattr(peers, "ROOT", tmp_path)  # each run's figures are kept under ROOT/.state/peers
    monkeypatch.setattr(peers, "SIDES", {"trl": side("trl", 100.0), "rollout-log": side("rollout-log", 50.0)})
    assert peers.main(["--quick", "--runs", "3"]) == 0
    assert order == ["trl", "rollout-log", "rollout-log", "trl", "trl", "rollout-log"]
    # TRL on glibc's malloc as it ships unless --trl-allocator says otherwise; rollout-log's side takes no choice
    assert allocators == ["glibc", None, None, "glibc", "glibc", None]
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["runs"] == 3 and out["job"]["eval_steps"] == [0, 2]
    assert [r["wall_s"] for r in out["rollout_log"]] == [52.0, 53.0, 56.0]
    assert out["summary"]["rollout_log"]["wall_s"] == {"min": 52.0, "median": 53.0, "max": 56.0}
    assert out["verdict"]["wall_met"] is True
    assert len(json.loads((tmp_path / ".state" / "peers" / "trl.json").read_text())) == 3
    order.clear(), allocators.clear()
    assert peers.main(["--quick", "--only", "trl", "--trl-allocator", "tcmalloc"]) == 0
    assert allocators == ["tcmalloc"]


def test_trl_runs_on_glibcs_malloc_unless_asked_to_run_on_tcmalloc_as_our_trainer_does():
    """``--trl-allocator tcmalloc``: a process started with TRL's environment has tcmalloc mapped in; by default not."""
    from benchmarks.peers import trl_environment

    def mapped(env: dict) -> bool:
        probe = "print('libtcmalloc' in open('/proc/self/maps').read())"
        return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                              check=True).stdout.strip() == "True"

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "environ", env)
        assert not mapped(trl_environment("glibc"))
        assert mapped(trl_environment("tcmalloc")) and trl_environment("tcmalloc")["HF_HUB_OFFLINE"] == "1"
