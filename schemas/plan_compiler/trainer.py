"""The trainer's sections: ``[trainer]`` settings, ``[trainer.optim]``, ``[trainer.loss]`` (the objective) and LoRA."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from schemas.objectives import OBJECTIVE_TYPES, DefaultLoss, objective_from
from schemas.plan import LoraSpec, OPTIMIZERS, OptimizerSpec
from schemas.plan_compiler.reader import RecipeReader, join_path, near_miss


class TrainerSection(RecipeReader):
    def _trainer(self, data: dict) -> tuple[dict[str, Any], OptimizerSpec]:
        """The reference trainer's lr and weight_decay, and its optimizer, from ``[trainer.optim]`` (prime-rl's
        defaults for what it leaves out: AdamW's betas 0.9/0.999, Muon's 0.9/0.95 and mu 0.95); every other trainer
        key is judged by ``schemas.recipe_keys`` (neutral, or refused)."""
        trainer = self.table(data, "trainer", "")
        if trainer is None:
            return {}, OptimizerSpec()
        optim = self.table(trainer, "optim", "trainer") or {}
        kind = optim.get("type", "adamw")
        if kind not in OPTIMIZERS:
            self.refused.append(f"trainer.optim.type: optimizer {kind!r}: the reference trainer runs "
                                f"{', '.join(OPTIMIZERS)}")
            kind = "adamw"
        out = {k: self.number(optim[k], join_path("trainer.optim", k)) for k in ("lr", "weight_decay") if k in optim}
        for k, v in out.items():
            self.provenance[f"trainer.{k}"] = f"trainer.optim.{k}"
        spec: dict[str, Any] = {"type": kind}
        if kind != "sign_sgd":
            default = (0.9, 0.95) if kind == "muon" else (0.9, 0.999)
            spec["betas"] = tuple(self.number(optim[k], join_path("trainer.optim", k)) if k in optim else d
                                  for k, d in zip(("betas1", "betas2"), default))
        if kind == "muon" and "mu" in optim:
            spec["momentum"] = self.number(optim["mu"], "trainer.optim.mu")
        if "max_norm" in optim:
            spec["max_norm"] = None if optim["max_norm"] is None else self.number(optim["max_norm"],
                                                                                  "trainer.optim.max_norm")
        for k in ("type", "betas1", "betas2", "mu", "max_norm"):
            if k in optim:
                self.provenance[f"trainer.optim.{k}"] = f"trainer.optim.{k}"
        self.ignore("trainer", {k: v for k, v in trainer.items()})
        try:
            return out, OptimizerSpec(**spec)
        except ValidationError as exc:
            raise self.fail("trainer.optim", exc.errors(include_url=False)[0]["msg"]) from None

    def _objective(self, data: dict, max_tokens: Any) -> Any:
        """``[trainer.loss]``: prime-rl's tagged union (``default``, ``ipo``, ``custom``) and ours (``trl``,
        ``ppo_clip``, ``ce``), each with its own keys and defaults (``schemas.objectives``); prime-rl's default
        when the table is absent. TRL's ``dr_grpo`` constant defaults to the learner's max_tokens."""
        trainer = self.table(data, "trainer", "") or {}
        loss = self.table(trainer, "loss", "trainer")
        if loss is None:
            return DefaultLoss()
        kind = loss.get("type", "default")
        if kind not in OBJECTIVE_TYPES:
            close = near_miss(str(kind), OBJECTIVE_TYPES)
            hint = f"did you mean {close[0]!r}?" if close else f"one of {', '.join(OBJECTIVE_TYPES)}"
            raise self.fail("trainer.loss.type", f"unknown loss type {kind!r} ({hint})")
        if kind == "trl" and loss.get("loss_type") == "dr_grpo" and "max_completion_length" not in loss \
                and max_tokens:
            loss = {**loss, "max_completion_length": max_tokens}
        try:
            spec = objective_from(loss)
        except ValidationError as exc:
            e = exc.errors(include_url=False)[0]
            where = ".".join(str(x) for x in e["loc"][1:] if not isinstance(x, int)) or "type"
            raise self.fail(join_path("trainer.loss", where), e["msg"]) from None
        for k in loss:
            self.provenance[f"objective.{k}"] = f"trainer.loss.{k}"
        return spec

    def _lora(self, data: dict) -> LoraSpec | None:
        """``[trainer.model.lora]`` (prime-rl's defaults for what it leaves out), with ``[orchestrator.model.lora]``'s
        rank and alpha over it where set, and its name (the adapter's in vLLM; prime-rl's default otherwise)."""
        table = ((data.get("trainer") or {}).get("model") or {}).get("lora")
        run = ((data.get("orchestrator") or {}).get("model") or {}).get("lora")
        if table is None:
            if run:
                raise self.fail("orchestrator.model.lora", "a LoRA adapter as the policy needs [trainer.model.lora] "
                                                           "(the adapter's rank, alpha and target modules)")
            return None
        if not isinstance(table, dict) or (run is not None and not isinstance(run, dict)):
            raise self.fail("trainer.model.lora", "must be a table")
        fields = {k: table[k] for k in ("rank", "alpha", "dropout", "target_modules") if k in table}
        fields.update({k: run[k] for k in ("rank", "alpha", "name") if run and run.get(k) is not None})
        try:
            spec = LoraSpec(**fields)
        except ValueError as e:
            raise self.fail("trainer.model.lora", str(e).splitlines()[-1] if str(e) else "invalid") from None
        for k in fields:
            self.provenance[f"lora.{k}"] = f"orchestrator.model.lora.{k}" if run and k in run else \
                f"trainer.model.lora.{k}"
        return spec
