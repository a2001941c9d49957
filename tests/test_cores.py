"""The core split of ``rollout demo`` / ``rollout rl`` (``rollout.cores``): vLLM and the trainer on disjoint cores."""

from __future__ import annotations

import os
import subprocess
import sys

from rollout.cores import CoreSplit, choose, split_cores, vllm_bind


def test_each_gets_its_own_half_and_vllm_reads_its_cores_as_ranges():
    assert split_cores({0, 1}) == CoreSplit(vllm=(1,), trainer=(0,))
    three = split_cores({0, 1, 2})
    assert three == CoreSplit(vllm=(2,), trainer=(0, 1))  # an odd core to the trainer
    assert vllm_bind(split_cores(set(range(8)))) == "4-7"
    assert vllm_bind(split_cores({0, 2, 3, 5, 6, 7})) == "5-7"
    assert vllm_bind(CoreSplit(vllm=(1, 3, 4, 5), trainer=(0, 2))) == "1,3-5"
    assert split_cores({3}) is None  # one core: nothing to split


def test_pinning_moves_every_thread_of_the_process_and_sizes_torch_to_it():
    """Threads already running (torch's pool, started by a matmul) are moved too, not only those started after."""
    if len(os.sched_getaffinity(0)) < 2:
        return
    code = ("import os, threading, time, torch\n"
            "torch.ones(256, 256) @ torch.ones(256, 256)\n"
            "t = threading.Thread(target=time.sleep, args=(2,)); t.start()\n"
            "from rollout.cores import pin_this_process, split_cores\n"
            "s = split_cores(); pin_this_process(s)\n"
            "tasks = os.listdir('/proc/self/task')\n"
            "print(all(os.sched_getaffinity(int(x)) == set(s.trainer) for x in tasks), torch.get_num_threads(),"
            " len(s.trainer), len(tasks) > 1)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "True" and out[1] == out[2] and out[3] == "True", out


def test_auto_takes_turns_below_four_cores_and_splits_from_four():
    from schemas.plan_compiler import compile_plan

    one = compile_plan("examples/plans/arithmetic-smollm2.toml")
    assert choose("auto", one, {0, 1}) == "turns" and choose("auto", one, {0}) == "turns"
    assert choose("auto", one, set(range(4))) == "split"
    assert choose("shared", one, set(range(8))) == "shared" and choose("turns", one, set(range(8))) == "turns"


def test_auto_shares_the_cores_below_four_for_rollouts_of_several_records():
    """A proposer/solver plan routes members: its rollouts yield several records, which a bound of 0 would refuse."""
    from schemas.plan_compiler import compile_plan

    several = compile_plan("examples/plans/proposer_solver.toml")
    assert several.members or several.train_one or any(e.seats for e in several.environments)
    assert choose("auto", several, {0, 1}) == "shared" and choose("auto", several, set(range(4))) == "split"


def test_a_verifiers_env_source_counts_as_several_records_a_rollout(tmp_path):
    """A recipe naming a verifiers env without seat tables (kuhn-poker's two seats are its own): the plan cannot
    tell how many records a rollout yields, so auto shares the cores and the arena counts before it sizes claims."""
    from schemas.plan_compiler import compile_plan

    recipe = tmp_path / "duel.toml"
    recipe.write_text('[model]\nname = "HuggingFaceTB/SmolLM2-135M-Instruct"\n\n[orchestrator]\nbatch_size = 8\n'
                      'group_size = 4\n\n[[orchestrator.train.source]]\nname = "duel"\n\n'
                      '[orchestrator.train.source.env.taskset]\nid = "rlt-tally-duel"\n')
    plan = compile_plan(str(recipe))
    assert not any(e.seats for e in plan.environments) and not plan.members
    assert not plan.one_record_per_rollout and choose("auto", plan, {0, 1}) == "shared"


def test_what_waits_for_the_trainer_steps_back_and_the_broker_is_put_back():
    """The arena is started at BACKGROUND_NICE (it and the threads it starts); the broker, a session of its own as
    the local broker is, is stepped back for the run and restored after it (its autogroup's nice value, where the
    kernel groups sessions; each thread's otherwise)."""
    from pathlib import Path

    from producers.inference.children import die_with_parent_at
    from rollout.cores import BACKGROUND_NICE, step_back

    child = subprocess.run([sys.executable, "-c", "import os, threading; t = threading.Thread(target=lambda: "
                            "print(os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, "
                            "threading.get_native_id()))); t.start(); t.join()"],
                           preexec_fn=die_with_parent_at(BACKGROUND_NICE), capture_output=True, text=True, check=True)
    assert child.stdout.split() == [str(os.getpriority(os.PRIO_PROCESS, 0) + BACKGROUND_NICE)] * 2

    broker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        group = Path(f"/proc/{broker.pid}/autogroup")
        autogroups = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
        restore = step_back(broker.pid)
        if autogroups:
            assert group.read_text().split()[-1] == str(BACKGROUND_NICE)
        else:
            assert os.getpriority(os.PRIO_PROCESS, broker.pid) == BACKGROUND_NICE
        restore()
        if autogroups:
            assert group.read_text().split()[-1] == "0"
    finally:
        broker.kill()
        broker.wait()
