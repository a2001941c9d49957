"""A LoRA revision written as its adapter alone (``policy.hf.save_checkpoint(..., base=)``): a PEFT folder that peft
and vLLM read, digest-checked like any checkpoint, naming the base it applies to."""

from __future__ import annotations

import json

import pytest
import torch

from policy import hf, lora
from policy.checkpoint import CheckpointDigestError
from schemas.plan import LoraSpec


def _model(seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True))


def _trained(tmp_path, spec: LoraSpec):
    """Revision 0 (the base) and a model over it whose adapters are not zero, as training leaves them."""
    base = hf.save_checkpoint(_model(), tmp_path, "org/m", 0)
    model = lora.inject(hf.load_model(base), spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return base, model.eval()


def test_an_adapter_revision_is_a_peft_folder_that_peft_loads_back_exactly(tmp_path):
    """The folder holds peft's ``adapter_config.json`` (rank, alpha, the target modules the model has, its base's
    folder) and ``adapter_model.safetensors`` under peft's names; ``PeftModel.from_pretrained`` on the base loads
    every tensor and computes what the trainer's model computes. ``hf.load_model`` of the ref (digest checked, the
    base found from the file's metadata) is the same model again."""
    from peft import PeftModel

    spec = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj", "experts"])
    base, model = _trained(tmp_path, spec)
    ref = hf.save_checkpoint(model, tmp_path, "org/m", 3, base=base)
    folder = hf.checkpoint_folder(ref)
    assert ref.adapter and folder.name.startswith("org--m-r000003-")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == ("LORA", "CAUSAL_LM", 4, 8)
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]  # "experts": not in Llama
    assert config["base_model_name_or_path"] == str(hf.checkpoint_folder(base))
    assert lora.base_of(ref) == base
    tensors = hf.load_weights(ref)
    assert all(k.startswith("base_model.model.model.layers.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
               for k in tensors) and len(tensors) == 2 * 3 * 2
    assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (16, 4)

    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        want = model(ids).logits
        peft_model = PeftModel.from_pretrained(hf.load_model(base), str(folder)).eval()
        held = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
        assert len(held) == len(tensors)
        assert torch.allclose(peft_model(ids).logits, want, atol=1e-6)
        assert torch.allclose(hf.load_model(ref)(ids).logits, want, atol=1e-6)
        assert not torch.allclose(hf.load_model(base)(ids).logits, want, atol=1e-3)  # the adapter matters
    assert lora.model_names(tensors).keys() == lora.adapter_state(model).keys()


def test_vllm_reads_the_adapter_folder(tmp_path):
    """vLLM's own reader of an adapter folder (what ``/v1/load_lora_adapter`` runs): the config is legal for a
    server whose max LoRA rank is the spec's, every tensor name parses to a module vLLM adapts, and the loaded
    A and B are the trainer's, scaled by alpha / rank."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    spec = LoraSpec(rank=8, alpha=16)
    base, model = _trained(tmp_path, spec)
    folder = hf.checkpoint_folder(hf.save_checkpoint(model, tmp_path, "org/m", 1, base=base))
    helper = PEFTHelper.from_local_dir(str(folder), max_position_embeddings=64)
    assert (helper.r, helper.lora_alpha, helper._validate_features()) == (8, 16, [])
    modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    loaded = LoRAModel.from_local_checkpoint(str(folder), modules, helper, lora_model_id=1, device="cpu",
                                             dtype=torch.float32)
    assert set(loaded.loras) == {f"model.layers.{i}.{m}" for i in (0, 1) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")}
    state = model.state_dict()
    q = "model.layers.0.self_attn.q_proj"
    assert torch.equal(loaded.loras[q].lora_a, state[f"{q}.lora_A.default.weight"])
    assert torch.equal(loaded.loras[q].lora_b, state[f"{q}.lora_B.default.weight"])
    assert loaded.loras[q].scaling == 16 / 8


def test_an_adapter_whose_bytes_changed_or_whose_base_changed_is_refused(tmp_path):
    """Digest-checked like any checkpoint: the adapter's own bytes, and the base its metadata names."""
    from schemas.policy import CheckpointRef

    spec = LoraSpec(rank=4, alpha=8, target_modules=["q_proj"])
    base, model = _trained(tmp_path, spec)
    ref = hf.save_checkpoint(model, tmp_path, "org/m", 1, base=base)
    with pytest.raises(CheckpointDigestError):
        hf.load_model(CheckpointRef(uri=ref.uri, digest="0" * 64))
    other = hf.save_checkpoint(model, tmp_path, "org/m", 2,
                               base=CheckpointRef(uri=base.uri, digest="1" * 64))  # a base that is not that file
    with pytest.raises(CheckpointDigestError):
        hf.load_model(other)


def test_a_trainer_without_lora_on_an_adapter_checkpoint_trains_the_merged_model(tmp_path):
    """A derived run whose plan trains every weight, forked at an adapter revision: the trainer starts from the
    merged weights (a plain model, no adapter layers), which compute what base + adapter computed."""
    from consumers.trainer.models import HFPolicy
    from consumers.trainer.step import ReferenceTrainer

    spec = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    base, model = _trained(tmp_path, spec)
    ref = hf.save_checkpoint(model, tmp_path, "org/m", 1, base=base)
    trainer = ReferenceTrainer(HFPolicy.load(ref), "org/m", 1, tmp_path, kind=HFPolicy, ref=ref)
    assert not lora.has_adapters(trainer.model) and not any("lora_" in k for k in trainer.model.state_dict())
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        assert torch.allclose(trainer.model(ids).logits, model(ids).logits, atol=1e-5)


def test_a_fresh_adapter_is_drawn_the_same_in_every_trainer_life():
    """``inject`` on the same base in two processes' lives (a take-over before any training state was written)
    gives the same ``lora_A`` (it was unseeded: the successor trained a different adapter from r0 on), and leaves
    the caller's random stream where it was."""
    spec = LoraSpec(rank=4, alpha=8)
    first = dict(lora.inject(_model(), spec).named_parameters())
    base = _model()
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    second = dict(lora.inject(base, spec).named_parameters())
    assert torch.equal(torch.rand(3), before)  # the global stream untouched by the draw
    a = [n for n in first if "lora_A" in n]
    assert a and all(torch.equal(first[n], second[n]) for n in a)
