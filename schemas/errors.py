"""Errors raised by the contracts. Services dead-letter on ``EventDecodeError`` and its kin."""


class ContractError(ValueError):
    """An event or batch that breaks the contract; the message says which field and why."""


class EventDecodeError(ContractError):
    """Bytes that are not a valid event (bad frame, bad JSON, failed validation)."""


class UnknownEventTypeError(EventDecodeError):
    """The frame names an event type this build does not know."""


class UnknownSchemaVersionError(EventDecodeError):
    """The frame was written by a newer schema than this build understands: upgrade the reader."""


class MissingCheckpointError(ContractError):
    """A policy revision without a checkpoint digest was offered where training needs one."""


class CrossFamilyMixError(ContractError):
    """Records from different model families cannot share a batch or lineage."""


class EmptyBatchError(ContractError):
    """A batch or rollout with nothing in it is refused rather than emitted."""


class StaleRecordError(ContractError):
    """A record whose source revision is further behind the target than the off-policy bound."""
