"""The services' settings: one object, built once from flags, plan, environment and defaults.

Precedence, highest first: an explicit flag > the plan (``--plan``) > ``ROLLOUT_<FIELD>`` in the
environment > the default here. Each service declares which fields are its own options
(``consumers.registry``); its flags are derived from those fields, so a verifier has no ``--lr``.
Defaults that the plan also defines (batch size, off-policy bound) come from the plan model, so
a service started without a plan behaves like one started with prime-rl's defaults.
"""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.history import Derivation
from schemas.objectives import DefaultLoss, ObjectiveSpec
from schemas.plan import (DEFAULT_BATCH_SIZE, DEFAULT_MAX_OFF_POLICY_STEPS, AdmissionGate, GenerationPlan, LoraSpec,
                          OptimizerSpec, References)
from schemas.policy import TINY_FAMILY
from streams import topics


MICRO_BATCH_TOKENS = 1024
"""The trainer's default token budget of one forward/backward (rows x padded width): activation memory grows with
it, not with the batch (SmolLM2-135M under bf16 autocast keeps about 1 MB a token, plus 270 MB of bf16 weight
copies). A row longer than the budget runs alone with its layers' activations recomputed in the backward pass
(gradient checkpointing): about 0.1 MB a token. Chosen by measurement (benchmarks/RESULTS.md, "trainer_step")."""
DEFAULT_STATE_EVERY = 8
"""The trainer writes its training state every this many revisions (benchmarks/RESULTS.md, "trainer_step")."""


class PlanRefused(Exception):
    """The plan asks for something this service cannot run (one line for the user)."""


class ServiceSettings(BaseSettings):
    """Everything a service reads; a service's own options are the fields its declaration names."""

    model_config = SettingsConfigDict(env_prefix="ROLLOUT_", extra="forbid", validate_assignment=True)

    instance: str = Field("", description="label for logs and producer names (several instances of one service)")
    family: str = Field(TINY_FAMILY, description="the learner's model family")
    credit: str = Field("grpo", description="credit strategy (consumers.credit.STRATEGIES)")
    credit_params: dict[str, Any] = Field(default_factory=dict, description="strategy parameters (from the plan)")
    alpha: float | None = Field(None, description="EMA factor of the moving baselines (default: the strategy's)")
    group_timeout_s: float = Field(300.0, description="refuse or flush a group still incomplete after this long")
    step_timeout_s: float = Field(600.0, description="dead-letter a rollout whose steps are still missing after this long")
    judge_targets: dict[str, Any] = Field(default_factory=dict, description="judge endpoints (from the plan)")
    max_off_policy_steps: int = Field(DEFAULT_MAX_OFF_POLICY_STEPS, ge=0,
                                      description="refuse records more revisions behind the batch target than this")
    batch_records: int | None = Field(DEFAULT_BATCH_SIZE, ge=1,
                                      description="records per TrainerBatch: one optimizer step (the plan's batch_size)")
    batch_tokens: int | None = Field(None, ge=1, description="completion tokens per TrainerBatch (instead of records)")
    flush_after_s: float = Field(10.0, description="emit a partial batch (a smaller step) when no record arrived "
                                                   "for this long: the end of a run, or generation stalled")
    ahead_timeout_s: float = Field(1800.0, gt=0, description="batcher: refuse a record whose revision is still not "
                                   "announced after this long (its trainer never published it, or another run's)")
    children_timeout_s: float = Field(1800.0, gt=0, description="verifier: forget children's outcomes whose parent "
                                      "rollout is still missing after this long (it timed out, or never came)")
    checkpoint_dir: str = Field(".state/checkpoints", description="trainer: where checkpoints are written")
    keep_checkpoints: int = Field(0, ge=0, description="trainer: keep only the newest N checkpoint files it wrote, "
                                                       "at least 2: the newest is not committed yet when written (0: "
                                                       "keep all; the arena must still find the one it loads)")
    lr: float = Field(1e-3, gt=0, description="trainer: learning rate (the plan's trainer.optim.lr)")
    weight_decay: float = Field(0.0, ge=0, description="trainer: AdamW weight decay (the plan's trainer.optim.weight_decay)")
    served_model: str | None = Field(None, description="trainer: the weights standing for the family, stamped on "
                                                       "every revision (the plan's served_model)")
    epochs: int = Field(1, ge=1, description="trainer: optimizer passes over each batch (PPO epochs)")
    lora: LoraSpec | None = Field(None, description="trainer: LoRA training (the plan's [trainer.model.lora]): only "
                                                    "the adapters train, each revision is served merged")
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec, description="trainer: the optimizer (the "
                                     "plan's [trainer.optim] type, betas, mu, max_norm)")
    objective: ObjectiveSpec = Field(default_factory=DefaultLoss, description="trainer: what it optimizes (the "
                                     "plan's [trainer.loss]: schemas.objectives)")
    references: References = Field(default_factory=References, description="reference, credit: each training "
                                   "source's reference (the plan's opd teachers): the reference service scores those "
                                   "sources' tokens under it, credit trains them from its output")
    policy_url: str | None = Field(None, description="reference: the learner's endpoint (.../v1) where a "
                                   "self-distilling (opsd) source's samples are scored under the live policy; "
                                   "rollout rl passes its own vLLM's")
    admission_gates: list[AdmissionGate] = Field(default_factory=list, description="credit: the plan's admission "
                                                 "gates (prime-rl's curriculum.gates): gated groups are not trained")
    max_steps: int | None = Field(None, ge=1, description="trainer: the run's last revision (the plan's max_steps, "
                                  "prime-rl's optimizer steps): a batch that would train past it is refused, its "
                                  "records dead-lettered with RunComplete (None: no end)")
    state_every: int = Field(DEFAULT_STATE_EVERY, ge=1, description="trainer: write the training state (float32 "
                             "weights, optimizer moments) every N revisions; a take-over loads the last one and trains "
                             "the batches the log committed after it again (the served weights are written every "
                             "revision)")
    micro_batch_tokens: int = Field(MICRO_BATCH_TOKENS, ge=1, description="trainer: tokens (rows x padded width; a "
                                    "group's rows, packed to run their prompt once, count as one row) of one "
                                    "forward/backward: activation memory grows with it, not with the batch")
    derivation: Derivation | None = Field(None, description="a derived run (rollout derive): the source run whose "
                                          "Steps and Rollouts it reads, its range, re-scoring and fork revision")

    def reads(self, topic: topics.Topic) -> tuple[str, ...]:
        """The names a service reads ``topic`` under: a derived run reads what arenas wrote from its source run's
        topics (it never writes there) and from its own (its evaluation's rollouts), everything else under its
        own prefix."""
        if self.derivation is not None and topic in topics.ARENA_WRITES:
            return self.derivation.source_prefix + topic.key, topic.name
        return (topic.name,)

    @property
    def needs_reference(self) -> bool:
        """Whether a training source trains with ref_kl (the reference service has work)."""
        return self.references.any

    @property
    def strategy_params(self) -> dict[str, Any]:
        """The credit strategy's parameters: the plan's, the group timeout, and ``alpha`` when set."""
        alpha = {"alpha": self.alpha} if self.alpha is not None else {}
        return {"group_timeout_s": self.group_timeout_s, **self.credit_params, **alpha}


