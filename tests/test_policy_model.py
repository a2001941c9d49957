"""policy/: tokenizer round trip, seeded init, real logprobs that the trainer can recompute, checkpoints."""

import pytest
import torch

from policy import TOKENIZER, PolicyModel, generate, generate_batch, load_checkpoint, save_checkpoint, token_logprobs
from policy.checkpoint import CheckpointDigestError
from policy.model import token_logprobs_batch
from policy.tokenizer import ASSISTANT, BOS, END
from schemas.policy import CheckpointRef


def test_tokenizer_round_trip_and_template():
    ids = TOKENIZER.encode_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}])
    assert ids[0] == BOS and ids[-1] == ASSISTANT and ids.count(END) == 2
    assert TOKENIZER.decode(TOKENIZER.encode("héllo ✓")) == "héllo ✓"
    assert "<|user|>" in TOKENIZER.decode(ids, skip_special=False)


def test_seeded_init_is_deterministic():
    a, b, c = PolicyModel.from_seed(7), PolicyModel.from_seed(7), PolicyModel.from_seed(8)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.head.weight, c.head.weight)
    assert 100_000 <= a.num_parameters() <= 1_000_000


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_generate_logprobs_are_the_models(temperature):
    model = PolicyModel.from_seed(0)
    prompt = TOKENIZER.encode_chat([{"role": "user", "content": "2+2?"}])
    ids, lps = generate(model, prompt, 40, temperature, seed=3)
    assert 1 <= len(ids) <= 40 and len(ids) == len(lps)
    assert generate(model, prompt, 40, temperature, seed=3) == (ids, lps)
    recomputed = token_logprobs(model, prompt, ids, temperature if temperature > 0 else 1.0).detach()
    assert torch.allclose(recomputed, torch.tensor(lps), atol=1e-5)
    assert all(lp <= 0 for lp in lps)
    batched = generate_batch(model, [prompt, prompt[:-1] + [ASSISTANT]], 40, temperature, [3, 4])
    assert batched[0][0] == ids
    rb = token_logprobs_batch(model, [prompt], [ids], temperature if temperature > 0 else 1.0)[0].detach()
    assert torch.allclose(rb, torch.tensor(lps), atol=1e-5)


def test_checkpoint_round_trip_and_digest_check(tmp_path):
    model = PolicyModel.from_seed(1)
    ref = save_checkpoint(model, tmp_path, "tiny", 2)
    assert ref.uri.endswith(f"tiny-r000002-{ref.digest[:12]}.pt")
    loaded = load_checkpoint(ref)
    assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), loaded.state_dict().values()))
    with pytest.raises(CheckpointDigestError):
        load_checkpoint(CheckpointRef(uri=ref.uri, digest="0" * 64))


def test_two_trainers_writing_one_revision_never_overwrite_each_other(tmp_path):
    """A fenced trainer and its successor sharing a volume both write revision 2: checkpoints are named by their
    content, so the committed one's file still matches its digest, whatever the other wrote after it (issue 24,
    hole 2); the same tiny-model weights written twice are one file (safetensors orders its metadata as a hash map
    does, so two HF saves of the same weights may differ in bytes, and are then two folders)."""
    from policy import hf
    from policy.checkpoint import checkpoint_path, file_sha256
    from transformers import AutoModelForCausalLM, LlamaConfig

    committed = save_checkpoint(PolicyModel.from_seed(1), tmp_path, "tiny", 2)
    zombie = save_checkpoint(PolicyModel.from_seed(2), tmp_path, "tiny", 2)  # after the commit, other weights
    assert checkpoint_path(committed) != checkpoint_path(zombie)
    assert file_sha256(checkpoint_path(committed)) == committed.digest
    load_checkpoint(committed)  # digest-checked
    assert save_checkpoint(PolicyModel.from_seed(1), tmp_path, "tiny", 2) == committed
    assert len(list(tmp_path.glob("tiny-r000002-*.pt"))) == 2 and not list(tmp_path.glob("*.tmp*"))

    def llama(seed: int):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=64))

    a = hf.save_checkpoint(llama(0), tmp_path / "hf", "org/m", 2)
    b = hf.save_checkpoint(llama(1), tmp_path / "hf", "org/m", 2)
    assert hf.checkpoint_folder(a) != hf.checkpoint_folder(b)
    assert file_sha256(checkpoint_path(a)) == a.digest and file_sha256(checkpoint_path(b)) == b.digest
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted(
        hf.checkpoint_folder(r).name for r in (a, b))


def test_an_hf_checkpoint_loads_as_its_tensors_and_refuses_one_missing(tmp_path):
    """``hf.load_model`` builds the model without a random init: every weight must then be the checkpoint's (the
    tied head the embeddings), and a checkpoint lacking one is refused rather than left uninitialised."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    from policy import hf
    from policy.checkpoint import checkpoint_path

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    ref = hf.save_checkpoint(AutoModelForCausalLM.from_config(config), tmp_path, "org/m", 1)
    saved = load_file(checkpoint_path(ref))
    model = hf.load_model(ref)
    own = dict(model.named_parameters())
    assert set(saved) == set(own) and all(torch.equal(own[k], v.float()) for k, v in saved.items())
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(model(ids).logits, hf.load_model(ref)(ids).logits)  # nothing of a fresh init in it

    broken = tmp_path / "broken"
    broken.mkdir()
    save_file({k: v for k, v in saved.items() if not k.endswith("layers.1.mlp.up_proj.weight")}, broken / hf.WEIGHTS)
    config.to_json_file(broken / "config.json")
    with pytest.raises(ValueError, match="missing.*up_proj"):
        hf.load_model(broken / hf.WEIGHTS)
