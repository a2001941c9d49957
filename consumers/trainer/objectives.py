"""The objectives as pure loss functions over per-token tensors, and the one registry the trainer selects from.

Every function takes prime-rl's ``LossInputs`` (the trainer's and the inference server's logprobs of the trained
tokens, the advantages, the loss mask, the optional reference logprobs and per-token weights; rows of tokens, or one
sample's tokens) and returns prime-rl's ``LossOutputs``: the loss *summed* over its tokens (or rows, for TRL's
``grpo``) and its metrics. The trainer divides the sum by the whole batch's ``Objective.scale`` (its loss tokens, its
rows, or TRL's ``dr_grpo`` constant), so micro-batches add up to the batch's loss whatever their sizes.

The functions follow their references line for line (prime-rl's ``trainer/rl/loss.py`` at its 2026-08 head, TRL
1.16's ``GRPOTrainer._compute_loss``); ``tests/test_objectives.py`` checks each against the published formula by
hand and TRL's against TRL itself. Which objective a run trains with is the plan's (``schemas.objectives``).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from schemas.objectives import CeLoss, CustomLoss, DefaultLoss, IpoLoss, ObjectiveError, PpoClipLoss, TrlLoss


@dataclass
class LossInputs:
    """prime-rl's names, so that a custom loss written for prime-rl runs unchanged. ``old_logprobs``: the trainer's
    own logprobs of these tokens before this step (TRL's ``old_per_token_logps``), None on the step's first pass
    (then this pass's, detached)."""

    trainer_logprobs: Tensor
    inference_logprobs: Tensor
    ref_logprobs: Tensor | None
    advantages: Tensor
    loss_mask: Tensor  # bool
    loss_weights: Tensor | None = field(default=None)
    old_logprobs: Tensor | None = field(default=None)


@dataclass
class LossOutputs:
    loss: Tensor
    metrics: dict[str, Tensor]


def _mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over the mask's tokens; 0 when it has none (prime-rl's ``_safe_mean``)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def _weighted(per_token: Tensor, inputs: LossInputs) -> Tensor:
    return per_token if inputs.loss_weights is None else per_token * inputs.loss_weights


def _ratio(inputs: LossInputs) -> tuple[Tensor, Tensor, Tensor]:
    """log r, r = p_trainer / p_inference and the mismatch KL r - log r - 1, zero off the loss mask."""
    log_r = torch.where(inputs.loss_mask, inputs.trainer_logprobs - inputs.inference_logprobs, 0.0)
    r = torch.exp(log_r)
    return log_r, r, r - log_r - 1


def _dppo(inputs: LossInputs, masked: Tensor, adv_tau: float, kl_tau: float) -> tuple[Tensor, Tensor]:
    """The policy-gradient term on the kept tokens plus ``kl_tau`` (log r)^2 on all: prime-rl's default and ipo."""
    log_r, r, _ = _ratio(inputs)
    keep = inputs.loss_mask & ~masked
    per_token = -(keep * (adv_tau * inputs.advantages) * r) + kl_tau * (inputs.loss_mask * log_r ** 2)
    return _weighted(per_token, inputs).sum(), keep


def default_loss(inputs: LossInputs, spec: DefaultLoss) -> LossOutputs:
    """prime-rl's ``default_loss_fn``: DPPO-Binary TV, the mask conditioned on the advantage's sign, plus KL."""
    mask = inputs.loss_mask
    _, _, mismatch_kl = _ratio(inputs)
    diff = torch.exp(inputs.trainer_logprobs) - torch.exp(inputs.inference_logprobs)
    high, low = diff > spec.dppo_mask_high, diff < -spec.dppo_mask_low
    positive, negative = inputs.advantages > 0, inputs.advantages < 0
    masked = torch.where(positive, high, low)
    loss, keep = _dppo(inputs, masked, spec.adv_tau, spec.kl_tau)
    dropped = mask & masked
    return LossOutputs(loss, {
        "masked_mismatch_kl": _mean(mismatch_kl, dropped), "unmasked_mismatch_kl": _mean(mismatch_kl, keep),
        "is_masked": _mean(masked, mask), "is_masked_low": _mean(negative & low, mask),
        "is_masked_high": _mean(positive & high, mask),
        "masked_advantage_positive": _mean(positive, dropped), "masked_advantage_negative": _mean(negative, dropped)})


def ipo_loss(inputs: LossInputs, spec: IpoLoss) -> LossOutputs:
    """prime-rl's ``ipo_loss_fn``: masked when |p_trainer - p_inference| > ``ipo_threshold``, whatever the sign."""
    mask = inputs.loss_mask
    _, _, mismatch_kl = _ratio(inputs)
    masked = (torch.exp(inputs.trainer_logprobs) - torch.exp(inputs.inference_logprobs)).abs() > spec.ipo_threshold
    loss, keep = _dppo(inputs, masked, spec.adv_tau, spec.kl_tau)
    return LossOutputs(loss, {"masked_mismatch_kl": _mean(mismatch_kl, mask & masked),
                              "unmasked_mismatch_kl": _mean(mismatch_kl, keep), "is_masked": _mean(masked, mask)})


def trl_loss(inputs: LossInputs, spec: TrlLoss) -> LossOutputs:
    """TRL 1.16's clipped objective (``beta`` 0) with its vLLM importance-sampling correction; summed per token, or
    per row of each row's token mean for ``grpo``."""
    mask = inputs.loss_mask.to(inputs.trainer_logprobs.dtype)
    lp = inputs.trainer_logprobs
    old = lp.detach() if inputs.old_logprobs is None else inputs.old_logprobs
    log_ratio = torch.where(inputs.loss_mask, lp - old, 0.0)
    if spec.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    high = spec.epsilon if spec.epsilon_high is None else spec.epsilon_high
    coef_2 = torch.clamp(coef_1, 1 - spec.epsilon, 1 + high)
    adv = inputs.advantages
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    metrics: dict[str, Tensor] = {
        "clip_frac_low": _mean(((coef_1 < 1 - spec.epsilon) & (adv < 0)).expand_as(mask).float(), mask),
        "clip_frac_high": _mean(((coef_1 > 1 + high) & (adv > 0)).expand_as(mask).float(), mask)}
    if spec.vllm_importance_sampling_correction:
        weight, kept = vllm_importance_weight(old, inputs.inference_logprobs, mask, spec)
        per_token = per_token * weight
        metrics["is_masked"] = _mean((~kept).expand_as(mask).float(), mask)
    per_token = _weighted(per_token, inputs) * mask
    if spec.loss_type == "grpo":
        loss = (per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    else:
        loss = per_token.sum()
    return LossOutputs(loss, metrics)


def vllm_importance_weight(old: Tensor, inference: Tensor, mask: Tensor, spec: TrlLoss) -> tuple[Tensor, Tensor]:
    """TRL's ``importance_sampling_ratio``: exp(logp_trainer - logp_vllm) per token or per sequence (summed),
    truncated to [clip_min, clip_max] or zeroed outside it; and which tokens or rows it kept."""
    diff = torch.nan_to_num((old - inference) * mask, nan=0.0)
    if spec.vllm_importance_sampling_mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    lo, hi = spec.vllm_importance_sampling_clip_min, spec.vllm_importance_sampling_clip_max
    if spec.vllm_importance_sampling_mode.endswith("truncate"):
        return torch.clamp(ratio, min=lo, max=hi), torch.ones_like(ratio, dtype=torch.bool)
    kept = (ratio >= (-math.inf if lo is None else lo)) & (ratio <= (math.inf if hi is None else hi))
    return ratio.masked_fill(~kept, 0.0), kept


def ppo_clip_loss(inputs: LossInputs, spec: PpoClipLoss) -> LossOutputs:
    """-min(r A, clip(r, 1 - clip, 1 + clip) A), r against the recorded (inference) logprobs: a derived run's rule."""
    log_r, r, _ = _ratio(inputs)
    adv = inputs.advantages
    per_token = -torch.min(r * adv, torch.clamp(r, 1 - spec.clip, 1 + spec.clip) * adv)
    clipped = (r - 1).abs() > spec.clip
    return LossOutputs(_weighted(per_token * inputs.loss_mask, inputs).sum(),
                       {"clip_frac": _mean(clipped.float(), inputs.loss_mask)})


def ce_loss(inputs: LossInputs, spec: CeLoss) -> LossOutputs:
    """prime-rl's ``ce_loss_fn``: the masked negative log-likelihood."""
    nll = _weighted(-inputs.trainer_logprobs, inputs)
    return LossOutputs((nll * inputs.loss_mask).sum(), {"nll": _mean(-inputs.trainer_logprobs, inputs.loss_mask)})


REF_KL_MASK = 0.2
"""prime-rl's ``ref_kl_loss_fn`` drops a token whose trainer probability fell more than this below vLLM's."""
REF_KL_TAU = 1e-3
"""... and regularizes drift with this times (log r)^2 (both fixed there, not settings)."""


def ref_kl_loss(inputs: LossInputs, spec: Any = None) -> LossOutputs:
    """prime-rl's ``ref_kl_loss_fn`` (on-policy distillation, ``opd``): the reverse KL to the reference, (ref_lp -
    trainer_lp) detached, is each token's policy-gradient signal times r = p_trainer / p_vLLM; tokens with p_trainer
    - p_vLLM < -0.2 are dropped from it; plus 1e-3 (log r)^2 on every loss token. Scalar advantages are not read."""
    if inputs.ref_logprobs is None:
        raise ObjectiveError("the ref_kl loss needs the reference's logprobs of every trained token (opd)")
    mask = inputs.loss_mask
    log_r, r, mismatch_kl = _ratio(inputs)
    masked = (torch.exp(inputs.trainer_logprobs) - torch.exp(inputs.inference_logprobs)) < -REF_KL_MASK
    keep = mask & ~masked
    ref_kl = torch.where(mask, inputs.ref_logprobs - inputs.trainer_logprobs, 0.0)
    per_token = -(keep * ref_kl.detach() * r) + REF_KL_TAU * (mask * log_r ** 2)
    return LossOutputs(_weighted(per_token, inputs).sum(), {
        "ref_kl/masked_mismatch_kl": _mean(mismatch_kl, mask & masked),
        "ref_kl/unmasked_mismatch_kl": _mean(mismatch_kl, keep), "ref_kl/is_masked": _mean(masked, mask),
        "ref_kl": _mean(ref_kl.detach(), mask)})


def custom_loss(spec: CustomLoss) -> Callable[[LossInputs, Any], LossOutputs]:
    """The user's function, called per sample as prime-rl calls it: one row's tokens each, ``fn(inputs,
    **kwargs)``; the rows' losses summed, their metrics averaged. What it raises, or a loss that is not a finite
    scalar, is an ``ObjectiveError`` naming the function."""
    module, _, name = spec.import_path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ObjectiveError(f"custom loss {spec.import_path!r} cannot be imported: {type(e).__name__}: {e}") from None

    def per_sample(inputs: LossInputs, _spec: Any) -> LossOutputs:
        total: Tensor | int = 0
        metrics: dict[str, list[Tensor]] = {}
        for i in range(inputs.loss_mask.shape[0]):
            row = _select(inputs, i)
            try:
                out = fn(row, **spec.kwargs)
                loss = out.loss
                ok = isinstance(loss, Tensor) and loss.numel() == 1 and bool(torch.isfinite(loss.detach()).all())
            except Exception as e:  # noqa: BLE001 - the user's code: its failure is the batch's, with the reason
                raise ObjectiveError(f"custom loss {spec.import_path} raised {type(e).__name__}: {e}") from e
            if not ok:
                raise ObjectiveError(f"custom loss {spec.import_path} returned {loss!r} for sample {i}: not a finite "
                                     "scalar tensor")
            total = total + loss.reshape(())
            for k, v in (out.metrics or {}).items():
                metrics.setdefault(k, []).append(torch.as_tensor(v, dtype=torch.float32).detach().float().mean())
        return LossOutputs(torch.as_tensor(total), {k: torch.stack(v).mean() for k, v in metrics.items()})

    return per_sample


REGISTRY: dict[str, Callable[..., LossOutputs]] = {
    "default": default_loss, "ipo": ipo_loss, "trl": trl_loss, "ppo_clip": ppo_clip_loss, "ce": ce_loss}
"""The built-in objectives by ``[trainer.loss] type``; ``custom`` is the user's (``custom_loss``)."""


class Objective:
    """A plan's objective, bound: ``loss`` for a micro-batch's rows, ``scale`` for the whole batch."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self._fn = custom_loss(spec) if isinstance(spec, CustomLoss) else REGISTRY[spec.type]

    def scale(self, loss_mask: Tensor) -> Tensor:
        """The whole batch's denominator: its loss tokens, its rows (grpo), or rows x max_completion_length."""
        if isinstance(self.spec, TrlLoss) and self.spec.loss_type == "grpo":
            return torch.tensor(float(loss_mask.shape[0]))
        if isinstance(self.spec, TrlLoss) and self.spec.loss_type == "dr_grpo":
            return torch.tensor(float(loss_mask.shape[0] * self.spec.max_completion_length))
        return loss_mask.sum().float().clamp(min=1.0)

    def loss(self, inputs: LossInputs) -> LossOutputs:
        return _finite(self._fn(inputs, self.spec), self.spec.type)

    def scales(self, loss_mask: Tensor, ref_rows: Tensor, ce_weights: Tensor | None = None
               ) -> tuple[Tensor, Tensor, Tensor]:
        """The whole batch's denominators of its three components, as prime-rl's ``rl_scale``, ``ref_kl_scale`` and
        ``ce_scale``: this objective's ``scale`` over the rows without reference logprobs, the loss tokens of the
        rows with, and the tokens with a cross-entropy weight (echo's); 0 for a component the batch does not
        have."""
        none = torch.zeros((), device=loss_mask.device)
        ce = none if ce_weights is None else (ce_weights != 0).sum().float()
        return (self.scale(loss_mask[~ref_rows]) if bool((~ref_rows).any()) else none,
                loss_mask[ref_rows].sum().float().clamp(min=1.0) if bool(ref_rows.any()) else none, ce)

    def component_loss(self, inputs: LossInputs, ref_rows: Tensor, scales: tuple[Tensor, Tensor, Tensor],
                       ce_weights: Tensor | None = None) -> LossOutputs:
        """prime-rl's ``compute_loss``: each row trains with its own component (``ref_kl_loss`` where the record
        carries the reference's logprobs, an opd source's; this objective elsewhere), plus ``ce_loss`` on the tokens
        ``ce_weights`` weighs (echo's environment tokens, outside the loss mask), each component's sum divided by
        its own ``scales`` entry, so that none dilutes another. A component the batch has and these rows lack
        still names its metrics (0): every micro-batch of a batch, on every rank of a group, reports the same
        ones."""
        total: Tensor | float = inputs.trainer_logprobs.sum() * 0.0  # a backward-able loss when no row trains
        metrics: dict[str, Tensor] = {}
        for rows, fn, scale in ((~ref_rows, self.loss, scales[0]), (ref_rows, _ref_kl, scales[1])):
            if bool(rows.any()):
                out = fn(inputs if bool(rows.all()) else _select(inputs, rows))
                total = total + out.loss / scale
                metrics.update(out.metrics)
            elif bool(scale > 0):
                metrics.update({k: torch.zeros_like(v) for k, v in fn(_select(inputs, rows)).metrics.items()})
        if ce_weights is not None and bool((ce_weights != 0).any()):
            out = _finite(ce_loss(LossInputs(inputs.trainer_logprobs, inputs.inference_logprobs, None,
                                             inputs.advantages, ce_weights != 0, ce_weights), CeLoss()), "ce")
            total = total + out.loss / scales[2]
            metrics.update({f"ce/{k}": v for k, v in out.metrics.items()})
        elif bool(scales[2] > 0):
            metrics["ce/nll"] = inputs.trainer_logprobs.new_zeros(())
        return LossOutputs(total, metrics)


def _ref_kl(inputs: LossInputs) -> LossOutputs:
    return _finite(ref_kl_loss(inputs), "ref_kl")


def _finite(out: LossOutputs, name: str) -> LossOutputs:
    if not bool(torch.isfinite(out.loss.detach()).all()):
        raise ObjectiveError(f"the {name} loss is not finite ({float(out.loss.detach())}): the batch's logprobs or "
                             "advantages hold inf or nan")
    return LossOutputs(out.loss, {k: v.detach() for k, v in out.metrics.items()})


def _select(inputs: LossInputs, rows: Tensor) -> LossInputs:
    """Those rows of every per-token field."""
    return LossInputs(**{k: None if v is None else v[rows] for k, v in vars(inputs).items()})

