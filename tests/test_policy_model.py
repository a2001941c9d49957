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
    assert ref.uri.endswith("tiny-r000002.pt")
    loaded = load_checkpoint(ref)
    assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), loaded.state_dict().values()))
    with pytest.raises(CheckpointDigestError):
        load_checkpoint(CheckpointRef(uri=ref.uri, digest="0" * 64))
