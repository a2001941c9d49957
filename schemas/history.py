"""Derived runs: a new projection of a past run's Steps and Rollouts, and the rule it trains them by.

A derived run re-scores, re-credits and re-trains another run's rollouts into a revision chain of its own
(``rollout derive``). Its chain *forks* from one revision of the source run: the derived family's first
revision holds the source revision's checkpoint, and every revision after it is one optimizer step of the
derived trainer. What the stages share about it is declared here, once:

* ``schemas.envelope.SourceEvent``: where an event a derived event was computed from sits on the source run's
  log, and its bytes' digest: a derived score, record and revision name it, and the audit walks back through it.
* ``HistoryRule``: how tokens older weights generated are trained (the batch records it, the trainer obeys it).
* ``history_lag``: the staleness bound for history (see there).
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from typing import Literal

from pydantic import Field, field_validator

from schemas.envelope import Record
from schemas.objectives import DEFAULT_CLIP, PpoClipLoss
from schemas.policy import PolicyRef
from schemas.scoring import ScoringSpec, WeightedFunc



class HistoryRule(Record):
    """The off-policy rule of a derived run's batch.

    ``importance``: ``token_ppo_clip`` (the ``ppo_clip`` objective, whatever the live run trained with): per completion token, the
    ratio exp(logp_trainer - logp_recorded) against the logprob the *generating* revision recorded, clipped to
    [1 - clip, 1 + clip] (PPO/GRPO's pessimistic min), token-mean over the loss mask. Token-level, not
    sequence-level: a sequence ratio over hundreds of tokens of much older weights is 0 or huge, and clipping
    it discards whole sequences. The staleness bound is ``history_lag`` against the batch's
    ``max_off_policy_steps``, and the derived batcher stays at most ``consumers.batching.HISTORY_AHEAD`` batches ahead of the trainer.
    """

    source_run_id: str = Field(min_length=1)
    fork: PolicyRef = Field(description="the source revision the derived chain started from (its checkpoint)")
    importance: Literal["token_ppo_clip"] = "token_ppo_clip"
    clip: float = Field(DEFAULT_CLIP, gt=0)

    def objective(self) -> PpoClipLoss:
        """What the trainer trains a batch under this rule with (``schemas.objectives``)."""
        return PpoClipLoss(clip=self.clip)


class Rescore(Record):
    """What a derived run's verifier scores with instead of the spec each rollout carries: the fields given
    replace the rollout's (its answer, players and judge target stay)."""

    kind: str | None = None
    funcs: list[WeightedFunc] | None = None
    metrics: list[WeightedFunc] | None = None
    params: dict | None = None

    def apply(self, spec: ScoringSpec) -> ScoringSpec:
        return spec.model_copy(update={k: getattr(self, k) for k in type(self).model_fields
                                       if getattr(self, k) is not None})

    def version(self) -> str:
        """A short digest of the override, stamped into the derived scores' verifier_version."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:8]


class Derivation(Record):
    """A derived run's settings, the same for every stage and every restart (``rollout derive``)."""

    run_id: str = Field(min_length=1, description="the derived run's own id, on every event it writes")
    source_run_id: str = Field(min_length=1)
    source_prefix: str = Field(description="the topic prefix the source run's events are under")
    fork: PolicyRef = Field(description="the source revision to train from (its checkpoint digest checked)")
    from_revision: int | None = Field(None, ge=0, description="only rollouts admitted under this revision or later")
    to_revision: int | None = Field(None, ge=0, description="only rollouts admitted under this revision or earlier")
    since: datetime | None = Field(None, description="only rollouts created at or after this time")
    until: datetime | None = Field(None, description="only rollouts created before this time")
    rescore: Rescore | None = None

    @field_validator("since", "until")
    @classmethod
    def _zoned(cls, t: datetime | None) -> datetime | None:
        """A time without a zone (``--since 2026-11-20``) is UTC, as every event's ``created_at`` is: a naive and
        a zoned time cannot be compared."""
        return t.replace(tzinfo=timezone.utc) if t is not None and t.tzinfo is None else t

    def rule(self) -> HistoryRule:
        return HistoryRule(source_run_id=self.source_run_id, fork=self.fork)

    def takes(self, run_id: str, revision: int | None, created_at: datetime) -> bool:
        """Whether a source rollout (its run, admission revision and time) is in the derived run's range."""
        if run_id != self.source_run_id:
            return False
        if revision is not None and ((self.from_revision is not None and revision < self.from_revision) or
                                     (self.to_revision is not None and revision > self.to_revision)):
            return False
        return not ((self.since is not None and created_at < self.since) or
                    (self.until is not None and created_at >= self.until))


def history_lag(generated: PolicyRef, target: PolicyRef, rule: HistoryRule) -> int | None:
    """How far a source record is from the derived target: |t - j|, the derived chain numbered on from the fork's
    revision k. A pacing bound, the live rule's where j <= t: a derived run that batches as its source did stays
    as far behind the generating revisions as the source run trained (its records of source revision j arrive
    around its own revision j), and a record the derived run reaches much earlier or later than the source did
    (another batch size, a range starting later than the fork) is refused with its reason instead of trained
    out of order. It is not a divergence measure: after the fork the derived weights are not the source's, and
    what bounds each token's update is the clipped importance ratio against the recorded logprob (``HistoryRule``).
    None: the record is not of the fork's family."""
    if generated.family != rule.fork.family:
        return None
    return abs(target.revision - generated.revision)
