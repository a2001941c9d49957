"""The trainer data-parallel on torch.distributed (``consumers.trainer.distributed``): 2 ranks under torchrun (FSDP2 on
gloo) train the batch the single-process trainer trains, to float rounding. Both sides run the same program
(``benchmarks.trainer_dp``) under torchrun, one with 1 process (no group) and one with 2. The take-over when a
rank dies is tested on the broker in ``tests/test_trainer_restart.py`` (``torchrun-2-ranks``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.trainer_dp import drift, run_group, weights
from consumers import testing
from consumers.trainer.distributed import read_sharded
from consumers.trainer.step import open_trainer
from schemas.policy import CheckpointRef
from consumers.trainer.state import TRAINING_STATE_SUFFIX
from schemas.batch import assemble_batch

ROOT = Path(__file__).resolve().parents[1]


def _tiny_gru(tmp: Path):
    from policy.checkpoint import load_checkpoint, save_checkpoint
    from policy.model import PolicyModel

    ref = save_checkpoint(PolicyModel.from_seed(0), tmp / "start", testing.FAMILY, 0)
    return testing.FAMILY, ref, load_checkpoint(ref).state_dict()


def _tiny_llama(tmp: Path):
    """Two transformer blocks (each its own FSDP2 unit) and tied embeddings (in the root unit)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from policy import hf

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True))
    ref = hf.save_checkpoint(model, tmp / "start", "org/tiny-llama", 0)
    return "org/tiny-llama", ref, hf.load_model(ref).state_dict()


# float32 (the GRU): rounding alone, ~1e-6 seen; bf16 autocast (the HF kind on this CPU): ~7e-4 seen. Leaving one
# record of the batch out moves the weights 0.8% and 13%: each tolerance is far below what a wrong batch gives.
@pytest.mark.parametrize("model, tolerance", [(_tiny_gru, 1e-4), (_tiny_llama, 1e-2)], ids=["gru-fp32", "llama-bf16"])
def test_two_ranks_train_what_one_trains(tmp_path, model, tolerance):
    family, ref, start = model(tmp_path)
    rev0 = testing.revision(0, family=family).model_copy(update={"checkpoint": ref})
    # 11 rows of uneven lengths: rank 0 trains 6, rank 1 trains 5. Each its own prompt: alone, rows that share one
    # run it once (policy.shared_prefix) and the ranks do not, a different summation that bf16 autocast rounds
    # differently (2.4% here, where these padded both ways are 7e-4); that equivalence is tests/test_shared_prefix.py's
    recs = [testing.training_record(i, family=family, n=6 + i % 5, reward=float(i % 3)) for i in range(11)]
    recs = [r.model_copy(update={"prompt_token_ids": r.prompt_token_ids + i}) for i, r in enumerate(recs)]
    batches = [assemble_batch(recs, rev0, 2, run_id="r", producer="t")] * 2
    one = run_group(1, batches, ref, tmp_path / "one", lr=1e-2)
    two = run_group(2, batches, ref, tmp_path / "two", lr=1e-2)
    fewer = run_group(1, [assemble_batch(recs[:-1], rev0, 2, run_id="r", producer="t")] * 2, ref,
                      tmp_path / "fewer", lr=1e-2)
    a, b = weights(one["state"]), weights(two["state"])
    assert sorted(a) == sorted(b)
    assert drift(a, b, start) < tolerance
    assert drift(a, weights(fewer["state"]), start) > 10 * tolerance  # the measure tells batches apart
    # the group's revisions are the single trainer's: same numbers, parents, batches; checkpoints written once
    assert [(r["revision"], r["parent_revision"], r["batch_id"]) for r in two["revisions"]] == \
        [(r["revision"], r["parent_revision"], r["batch_id"]) for r in one["revisions"]] == \
        [(1, 0, batches[0].batch_id), (2, 1, batches[0].batch_id)]
    assert len(two["peak_rss_mb"]) == 2
    # the training state the 2 ranks wrote, each its own shards, loads into one process: the same weights and
    # optimizer moments (a run can change its number of ranks)
    alone = open_trainer(ref=CheckpointRef(**two["revisions"][-1]["checkpoint"]), revision=2, family=family,
                         checkpoint_dir=str(tmp_path / "alone"))
    assert alone.load_training_state(CheckpointRef(**two["revisions"][-1]["checkpoint"]))
    written = read_sharded(Path(two["state"]))
    for k, v in alone.model.state_dict().items():
        assert torch.equal(v, written["model"][k]), k
    moments = alone.opt.state_dict()["state"]
    assert len(moments) == len(list(alone.model.parameters())) and all(int(m["step"]) == 2 for m in moments.values())
    written = sorted(p.name for p in (tmp_path / "two").iterdir() if "-r000002-" in p.name)
    assert len([n for n in written if not n.endswith(TRAINING_STATE_SUFFIX)]) == 1, written


