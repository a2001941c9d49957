"""benchmarks/distill.py's pure parts: which checkpoint is the teacher, and the plan that names it."""

from pathlib import Path

import pytest

from benchmarks.distill import plan_for, teacher_checkpoint
from policy.hf import WEIGHTS
from schemas.plan import references
from schemas.plan_compiler import compile_plan


def _checkpoint(folder: Path, name: str, weights: str = WEIGHTS) -> Path:
    (folder / name).mkdir(parents=True)
    (folder / name / weights).write_bytes(b"w")
    return folder / name


def test_a_runs_teacher_is_its_newest_whole_model_checkpoint(tmp_path):
    ck = tmp_path / "run" / "checkpoints"
    _checkpoint(ck, "SmolLM2-135M-Instruct-r000008-aaaaaaaaaaaa")
    newest = _checkpoint(ck, "SmolLM2-135M-Instruct-r000024-bbbbbbbbbbbb")
    _checkpoint(ck, "SmolLM2-135M-Instruct-r000016-cccccccccccc")
    _checkpoint(ck, "SmolLM2-135M-Instruct-r000030-dddddddddddd", weights="adapter_model.safetensors")  # LoRA
    assert teacher_checkpoint(str(tmp_path / "run")) == newest
    assert teacher_checkpoint(str(newest)) == newest
    with pytest.raises(SystemExit, match="no checkpoint"):
        teacher_checkpoint(str(tmp_path / "nothing-here"))


def test_the_student_plan_names_the_teacher_as_served(tmp_path):
    name = "SmolLM2-135M-Instruct-r000024-bbbbbbbbbbbb"
    plan = compile_plan(str(plan_for(name, tmp_path)))
    assert plan.advantage.credit == "ref_kl" and not plan.refused
    ref = references(plan).by_source["arithmetic"]
    assert (ref.model, ref.base_url) == (name, "http://127.0.0.1:8001/v1")
