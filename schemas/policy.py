"""Policy revisions: which weights produced a token, and which weights a batch trains."""

from __future__ import annotations

import re
from typing import ClassVar

from pydantic import Field, model_validator

from schemas.envelope import Event, Record
from schemas.errors import MissingCheckpointError

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
TINY_FAMILY = "tiny-byte-lm"  # the built-in byte-level model: the family a plan-less service or server assumes


class CheckpointRef(Record):
    """Where a revision's weights live, and the SHA-256 of their bytes."""

    uri: str = Field(min_length=1)
    digest: str = Field(pattern=SHA256_HEX.pattern, description="sha256 hex of the checkpoint file")


class PolicyRef(Record):
    """A compact pointer to one revision of one model family, carried by every Step and record."""

    family: str = Field(min_length=1, description="model family; revisions of different families never mix")
    revision: int = Field(ge=0)
    checkpoint_digest: str | None = Field(default=None, pattern=SHA256_HEX.pattern)

    def __str__(self) -> str:
        return f"{self.family}@r{self.revision}"


class PolicyRevision(Event):
    """Published by the trainer (revision 0 by whoever seeds the run) on the policy-revisions topic."""

    EVENT_TYPE: ClassVar[str] = "policy_revision"

    family: str = Field(min_length=1)
    revision: int = Field(ge=0, description="monotonically increasing within a family")
    checkpoint: CheckpointRef | None = None
    parent_revision: int | None = Field(default=None, ge=0)
    batch_id: str | None = Field(default=None, description=(
        "the TrainerBatch this revision was trained on (one optimizer step from parent_revision); None for a "
        "revision no batch made (revision 0)"))
    batch_digest: str | None = Field(default=None, description="that batch's batch_digest, as the trainer read it")
    metrics: dict[str, float] = Field(default_factory=dict, description=(
        "the training step that made this revision: loss, clip fraction, step seconds, and the trainer-inference "
        "logprob mismatch (mean/max |logprob(trainer) - logprob(inference)| over the batch's tokens, each "
        "recomputed under the revision that generated it)"))

    @model_validator(mode="after")
    def _parent_precedes(self) -> PolicyRevision:
        if self.parent_revision is not None and self.parent_revision >= self.revision:
            raise ValueError(f"parent_revision {self.parent_revision} must be below revision {self.revision}")
        return self

    def ref(self) -> PolicyRef:
        return PolicyRef(family=self.family, revision=self.revision,
                         checkpoint_digest=self.checkpoint.digest if self.checkpoint else None)

    def require_checkpoint(self) -> CheckpointRef:
        """Training targets must name real weights: refuse a revision that has no checkpoint digest."""
        if self.checkpoint is None:
            raise MissingCheckpointError(
                f"policy revision {self.family}@r{self.revision} has no checkpoint digest; "
                "publish it with the checkpoint it was saved to before training against it")
        return self.checkpoint
