"""LoRA training: adapters only, each revision served as its spec says, take-overs that resume the adapter exactly."""

from __future__ import annotations


import pytest
import torch

from consumers import testing
from consumers.trainer.task import TrainerTask
from consumers.trainer.state import wait_for_training_states
from consumers.trainer.step import ReferenceTrainer
from consumers.trainer.tensors import to_tensors

from _trainer_batches import BatchRec, batch_of, json_roundtrip


def _lora_llama(seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True))


@pytest.mark.parametrize("serving", ["adapter", "merged"])
def test_a_lora_recipe_trains_the_adapters_only_and_serves_each_revision_as_its_spec_says(tmp_path, serving):
    """``[trainer.model.lora]``: adapters on the attention projections, the rest frozen. Two revisions: the adapters
    move and the base weights do not (bit for bit), the optimizer holds moments for the adapters only. Served as an
    adapter (prime-rl's way), each checkpoint is a PEFT folder of the adapter alone naming revision 0 as its base;
    served merged, the merged weights under the model's own names, equal to base + scale B A. Either way the trainer's
    model (base + adapter) and the served weights give the same logprobs, and a take-over from the training state
    resumes the adapters exactly (``settle`` finds the served weights)."""
    from consumers.trainer.models import HFPolicy
    from policy import hf, lora
    from schemas.plan import LoraSpec

    fam = "org/tiny-llama"
    ck = tmp_path / "checkpoints"
    ref0 = hf.save_checkpoint(_lora_llama(), ck, fam, 0)
    rev0 = testing.revision(0, family=fam).model_copy(update={"checkpoint": ref0})
    spec = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "experts"], serving=serving)  # no experts
    trainer = ReferenceTrainer(HFPolicy.load(ref0), fam, 0, ck, lr=5e-2, kind=HFPolicy, lora=spec, state_every=2,
                               ref=ref0)
    base0 = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_" not in k}
    adapters0 = {k: v.clone() for k, v in lora.adapter_state(trainer.model).items()}
    assert adapters0 and all(("q_proj" in k or "v_proj" in k) for k in adapters0)
    assert {id(p) for g in trainer.opt.param_groups for p in g["params"]} == \
        {id(p) for n, p in trainer.model.named_parameters() if "lora_" in n}
    rev = rev0
    for k in range(2):
        recs = [testing.training_record(10 * k + i, family=fam, revision_=k, reward=float(i % 2)) for i in range(4)]
        b = batch_of(recs, rev)
        trainer.step(to_tensors(b), b)
        rev = trainer.publish(run_id="run", batch=b)
    wait_for_training_states()
    after = trainer.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in base0.items())  # the base did not move
    moved = [k for k, v in adapters0.items() if not torch.equal(after[k], v)]
    assert any("lora_A" in k for k in moved) and any("lora_B" in k for k in moved)
    q = "model.layers.0.self_attn.q_proj"
    a, b_ = after[f"{q}.lora_A.default.weight"], after[f"{q}.lora_B.default.weight"]
    served = hf.load_weights(rev.checkpoint)
    if serving == "adapter":
        folder = hf.checkpoint_folder(rev.checkpoint)
        assert rev.checkpoint.adapter and sorted(p.name for p in folder.iterdir()) == \
            ["adapter_config.json", "adapter_model.safetensors", "revision.json"]
        assert lora.base_of(rev.checkpoint) == ref0  # every adapter names revision 0, the unchanged base
        assert set(served) == {f"base_model.model.model.layers.{i}.self_attn.{m}_proj.lora_{x}.weight"
                               for i in (0, 1) for m in "qv" for x in "AB"}  # peft's names, nothing of the base's
        assert torch.equal(served[f"base_model.model.{q}.lora_B.weight"], b_)  # float32, as trained
    else:
        assert not rev.checkpoint.adapter
        assert set(served) == set(hf.load_weights(ref0))  # the model's own names, nothing of peft's
        merged = after[f"{q}.base_layer.weight"] + (spec.alpha / spec.rank) * b_ @ a
        assert torch.equal(served[f"{q}.weight"], merged.to(hf.served_dtype("cpu")))
        assert torch.equal(served["model.layers.0.mlp.up_proj.weight"],
                           hf.load_weights(ref0)["model.layers.0.mlp.up_proj.weight"])
    # what the revision serves (loaded from its checkpoint alone) is what the trainer computes with: the same numbers
    # where it serves float32; where it serves bf16 (a CPU with native bf16: ``hf.served_dtype``) within the weights'
    # rounding, a tenth of what the two steps moved
    t = to_tensors(b)
    with torch.no_grad():
        served_lp, trained_lp, base_lp = (HFPolicy.logprobs(m, t) for m in (
            HFPolicy.load(rev.checkpoint), trainer.model.eval(), HFPolicy.load(ref0)))
    tol = 1e-5 if hf.served_dtype("cpu") == torch.float32 else 2e-3
    assert float((served_lp - trained_lp).abs().max()) <= tol < float((base_lp - trained_lp).abs().max()) / 10

    # a take-over from r2's training state: the adapters and the served weights exactly
    successor = ReferenceTrainer(HFPolicy.load(rev.checkpoint), fam, 2, ck, lr=5e-2, kind=HFPolicy, lora=spec,
                                 ref=rev.checkpoint)
    assert successor.load_training_state(rev.checkpoint, 2)
    assert all(torch.equal(successor.model.state_dict()[k], v) for k, v in lora.adapter_state(trainer.model).items())
    assert successor.settle(rev.checkpoint, 2)
    assert successor.base == (ref0 if serving == "adapter" else None)


