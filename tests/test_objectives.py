"""The objectives (``consumers.trainer.objectives``) against their published formulas, computed here by hand token by
token (prime-rl's ``trainer/rl/loss.py``, TRL 1.16's ``GRPOTrainer._compute_loss``), a user's custom loss written
for prime-rl run unchanged, and what the plan compiles from ``[trainer.loss]``."""

from __future__ import annotations

import math
from pathlib import Path
import textwrap

import pytest
import torch

from consumers.trainer.objectives import LossInputs, Objective, _select, ref_kl_loss
from schemas.objectives import (CustomLoss, DefaultLoss, IpoLoss, ObjectiveError, PpoClipLoss, TrlLoss, CeLoss,
                                describe)
from schemas.plan import PlanError
from schemas.plan_compiler import compile_plan_dict

# one sample, five tokens; the last is off the loss mask. Probabilities chosen so that each trust-region case occurs:
# token 0 rose by 0.3 (masked when its advantage is positive), token 1 fell by 0.3 (masked when negative), tokens 2
# and 3 moved by less than 0.2.
P_TRAINER = [0.8, 0.2, 0.55, 0.3, 0.9]
P_INFER = [0.5, 0.5, 0.5, 0.35, 0.1]
MASK = [True, True, True, True, False]


def _inputs(adv: list[float], weights: list[float] | None = None, rows: int = 1) -> LossInputs:
    lp = torch.log(torch.tensor([P_TRAINER] * rows, dtype=torch.float64)).requires_grad_(True)
    return LossInputs(trainer_logprobs=lp, inference_logprobs=torch.log(torch.tensor([P_INFER] * rows, dtype=torch.float64)),
                      ref_logprobs=None, advantages=torch.tensor([adv] * rows, dtype=torch.float64),
                      loss_mask=torch.tensor([MASK] * rows),
                      loss_weights=None if weights is None else torch.tensor([weights] * rows, dtype=torch.float64))


def _by_hand(adv, keep, kl_tau=1e-3, adv_tau=1.0, weights=None) -> float:
    """sum over masked-in tokens of w * (-(kept) adv_tau A r + kl_tau (log r)^2)."""
    total = 0.0
    for i, m in enumerate(MASK):
        if not m:
            continue
        r = P_TRAINER[i] / P_INFER[i]
        term = -(adv_tau * adv[i] * r if keep[i] else 0.0) + kl_tau * math.log(r) ** 2
        total += term * (1.0 if weights is None else weights[i])
    return total


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_prime_rl_default_masks_on_the_probability_difference_in_the_advantages_direction(sign):
    adv = [sign * a for a in (1.0, 1.0, 0.5, -0.25, 2.0)]
    out = Objective(DefaultLoss()).loss(_inputs(adv))
    # token 0: +0.3 > 0.2 masked when A > 0; token 1: -0.3 < -0.2 masked when A < 0; token 3's A has the other sign
    keep = [sign < 0, sign > 0, True, True, True]
    assert out.loss.item() == pytest.approx(_by_hand(adv, keep), rel=1e-12)
    assert float(out.metrics["is_masked"]) == pytest.approx(1 / 4)
    assert float(out.metrics["is_masked_high"]) == pytest.approx(1 / 4 if sign > 0 else 0.0)
    assert float(out.metrics["is_masked_low"]) == pytest.approx(0.0 if sign > 0 else 1 / 4)


def test_prime_rl_default_settings_and_loss_weights_change_the_loss_as_the_formula_says():
    adv, w = [1.0, -1.0, 0.5, -0.25, 2.0], [0.5, 2.0, 1.0, 3.0, 7.0]
    spec = DefaultLoss(dppo_mask_low=0.4, dppo_mask_high=0.4, adv_tau=2.0, kl_tau=0.1)
    out = Objective(spec).loss(_inputs(adv, w))  # nothing moved past 0.4
    assert out.loss.item() == pytest.approx(_by_hand(adv, [True] * 5, kl_tau=0.1, adv_tau=2.0, weights=w), rel=1e-12)
    assert float(out.metrics["is_masked"]) == 0.0


