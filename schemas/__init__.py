"""The event contracts of rollout-log: pure pydantic models, no Kafka.

Everything that crosses a topic is defined here; ``schemas.codec`` turns it into bytes and back.
"""

from schemas._lazy import exports

# Imported on first use: ``from schemas import Step`` loads the events, ``import schemas.plan`` alone does not.
_WHERE = {
    **dict.fromkeys(("assemble_batch", "stale_reason", "staleness", "verify_batch"), "schemas.batch"),
    **dict.fromkeys(("Event", "Record"), "schemas.envelope"),
    **dict.fromkeys(("ContractError", "CrossFamilyMixError", "EmptyBatchError", "EventDecodeError",
                     "MissingCheckpointError", "StaleRecordError", "UnknownEventTypeError",
                     "UnknownSchemaVersionError"), "schemas.errors"),
    **dict.fromkeys(("ALL_EVENTS", "EVENTS_BY_TYPE", "Aggregates", "ChatMessage", "DeadLetter", "RevisionCount",
                     "Rollout", "RolloutReferenced", "RolloutScored", "Step", "StepReference", "StepTokens", "ToolCall",
                     "TrainerBatch", "TrainingRecord"),
                    "schemas.events"),
    **dict.fromkeys(("CheckpointRef", "PolicyRef", "PolicyRevision"), "schemas.policy"),
}
__all__ = sorted(_WHERE)
__getattr__ = exports(__name__, _WHERE)