def test_a_take_over_that_did_not_reproduce_an_adapter_takes_the_served_one(tmp_path):
    """``settle`` at an adapter revision whose re-training differs: the adapters take the served adapter, the base
    is untouched. The mismatch probe of an earlier revision runs that revision's adapter, not the current one."""
    from consumers.trainer.models import HFPolicy
    from policy import hf, lora
    from schemas.plan import LoraSpec

    fam = "org/tiny-llama"
    ck = tmp_path / "checkpoints"
    ref0 = hf.save_checkpoint(_lora_llama(), ck, fam, 0)
    spec = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = ReferenceTrainer(HFPolicy.load(ref0), fam, 0, ck, lr=5e-2, kind=HFPolicy, lora=spec, ref=ref0)
    rev = testing.revision(0, family=fam).model_copy(update={"checkpoint": ref0})
    recs = [testing.training_record(i, family=fam, revision_=0, reward=float(i % 2)) for i in range(4)]
    b = batch_of(recs, rev)
    trainer.step(to_tensors(b), b)
    r1 = trainer.publish(run_id="run", batch=b)
    served = {k: v.clone() for k, v in lora.adapter_state(trainer.model).items()}
    base = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_" not in k}
    other = ReferenceTrainer(HFPolicy.load(ref0), fam, 0, ck, lr=5e-2, kind=HFPolicy, lora=spec, ref=ref0)  # new A
    assert not other.settle(r1.checkpoint, 1)
    held = other.model.state_dict()
    assert all(torch.equal(held[k], v) for k, v in served.items())
    assert all(torch.equal(held[k], v) for k, v in base.items())
    # r0's rows probed under r0 (no adapter: B = 0), not under r1's adapter
    old = to_tensors(b)
    figures = trainer.mismatch(old, b, torch.zeros_like(old.old_logprobs[:, 1:]))
    with torch.no_grad():
        expected = (HFPolicy.logprobs(HFPolicy.load(ref0), old) - old.old_logprobs[:, 1:]).abs()
    expected = expected[old.loss_mask[:, 1:] > 0]
    assert figures["mismatch_mean"] == pytest.approx(float(expected.mean()), abs=1e-6)


async def test_a_lora_trainer_taken_over_between_training_states_resumes_its_adapter_exactly(tmp_path):
    """A LoRA run publishing adapters, training states every 3 revisions: the trainer stops after r5; its successor
    opens the committed r5 (its adapter over the base it names), loads r3's state, trains r4's and r5's batches
    again, settles on r5's adapter and trains r6: the same adapter revision, adapters and moments, bit for bit, as
    a trainer that never stopped, and still an adapter naming revision 0."""
    from policy import hf, lora
    from schemas import codec
    from schemas.plan import LoraSpec
    from schemas.policy import CheckpointRef

    fam = "org/tiny-llama"
    ref0 = hf.save_checkpoint(_lora_llama(), tmp_path / "r0", fam, 0)
    spec = LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    log: dict[int, bytes] = {}

    async def read_records(topic, partition, offsets):
        return [BatchRec(o, log[o]) for o in offsets if o in log]

    def batch(k):
        recs = [testing.training_record(10 * k + i, family=fam, revision_=k, reward=float((i + k) % 2))
                for i in range(4)]
        return batch_of(recs, testing.revision(k, family=fam).model_copy(update={"checkpoint": ref0}))

    async def feed(task, k):
        log[k] = codec.encode(batch(k))
        outs = await task.process(BatchRec(k, log[k]))
        task.committed()
        return outs[-1].event

    options = dict(state_every=3, lora=spec, lr=5e-2)
    straight = TrainerTask(0, fam, tmp_path / "ck", target_checkpoint=lambda t: ref0, **options)
    for k in range(5):
        await feed(straight, k)
    assert straight.base["revision"] == 3 and [o for _, o in straight.since] == [3, 4]
    successor = TrainerTask(0, fam, tmp_path / "ck", read_records=read_records, **options)
    successor.load_state(json_roundtrip(straight.state()))
    r6 = await feed(successor, 5)
    await feed(straight, 5)
    assert r6.revision == 6 and r6.checkpoint.adapter and lora.base_of(r6.checkpoint) == ref0
    # the same tensors (not the same digest: safetensors 0.8 writes its metadata in a random order)
    mine, theirs = hf.load_weights(r6.checkpoint), hf.load_weights(CheckpointRef(**straight.current["checkpoint"]))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    a, b = straight.trainer, successor.trainer
    for k, v in a.model.state_dict().items():
        assert torch.equal(b.model.state_dict()[k], v), k
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        sa, sb = a.opt.state.get(pa, {}), b.opt.state.get(pb, {})
        assert sa.keys() == sb.keys() and all(torch.equal(sa[key], sb[key]) for key in sa)