def test_a_service_that_scales_by_instances_refuses_torchrun():
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "consumers", "serve", "verifier"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "only the trainer trains data-parallel" in done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("optim", ["lora", "muon"])
def test_a_trainer_plan_a_torchrun_group_cannot_train_is_refused_at_start(tmp_path, optim):
    """LoRA and muon train on one process: under torchrun the trainer says so when it starts, before it joins a
    group or reads a batch (it once refused the first batch, and its group restarted into a poison dead letter)."""
    plan = (ROOT / "examples/plans/arithmetic-smollm2-lora.toml").read_text()
    if optim == "muon":
        plan = re.sub(r"(?m)^\[trainer\.model\.lora\][^\[]*", "", plan).replace("[trainer.optim]", '[trainer.optim]\ntype = "muon"')
    (tmp_path / "plan.toml").write_text(plan)
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "consumers", "serve", "trainer", "--plan", str(tmp_path / "plan.toml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("rollout serve trainer: ") and ("LoRA" if optim == "lora" else "muon") in last, done.stderr


def test_a_training_state_written_before_states_were_sharded_still_resumes(tmp_path):
    """The single ``.train.pt`` file (optimizer state keyed by position) that trainers wrote before: a take-over
    from such a revision gets its weights and moments, not a fresh optimizer."""
    from consumers.trainer.state import LEGACY_TRAINING_STATE_SUFFIX
    from consumers.trainer.step import ReferenceTrainer
    from consumers.trainer.tensors import to_tensors

    family, ref, _ = _tiny_gru(tmp_path)
    rev0 = testing.revision(0, family=family).model_copy(update={"checkpoint": ref})
    old = open_trainer(ref=ref, revision=0, family=family, checkpoint_dir=str(tmp_path / "old"), lr=1e-2)
    b = assemble_batch([testing.training_record(i, n=6, reward=float(i % 2)) for i in range(4)], rev0, 1,
                       run_id="r", producer="t")
    old.step(to_tensors(b), b)
    rev = old.publish(run_id="r", batch=b)
    legacy = old.training_state_path(rev.checkpoint, LEGACY_TRAINING_STATE_SUFFIX)
    torch.save({"revision": 1, "model": old.model.state_dict(), "optimizer": old.opt.state_dict()}, legacy)
    import shutil

    from consumers.trainer.state import wait_for_training_states

    wait_for_training_states()  # the sharded one publish started, gone: only the legacy file is left
    shutil.rmtree(old.training_state_path(rev.checkpoint))
    new = open_trainer(ref=rev.checkpoint, revision=1, family=family, checkpoint_dir=str(tmp_path / "old"), lr=1e-2)
    assert isinstance(new, ReferenceTrainer) and new.load_training_state(rev.checkpoint)
    for k, v in old.model.state_dict().items():
        assert torch.equal(new.model.state_dict()[k], v), k
    for i, m in old.opt.state_dict()["state"].items():
        assert torch.equal(new.opt.state_dict()["state"][i]["exp_avg"], m["exp_avg"])
