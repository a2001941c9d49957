"""The probe a trainer publishes each revision with (``PolicyRevision.probe``, ``policy.hf.logprob_probe``): what an
inference server that loaded the revision must answer for a few tokens. It must be the float32 logprobs of the
weights the checkpoint serves (rounded to bf16 on a CPU with native bf16), not of the trainer's own float32 weights,
for every kind of checkpoint: whole weights, a LoRA adapter, a LoRA model's merged weights. The arena's check of it
against a real vLLM is in tests/test_vllm.py."""

from __future__ import annotations

import pytest
import torch

from consumers import testing
from consumers.trainer.models import HFPolicy
from consumers.trainer.step import ReferenceTrainer
from consumers.trainer.tensors import to_tensors
from policy import hf
from schemas.batch import assemble_batch
from schemas.plan import LoraSpec


def _tiny_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True))


@pytest.mark.parametrize("serving", [None, "adapter", "merged"])
def test_a_published_revision_carries_the_float32_logprobs_its_checkpoint_serves(tmp_path, serving):
    fam = "org/tiny-llama"
    ref0 = hf.save_checkpoint(_tiny_llama(), tmp_path, fam, 0)
    rev0 = testing.revision(0, family=fam).model_copy(update={"checkpoint": ref0})
    lora = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"], serving=serving) if serving else None
    trainer = ReferenceTrainer(HFPolicy.load(ref0), fam, 0, tmp_path, lr=5e-2, kind=HFPolicy, lora=lora, ref=ref0)
    records = [testing.training_record(i, family=fam, reward=float(i % 2), prompt=6, n=12) for i in range(4)]
    batch = assemble_batch(records, rev0, 1, run_id="run", producer="t")
    trainer.step(to_tensors(batch), batch)
    trainer.model.train()
    rev = trainer.publish(run_id="run", batch=batch)
    assert trainer.model.training  # left as it was

    first = records[0]
    assert rev.probe.token_ids == [*first.prompt_token_ids, *first.completion_token_ids]
    ids = torch.tensor([rev.probe.token_ids])
    with torch.no_grad():
        served = hf.token_logprobs(hf.load_model(rev.checkpoint), ids, torch.ones_like(ids), autocast=False)[0]
    assert float((torch.tensor(rev.probe.logprobs) - served).abs().max()) < 1e-5