def test_prime_rl_default_gradient_is_the_kept_tokens_policy_gradient_plus_the_kl_term():
    adv = [1.0, 1.0, 0.5, -0.25, 2.0]
    inputs = _inputs(adv)
    Objective(DefaultLoss()).loss(inputs).loss.backward()
    grad = inputs.trainer_logprobs.grad[0].tolist()
    for i, keep in enumerate([False, True, True, True, False]):
        r = P_TRAINER[i] / P_INFER[i]
        # d/dlogp of -A r + tau (log r)^2 = -A r + 2 tau log r
        want = (-(adv[i] * r) if keep else 0.0) + 2e-3 * math.log(r) if MASK[i] else 0.0
        assert grad[i] == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_prime_rl_ipo_masks_both_directions_past_its_threshold():
    adv = [1.0, 1.0, 0.5, -0.25, 2.0]
    out = Objective(IpoLoss(ipo_threshold=0.1)).loss(_inputs(adv))
    # |dp|: 0.3, 0.3, 0.05, 0.05 -> the first two masked, whatever their advantage
    assert out.loss.item() == pytest.approx(_by_hand(adv, [False, False, True, True, True]), rel=1e-12)
    assert float(out.metrics["is_masked"]) == pytest.approx(0.5)


def test_trl_dapo_on_policy_is_the_plain_policy_gradient_and_its_vllm_weight_masks_sequences_past_the_cap():
    adv = [1.0, 1.0, 1.0, 1.0, 1.0]
    inputs = _inputs(adv, rows=1)
    spec = TrlLoss(vllm_importance_sampling_clip_max=10.0)
    out = Objective(spec).loss(inputs)
    # ratio against the trainer's own logprobs before the step: exactly 1, nothing clipped; the sequence's vLLM weight
    # exp(sum over tokens of log p_trainer - log p_vllm) multiplies every token
    seq_w = math.exp(sum(math.log(P_TRAINER[i] / P_INFER[i]) for i in range(4)))
    assert seq_w < 10.0
    assert out.loss.item() == pytest.approx(-4 * seq_w, rel=1e-12)
    assert float(out.metrics["clip_frac_low"]) == float(out.metrics["clip_frac_high"]) == 0.0
    out.loss.backward()
    assert inputs.trainer_logprobs.grad[0, :4].tolist() == pytest.approx([-seq_w] * 4, rel=1e-12)
    masked = Objective(TrlLoss(vllm_importance_sampling_clip_max=seq_w * 0.99)).loss(_inputs(adv))
    assert masked.loss.item() == 0.0 and float(masked.metrics["is_masked"]) == 1.0


def test_trl_clips_a_moved_ratio_on_later_passes_and_grpo_normalises_per_sequence():
    adv = [1.0, -1.0, 1.0, -1.0, 1.0]
    inputs = _inputs(adv)
    # the step's first pass saw these tokens 0.5x / 2x / 1x / 1x as likely as now: ratios 2, 0.5, 1, 1
    before = inputs.trainer_logprobs.detach() + torch.log(torch.tensor([[0.5, 2.0, 1.0, 1.0, 1.0]],
                                                                        dtype=torch.float64))
    inputs.old_logprobs = before
    spec = TrlLoss(epsilon=0.2, epsilon_high=0.28, vllm_importance_sampling_correction=False)
    out = Objective(spec).loss(inputs)
    # -min(r A, clip(r) A): token 0 (r 2, A +) -> -1.28; token 1 (r 0.5, A -) -> 0.8; tokens 2, 3 -> -1, +1
    assert out.loss.item() == pytest.approx(-1.28 + 0.8 - 1.0 + 1.0, rel=1e-12)
    assert float(out.metrics["clip_frac_high"]) == pytest.approx(0.25)
    assert float(out.metrics["clip_frac_low"]) == pytest.approx(0.25)
    grpo = Objective(spec.model_copy(update={"loss_type": "grpo"}))
    two = _inputs(adv, rows=2)
    two.old_logprobs = torch.cat([before, before])
    assert grpo.loss(two).loss.item() == pytest.approx(2 * (-1.28 + 0.8) / 4, rel=1e-12)  # per-row token mean, summed
    assert float(grpo.scale(two.loss_mask)) == 2.0  # ... then divided by the batch's rows
    dr = Objective(TrlLoss(loss_type="dr_grpo", max_completion_length=16))
    assert float(dr.scale(two.loss_mask)) == 32.0


