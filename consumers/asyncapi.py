"""AsyncAPI description of every pipeline topic and message, via FastStream, derived from the registry.

    .venv/bin/faststream docs gen consumers.asyncapi:app --yaml      # -> asyncapi.yaml

Documentation only: the services themselves run on ``streams.transactions`` (FastStream has no Kafka
transactions), so the handlers registered here are never started. Frames are the binary
``schemas.codec`` format; the payload schemas are the events' JSON Schemas.
"""

from __future__ import annotations

from typing import Any, Union

from faststream import FastStream
from faststream.kafka import KafkaBroker
from faststream.specification import AsyncAPI

from consumers.registry import SERVICES
from consumers.service import Service
from schemas.admission import ADMISSION_EVENTS
from streams import topics

broker = KafkaBroker("localhost:9092", description="rollout-log pipeline (binary schemas.codec frames)")


def _doc(t: topics.Topic) -> str:
    return f"{t.doc} ({t.partitions} partitions)"


def _handler(event: type, doc: str) -> Any:
    """A never-run handler typed with ``event``, so the document carries that message's schema."""
    async def handle(msg: Any) -> None:
        pass

    handle.__annotations__["msg"] = event
    handle.__doc__ = doc
    return handle


def _describe(svc: Service) -> None:
    handler = _handler(svc.inputs[0].event, svc.help)
    for t in svc.outputs:
        handler = broker.publisher(t.name, title=f"{svc.name}:{t.key}", schema=t.event, description=_doc(t))(handler)
    broker.subscriber(*(t.name for t in svc.inputs), group_id=svc.group_id,
                      title=f"{svc.name}:" + "+".join(t.key for t in svc.inputs),
                      description="; ".join(map(_doc, svc.inputs)))(handler)
    for t in svc.side_inputs:
        broker.subscriber(t.name, title=f"{svc.name}:{t.key} (side input: every instance reads it all, no group)",
                          description=_doc(t))(_handler(t.event, "the latest revision"))


for _svc in SERVICES.values():
    _describe(_svc)
broker.subscriber(topics.DEAD_LETTERS.name, group_id=topics.group_id("ops"), title="ops:dead-letters",
                  description=_doc(topics.DEAD_LETTERS))(
    _handler(topics.DEAD_LETTERS.event, "What a service could not process, with the reason (inspect, fix, re-inject)."))
broker.subscriber(topics.ADMISSIONS.name, title="arena:admissions (every arena appends and reads it all, no group)",
                  description=_doc(topics.ADMISSIONS))(
    _handler(Union[ADMISSION_EVENTS], "The arenas' shared admission bound (schemas.admission)."))

app = FastStream(broker, specification=AsyncAPI(
    title="rollout-log", version="0.1.0", description="Event-sourced rollout pipeline: topics and messages"))
