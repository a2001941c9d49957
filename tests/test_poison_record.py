"""One poison record does not halt its instance (issue 24, hole 8).

A record the task raises on outside its own error handling (a bug one input triggers) aborts the transaction,
and the partitions are rebuilt from the log and tried again; before, the same record raised again, for ever, and
held every partition of the instance. Now after ``POISON_ATTEMPTS`` tries it is dead-lettered with the error and
the service goes on: on a real broker, the verifier's task made to raise on one rollout.
"""

from __future__ import annotations

import uuid
from collections import Counter

import pytest

from consumers import testing
from consumers.runner import System
from consumers.settings import ServiceSettings
from consumers.tasks import verifier
from schemas import codec
from schemas.events import DeadLetter, Rollout, RolloutScored
from streams import serde, topics
from streams.transactions import POISON_ATTEMPTS
from tests.test_eos_pipeline import read_all, seed_groups

pytestmark = pytest.mark.integration

POISON = "g000003-r1"


async def test_a_record_the_task_raises_on_is_dead_lettered_and_the_rest_goes_on(kafka_settings, monkeypatch):
    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", f"poison{uuid.uuid4().hex[:8]}.")
    attempts = Counter()
    process = verifier.VerifierTask.process

    async def buggy(self, rec):
        if rec.topic == topics.ROLLOUTS.name and serde.from_message(rec.value, Rollout).rollout_id == POISON:
            attempts[rec.offset] += 1
            raise RuntimeError("a bug this one rollout triggers")
        return await process(self, rec)

    monkeypatch.setattr(verifier.VerifierTask, "process", buggy)
    kw = kafka_settings.client_kwargs()
    async with System(("verifier",), ServiceSettings(family=testing.FAMILY), kw):
        await seed_groups(kw, 10)
        await read_all(kw, topics.SCORES.name, until=lambda rs: len(rs) >= 39, timeout_s=120)
        await seed_groups(kw, 2, start=10)  # input after the poison record: the instance still serves it
        scored = await read_all(kw, topics.SCORES.name, until=lambda rs: len(rs) >= 47, timeout_s=60)
    ids = Counter(codec.decode(r.value, RolloutScored).rollout_id for r in scored)
    assert POISON not in ids and len(ids) == 47 and max(ids.values()) == 1
    letters = [codec.decode(r.value, DeadLetter) for r in await read_all(kw, topics.DEAD_LETTERS.name, idle_s=2)]
    assert [(d.error_type, d.origin_topic) for d in letters] == [("PoisonRecordError", topics.ROLLOUTS.name)]
    assert f"failed {POISON_ATTEMPTS} times" in letters[0].error_message
    assert "RuntimeError: a bug this one rollout triggers" in letters[0].error_message
    assert codec.decode(letters[0].raw, Rollout).rollout_id == POISON  # the record kept whole
    assert list(attempts.values()) == [POISON_ATTEMPTS]


async def test_a_full_disk_is_waited_out_and_dead_letters_nothing(kafka_settings, monkeypatch):
    """The environment's fault (ENOSPC, five times: more than ``POISON_ATTEMPTS``) on one rollout: the instance
    waits and tries again; once space is back the rollout is scored exactly once, and nothing is dead-lettered."""
    import errno

    from streams import transactions

    monkeypatch.setenv("ROLLOUT_TOPIC_PREFIX", f"enospc{uuid.uuid4().hex[:8]}.")
    monkeypatch.setattr(transactions, "ENVIRONMENT_RETRY_S", 0.2)
    attempts = Counter()
    process = verifier.VerifierTask.process

    async def disk_full(self, rec):
        if rec.topic == topics.ROLLOUTS.name and serde.from_message(rec.value, Rollout).rollout_id == POISON \
                and attempts[rec.offset] < POISON_ATTEMPTS + 2:
            attempts[rec.offset] += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return await process(self, rec)

    monkeypatch.setattr(verifier.VerifierTask, "process", disk_full)
    kw = kafka_settings.client_kwargs()
    async with System(("verifier",), ServiceSettings(family=testing.FAMILY), kw):
        await seed_groups(kw, 10)
        scored = await read_all(kw, topics.SCORES.name, until=lambda rs: len(rs) >= 40, timeout_s=120)
    ids = Counter(codec.decode(r.value, RolloutScored).rollout_id for r in scored)
    assert ids[POISON] == 1 and len(ids) == 40 and max(ids.values()) == 1
    assert list(attempts.values()) == [POISON_ATTEMPTS + 2]
    assert not await read_all(kw, topics.DEAD_LETTERS.name, idle_s=2)
