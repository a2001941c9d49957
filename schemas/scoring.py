"""The scoring spec: what the verifier service runs for a rollout, recorded in the rollout itself.

An environment declares it; the arena writes it into ``Rollout.artifacts["scoring"]`` (as
``spec.model_dump(mode="json")``) next to the finalized artifacts, so the verifier scores
from the log alone and a replay knows how every reward was computed.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, JsonValue, model_validator

from schemas.envelope import Record

SCORING_ARTIFACT = "scoring"


class WeightedFunc(Record):
    fn: str = Field(pattern=r"^[\w.]+:[\w.]+$", description="import path 'package.module:function'")
    weight: float = 1.0


class ScoringSpec(Record):
    """kinds:

    * ``exact_match``: completion's final answer == ``answer`` (reward 1/0 for each trainable member);
    * ``rubric``: weighted sum of reward functions (sync or async; called with prompt, completion,
      answer, state keyword arguments, each taking what it needs); ``metrics`` are logged only;
    * ``llm_judge``: the fixed plan target ``judge_target`` grades the transcript (never trained on);
    * ``zero_sum_judge``: the judge picks a winner among ``players``: +1 / -1, 0 on a tie;
    * ``monte_carlo``: a parent scored from its child rollouts' outcomes (proposer/solver).
    """

    kind: Literal["exact_match", "rubric", "llm_judge", "zero_sum_judge", "monte_carlo"]
    answer: str | None = None
    funcs: list[WeightedFunc] = Field(default_factory=list)
    metrics: list[WeightedFunc] = Field(default_factory=list)
    judge_target: str | None = None
    players: list[str] = Field(default_factory=list)
    params: dict[str, JsonValue] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _complete(self) -> ScoringSpec:
        if self.kind == "exact_match" and self.answer is None:
            raise ValueError("exact_match scoring needs an answer")
        if self.kind == "rubric" and not self.funcs:
            raise ValueError("rubric scoring needs at least one reward function")
        if self.kind in ("llm_judge", "zero_sum_judge") and not self.judge_target:
            raise ValueError(f"{self.kind} scoring needs judge_target (a fixed target of the plan)")
        if self.kind == "zero_sum_judge" and len(self.players) != 2:
            raise ValueError("zero_sum_judge scoring needs exactly two players")
        return self
