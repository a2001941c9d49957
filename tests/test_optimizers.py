"""prime-rl's ``[trainer.optim] type``: muon and sign_sgd change what the reference trainer does, and a take-over
from a training state resumes either exactly (a small random-init Llama; no broker)."""

from __future__ import annotations

import torch

from consumers import testing
from consumers.trainer.models import HFPolicy
from consumers.trainer.state import wait_for_training_states
from consumers.trainer.step import ReferenceTrainer
from consumers.trainer.tensors import to_tensors
from schemas.batch import assemble_batch
from schemas.plan import OptimizerSpec

FAMILY = "org/tiny-llama"
Q = "model.layers.0.self_attn.q_proj.weight"


def _trainer(tmp_path, spec: OptimizerSpec | None, *, lr: float = 1e-2, **kw) -> tuple[ReferenceTrainer, object]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from policy import hf

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True))
    ref0 = hf.save_checkpoint(model, tmp_path / "ck", FAMILY, 0)
    rev0 = testing.revision(0, family=FAMILY).model_copy(update={"checkpoint": ref0})
    return ReferenceTrainer(HFPolicy.load(ref0), FAMILY, 0, tmp_path / "ck", lr=lr, kind=HFPolicy, optimizer=spec,
                            **kw), rev0


def _step(trainer: ReferenceTrainer, rev, k: int):
    recs = [testing.training_record(10 * k + i, family=FAMILY, revision_=k, reward=float(i % 2)) for i in range(4)]
    b = assemble_batch(recs, rev, 1, run_id="run", producer="t")
    trainer.step(to_tensors(b), b)
    return trainer.publish(run_id="run", batch=b)


def _top(update: torch.Tensor) -> list[float]:
    return torch.linalg.svdvals(update.double()).tolist()


def test_muon_orthogonalizes_the_matrices_and_leaves_embeddings_and_norms_to_adamw(tmp_path):
    trainer, rev0 = _trainer(tmp_path, OptimizerSpec(type="muon", betas=(0.9, 0.95), momentum=0.95))
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    muon, adamw = ([names[id(p)] for g in o.param_groups for p in g["params"]] for o in trainer.opt.parts)
    assert isinstance(trainer.opt.parts[0], torch.optim.Muon) and isinstance(trainer.opt.parts[1], torch.optim.AdamW)
    assert Q in muon and "model.layers.1.mlp.down_proj.weight" in muon
    assert "model.embed_tokens.weight" in adamw and "model.norm.weight" in adamw  # tied LM head: the embeddings
    assert all(trainer.model.get_parameter(n).ndim == 2 for n in muon) and len(muon) == 2 * 7
    assert trainer.opt.param_groups[1]["betas"] == (0.9, 0.95)

    before = trainer.model.get_parameter(Q).detach().clone()
    _step(trainer, rev0, 0)
    muon_update = trainer.model.get_parameter(Q).detach() - before
    adam, rev0b = _trainer(tmp_path / "adamw", None)
    before = adam.model.get_parameter(Q).detach().clone()
    _step(adam, rev0b, 0)
    adam_update = adam.model.get_parameter(Q).detach() - before
    # Newton-Schulz flattens the gradient's leading directions to one size, lr scaled to AdamW's update RMS
    # (0.2 * sqrt(16) = 0.8 lr, within the quintic's band); AdamW's update keeps the gradient's uneven spectrum
    m, a = _top(muon_update), _top(adam_update)
    assert 0.6 * 0.8e-2 < m[0] < 1.3 * 0.8e-2 and m[0] / m[3] < 1.1, m
    assert a[0] / a[3] > 1.5, a


def test_sign_sgd_moves_every_weight_with_a_gradient_by_the_learning_rate_and_keeps_no_state(tmp_path):
    lr = 1e-3
    trainer, rev0 = _trainer(tmp_path, OptimizerSpec(type="sign_sgd", max_norm=None), lr=lr)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    _step(trainer, rev0, 0)
    moved = 0
    for n, p in trainer.model.named_parameters():
        delta = (p.detach() - before[n]).abs()
        changed = delta > 0
        moved += int(changed.sum())
        assert torch.allclose(delta[changed], torch.full_like(delta[changed], lr), rtol=1e-2), n
    assert moved > 0.5 * sum(p.numel() for p in trainer.model.parameters())
    assert not trainer.opt.state


def test_a_take_over_from_a_muon_training_state_resumes_it_exactly(tmp_path):
    """The training state holds Muon's momentum and AdamW's moments in one optimizer state; a successor loaded
    from it trains the next batch to the same weights, bit for bit, as the trainer that never stopped."""
    spec = OptimizerSpec(type="muon", betas=(0.9, 0.95))
    trainer, rev = _trainer(tmp_path, spec, state_every=1)
    for k in range(2):
        rev = _step(trainer, rev, k)
    wait_for_training_states()
    successor = ReferenceTrainer(HFPolicy.load(rev.checkpoint), FAMILY, 2, tmp_path / "ck", lr=1e-2, kind=HFPolicy,
                                 optimizer=spec)
    assert successor.load_training_state(rev.checkpoint, 2)
    assert successor.opt.parts[0].state is successor.opt.state and successor.opt.state
    _step(trainer, rev, 2)
    _step(successor, rev, 2)
    for (n, a), b in zip(trainer.model.named_parameters(), successor.model.parameters()):
        assert torch.equal(a, b), n
