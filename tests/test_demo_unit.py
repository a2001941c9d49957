"""`rollout demo` / `rollout rl`'s own rules, without a broker: the run folders kept, a plan the chosen policy
cannot run refused in one line, the run's last revision told to the trainer."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from rollout.demo import PROFILES, _retain_runs, last_revision, load_plan

ROOT = Path(__file__).resolve().parents[1]


def test_older_run_folders_are_removed_newest_kept(tmp_path, capsys):
    """A run leaves its folder under .state/demo (checkpoints, vLLM log): the newest ``--keep-runs`` stay, older
    ones are removed when a run starts, so a machine running the loop every day does not fill its disk."""
    for i, name in enumerate(["a", "b", "c", "d"]):
        d = tmp_path / name / "checkpoints"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * 1000)
        os.utime(tmp_path / name, (1000 + i, 1000 + i))  # a oldest, d newest
    _retain_runs(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "d"]
    assert "removed 2 older run folder(s)" in capsys.readouterr().out
    _retain_runs(tmp_path, 2)  # nothing more to remove: silent
    assert capsys.readouterr().out == ""
    _retain_runs(tmp_path / "absent", 2)


def test_the_tiny_policy_refuses_a_plan_of_another_model_in_one_line():
    """`rollout demo --policy tiny --plan <a SmolLM2 recipe>` ended in a ContractError traceback (issue 36)."""
    from schemas.plan import PlanError

    args = argparse.Namespace(plan=str(ROOT / "examples" / "plans" / "arithmetic-smollm2.toml"), policy="tiny")
    with pytest.raises(PlanError, match="--policy tiny runs the tiny byte-level model .* leave out --policy"):
        load_plan(args)


def test_the_demos_last_revision_is_what_its_groups_fill_and_only_when_they_fill_whole_batches():
    """The trainer writes no training state at the run's last revision (the demo drops its states at the end): the
    demo's groups fix it when every rollout is one record and they fill whole batches; otherwise it is unknown,
    and a plan's own ``max_steps`` wins."""
    from schemas.plan_compiler import compile_plan

    for prof in PROFILES.values():
        plan = compile_plan(prof.plan)
        assert plan.max_steps is None and plan.one_record_per_rollout
        assert last_revision(plan, prof.groups) * plan.batch_size == prof.groups * plan.group_size
    plan = compile_plan(PROFILES["vllm"].plan)  # groups of 8, batches of 32
    assert last_revision(plan, 96) == 24 and last_revision(plan, 4) == 1
    assert last_revision(plan, 5) is None  # 40 rollouts: the last batch is a partial one, flushed later
    assert last_revision(plan.model_copy(update={"max_steps": 7}), 96) == 7
    assert last_revision(plan.model_copy(update={"token_batch_size": 4096}), 96) is None