def test_ppo_clip_and_ce_by_hand():
    adv = [1.0, -1.0, 0.5, -0.25, 2.0]
    out = Objective(PpoClipLoss(clip=0.2)).loss(_inputs(adv))
    want = 0.0
    for i in range(4):
        r = P_TRAINER[i] / P_INFER[i]
        want += -min(r * adv[i], min(max(r, 0.8), 1.2) * adv[i])
    assert out.loss.item() == pytest.approx(want, rel=1e-12)
    ce = Objective(CeLoss()).loss(_inputs(adv, weights=[1.0, 2.0, 1.0, 1.0, 5.0]))
    assert ce.loss.item() == pytest.approx(-(math.log(0.8) + 2 * math.log(0.2) + math.log(0.55) + math.log(0.3)))


P_REF = [0.6, 0.4, 0.25, 0.5, 0.7]  # the reference's probabilities of the same tokens (opd's teacher)


def _ref_kl_by_hand(weights=None) -> tuple[float, list[float]]:
    """prime-rl's ref_kl_loss_fn token by token: -(kept) (log p_ref - log p_trainer) r + 1e-3 (log r)^2, a token
    kept unless p_trainer - p_inference < -0.2 (token 1 fell by 0.3); and its gradient in log p_trainer, the signal
    held constant: -(kept) (log p_ref - log p_trainer) r + 2e-3 log r."""
    loss, grad = 0.0, [0.0] * 5
    for i, m in enumerate(MASK):
        if not m:
            continue
        r = P_TRAINER[i] / P_INFER[i]
        kept = P_TRAINER[i] - P_INFER[i] >= -0.2
        signal = math.log(P_REF[i]) - math.log(P_TRAINER[i])
        w = 1.0 if weights is None else weights[i]
        loss += w * (-(signal * r if kept else 0.0) + 1e-3 * math.log(r) ** 2)
        grad[i] = w * (-(signal * r if kept else 0.0) + 2e-3 * math.log(r))
    return loss, grad


def test_ref_kl_is_prime_rls_reverse_kl_to_the_reference_by_hand_and_reads_no_advantage():
    inputs = _inputs([1.0, -1.0, 0.5, -0.25, 2.0])
    inputs.ref_logprobs = torch.log(torch.tensor([P_REF], dtype=torch.float64))
    out = ref_kl_loss(inputs)
    want, grad = _ref_kl_by_hand()
    assert out.loss.item() == pytest.approx(want, rel=1e-12)
    out.loss.backward()
    assert inputs.trainer_logprobs.grad[0].tolist() == pytest.approx(grad, rel=1e-12)  # the signal is detached
    assert out.metrics["ref_kl/is_masked"].item() == pytest.approx(1 / 4)
    assert out.metrics["ref_kl"].item() == pytest.approx(
        sum(math.log(P_REF[i] / P_TRAINER[i]) for i in range(4)) / 4, rel=1e-12)
    other = _inputs([-5.0, 5.0, 0.0, 3.0, 1.0], weights=[2.0, 1.0, 0.5, 3.0, 9.0])  # other advantages: not read
    other.ref_logprobs = inputs.ref_logprobs
    assert ref_kl_loss(other).loss.item() == pytest.approx(_ref_kl_by_hand([2.0, 1.0, 0.5, 3.0, 9.0])[0], rel=1e-12)
    with pytest.raises(ObjectiveError, match="reference"):
        ref_kl_loss(_inputs([1.0] * 5))


