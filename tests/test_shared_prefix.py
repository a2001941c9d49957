"""A group's prompt run once (``policy.shared_prefix``) gives the logprobs and the gradients of the padded batch.

On a small random-init Llama (transformers' own implementation, float32), for SDPA and eager attention: groups of
different prompt and completion lengths, a row alone, and a row whose loss reaches into its prompt, in one batch.
"""

from __future__ import annotations

import pytest
import torch

from policy import shared_prefix
from policy.hf import token_logprobs


def _llama(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation=attn)
    return LlamaForCausalLM(config).float()


def _batch():
    """Rows as the trainer pads them: prompt, completion, right padding; the loss on the completion."""
    g = torch.Generator().manual_seed(1)
    tok = lambda n: torch.randint(3, 97, (n,), generator=g)  # noqa: E731
    p1, p2 = tok(7), tok(12)
    rows = [(p1, tok(5)), (p1, tok(9)), (p1, tok(1)),          # a group, completions of 5, 9 and 1 tokens
            (tok(4), tok(6)),                                 # a row alone
            (p2, tok(3)), (p2, tok(8)),                        # another group, longer prompt
            (p1, tok(4))]                                     # the first group's prompt again, apart from it
    T = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros((len(rows), T), dtype=torch.long)
    att = torch.zeros((len(rows), T), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), T))
    for i, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        ids[i, :n] = torch.cat([p, c])
        att[i, :n] = 1
        loss_mask[i, len(p):n] = 1.0
    loss_mask[5, len(p2) + 2] = 0.0  # a token of another seat inside a completion: not trained, still attended to
    prompt_lens = torch.tensor([len(p) for p, _ in rows])
    return ids, att, loss_mask, prompt_lens, att.sum(1)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prompts_give_the_padded_batchs_logprobs_and_gradients(attn):
    model = _llama(attn)
    ids, att, loss_mask, prompt_lens, seq_lens = _batch()
    wanted = loss_mask[:, 1:] > 0
    weights = torch.linspace(0.5, 1.5, wanted.numel()).reshape(wanted.shape)  # a loss that weighs every token

    def run(**kw):
        model.zero_grad()
        lp = token_logprobs(model, ids, att, wanted=wanted, autocast=False, **kw)
        (lp * weights).sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    padded, padded_grads = run()
    shared, shared_grads = run(prompt_lens=prompt_lens, seq_lens=seq_lens)
    plan = shared_prefix.layout(ids, wanted, prompt_lens, seq_lens)
    assert [rows for rows, _ in plan.groups] == [[0, 1, 2, 6], [4, 5]] and plan.singles == [3]
    assert bool((shared[~wanted] == 0).all()) and bool((shared[wanted] != 0).all())
    torch.testing.assert_close(shared, padded, rtol=1e-5, atol=1e-5)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_tokens_logprob_is_its_log_softmax_whatever_integer_type_holds_the_ids():
    """The definition, on the whole logits (a record's token ids arrive as int32 from its arrays)."""
    model = _llama("sdpa")
    ids, att, loss_mask, _, _ = _batch()
    wanted = loss_mask[:, 1:] > 0
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1], attention_mask=att[:, :-1]).logits.float()
        expected = logits.log_softmax(-1).gather(2, ids[:, 1:, None])[..., 0]
        for dtype in (torch.long, torch.int32):
            lp = token_logprobs(model, ids.to(dtype), att, wanted=wanted, autocast=False)
            torch.testing.assert_close(lp[wanted], expected[wanted], rtol=1e-5, atol=1e-5)


def test_a_row_whose_loss_reaches_into_its_prompt_runs_padded():
    ids, att, loss_mask, prompt_lens, seq_lens = _batch()
    loss_mask[1, 3] = 1.0
    plan = shared_prefix.layout(ids, loss_mask[:, 1:] > 0, prompt_lens, seq_lens)
    assert plan.singles == [1, 3] and [rows for rows, _ in plan.groups] == [[0, 2, 6], [4, 5]]


def test_attention_a_mask_cannot_be_given_to_is_not_packed():
    model = _llama("sdpa")
    assert shared_prefix.packable(model)
    model.config.sliding_window = 4096
    assert not shared_prefix.packable(model)


def test_micro_batches_keep_a_group_in_one_packed_row_within_the_budget():
    """The demo's shape, its records in the order the batcher gives them (not by group): a group's 8 rows are one
    packed row of 40 + 8 x 15 = 160 tokens, as many per micro-batch as fit the budget; a budget narrower than a group
    cuts it into packs, each with the prompt; every row once."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 97, (40,), generator=g) for _ in range(4)]
    order = torch.randperm(32, generator=g).tolist()
    ids = torch.stack([torch.cat([prompts[i // 8], torch.randint(3, 97, (16,), generator=g)]) for i in order])
    prompt_lens, seq_lens = torch.full((32,), 40), torch.full((32,), 56)
    wanted = torch.zeros((32, 55), dtype=torch.bool)
    wanted[:, 39:] = True
    for budget, sizes, widest in ((1024, [32], 160), (400, [16, 16], 160), (160, [8] * 4, 160), (100, [4] * 8, 100)):
        plan = shared_prefix.micro_batches(ids, wanted, prompt_lens, seq_lens, budget)
        assert sorted(r for rows, _ in plan for r in rows) == list(range(32))
        assert [len(rows) for rows, _ in plan] == sizes and {w for _, w in plan} == {widest}, budget
        assert all(len({order[r] // 8 for r in rows}) == max(1, len(rows) // 8) for rows, _ in plan)
