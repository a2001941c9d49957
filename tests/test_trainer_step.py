"""The trainer's step: tensors from a batch, the reference trainer's update (ref_kl rows beside clipped ones), the
mismatch measured under the generating revision, and memory bounded by the token budget, not the batch."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from consumers import testing
from consumers.trainer.step import ReferenceTrainer, initial_revision
from consumers.trainer.tensors import to_tensors
from policy.checkpoint import file_sha256, load_checkpoint
from policy.model import PolicyModel, token_logprobs

from _trainer_batches import batch_of, record


def test_padded_tensors_align_tokens_mask_and_logprobs():
    recs = [testing.training_record(0, n=3), testing.training_record(1, n=6)]
    b = batch_of(recs)
    t = to_tensors(b, pad_id=7)
    assert t.input_ids.shape == (2, 4 + 6)
    r0 = b.records[0]
    assert t.input_ids[0, :7].tolist() == [*r0.prompt_token_ids.tolist(), *r0.completion_token_ids.tolist()]
    assert t.input_ids[0, 7:].tolist() == [7, 7, 7]
    assert t.loss_mask[0].tolist() == [0] * 4 + [1] * 3 + [0] * 3
    assert t.old_logprobs[1, 4:].tolist() == [-1.0] * 6
    assert torch.all(t.advantages[0, 4:7] == r0.advantage) and torch.all(t.advantages[0, :4] == 0)
    assert t.num_tokens == 9


def test_packed_tensors():
    b = batch_of([testing.training_record(0, n=3), testing.training_record(1, n=6)])
    t = to_tensors(b, packed=True)
    assert t.input_ids.shape == (1, 17) and t.cu_seqlens.tolist() == [0, 7, 17]
    assert t.loss_mask.sum() == 9


def test_reference_trainer_raises_logprob_of_advantaged_completion(tmp_path):
    model = PolicyModel.from_seed(0)
    prompt = list(b"1+1=")
    good, bad = list(b"2"), list(b"7")
    rev0 = initial_revision("tiny", tmp_path, seed=0)
    tr = ReferenceTrainer(model, "tiny", 0, tmp_path, lr=3e-3)
    with torch.no_grad():
        before = (float(token_logprobs(model, prompt, good).sum()), float(token_logprobs(model, prompt, bad).sum()))
    for step in range(15):
        recs = [record(4 * step + k, model, prompt, c, a) for k, (c, a) in enumerate([(good, 1.0), (bad, -1.0)] * 2)]
        target = testing.revision(tr.revision)
        target = target.model_copy(update={"checkpoint": rev0.checkpoint})
        b = batch_of(recs, target)
        stats = tr.step(to_tensors(b), b)
        assert np.isfinite(stats["loss"])
    with torch.no_grad():
        after = (float(token_logprobs(model, prompt, good).sum()), float(token_logprobs(model, prompt, bad).sum()))
    assert after[0] > before[0] + 0.5 and after[1] < before[1] - 0.5
    rev = tr.publish(run_id="run")
    assert rev.revision == 1 and rev.parent_revision == 0
    from policy.checkpoint import checkpoint_path

    assert file_sha256(checkpoint_path(rev.checkpoint)) == rev.checkpoint.digest
    reloaded = load_checkpoint(rev.checkpoint)
    assert torch.allclose(token_logprobs(reloaded, prompt, good), token_logprobs(model, prompt, good))


def test_a_records_reference_logprobs_train_it_with_ref_kl_toward_the_reference_beside_grpo_rows(tmp_path):
    """prime-rl's opd: a record with the reference's logprobs (advantage 0: none is assigned) trains with ref_kl, its
    completion's logprob moving toward the reference's; a grpo record in the same batch trains with the plan's
    objective; to_tensors puts each reference logprob under its completion token."""
    model = PolicyModel.from_seed(0)
    prompt, opd, grpo = list(b"3+4="), list(b"7"), list(b"9")
    rev0 = initial_revision("tiny", tmp_path, seed=0)
    tr = ReferenceTrainer(model, "tiny", 0, tmp_path, lr=3e-3)

    def lp(c):
        with torch.no_grad():
            return float(token_logprobs(model, prompt, c).sum())

    before = (lp(opd), lp(grpo))
    ref = np.array([-0.05], np.float32)  # the teacher is sure of "7"
    for step in range(10):
        distilled = [record(3 * step + k, model, prompt, opd, 0.0).model_copy(update={"ref_logprobs": ref,
                                                                                       "credit": "ref_kl"})
                     for k in range(2)]
        b = batch_of([*distilled, record(3 * step + 2, model, prompt, grpo, -1.0)],
                     testing.revision(tr.revision).model_copy(update={"checkpoint": rev0.checkpoint}))
        t = to_tensors(b)
        assert t.ref_rows.tolist() == [True, True, False]
        assert t.ref_logprobs[0, len(prompt)].item() == pytest.approx(-0.05) and t.ref_logprobs[2].abs().sum() == 0
        stats = tr.step(t, b)
        assert {"ref_kl", "ref_kl/is_masked", "is_masked"} <= stats.keys() and np.isfinite(stats["loss"])
        first = first if step else stats["ref_kl"]  # log p_ref - log p_trainer, token mean
    assert lp(opd) > before[0] + 0.5 and lp(grpo) < before[1] - 0.5
    assert abs(stats["ref_kl"]) < first - 0.5  # the trainer's logprob came (near) to the reference's


def test_mismatch_is_measured_under_the_revision_that_generated_each_token(tmp_path):
    """A pipelined batch holds tokens of earlier revisions: each is recomputed under its own weights (read from its
    checkpoint file), so exact logprobs give ~0 and logprobs off by 0.5 give 0.5, whatever the current weights."""
    model = PolicyModel.from_seed(0)
    prompt, completion = list(b"2+2="), list(b"4!")
    rev0 = initial_revision("tiny", tmp_path, seed=0)
    tr = ReferenceTrainer(model, "tiny", 0, tmp_path, lr=5e-2, epochs=3, ref=rev0.checkpoint)
    exact0 = [record(i, model, prompt, completion, (-1.0) ** i) for i in range(4)]  # generated by r0
    target = testing.revision(0).model_copy(update={"checkpoint": rev0.checkpoint})
    b = batch_of(exact0, target)
    first = tr.step(to_tensors(b), b)
    assert first["mismatch_tokens"] == 8 and first["mismatch_max"] < 1e-4  # r0 tokens under r0 weights
    tr.publish(run_id="run")  # now at r1; the weights moved
    with torch.no_grad():
        moved = float((token_logprobs(model, prompt, completion) - torch.tensor(exact0[0].completion_logprobs)).abs().max())
    assert moved > 1e-3
    off = [r.model_copy(update={"record_id": f"x{i}", "completion_logprobs": r.completion_logprobs - 0.5})
           for i, r in enumerate(exact0)]
    b = batch_of(off, testing.revision(1).model_copy(update={"checkpoint": rev0.checkpoint}))
    second = tr.step(to_tensors(b), b)  # r0 tokens, trainer at r1: measured with r0's checkpoint
    assert second["mismatch_tokens"] == 8 and abs(second["mismatch_mean"] - 0.5) < 1e-4
    tr.mismatch_rows = 1  # a sample: one row of an earlier revision
    assert tr.mismatch(to_tensors(b), b, torch.zeros(4, 5))["mismatch_tokens"] == 2
    tr.refs.pop(0)
    assert tr.mismatch(to_tensors(b), b, torch.zeros(4, 5)) == {"mismatch_tokens": 0.0}  # too old: not measured


def test_the_probe_runs_an_earlier_revision_in_the_trainers_own_model_and_puts_its_weights_back(tmp_path):
    """An HF model with a tied head: r0's rows, the trainer at r1, are probed under r0's file (the figure equals
    r0's model loaded on its own) in the trained model itself, and every weight, the tied head's too, is the
    trainer's own again after, the same tensors, so the next step trains from r1 and its optimizer still holds them."""
    from consumers.trainer.models import HFPolicy
    from policy import hf

    fam = "org/tiny-llama"
    ref0 = hf.save_checkpoint(_tiny_llama(vocab=64), tmp_path, fam, 0)
    trainer = ReferenceTrainer(HFPolicy.load(ref0), fam, 0, tmp_path, lr=5e-2, kind=HFPolicy, ref=ref0)
    recs = [testing.training_record(i, family=fam, revision_=0, reward=float(i % 2)) for i in range(4)]
    b = batch_of(recs, testing.revision(0, family=fam).model_copy(update={"checkpoint": ref0}))
    trainer.step(to_tensors(b), b)
    trainer.publish(run_id="run", batch=b)  # at r1
    model = trainer.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    own = {n: (p, p.data, p.detach().clone()) for n, p in model.named_parameters()}
    t = to_tensors(b)
    figures = trainer.mismatch(t, b, torch.zeros_like(t.old_logprobs[:, 1:]))
    with torch.no_grad():
        r0 = (HFPolicy.logprobs(HFPolicy.load(ref0), t) - t.old_logprobs[:, 1:])[t.loss_mask[:, 1:] > 0].abs()
        r1 = (HFPolicy.logprobs(model, t) - t.old_logprobs[:, 1:])[t.loss_mask[:, 1:] > 0].abs()
    assert figures["mismatch_mean"] == pytest.approx(float(r0.mean()), abs=1e-6)
    assert abs(float(r1.mean()) - float(r0.mean())) > 1e-4  # r1's weights would have given another figure
    for n, p in model.named_parameters():
        assert p is own[n][0] and p.data.data_ptr() == own[n][1].data_ptr() and torch.equal(p, own[n][2]), n
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.training is False


# -- bounded memory: logprobs at the trained positions, micro-batches by a token budget ---------------------------
def _tiny_llama(vocab: int = 512):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True), dtype=torch.float32)


