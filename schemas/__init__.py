"""The event contracts of rollout-log: pure pydantic models, no Kafka.

Everything that crosses a topic is defined here; ``schemas.codec`` turns it into bytes and back.
"""

from schemas.batch import assemble_batch, stale_reason, staleness, verify_batch
from schemas.envelope import Event, Record
from schemas.errors import (ContractError, CrossFamilyMixError, EmptyBatchError, EventDecodeError,
                            MissingCheckpointError, StaleRecordError, UnknownEventTypeError,
                            UnknownSchemaVersionError)
from schemas.events import (ALL_EVENTS, EVENTS_BY_TYPE, Aggregates, ChatMessage, DeadLetter, RevisionCount,
                            Rollout, RolloutScored, Step, StepTokens, ToolCall, TrainerBatch, TrainingRecord)
from schemas.policy import CheckpointRef, PolicyRef, PolicyRevision

__all__ = [
    "ALL_EVENTS", "EVENTS_BY_TYPE", "Aggregates", "ChatMessage", "CheckpointRef", "ContractError",
    "CrossFamilyMixError", "DeadLetter", "EmptyBatchError", "Event", "EventDecodeError",
    "MissingCheckpointError", "PolicyRef", "PolicyRevision", "Record", "RevisionCount", "Rollout",
    "RolloutScored", "StaleRecordError", "Step", "StepTokens", "ToolCall", "TrainerBatch",
    "TrainingRecord", "UnknownEventTypeError", "UnknownSchemaVersionError", "assemble_batch",
    "stale_reason", "staleness", "verify_batch",
]
