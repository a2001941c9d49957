"""`rollout demo` / `rollout rl`'s own rules, without a broker: the run folders kept, a plan the chosen policy
cannot run refused in one line."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from rollout.demo import _retain_runs, load_plan

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
