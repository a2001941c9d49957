"""The events of a run, in the order the pipeline produces them.

Step (one model call) and Rollout (one finished episode) come from the arena; RolloutScored
from the verifier; RolloutReferenced from the reference service (a ref_kl source's score with the reference's
logprobs); TrainingRecord from credit assignment; TrainerBatch from the batcher;
DeadLetter from any service that could not process its input.
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import Field, JsonValue, model_validator

from schemas.admission import ADMISSION_EVENTS
from schemas.arrays import Logprobs, Mask, TokenIds
from schemas.envelope import Event, Record, SourceEvent
from schemas.history import HistoryRule
from schemas.objectives import Reference
from schemas.policy import PolicyRef, PolicyRevision

ROOT_GROUP_DOC = ("group id of the top-level episode this belongs to (its own group_id when top-level); "
                  "everything of one root group is co-located, so a group or an episode tree is seen whole")
TRAIN_SOURCE_DOC = ("the plan's training source (its name) the group was sampled for, which says its algorithm when "
                    "two sources share an environment; None: an evaluation, or written before sources were named")
ENV_REF = re.compile(r"^[A-Za-z0-9_.\-/]+@[A-Za-z0-9_.\-+]+$")


class ToolCall(Record):
    id: str
    name: str
    arguments: str = Field(description="JSON-encoded arguments, exactly as the model produced them")


class ChatMessage(Record):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None


class Step(Event):
    """One model call. Immutable; the Rollout that owns it lists its ``step_id`` in order."""

    EVENT_TYPE: ClassVar[str] = "step"

    step_id: str = Field(min_length=1)
    rollout_id: str = Field(min_length=1)
    root_group_id: str = Field(min_length=1, description=ROOT_GROUP_DOC)
    index: int = Field(ge=0, description="position of this call within its rollout")
    member_id: str = Field(min_length=1, description="the seat that spoke (a role if trainable)")
    target: str = Field(min_length=1, description="the GenerationPlan target that served the call")
    trainable: bool = Field(description="whether this member was the learner for this rollout")
    policy: PolicyRef | None = Field(description="revision that produced the tokens; None for fixed targets")
    policy_exact: bool = Field(default=True, description=(
        "True when every token is known to come from `policy` (the serving endpoint reported it, or the arena "
        "drained calls around each weight swap); False when the revision is the arena's best knowledge only"))
    prompt: list[ChatMessage]
    completion: list[ChatMessage]
    prompt_token_ids: TokenIds
    completion_token_ids: TokenIds
    completion_logprobs: Logprobs
    finish_reason: str
    tool_calls: list[ToolCall] = Field(default_factory=list)
    latency_s: float = Field(ge=0)

    @model_validator(mode="after")
    def _aligned(self) -> Step:
        if len(self.completion_token_ids) != len(self.completion_logprobs):
            raise ValueError(f"completion_token_ids ({len(self.completion_token_ids)}) and completion_logprobs "
                             f"({len(self.completion_logprobs)}) must have the same length")
        if self.trainable and self.policy is None:
            raise ValueError("a trainable step must name the policy revision that produced it")
        return self


RolloutStatus = Literal["completed", "truncated", "failed"]


class Rollout(Event):
    """A finished episode: what was asked, which calls were made, what came out."""

    EVENT_TYPE: ClassVar[str] = "rollout"

    rollout_id: str = Field(min_length=1)
    episode_type: str = Field(min_length=1)
    environment: str = Field(pattern=ENV_REF.pattern, description="environment reference name@version")
    example_id: str = Field(min_length=1, description="dataset example the seed came from")
    seed: dict[str, JsonValue]
    step_ids: list[str] = Field(description="the rollout's steps, in call order")
    members: dict[str, bool] = Field(description="member_id -> trainable in this rollout")
    artifacts: dict[str, JsonValue] = Field(default_factory=dict, description="Episode.finalize() output")
    parent_rollout_id: str | None = None
    child_rollout_ids: list[str] = Field(default_factory=list)
    group_id: str = Field(min_length=1, description="rollouts of one prompt sampled together")
    root_group_id: str = Field(min_length=1, description=ROOT_GROUP_DOC)
    group_size: int = Field(ge=1)
    policy: PolicyRef | None = Field(description="learner revision current when the episode was admitted")
    status: RolloutStatus
    failure_reason: str | None = None
    evaluation: bool = Field(default=False, description="a held-out evaluation rollout: scored, never trained on")
    train_source: str | None = Field(default=None, description=TRAIN_SOURCE_DOC)

    @model_validator(mode="after")
    def _status_consistent(self) -> Rollout:
        if self.status == "failed" and not self.failure_reason:
            raise ValueError("a failed rollout must say why (failure_reason)")
        if self.status != "failed" and not self.step_ids and not self.child_rollout_ids:
            raise ValueError("an empty rollout (no steps, no children) is refused; record it as failed with a reason")
        if len(set(self.step_ids)) != len(self.step_ids):
            raise ValueError("step_ids repeat a step")
        return self


class StepTokens(Record):
    """The trainable part of a Step, carried forward so credit assignment needs no join."""

    step_id: str
    member_id: str
    policy: PolicyRef
    prompt_token_ids: TokenIds
    completion_token_ids: TokenIds
    completion_logprobs: Logprobs
    observation_roles: list[str] | None = Field(default=None, description="the roles of the prompt's messages after "
                                                "its last assistant message: the environment's turn since the member "
                                                "last spoke (prime-rl's echo trains on it); None on a first call")

    @classmethod
    def of(cls, step: Step) -> StepTokens:
        last = max((i for i, m in enumerate(step.prompt) if m.role == "assistant"), default=None)
        roles = [m.role for m in step.prompt[last + 1:]] if last is not None else []
        return cls(step_id=step.step_id, member_id=step.member_id, policy=step.policy,
                   prompt_token_ids=step.prompt_token_ids, completion_token_ids=step.completion_token_ids,
                   completion_logprobs=step.completion_logprobs, observation_roles=roles or None)


class CeSpan(Record):
    """Prompt tokens ``[start, end)`` trained with cross-entropy at ``weight``, outside the loss mask (prime-rl's
    echo: the environment's tokens since the member's previous call)."""

    start: int = Field(ge=1, description="the first token predicted (never the prompt's first)")
    end: int
    weight: float = Field(gt=0)


class RolloutScored(Event):
    """The verifier's verdict on one rollout. Metrics are logged, never rewarded."""

    EVENT_TYPE: ClassVar[str] = "rollout_scored"

    rollout_id: str
    group_id: str
    root_group_id: str = Field(min_length=1, description=ROOT_GROUP_DOC)
    group_size: int = Field(ge=1)
    environment: str = Field(pattern=ENV_REF.pattern)
    example_id: str
    parent_rollout_id: str | None = None
    status: RolloutStatus
    rewards: dict[str, float] = Field(description="member_id -> reward")
    metrics: dict[str, float] = Field(default_factory=dict)
    verifier: str = Field(min_length=1)
    verifier_version: str = Field(min_length=1)
    trainable_steps: list[StepTokens] = Field(default_factory=list)
    evaluation: bool = Field(default=False, description="copied from the Rollout: credit assignment skips it")
    source: SourceEvent | None = Field(default=None, description="a derived run's score: the source run's Rollout "
                                       "it re-scored (schemas.history)")
    train_source: str | None = Field(default=None, description="copied from the Rollout: " + TRAIN_SOURCE_DOC)
    demonstration: str | None = Field(default=None, description="what a self-distilling reference (opsd) prepends: "
                                      "the Rollout's demonstration, copied for a source whose reference has one")


