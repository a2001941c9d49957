"""The scoring spec: what the verifier service runs for a rollout, recorded in the rollout itself.

An environment declares it; the arena writes it into ``Rollout.artifacts["scoring"]`` (as
``spec.model_dump(mode="json")``) next to the finalized artifacts, so the verifier scores
from the log alone and a replay knows how every reward was computed.
"""

from __future__ import annotations

from pydantic import Field, JsonValue

from schemas.envelope import Record

SCORING_ARTIFACT = "scoring"


class WeightedFunc(Record):
    fn: str = Field(pattern=r"^[\w.]+:[\w.]+$", description="import path 'package.module:function'")
    weight: float = 1.0


class ScoringSpec(Record):
    """What to score a rollout with: ``kind`` names a verifier registered in the verifier service
    (``consumers.scoring.VERIFIERS``), which says which of the other fields it needs and refuses a spec
    without them.

    ``kind`` is an open name because this schema cannot know which verifiers a service registers; an
    unknown kind is refused when the rollout is scored (dead-lettered with the known kinds).
    """

    kind: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="a registered verifier kind")
    answer: str | None = None
    funcs: list[WeightedFunc] = Field(default_factory=list)
    metrics: list[WeightedFunc] = Field(default_factory=list)
    judge_target: str | None = None
    players: list[str] = Field(default_factory=list)
    params: dict[str, JsonValue] = Field(default_factory=dict)