def test_a_mixed_batch_trains_each_row_with_its_sources_component_each_normalised_by_its_own_tokens():
    """prime-rl's compute_loss: rl_loss / rl_scale + ref_kl_loss / ref_kl_scale; a grpo row (no reference) under the
    plan's objective, an opd row (reference logprobs) under ref_kl; a batch of one kind is that component alone."""
    adv = [1.0, -1.0, 0.5, -0.25, 2.0]
    inputs = _inputs(adv, rows=3)
    inputs.loss_mask[2, 3] = False  # the second opd row has 3 loss tokens: ref_kl's denominator is 4 + 3
    inputs.ref_logprobs = torch.log(torch.tensor([P_REF] * 3, dtype=torch.float64))
    ref_rows = torch.tensor([False, True, True])
    objective = Objective(DefaultLoss())
    scales = objective.scales(inputs.loss_mask, ref_rows)
    assert [float(s) for s in scales] == [4.0, 7.0, 0.0]  # no echo tokens: no ce component
    out = objective.component_loss(inputs, ref_rows, scales)
    r3 = P_TRAINER[3] / P_INFER[3]
    last = -(math.log(P_REF[3]) - math.log(P_TRAINER[3])) * r3 + 1e-3 * math.log(r3) ** 2
    want_ref = 2 * _ref_kl_by_hand()[0] - last
    assert out.loss.item() == pytest.approx(_by_hand(adv, [False, False, True, True]) / 4 + want_ref / 7, rel=1e-12)
    assert {"is_masked", "ref_kl/is_masked"} <= out.metrics.keys()
    only_rl = objective.component_loss(inputs, torch.zeros(3, dtype=torch.bool), objective.scales(
        inputs.loss_mask, torch.zeros(3, dtype=torch.bool)))
    assert only_rl.loss.item() == pytest.approx(objective.loss(inputs).loss.item() / 11, rel=1e-12)
    assert not any(k.startswith("ref_kl") for k in only_rl.metrics)  # a batch without opd rows: rl's alone
    # a micro-batch of the mixed batch with its grpo row alone still names ref_kl's metrics (0): a torchrun group's
    # ranks sum the same vector of them
    part = objective.component_loss(_select(inputs, torch.tensor([True, False, False])), torch.tensor([False]), scales)
    assert part.metrics.keys() == out.metrics.keys() and part.metrics["ref_kl"].item() == 0.0


def test_echo_adds_cross_entropy_on_the_environments_tokens_normalised_by_their_own_count():
    """prime-rl's compute_loss with a ce stream: rl_loss / rl_scale + ce_loss / ce_scale, ce_loss the weighted NLL of
    the tokens with a ce weight (outside the loss mask: echo's environment tokens), ce_scale their count over the
    whole batch. Here token 4 (off the loss mask) of both rows at alpha 0.1, and token 3 of row 1 at 0.5."""
    adv = [1.0, -1.0, 0.5, -0.25, 2.0]
    inputs = _inputs(adv, rows=2)
    ce = torch.zeros((2, 5), dtype=torch.float64)
    ce[:, 4], ce[1, 3] = 0.1, 0.5
    objective = Objective(DefaultLoss())
    no_ref = torch.zeros(2, dtype=torch.bool)
    scales = objective.scales(inputs.loss_mask, no_ref, ce)
    assert [float(s) for s in scales] == [8.0, 0.0, 3.0]
    out = objective.component_loss(inputs, no_ref, scales, ce)
    nll = 2 * 0.1 * -math.log(P_TRAINER[4]) + 0.5 * -math.log(P_TRAINER[3])
    want = 2 * _by_hand(adv, [False, False, True, True]) / 8 + nll / 3
    assert out.loss.item() == pytest.approx(want, rel=1e-12)
    assert out.metrics["ce/nll"].item() == pytest.approx(
        (2 * -math.log(P_TRAINER[4]) - math.log(P_TRAINER[3])) / 3, rel=1e-12)
    out.loss.backward()
    assert inputs.trainer_logprobs.grad[0, 4].item() == pytest.approx(-0.1 / 3, rel=1e-12)  # the ce token's
    # a micro-batch without ce tokens of a batch with them still names ce's metric (0), as ref_kl's
    part = objective.component_loss(_select(inputs, torch.tensor([True, False])), torch.tensor([False]), scales,
                                    torch.zeros((1, 5), dtype=torch.float64))
    assert part.metrics.keys() == out.metrics.keys() and part.metrics["ce/nll"].item() == 0.0


