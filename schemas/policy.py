"""Policy revisions: which weights produced a token, and which weights a batch trains."""

from __future__ import annotations

import hashlib
import re
from typing import ClassVar

from pydantic import Field, JsonValue, model_validator

from schemas.envelope import Event, Record, SourceEvent
from schemas.errors import MissingCheckpointError

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
TINY_FAMILY = "tiny-byte-lm"  # the built-in byte-level model: the family a plan-less service or server assumes

# a family named as Hugging Face names models (``org/name``) whose parts are HF-valid: word characters, ``.`` and
# ``-``, starting and ending with a word character, no ``--`` or ``..`` (HF's own rules for repo ids)
_HF_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
SLUG_MAX = 128


def family_slug(family: str) -> str:
    """The family as a name that is safe in a file or folder name, a Kafka topic / group / transactional id, a
    URL path segment and an HTML id: only ``[A-Za-z0-9._-]``. The family itself (``PolicyRef.family``, in every
    event) never changes; anything that *names* something after it reads this, and only this.

    * a family that is already one safe name (``tiny-byte-lm``, ``SmolLM2-135M-Instruct``) is itself;
    * ``org/name`` (HF-valid parts) becomes ``org--name``, as Hugging Face's own cache names a repo
      (``models--org--name``). HF ids cannot hold ``--``, and no part starts or ends with ``-``, so distinct
      such families get distinct slugs;
    * anything else (other characters, ``--``, ``..``, an empty part, a leading ``.`` or ``-``) has each unsafe
      character replaced (``/`` by ``--``, the others by ``-``) and the first 10 hex digits of the family's
      SHA-256 appended, so two families that clean up alike still differ (leading and trailing ``.``/``-``
      dropped: never a hidden file, an option or ``..``); so does a slug over ``SLUG_MAX`` characters, cut short.
    """
    if not family:
        raise ValueError("a model family is never empty")
    parts = family.split("/")
    clean = all(_HF_PART.fullmatch(p) and "--" not in p and ".." not in p for p in parts)
    slug = "--".join(_UNSAFE.sub("-", p) for p in parts)
    if clean and len(slug) <= SLUG_MAX:
        return slug
    base = slug[:SLUG_MAX - 11].strip(".-") or "family"  # never hidden, never read as an option, never ``..``
    return f"{base}-{hashlib.sha256(family.encode()).hexdigest()[:10]}"


ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""The weights file of a LoRA adapter checkpoint (a PEFT folder, ``policy.lora``): a revision whose checkpoint is one
is served as an adapter over its base model, not as whole weights."""


class CheckpointRef(Record):
    """Where a revision's weights live, and the SHA-256 of their bytes."""

    uri: str = Field(min_length=1)
    digest: str = Field(pattern=SHA256_HEX.pattern, description="sha256 hex of the checkpoint file")

    @property
    def adapter(self) -> bool:
        """A LoRA adapter alone (``ADAPTER_WEIGHTS``), to be served over the base model its file names."""
        return self.uri.endswith("/" + ADAPTER_WEIGHTS)


class PolicyRef(Record):
    """A compact pointer to one revision of one model family, carried by every Step and record."""

    family: str = Field(min_length=1, description="model family; revisions of different families never mix")
    revision: int = Field(ge=0)
    checkpoint_digest: str | None = Field(default=None, pattern=SHA256_HEX.pattern)

    def __str__(self) -> str:
        return f"{self.family}@r{self.revision}"


class LogprobProbe(Record):
    """A short token sequence and its float32 logprobs under a revision's weights exactly as its checkpoint stores
    them (``policy.hf.logprob_probe``), written by the trainer as it publishes the revision: what an inference server
    that loaded the revision must answer for these tokens (``producers.inference.weights``), within its dtype's rounding."""

    token_ids: list[int] = Field(min_length=2)
    logprobs: list[float] = Field(description="log p(token_ids[t] | token_ids[:t]) for t >= 1")

    @model_validator(mode="after")
    def _one_per_next_token(self) -> LogprobProbe:
        if len(self.logprobs) != len(self.token_ids) - 1:
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.token_ids)} tokens: one per token after "
                             "the first")
        return self


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
    served_model: str | None = Field(default=None, description=(
        "the weights that stand for this family when its own model cannot be served here (e.g. the packaged "
        "SmolLM2 in place of a recipe's model), or a local folder they were loaded from; None: the family's own"))
    fork: PolicyRef | None = Field(default=None, description=(
        "a derived run's first revision (schemas.history): the source run's revision whose checkpoint it holds; "
        "its chain continues from there"))
    source: SourceEvent | None = Field(default=None, description="the fork's own event on the source run's log")
    derivation: dict[str, JsonValue] | None = Field(default=None, description=(
        "a derived run's first revision: the run's settings (schemas.history.Derivation), so that a resume with "
        "other settings is refused"))
    plan: dict[str, JsonValue] | None = Field(default=None, description=(
        "revision 0 of a run `rollout rl` or `rollout demo` started: the GenerationPlan it runs, as compiled (with "
        "the command line's cadence), so that a derived run answers the same held-out questions at the same "
        "evaluation cadence (rollout derive)"))
    metrics: dict[str, float] = Field(default_factory=dict, description=(
        "the training step that made this revision: loss, the objective's own figures (masked or clipped "
        "fractions), step seconds, and the trainer-inference logprob mismatch (mean/max |logprob(trainer) - "
        "logprob(inference)| and the mismatch KL over the batch's tokens, each recomputed under the revision that "
        "generated it)"))
    objective: dict[str, JsonValue] | None = Field(default=None, description=(
        "what the step that made this revision optimized: its schemas.objectives spec (type and every setting); "
        "None for a revision no batch made"))
    probe: LogprobProbe | None = Field(default=None, description=(
        "a few tokens' float32 logprobs under this revision's checkpoint: the arena checks what its inference server "
        "serves against them after loading the revision (producers.inference.weights); None: nothing to check against"))

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