def plan_values(plan: GenerationPlan, *, credit: bool) -> dict[str, Any]:
    """The settings a plan defines. ``credit``: the service runs the plan's algorithm, so a plan whose
    algorithm nothing here runs (or names a strategy nobody registered) is refused (``PlanRefused``)
    instead of falling back to another."""
    from consumers.credit import STRATEGIES, check_gates
    from schemas.plan import PlanError, admission_gates, credit_strategy, references

    values: dict[str, Any] = {"family": plan.family, "max_off_policy_steps": plan.max_off_policy_steps,
                              "judge_targets": dict(plan.targets), "served_model": plan.served_model,
                              "max_steps": plan.max_steps, "lora": plan.lora, "optimizer": plan.optimizer,
                              "objective": plan.objective, "references": references(plan),
                              **{k: plan.trainer[k] for k in ("lr", "weight_decay") if k in plan.trainer}}
    if plan.token_batch_size:
        values.update(batch_tokens=plan.token_batch_size, batch_records=None)
    else:
        values["batch_records"] = plan.batch_size
    try:
        name, params = credit_strategy(plan)
        if name not in STRATEGIES:
            raise PlanError(f"{plan.source}: advantage type {name!r} is not a registered credit strategy "
                            f"({', '.join(STRATEGIES)}; see consumers.credit.register_strategy)")
        values["credit"], values["credit_params"] = name, params
        values["admission_gates"] = admission_gates(plan)
        try:
            check_gates(name, values["admission_gates"])
        except ValueError as e:
            raise PlanError(f"{plan.source}: {e}") from None
    except PlanError as e:
        if credit:
            raise PlanRefused(str(e)) from None
    return values


def build(flags: dict[str, Any] | None = None, plan: GenerationPlan | None = None, *, credit: bool = False,
          **overrides: Any) -> ServiceSettings:
    """Settings from the sources in precedence order: ``overrides`` and ``flags`` > ``plan`` > environment.
    An explicit ``credit`` flag replaces the plan's algorithm, so the plan's cannot be refused then."""
    flags = {**(flags or {}), **overrides}
    values = plan_values(plan, credit=credit and "credit" not in flags) if plan is not None else {}
    values.update(flags)
    return ServiceSettings(**values)


# -- flags -------------------------------------------------------------------------------------------------
# structured: from the plan only
_NOT_FLAGS = {"credit_params", "judge_targets", "derivation", "lora", "optimizer", "admission_gates", "references"}


def add_flags(p: argparse.ArgumentParser, fields: tuple[str, ...]) -> None:
    """One flag per field, default suppressed: only what the user typed reaches ``build``."""
    for name in fields:
        if name in _NOT_FLAGS:
            continue
        info = ServiceSettings.model_fields[name]
        kind = _scalar(info.annotation)
        default = info.default if info.default_factory is None else info.default_factory()
        extra: dict[str, Any] = {}
        if name == "credit":
            from consumers.credit import STRATEGIES

            extra["choices"] = list(STRATEGIES)
        shown = f"default: {default}; " if default is not None else ""
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=argparse.SUPPRESS,
                       help=f"{info.description} ({shown}env ROLLOUT_{name.upper()})", **extra)


def flags_of(args: argparse.Namespace, fields: tuple[str, ...]) -> dict[str, Any]:
    return {f: getattr(args, f) for f in fields if hasattr(args, f)}


def _scalar(annotation: Any) -> type:
    for t in (int, float, str):
        if annotation is t or t in getattr(annotation, "__args__", ()):
            return t
    raise TypeError(f"no flag type for {annotation!r}")