PRIME_RL_CUSTOM = '''
    """A loss written for prime-rl: it reads prime-rl's LossInputs attributes and returns .loss and .metrics."""
    from dataclasses import dataclass

    import torch

    CALLS = []

    @dataclass
    class Out:
        loss: torch.Tensor
        metrics: dict

    def weighted_pg(inputs, scale=1.0, fail=False):
        CALLS.append(inputs.trainer_logprobs.shape)
        if fail:
            raise RuntimeError("my loss is broken")
        assert inputs.ref_logprobs is None and inputs.loss_weights is None
        m = inputs.loss_mask
        ratio = torch.exp(inputs.trainer_logprobs - inputs.inference_logprobs)
        loss = -(scale * inputs.advantages * ratio)[m].sum()
        return Out(loss=loss, metrics={"ratio_mean": ratio[m].mean()})

    def not_finite(inputs):
        return Out(loss=inputs.trainer_logprobs.sum() * float("nan"), metrics={})

    def refuses_large_advantages(inputs, limit=1.0):
        if bool((inputs.advantages.abs() > limit).any()):
            raise ValueError(f"advantage beyond {limit}")
        return weighted_pg(inputs)
'''


@pytest.fixture
def user_loss(tmp_path, monkeypatch):
    (tmp_path / "my_prime_rl_loss.py").write_text(textwrap.dedent(PRIME_RL_CUSTOM))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    import my_prime_rl_loss

    yield importlib.reload(my_prime_rl_loss)


def test_a_custom_loss_written_for_prime_rl_runs_per_sample_unchanged(user_loss):
    adv = [1.0, -1.0, 0.5, -0.25, 2.0]
    out = Objective(CustomLoss(import_path="my_prime_rl_loss.weighted_pg", kwargs={"scale": 3.0})).loss(
        _inputs(adv, rows=3))
    assert user_loss.CALLS == [torch.Size([5])] * 3  # called once per sample, with that sample's tokens
    per_sample = sum(-3.0 * adv[i] * P_TRAINER[i] / P_INFER[i] for i in range(4))
    assert out.loss.item() == pytest.approx(3 * per_sample, rel=1e-12)
    assert float(out.metrics["ratio_mean"]) == pytest.approx(sum(P_TRAINER[i] / P_INFER[i] for i in range(4)) / 4)


def test_a_custom_loss_that_raises_or_is_not_finite_is_one_objective_error(user_loss):
    with pytest.raises(ObjectiveError, match="my_prime_rl_loss.weighted_pg raised RuntimeError: my loss is broken"):
        Objective(CustomLoss(import_path="my_prime_rl_loss.weighted_pg", kwargs={"fail": True})).loss(_inputs([1.0] * 5))
    with pytest.raises(ObjectiveError, match="not a finite scalar"):
        Objective(CustomLoss(import_path="my_prime_rl_loss.not_finite")).loss(_inputs([1.0] * 5))
    with pytest.raises(ObjectiveError, match="cannot be imported"):
        Objective(CustomLoss(import_path="my_prime_rl_loss.missing"))


