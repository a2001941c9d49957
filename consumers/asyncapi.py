"""AsyncAPI description of every pipeline topic and message, via FastStream.

    .venv/bin/faststream docs gen consumers.asyncapi:app --yaml      # -> asyncapi.yaml

Documentation only: the services themselves run on ``streams.transactions`` (FastStream has no Kafka
transactions). The handlers below describe who consumes and produces what; they are never started.
Frames are the binary ``schemas.codec`` format; the payload schemas are the events' JSON Schemas.
"""

from __future__ import annotations

from faststream import FastStream
from faststream.kafka import KafkaBroker
from faststream.specification import AsyncAPI

from schemas.events import DeadLetter, Rollout, RolloutScored, Step, TrainerBatch, TrainingRecord
from schemas.policy import PolicyRevision
from streams import topics

broker = KafkaBroker("localhost:9092", description="rollout-log pipeline (binary schemas.codec frames)")


def _doc(t: topics.Topic) -> str:
    return f"{t.doc} ({t.partitions} partitions)"


@broker.subscriber(topics.STEPS.name, group_id="rollout.verifier", title="verifier:steps", description=_doc(topics.STEPS))
async def verifier_steps(step: Step) -> None:
    """Steps, keyed by root_group_id, joined with their Rollout (co-partitioned)."""


@broker.publisher(topics.SCORES.name, title="verifier:scores", schema=RolloutScored, description=_doc(topics.SCORES))
@broker.publisher(topics.DEAD_LETTERS.name, title="verifier:dead-letters", schema=DeadLetter,
                  description=_doc(topics.DEAD_LETTERS))
@broker.subscriber(topics.ROLLOUTS.name, group_id="rollout.verifier", title="verifier:rollouts",
                   description=_doc(topics.ROLLOUTS))
async def verifier(rollout: Rollout) -> RolloutScored:
    """Score a rollout with the ScoringSpec in artifacts['scoring']."""
    raise NotImplementedError


@broker.publisher(topics.TRAINING_RECORDS.name, title="credit:training-records", schema=TrainingRecord,
                  description=_doc(topics.TRAINING_RECORDS))
@broker.subscriber(topics.SCORES.name, group_id="rollout.credit", title="credit:scores")
async def credit(scored: RolloutScored) -> TrainingRecord:
    """Credit assignment: one TrainingRecord per trainable step."""
    raise NotImplementedError


@broker.subscriber(topics.POLICY_REVISIONS.name, title="batcher:policy-revisions (side input)",
                   description=_doc(topics.POLICY_REVISIONS))
async def batcher_revisions(revision: PolicyRevision) -> None:
    """The batch target: the latest revision with a checkpoint."""


@broker.publisher(topics.TRAINER_BATCHES.name, title="batcher:trainer-batches", schema=TrainerBatch,
                  description=_doc(topics.TRAINER_BATCHES))
@broker.subscriber(topics.TRAINING_RECORDS.name, group_id="rollout.batcher", title="batcher:training-records")
async def batcher(record: TrainingRecord) -> TrainerBatch:
    """Lineage-stamped batches with an off-policy bound."""
    raise NotImplementedError


@broker.publisher(topics.POLICY_REVISIONS.name, title="trainer:policy-revisions", schema=PolicyRevision)
@broker.subscriber(topics.TRAINER_BATCHES.name, group_id="rollout.trainer", title="trainer:trainer-batches")
async def trainer(batch: TrainerBatch) -> PolicyRevision:
    """Reference trainer: one clipped policy-gradient step per batch, then the next revision."""
    raise NotImplementedError


@broker.subscriber(topics.DEAD_LETTERS.name, group_id="rollout.ops", title="ops:dead-letters")
async def dead_letters(letter: DeadLetter) -> None:
    """What a service could not process, with the reason (inspect, fix, re-inject)."""


app = FastStream(broker, specification=AsyncAPI(
    title="rollout-log", version="0.1.0", description="Event-sourced rollout pipeline: topics and messages"))
