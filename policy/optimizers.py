"""The trainer's optimizers, as prime-rl's ``[trainer.optim] type`` names them (``schemas.plan.OptimizerSpec``).

* ``adamw``: torch's AdamW, fused (one kernel over every tensor: for SmolLM2 on two cores the loop of small ops took
  0.39 s a step, 6 s while vLLM computed beside it, against 0.09 s and 0.55 s, with bit-identical weights).
* ``muon``: torch's Muon on the 2-D weights but the embeddings and the LM head, AdamW on the rest, as prime-rl splits
  them; Muon's step size scaled to AdamW's update RMS (torch ``adjust_lr_fn="match_rms_adamw"``, prime-rl's dion
  ``adjust_lr="rms_norm"``: ``0.2 * sqrt(max(rows, cols))``).
* ``sign_sgd``: ``w -= lr * (sign(g) + weight_decay * w)``, no state (prime-rl's ``SignSGD``: AdamW with both betas
  at 0, epsilon aside). Scale-invariant: clipping changes only the reported norm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

if TYPE_CHECKING:
    from schemas.plan import OptimizerSpec


def build(spec: OptimizerSpec | None, named: Iterable[tuple[str, torch.nn.Parameter]], *, lr: float,
          weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer ``spec`` names over the trainable parameters of ``named`` (LoRA: the adapters only)."""
    named = [(n, p) for n, p in named if p.requires_grad]
    kind = spec.type if spec is not None else "adamw"
    betas = tuple(spec.betas) if spec is not None else (0.9, 0.999)
    if kind == "sign_sgd":
        return SignSGD([p for _, p in named], lr=lr, weight_decay=weight_decay)
    if kind == "muon":
        muon = [p for n, p in named if _muon_weight(n, p)]
        rest = [p for n, p in named if not _muon_weight(n, p)]
        return MuonAdamW(muon, rest, lr=lr, weight_decay=weight_decay, momentum=spec.momentum, betas=betas)
    return torch.optim.AdamW([p for _, p in named], lr=lr, weight_decay=weight_decay, betas=betas, fused=True)


def _muon_weight(name: str, p: torch.Tensor) -> bool:
    """prime-rl's split: matrices, but not the token embeddings or the LM head (tied or not)."""
    return p.ndim == 2 and "lm_head" not in name and "embed_tokens" not in name


class SignSGD(torch.optim.Optimizer):
    """Sign descent with decoupled weight decay; it keeps no state, so a training state holds only the weights."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    # the decay subtracted, not multiplied in: (1 - lr * wd) rounds a small decay away in fp32
                    p.sub_(p, alpha=group["lr"] * group["weight_decay"]).sub_(p.grad.sign(), alpha=group["lr"])


class MuonAdamW(torch.optim.Optimizer):
    """torch's Muon and AdamW as one optimizer: one list of parameter groups (the Muon ones first) and one state,
    shared with the two it steps, so a training state saves and loads it as any other
    (``torch.distributed.checkpoint``'s optimizer state dict)."""

    def __init__(self, muon: list[torch.Tensor], rest: list[torch.Tensor], *, lr: float, weight_decay: float,
                 momentum: float, betas: tuple[float, float]) -> None:
        parts = []
        if muon:
            parts.append(torch.optim.Muon(muon, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                          adjust_lr_fn="match_rms_adamw"))
        if rest:
            parts.append(torch.optim.AdamW(rest, lr=lr, weight_decay=weight_decay, betas=betas))
        self.parts = parts
        super().__init__([g for o in parts for g in o.param_groups], {})
        self._share()

    def _share(self) -> None:
        """The parts step this optimizer's groups and state (after a load replaced them, too)."""
        at = 0
        for o in self.parts:
            n = len(o.param_groups)
            o.param_groups, o.state = self.param_groups[at:at + n], self.state
            at += n

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for o in self.parts:
            o.step()