async def test_a_batch_its_custom_loss_refuses_is_dead_lettered_with_the_reason_and_the_trainer_goes_on(
        user_loss, tmp_path):
    """The trainer service's path (``TrainerTask.process``): the second of three batches makes the user's loss raise;
    that batch is one dead letter naming the function and its error, no revision is made from it, and the third
    batch trains r2 from r1."""
    from consumers import testing
    from consumers.trainer.task import TrainerTask
    from consumers.trainer.step import initial_revision
    from schemas import codec
    from schemas.batch import assemble_batch
    from schemas.events import DeadLetter, TrainerBatch
    from schemas.policy import PolicyRevision

    class Rec:
        topic, partition, headers, key = "tb", 0, [], b"tiny"

        def __init__(self, offset, value):
            self.offset, self.value = offset, value

    rev0 = initial_revision("tiny", tmp_path / "r0", seed=0)
    task = TrainerTask(0, "tiny", tmp_path / "ck", target_checkpoint=lambda t: rev0.checkpoint,
                       objective=CustomLoss(import_path="my_prime_rl_loss.refuses_large_advantages"))
    target, outs, batches = rev0, [], []
    for k, reward in enumerate((1.0, 9.0, 0.0)):  # advantage = reward - 0.5
        recs = [testing.training_record(10 * k + i, revision_=target.revision, reward=reward * (i % 2))
                for i in range(4)]
        batches.append(assemble_batch(recs, target, 1, run_id="run", producer="t"))
        outs.append(await task.process(Rec(k, codec.encode(batches[-1]))))
        task.committed()
        target = next((o.event for o in outs[-1] if isinstance(o.event, PolicyRevision)), target)
    kinds = [[type(o.event).__name__ for o in out] for out in outs]
    assert kinds == [["PolicyRevision"], ["DeadLetter"], ["PolicyRevision"]]
    (letter,) = [o.event for o in outs[1]]
    assert isinstance(letter, DeadLetter) and letter.error_type == "ObjectiveError" and letter.origin_offset == 1
    assert "my_prime_rl_loss.refuses_large_advantages raised ValueError: advantage beyond 1.0" in letter.error_message
    assert codec.decode(letter.raw, TrainerBatch).batch_id == batches[1].batch_id  # the whole batch, as it came
    assert target.revision == 2 and target.parent_revision == 1
    assert target.objective == {"type": "custom", "import_path": "my_prime_rl_loss.refuses_large_advantages",
                                "kwargs": {}}


def _recipe(loss: str = "") -> dict:
    import tomllib

    return tomllib.loads(textwrap.dedent('''
        [model]
        name = "SmolLM2-135M-Instruct"
        [orchestrator]
        batch_size = 8
        group_size = 4
        [orchestrator.train.sampling]
        max_tokens = 24
        [[orchestrator.train.env]]
        id = "arithmetic"
    ''') + textwrap.dedent(loss))


def test_a_recipe_without_trainer_loss_trains_with_prime_rls_default_and_each_type_compiles_with_its_keys():
    assert compile_plan_dict(_recipe(), "r.toml").objective == DefaultLoss()
    plan = compile_plan_dict(_recipe('[trainer.loss]\ntype = "ipo"\nipo_threshold = 0.3\n'), "r.toml")
    assert plan.objective == IpoLoss(ipo_threshold=0.3) and not plan.refused
    plan = compile_plan_dict(_recipe('[trainer.loss]\ntype = "custom"\nimport_path = "pkg.mod.fn"\n'
                                     'kwargs = { tau = 2 }\n'), "r.toml")
    assert plan.objective == CustomLoss(import_path="pkg.mod.fn", kwargs={"tau": 2})
    plan = compile_plan_dict(_recipe('[trainer.loss]\ntype = "trl"\nloss_type = "dr_grpo"\n'), "r.toml")
    assert plan.objective.max_completion_length == 24  # the learner's max_tokens, as TRL's max_completion_length
    assert describe(plan.objective).startswith("trl (loss_type dr_grpo, epsilon 0.2")