class StepReference(Record):
    """The reference's logprob of each completion token of one trainable step."""

    step_id: str
    ref_logprobs: Logprobs


class RolloutReferenced(Event):
    """A score of a source whose objective is ``ref_kl`` (prime-rl's opd), with the reference's logprobs of every
    trainable completion token, scored by prefill (the reference service). Credit trains these, not the score."""

    EVENT_TYPE: ClassVar[str] = "rollout_referenced"

    scored: RolloutScored = Field(description="the verifier's score, as it is on the scores topic")
    root_group_id: str = Field(min_length=1, description=ROOT_GROUP_DOC)
    reference: Reference
    steps: list[StepReference] = Field(description="one per trainable step of the score, in its order")

    @model_validator(mode="after")
    def _aligned(self) -> RolloutReferenced:
        want = [(s.step_id, len(s.completion_token_ids)) for s in self.scored.trainable_steps]
        got = [(s.step_id, len(s.ref_logprobs)) for s in self.steps]
        if got != want:
            raise ValueError(f"reference logprobs {got} do not match the trainable steps' completions {want}")
        if self.root_group_id != self.scored.root_group_id:
            raise ValueError("root_group_id differs from the score's")
        return self


class TrainingRecord(Event):
    """The trainer's unit: one trainable step's tokens with its credit."""

    EVENT_TYPE: ClassVar[str] = "training_record"

    record_id: str = Field(min_length=1, description="deterministic from rollout and step, so a retry cannot double it")
    rollout_id: str
    step_ids: list[str] = Field(min_length=1)
    member_id: str
    group_id: str
    environment: str = Field(pattern=ENV_REF.pattern)
    policy: PolicyRef = Field(description="source revision that produced the completion")
    prompt_token_ids: TokenIds
    completion_token_ids: TokenIds
    completion_logprobs: Logprobs
    loss_mask: Mask = Field(description="1 where the completion token is trained on")
    reward: float
    advantage: float
    credit: str = Field(description="credit strategy that produced the advantage")
    source: SourceEvent | None = Field(default=None, description="a derived run's record: the source run's Rollout "
                                       "its tokens come from (copied from the score)")
    ref_logprobs: Logprobs | None = Field(default=None, description="the reference's logprob of each completion "
                                          "token (a ref_kl source's, prime-rl's opd): the record trains with ref_kl; "
                                          "None: with the plan's objective")
    ce_spans: list[CeSpan] | None = Field(default=None, description="prompt tokens trained with cross-entropy "
                                          "besides the completion (prime-rl's echo); None: none")

    @model_validator(mode="after")
    def _aligned(self) -> TrainingRecord:
        n = len(self.completion_token_ids)
        if len(self.completion_logprobs) != n or len(self.loss_mask) != n:
            raise ValueError(f"completion_token_ids ({n}), completion_logprobs ({len(self.completion_logprobs)}) "
                             f"and loss_mask ({len(self.loss_mask)}) must have the same length")
        if self.ref_logprobs is not None and len(self.ref_logprobs) != n:
            raise ValueError(f"ref_logprobs ({len(self.ref_logprobs)}) and completion_token_ids ({n}) must have the "
                             "same length")
        if n == 0:
            raise ValueError("a training record with no completion tokens is refused")
        for span in self.ce_spans or ():
            if not span.start < span.end <= len(self.prompt_token_ids):
                raise ValueError(f"ce span [{span.start}, {span.end}) is not inside the prompt's "
                                 f"{len(self.prompt_token_ids)} tokens")
        return self


