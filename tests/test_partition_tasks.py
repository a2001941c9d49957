"""The contract every registered service's partition task keeps (run for each one, without Kafka).

A new owner of a partition rebuilds the task from the last changelog snapshot: ``load_state(state)`` and
``restore(rec)`` for exactly the offsets ``buffered()`` listed. The rebuilt task must hold the same buffered
offsets and the same state, and then behave like the original on the next input. The records here are in
memory (the exactly-once tests run the same tasks on a real broker).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from consumers import scoring, testing
from consumers.registry import SERVICES
from consumers.settings import ServiceSettings
from schemas import codec
from schemas.batch import assemble_batch
from schemas.objectives import Reference
from schemas.plan import References
from streams import topics
from streams.changelog import decode_snapshot, encode_snapshot


class Rec:
    """An input record as aiokafka hands it over."""

    def __init__(self, topic: str, offset: int, event: Any) -> None:
        self.topic, self.partition, self.offset, self.key, self.headers = topic, 0, offset, b"k", []
        self.value = codec.encode(event)


class NoRevisions:
    latest: dict = {}

    def check(self) -> None:
        pass


def verifier_inputs() -> list[tuple[str, Any]]:
    """Rollouts without their steps, steps without their rollouts, and a parent whose children have reported."""
    out: list[tuple[str, Any]] = []
    for g in range(3):
        for steps, ro in testing.arithmetic_group(f"g{g}", 4):
            out += [(topics.STEPS.name, s) for s in steps] if g != 1 else [(topics.ROLLOUTS.name, ro)]
    return out


async def scored_inputs() -> list[tuple[str, Any]]:
    out = []
    for g in range(3):
        for steps, ro in testing.arithmetic_group(f"g{g}", 4)[:3]:  # groups of 4, three arrived: all buffered
            verdict = await scoring.score(ro, steps)
            out.append((topics.SCORES.name, scoring.to_scored(ro, steps, verdict, producer="test")))
    return out


def batch_inputs(rev0) -> list[tuple[str, Any]]:
    return [(topics.TRAINER_BATCHES.name, assemble_batch([testing.training_record(i + 4 * b) for i in range(4)], rev0, 1,
                                                         run_id="run", producer="test"))
            for b in range(2)]


def _factories(tmp: Path) -> dict[str, tuple]:
    from consumers.tasks.batcher import BatcherTask
    from consumers.tasks.credit import CreditTask
    from consumers.tasks.reference import ReferenceTask
    from consumers.trainer.task import TrainerTask
    from consumers.tasks.verifier import VerifierTask
    from consumers.trainer.step import initial_revision

    base = ServiceSettings(family=testing.FAMILY, checkpoint_dir=str(tmp))
    rev0 = initial_revision(testing.FAMILY, tmp)
    return {
        "verifier": (base, lambda s: lambda p: VerifierTask(p, s), verifier_inputs),
        "credit": (base, lambda s: lambda p: CreditTask(p, s), scored_inputs),
        "batcher": (base.model_copy(update={"batch_records": 1000, "flush_after_s": 3600}),
                    lambda s: lambda p: BatcherTask(p, s, NoRevisions(), SimpleNamespace(count=0, check=lambda: None)),
                    lambda: [(topics.TRAINING_RECORDS.name, testing.training_record(i)) for i in range(10)]),
        "trainer": (base, lambda s: lambda p: TrainerTask(p, s.family, s.checkpoint_dir,
                                                          target_checkpoint=lambda target: rev0.checkpoint),
                    lambda: batch_inputs(rev0)),
        # every score waits for its reference's answer (one that does not come here): all buffered
        "reference": (base.model_copy(update={"references": References(by_source={"s": Reference(
            model="teacher", base_url="http://teacher/v1")})}), lambda s: lambda p: ReferenceTask(p, s, Silent()),
            scored_inputs),
    }


class Silent:
    """A reference that never answers."""

    async def served(self, ref):
        return ref

    async def score(self, ref, prompt_ids, completion_ids, prefix_ids=()):
        await asyncio.Event().wait()


def test_every_registered_service_has_a_contract_case(tmp_path):
    assert set(_factories(tmp_path)) == set(SERVICES), "add the new service's case to _factories()"


@pytest.mark.parametrize("name", list(SERVICES))
def test_snapshot_round_trip_restores_exactly_the_buffered_input(name: str, tmp_path):
    settings, make, inputs = _factories(tmp_path)[name]
    factory = make(settings)
    events = inputs()
    events = asyncio.run(events) if asyncio.iscoroutine(events) else events
    recs = [Rec(topic, off, ev) for off, (topic, ev) in enumerate(events)]

    async def run() -> None:
        task = factory(0)
        for rec in recs:
            await task.process(rec)
        buffered, state = task.buffered(), task.state()
        assert any(buffered.values()) or state, f"{name}: the sample input should leave input buffered or state"
        offsets, restored_state = decode_snapshot(encode_snapshot(buffered, state))
        assert offsets == {t: set(o) for t, o in buffered.items() if o}
        again = factory(0)
        again.load_state(restored_state)
        for rec in recs:
            if rec.offset in offsets.get(rec.topic, set()):
                again.restore(rec)
        assert {t: sorted(o) for t, o in again.buffered().items() if o} == \
               {t: sorted(o) for t, o in buffered.items() if o}
        assert again.state() == state
        # and the next input gives the same outputs
        nxt = recs[-1]
        nxt = Rec(nxt.topic, len(recs), codec.decode(nxt.value))
        a, b = await task.process(nxt), await again.process(nxt)
        assert [type(o.event).__name__ for o in a] == [type(o.event).__name__ for o in b]

    asyncio.run(run())