@pytest.mark.parametrize("loss, message", [
    ('type = "dppo"', "trainer.loss.type: unknown loss type 'dppo'"),
    ('type = "default"\nkl_taux = 1', "trainer.loss.kl_taux: Extra inputs are not permitted"),
    ('type = "ipo"\nipo_threshold = -1', "trainer.loss.ipo_threshold: Input should be greater than or equal to 0"),
    ('type = "custom"', "trainer.loss.import_path: Field required"),
])
def test_an_unknown_loss_type_or_key_is_one_clear_line(loss, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compile_plan_dict(_recipe(f"[trainer.loss]\n{loss}\n"), "r.toml")


# -- the trl objective against TRL itself --------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_one_step_of_the_trl_objective_updates_the_weights_as_trls_grpo_trainer_does(tmp_path, loss_type,
                                                                                   monkeypatch):
    """The same weights, completions and advantages through ``ReferenceTrainer`` (objective ``trl``) and through
    TRL 1.16's own ``GRPOTrainer._compute_loss`` with the optimizer its Trainer builds (AdamW, grad-norm clip 1,
    constant lr): the updated weights agree within float32 tolerance. On-policy, no vLLM: the ratio is 1, so this
    is the normalisation and the gradient. Both in float32 (a CPU with native bf16 trains under bf16 autocast:
    gradients 0.3% apart from float32's)."""
    import copy

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
    from trl import GRPOConfig, GRPOTrainer

    from consumers.trainer.models import HFPolicy
    from consumers.trainer.step import ReferenceTrainer
    from consumers.trainer.tensors import TrainerTensors
    from policy import hf
    from policy.hf import prepare_model

    monkeypatch.setattr(hf, "cpu_bf16", lambda: False)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True), dtype=torch.float32)
    ours, initial = copy.deepcopy(model), copy.deepcopy(model)
    group, prompt_len, comp_len, lr = 4, 6, 7, 3e-3
    prompt = torch.randint(3, 512, (1, prompt_len)).repeat(2 * group, 1)  # two groups of one prompt each
    prompt[group:] = torch.randint(3, 512, (1, prompt_len))
    completion = torch.randint(3, 512, (2 * group, comp_len))
    lengths = torch.tensor([7, 3, 5, 7, 2, 6, 4, 1])
    comp_mask = (torch.arange(comp_len)[None] < lengths[:, None]).long()
    completion = completion * comp_mask  # pads after each completion's end
    advantages = torch.tensor([1.5, -0.5, 0.25, -1.25, 0.75, -0.75, 1.0, -1.0])

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=2 * group,
                      num_generations=group, max_completion_length=comp_len, loss_type=loss_type, beta=0.0,
                      epsilon=0.2, temperature=1.0, learning_rate=lr, lr_scheduler_type="constant", weight_decay=0.0,
                      max_grad_norm=1.0, optim="adamw_torch", report_to=[], gradient_accumulation_steps=1,
                      steps_per_generation=1, gradient_checkpointing=False, model_init_kwargs=None)
    trl = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                      train_dataset=Dataset.from_dict({"prompt": ["x"] * 8}),
                      processing_class=AutoTokenizer.from_pretrained(prepare_model().path))
    trl.current_gradient_accumulation_steps = 1
    trl.model.train()
    inputs = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
              "completion_mask": comp_mask, "advantages": advantages, "old_per_token_logps": None,
              "num_items_in_batch": comp_mask.sum()}
    loss = trl._compute_loss(trl.model, inputs)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trl.model.parameters(), 1.0)
    trl_grads = [p.grad.clone() for p in trl.model.parameters()]
    trl.create_optimizer()
    trl.optimizer.step()

    rows = [torch.cat([prompt[i], completion[i, :lengths[i]]]) for i in range(2 * group)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(2 * group, width, dtype=torch.long)
    att, loss_mask, adv = (torch.zeros(2 * group, width) for _ in range(3))
    for i, r in enumerate(rows):
        ids[i, :len(r)], att[i, :len(r)] = r, 1
        loss_mask[i, prompt_len:len(r)] = 1
        adv[i, prompt_len:len(r)] = advantages[i]
    t = TrainerTensors(ids, att.bool(), loss_mask, adv, torch.zeros_like(adv), torch.full((2 * group,), prompt_len),
                       torch.tensor([len(r) for r in rows]))
    trainer = ReferenceTrainer(ours, "tiny-llama", 0, tmp_path / "ck", kind=HFPolicy, lr=lr,
                               objective=TrlLoss(loss_type=loss_type, max_completion_length=comp_len,
                                                 vllm_importance_sampling_correction=False))
    grads, step = [], trainer.opt.step
    trainer.opt.step = lambda: (grads.extend(p.grad.clone() for p in ours.parameters()), step())  # seen, then taken
    stats, _ = trainer._epoch(t, trainer.objective, None)
    assert stats["loss"] == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-7)
    top = max(float(g.abs().max()) for g in trl_grads)
    for (name, _), a, b in zip(trl.model.named_parameters(), trl_grads, grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6 * top, msg=lambda m: f"grad of {name}: {m}")
    # AdamW's first step moves each weight by lr * g / (|g| + eps): about lr * sign(g) whatever |g|, so a gradient
    # at float32's rounding (here: those within 1e-6 of the largest, e.g. the tied head's rows of tokens never seen)
    # gets a sign that is the rounding's. Every weight whose gradient is above it must have moved alike.
    for (name, a), b, g in zip(trl.model.named_parameters(), ours.parameters(), trl_grads):
        sure = g.abs() > 1e-6 * top
        torch.testing.assert_close(b[sure], a[sure], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # the step moved the weights (about lr each): not a comparison of two unmoved models
    assert max(float((p - q).abs().max()) for p, q in zip(ours.parameters(), initial.parameters())) > lr / 2


PEER_RECIPES = Path(__file__).resolve().parents[2] / "shared" / "peer-configs" / "prime-rl-2026-08-all"


@pytest.mark.skipif(not PEER_RECIPES.is_dir(), reason="shared/peer-configs is not beside this checkout")
def test_rollout_plan_names_the_objective_of_every_prime_rl_recipe():
    """prime-rl's own recipes name no [trainer.loss]: each compiles to prime-rl's default, and says so; the four opd
    recipes show ref_kl and their teacher for their opd sources, self_distill ref_kl under the live policy, and none
    of them is refused."""
    from rollout.plan_cmd import render
    from schemas.plan_compiler import compile_plan

    shown = opd = 0
    for path in sorted(PEER_RECIPES.glob("*.toml")):
        try:
            plan = compile_plan(path)
        except PlanError:  # a trainer-only, eval-only or broken file: not a run's recipe
            continue
        assert plan.objective == DefaultLoss(), path.name
        lines = render(plan).splitlines()
        at = next(i for i, x in enumerate(lines) if x.strip().startswith("objective"))
        shown_lines = " ".join(lines[at:at + 3])
        if "self_distill" in path.name:  # opsd: the learner itself, under the example's demonstration
            assert "reference the live policy PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT at the run's own policy " \
                   "server with the demonstration 'answer' prepended" in shown_lines, shown_lines
            opd += 1
        elif "opd" in path.name:  # every opd source trains with ref_kl against its teacher, a grpo source beside it not
            assert "ref_kl (prime-rl's reverse KL to the reference" in shown_lines, (path.name, shown_lines)
            assert "reference PrimeIntellect/Qwen3-0.6B-Reverse-Text-RL at http://localhost:8001/v1" in shown_lines
            assert ("default (" in lines[at]) == ("mixed_grpo" in path.name), (path.name, shown_lines)
            opd += 1
        else:
            assert "default (dppo_mask_low 0.2, dppo_mask_high 0.2, adv_tau 1, kl_tau 0.001)" in lines[at], (
                path.name, lines[at])
        if "algo_echo" in path.name:  # grpo's objective on the policy's tokens, and cross-entropy on the user's
            assert "plus cross-entropy on the environment's tokens of later turns (user alpha 0.1)" in render(plan)
        assert "CANNOT RUN" not in render(plan) or not any(
            k in path.name for k in ("opd", "self_distill", "algo_echo")), path.name
        shown += 1
    assert shown >= 41 and opd == 5