def test_the_same_weights_written_twice_have_one_digest(tmp_path):
    """A checkpoint's digest names its content: safetensors' own header order changes from write to write, the
    sorted header does not; the file still loads as written (transformers reads it back)."""
    from transformers import AutoModelForCausalLM

    from policy import hf

    model = _tiny_llama()
    refs = [hf.save_checkpoint(model, tmp_path / str(k), "tiny-llama", 3) for k in range(6)]
    assert len({r.digest for r in refs}) == 1, [r.digest[:12] for r in refs]
    back = AutoModelForCausalLM.from_pretrained(hf.checkpoint_folder(refs[0]))
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v.to(hf.served_dtype("cpu")).to(back.state_dict()[k].dtype)), k


def test_trained_position_logprobs_equal_the_whole_vocabulary_softmax_and_its_gradient(monkeypatch):
    """``policy.hf.token_logprobs`` runs the head on the wanted positions only, in recomputed chunks: the values and
    the gradient are those of ``log_softmax`` over the model's whole logits."""
    from policy import hf

    monkeypatch.setattr(hf, "LOGIT_CHUNK", 5)  # several chunks, one of them partial
    model = _tiny_llama()
    ids = torch.randint(3, 512, (3, 12))
    att = torch.ones_like(ids)
    wanted = torch.zeros(3, 11, dtype=torch.bool)
    wanted[:, 6:] = True
    wanted[1, 2:4] = True  # a second turn of one row
    got = hf.token_logprobs(model, ids, att, wanted=wanted, autocast=False)
    got.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    whole = torch.log_softmax(model(input_ids=ids[:, :-1], attention_mask=att[:, :-1]).logits.float(), -1)
    ref = whole.gather(2, ids[:, 1:].unsqueeze(2)).squeeze(2)
    (ref * wanted).sum().backward()
    torch.testing.assert_close(got[wanted], ref[wanted], rtol=1e-5, atol=1e-5)
    assert torch.all(got[~wanted] == 0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def _saved_bytes_per_micro_batch(trainer, batch) -> list[int]:
    """The bytes autograd keeps for the backward pass, at their peak within each forward (activation memory)."""
    peaks: list[int] = []
    live = [0]

    def pack(t):
        live[0] += t.numel() * t.element_size()
        peaks[-1] = max(peaks[-1], live[0])
        return t

    loss = trainer.loss

    def counted(*a, **kw):
        peaks.append(0)
        live[0] = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return loss(*a, **kw)

    trainer.loss = counted
    trainer.step(to_tensors(batch), batch)
    return peaks


def _activation_peaks(tmp_path, rows: int, shared: bool = False, half: int = 64) -> list[int]:
    """Rows of ``half`` prompt and ``half`` completion tokens, each with its own prompt (a game's seats, turns) or,
    ``shared``, all one prompt (a group's)."""
    from consumers.trainer.models import HFPolicy
    from policy import hf

    fam = "tiny-llama"
    model = _tiny_llama(4096)
    ref0 = hf.save_checkpoint(model, tmp_path, fam, 0)
    trainer = ReferenceTrainer(model, fam, 0, tmp_path, kind=HFPolicy, micro_batch_tokens=256, ref=ref0)
    recs = [testing.training_record(i, family=fam, reward=float(i % 2)).model_copy(update={
        "prompt_token_ids": np.arange(3, 3 + half, dtype=np.int32) + (0 if shared else half * i),
        "completion_token_ids": np.arange(3 + half, 3 + 2 * half, dtype=np.int32),
        "completion_logprobs": np.full(half, -6.0, np.float32), "loss_mask": np.ones(half, np.uint8)})
        for i in range(rows)]
    b = batch_of(recs, testing.revision(0, family=fam).model_copy(update={"checkpoint": ref0}))
    return _saved_bytes_per_micro_batch(trainer, b)


def test_activation_memory_follows_the_token_budget_not_the_batch(tmp_path):
    """The memory bound: a micro-batch holds at most ``micro_batch_tokens`` tokens (256: 2 rows of 128), so what
    autograd keeps per micro-batch is the same for a batch of 4 rows and of 16, and no whole-vocabulary tensor per
    token is kept (one micro-batch's [tokens, vocab] float32 logits alone would be 256 x 4096 x 4 bytes = 4 MiB)."""
    small, large = _activation_peaks(tmp_path / "a", 4), _activation_peaks(tmp_path / "b", 16)
    assert (len(small), len(large)) == (2, 8)
    assert max(large) == max(small) < 256 * 4096 * 4, (small, large)
    # one prompt for all (policy.shared_prefix): packs of 3 rows, 64 + 3 x 63 = 253 tokens, as many micro-batches of
    # one pack whatever the batch; a pack keeps its attention mask besides (the boolean W x W, and the float32 copy
    # SDPA's kernel keeps in each layer: for SmolLM2 at W = 1,024, 120 MB beside the row's ~1.2 GB of activations)
    shared, more = _activation_peaks(tmp_path / "c", 16, shared=True), _activation_peaks(tmp_path / "d", 32, shared=True)
    assert (len(shared), len(more)) == (6, 11)
    assert max(shared) == max(more) < 256 * 4096 * 4, (shared, more)


def test_echo_spans_train_the_environments_prompt_tokens_with_cross_entropy(tmp_path):
    """prime-rl's echo on an HF model: records whose prompt carries a ce span (the environment's tokens of a later
    turn), their completions off the loss mask, so that cross-entropy alone trains: the span's tokens get likelier
    step by step and the step's ce/nll falls. Rows sharing their prompt run it once unless a loss reads inside it
    (``TrainerTensors.wanted``): the rows with a span run alone."""
    from consumers.trainer.models import HFPolicy
    from policy import hf
    from schemas.events import CeSpan

    fam = "org/tiny-llama"
    ref0 = hf.save_checkpoint(_tiny_llama(vocab=64), tmp_path / "ck", fam, 0)
    trainer = ReferenceTrainer(HFPolicy.load(ref0), fam, 0, tmp_path / "ck", lr=1e-2, kind=HFPolicy)
    rev0 = testing.revision(0, family=fam).model_copy(update={"checkpoint": ref0})
    span = CeSpan(start=5, end=12, weight=1.0)

    def span_logprob() -> float:
        ids = torch.arange(16).unsqueeze(0)
        wanted = torch.zeros(1, 15, dtype=torch.bool)
        wanted[0, span.start - 1:span.end - 1] = True
        with torch.no_grad():
            return float(hf.token_logprobs(trainer.model, ids, torch.ones_like(ids), wanted=wanted).sum())

    before, nll = span_logprob(), []
    for step in range(6):
        recs = [testing.training_record(8 * step + i, family=fam, revision_=0, reward=0.5, prompt=12)
                .model_copy(update={"ce_spans": [span] if i < 2 else None, "loss_mask": np.zeros(8, np.uint8)})
                for i in range(4)]
        b = batch_of(recs, rev0)
        t = to_tensors(b)
        assert t.ce_weights[0, 5:12].tolist() == [1.0] * 7 and t.ce_weights[2].abs().sum() == 0
        assert bool(t.wanted[0, 4:11].all()) and not bool(t.wanted[2].any())
        stats = trainer.step(t, b)
        nll.append(stats["ce/nll"])
    assert span_logprob() > before + 1.0 and nll[-1] < nll[0] - 0.1, (span_logprob() - before, nll)