class RevisionCount(Record):
    policy: PolicyRef
    records: int = Field(ge=1)


class Aggregates(Record):
    count: int
    mean: float
    std: float
    min: float
    max: float


class TrainerBatch(Event):
    """A lineage-stamped batch for one target revision. Build it with ``schemas.batch.assemble_batch``."""

    EVENT_TYPE: ClassVar[str] = "trainer_batch"

    batch_id: str
    family: str
    target: PolicyRef
    max_off_policy_steps: int = Field(ge=0)
    records: list[TrainingRecord] = Field(min_length=1)
    source_revisions: list[RevisionCount]
    reward: Aggregates
    advantage: Aggregates
    completion_tokens: int = Field(ge=0)
    proof_refs: list[str] = Field(description="sorted unique references (rollout ids) the batch rests on")
    batch_digest: str
    lineage_digest: str
    history: HistoryRule | None = Field(default=None, description="a derived run's batch: the rule its records, "
                                        "generated by the source run's weights, are trained and bounded by")


class DeadLetter(Event):
    """Input a service could not process, kept whole with the reason, so nothing is silently lost."""

    EVENT_TYPE: ClassVar[str] = "dead_letter"

    origin_topic: str
    origin_partition: int
    origin_offset: int
    origin_key: bytes | None = None
    raw: bytes
    error_type: str
    error_message: str
    service: str
    partial: bool = Field(False, description="only this part of the input (one record of a batch) was refused; the "
                                             "rest of it was processed (the batch trained without it)")


ALL_EVENTS: tuple[type[Event], ...] = (
    PolicyRevision, Step, Rollout, RolloutScored, RolloutReferenced, TrainingRecord, TrainerBatch, DeadLetter,
    *ADMISSION_EVENTS)
EVENTS_BY_TYPE: dict[str, type[Event]] = {cls.EVENT_TYPE: cls for cls in ALL_EVENTS}
