"""The training objectives a plan can name: one tagged union, read from a recipe's ``[trainer.loss]``.

The loss functions themselves are torch code (``consumers.trainer.objectives``); what is declared here is what a plan
says and what a PolicyRevision records: the objective's type and every setting, defaults filled in, so that
``rollout plan`` shows it and replay reads what each revision was trained with.

* ``default``, ``ipo``, ``custom``: prime-rl's ``[trainer.loss]`` (its ``LossConfig`` union, the same keys and
  defaults). A recipe without ``[trainer.loss]`` trains with ``default``, as prime-rl does.
* ``trl``: TRL 1.16's ``GRPOTrainer`` objective (its ``GRPOConfig`` names: ``loss_type``, ``epsilon``,
  ``epsilon_high``, ``importance_sampling_level``, the vLLM importance-sampling correction), so that a run compared
  with TRL optimizes the same thing.
* ``ppo_clip``: the token-level PPO clip against the logprobs the generating revision recorded: a derived run's
  ``HistoryRule`` (``schemas.history``).
* ``ce``: masked negative log-likelihood (prime-rl's ``ce`` loss, its ``sft`` and ``echo`` algorithms' component).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeAlias, Union

from pydantic import Field, JsonValue, TypeAdapter, model_validator

from schemas.envelope import Record

DEFAULT_CLIP = 0.2
"""The PPO clip of the importance ratio (``ppo_clip``, and TRL's ``epsilon``)."""


class ObjectiveError(RuntimeError):
    """The objective cannot give a loss for a batch (a custom loss that raises or cannot be imported, a loss that
    is not finite): the trainer dead-letters the batch with this reason and goes on."""


class DefaultLoss(Record):
    """prime-rl's default, "DPPO+KL": DPPO-Binary TV (a token is masked when its probability moved past the trust
    region in the direction its advantage pushes) plus a squared log-ratio KL term. Masks on probability
    differences, so engine noise on an on-policy step masks nothing."""

    type: Literal["default"] = "default"
    dppo_mask_low: float = Field(0.2, ge=0)
    dppo_mask_high: float = Field(0.2, ge=0)
    adv_tau: float = Field(1.0, ge=0)
    kl_tau: float = Field(1e-3, ge=0)


class IpoLoss(Record):
    """prime-rl's ``ipo``: a symmetric trust region on |p_trainer - p_inference|, the same policy-gradient and KL
    terms as ``default``."""

    type: Literal["ipo"] = "ipo"
    ipo_threshold: float = Field(0.1, ge=0)
    adv_tau: float = Field(1.0, ge=0)
    kl_tau: float = Field(1e-3, ge=0)


class CustomLoss(Record):
    """prime-rl's ``custom``: a user's function ``module.function``, called per sample as ``fn(inputs, **kwargs)``
    with prime-rl's ``LossInputs`` attributes, returning ``.loss`` and ``.metrics`` (``consumers.trainer.objectives``)."""

    type: Literal["custom"] = "custom"
    import_path: str = Field(min_length=3, pattern=r"^[\w.]+\.\w+$")
    kwargs: dict[str, JsonValue] = Field(default_factory=dict)


TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
TRL_IS_MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")


class TrlLoss(Record):
    """TRL 1.16's GRPO objective as ``GRPOTrainer._compute_loss`` computes it (``beta`` 0: no reference model).

    The ratio is against the trainer's own logprobs of the batch before the step (TRL's ``old_per_token_logps``:
    exactly 1 on the first pass), so engine noise never clips; the engine's difference is corrected by TRL's
    vLLM importance weight exp(logp_trainer - logp_vllm), masked or truncated per ``vllm_importance_sampling_mode``
    at ``vllm_importance_sampling_clip_max``. ``loss_type`` is the normalisation: ``dapo`` and ``bnpo`` (the
    batch's tokens: one accumulation window here), ``grpo`` (each sequence's token mean, then the mean),
    ``dr_grpo`` (rows x ``max_completion_length``, the plan's max_tokens when not set)."""

    type: Literal["trl"] = "trl"
    loss_type: Literal[TRL_LOSS_TYPES] = "dapo"  # type: ignore[valid-type]
    epsilon: float = Field(DEFAULT_CLIP, gt=0)
    epsilon_high: float | None = Field(None, gt=0, description="None: epsilon")
    importance_sampling_level: Literal["token", "sequence"] = "token"
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: Literal[TRL_IS_MODES] = "sequence_mask"  # type: ignore[valid-type]
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0
    max_completion_length: int | None = Field(None, ge=1, description="dr_grpo's constant; None: the plan's "
                                                                       "max_tokens")

    @model_validator(mode="after")
    def _dr_grpo_length(self) -> TrlLoss:
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise ValueError("loss_type 'dr_grpo' divides by max_completion_length: set it (or the sampling "
                             "max_tokens it defaults to)")
        return self


class PpoClipLoss(Record):
    """The token-level PPO clip of exp(logp_trainer - logp_recorded) at ``clip``, token mean: how a derived run
    trains tokens older weights generated (``schemas.history.HistoryRule``)."""

    type: Literal["ppo_clip"] = "ppo_clip"
    clip: float = Field(DEFAULT_CLIP, gt=0)


class CeLoss(Record):
    """Masked negative log-likelihood of the loss-mask tokens, token mean."""

    type: Literal["ce"] = "ce"


OPSD_TEMPLATE = "Here is an example of an expert response:\n<demonstration>\n{demonstration}\n</demonstration>"
"""prime-rl's ``OPSDAlgoConfig.template`` default: the leading system message that carries the demonstration."""


class Demonstration(Record):
    """What conditions a self-distilling reference (prime-rl's opsd): the demonstration under ``key``, in
    ``template``, prepended to each sample as a leading system message rendered by the served model's own chat
    template; the sample itself is scored verbatim after it."""

    key: str = Field("demonstration", min_length=1, description="where the demonstration is: the example's info "
                     "first, then the rollout's own field of that name (e.g. answer)")
    template: str = Field(OPSD_TEMPLATE, description="the system message; receives {demonstration}")

    @model_validator(mode="after")
    def _formats(self) -> "Demonstration":
        """Formatted as prime-rl does (``str.format``): other braces must be doubled."""
        try:
            self.template.format(demonstration="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"the template must format with {{demonstration}} alone: {e!r}") from None
        return self

    def text_in(self, artifacts: dict[str, Any]) -> str | None:
        """The demonstration a Rollout's artifacts hold: ``example_info[key]``, else ``artifacts[key]``."""
        info = artifacts.get("example_info")
        value = info.get(self.key) if isinstance(info, dict) else None
        if value is None:
            value = artifacts.get(self.key)
        return None if value is None else str(value)

    def hint(self, text: str) -> str:
        return self.template.format(demonstration=text)


class Reference(Record):
    """The model a ``ref_kl`` component distills toward, named on every event its logprobs are in, so that replay
    shows which model scored each token: a frozen teacher (prime-rl's opd ``teacher``), or the live policy under a
    demonstration (opsd: ``demonstration`` set, ``base_url`` the run's own policy server)."""

    model: str = Field(min_length=1, description="the served model's name, sent as each request's model")
    base_url: str | None = Field(None, min_length=1, description="its OpenAI-compatible endpoint (.../v1); None: the "
                                 "run's own policy server (the reference service's policy_url)")
    api_key_var: str | None = Field(None, description="the environment variable holding its API key, if any")
    revision: str | None = Field(None, description="what the server says it serves (vLLM's /v1/models root: a "
                                                   "checkpoint path or hub revision), where it says")
    demonstration: Demonstration | None = Field(None, description="opsd: the live policy scores each sample with "
                                                "this demonstration prepended")


ObjectiveSpec: TypeAlias = Annotated[Union[DefaultLoss, IpoLoss, CustomLoss, TrlLoss, PpoClipLoss, CeLoss],
                                     Field(discriminator="type")]
OBJECTIVE_TYPES = ("default", "ipo", "custom", "trl", "ppo_clip", "ce")
PRIME_RL_LOSS_TYPES = ("default", "ipo", "custom")
"""What prime-rl's ``[trainer.loss] type`` takes; ours add ``trl``, ``ppo_clip`` and ``ce``."""

_ADAPTER: TypeAdapter[Any] = TypeAdapter(ObjectiveSpec)


def objective_from(value: dict[str, Any]) -> Any:
    """The objective a ``[trainer.loss]`` table (or a recorded one) names; pydantic's ValidationError names the
    key that is wrong."""
    return _ADAPTER.validate_python({"type": "default", **value})


def describe(spec: Any) -> str:
    """One line for ``rollout plan`` and logs: the type and every setting."""
    settings = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in spec.model_dump(exclude={"type"}).items() if v not in (None, {}))
    return f"{spec.type} ({settings})" if settings else spec.type
