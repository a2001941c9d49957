"""Canonical digests and deterministic batch assembly: order-free, bit-sensitive, refusing bad input."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.batch import assemble_batch, stale_reason, verify_batch
from schemas.digests import batch_digest, canonical_bytes, lineage_digest, record_digest
from schemas.errors import CrossFamilyMixError, EmptyBatchError, MissingCheckpointError, StaleRecordError

sys.path.insert(0, str(Path(__file__).parent))
from _contract_factories import record, ref, revision  # noqa: E402

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def build(records, target_rev: int = 5, bound: int = 2):
    return assemble_batch(records, revision(target_rev), bound, run_id="run-1", producer="batcher-0")


@SETTINGS
@given(n=st.integers(1, 40), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_batch_is_independent_of_arrival_order(n: int, seed: int, data: st.DataObject) -> None:
    records = [record(i, rev=data.draw(st.integers(3, 5))) for i in range(n)]
    shuffled = list(records)
    random.Random(seed).shuffle(shuffled)
    a, b = build(records), build(shuffled)
    assert a.batch_digest == b.batch_digest
    assert a.lineage_digest == b.lineage_digest
    assert a.batch_id == b.batch_id
    assert [r.record_id for r in a.records] == [r.record_id for r in b.records] == sorted(r.record_id for r in records)
    assert a == b.model_copy(update={"event_id": a.event_id, "created_at": a.created_at})  # all but write metadata
    assert verify_batch(a) == []


@SETTINGS
@given(n=st.integers(1, 12), which=st.data(), bit=st.integers(0, 31))
def test_one_logprob_bit_changes_the_digests(n: int, which: st.DataObject, bit: int) -> None:
    records = [record(i, rev=4) for i in range(n)]
    i = which.draw(st.integers(0, n - 1))
    j = which.draw(st.integers(0, len(records[i].completion_logprobs) - 1))
    raw = records[i].completion_logprobs.view("<u4").copy()
    raw[j] ^= np.uint32(1 << bit)
    flipped = raw.view("<f4")
    changed = list(records)
    changed[i] = records[i].model_copy(update={"completion_logprobs": flipped})
    changed[i] = type(records[i]).model_validate(dict(changed[i]))  # re-validate through the contract
    assert record_digest(changed[i]) != record_digest(records[i])
    assert build(changed).batch_digest != build(records).batch_digest
    # lineage covers revisions and counts, not content: unchanged by a logprob flip
    assert build(changed).lineage_digest == build(records).lineage_digest


def test_nan_payloads_and_negative_zero_are_distinguished() -> None:
    a = np.array([-0.0, np.nan], dtype="<f4")
    b = np.array([0.0, np.nan], dtype="<f4")
    c = np.array([-0.0, np.nan], dtype="<f4")
    c.view("<u4")[1] ^= 1  # another NaN payload
    digests = {record_digest(record(0, n_tokens=2, logprobs=x)) for x in (a, b, c)}
    assert len(digests) == 3


def test_write_metadata_does_not_change_the_digest() -> None:
    r = record(1)
    again = r.model_copy(update={"event_id": "another-event-id", "producer": "credit-9", "causation_id": "x"})
    assert record_digest(again) == record_digest(r)
    assert record_digest(r.model_copy(update={"reward": 0.0})) != record_digest(r)


def test_lineage_changes_with_source_revisions() -> None:
    same_content = [record(i, rev=5) for i in range(3)]
    older = [record(i, rev=4) for i in range(3)]
    assert build(same_content).lineage_digest != build(older).lineage_digest
    target = ref(5)
    assert lineage_digest("f", target, [(ref(3), 2), (ref(4), 1)]) == lineage_digest("f", target, [(ref(4), 1), (ref(3), 2)])
    assert lineage_digest("f", target, [(ref(3), 2)]) != lineage_digest("f", target, [(ref(3), 3)])


def test_batch_digest_sorts_record_digests() -> None:
    assert batch_digest("f", ref(1), ["b", "a"]) == batch_digest("f", ref(1), ["a", "b"])
    assert canonical_bytes({"b": 1, "a": [1.5, None]}) == b'{"a":[1.5,null],"b":1}'


def test_batch_surfaces_lineage_and_aggregates() -> None:
    records = [record(0, rev=3, reward=1.0, advantage=1.0), record(1, rev=5, reward=0.0, advantage=-1.0),
               record(2, rev=5, reward=1.0, advantage=0.0), record(3, rev=3, reward=1.0, advantage=0.0)]
    batch = build(records)
    assert [(s.policy.revision, s.records) for s in batch.source_revisions] == [(3, 2), (5, 2)]
    assert batch.target.revision == 5 and batch.target.checkpoint_digest == revision(5).checkpoint.digest
    assert batch.reward.count == 4 and batch.reward.mean == 0.75 and batch.advantage.min == -1.0
    assert batch.completion_tokens == sum(len(r.completion_token_ids) for r in records)
    assert batch.proof_refs == ["rollout-0"]


def test_tampering_is_detected() -> None:
    batch = build([record(i, rev=5) for i in range(4)])
    forged = batch.model_copy(update={"records": [batch.records[0].model_copy(update={"advantage": 9.0}),
                                                  *batch.records[1:]]})
    assert any("batch digest" in p for p in verify_batch(forged))
    relabelled = batch.model_copy(update={"records": [batch.records[0].model_copy(update={"policy": ref(4)}),
                                                      *batch.records[1:]]})
    problems = verify_batch(relabelled)
    assert any("lineage digest" in p for p in problems)


# -- refusals -------------------------------------------------------------------------------------


def test_empty_batch_is_refused() -> None:
    with pytest.raises(EmptyBatchError, match="empty batch"):
        build([])


def test_cross_family_mix_is_refused() -> None:
    with pytest.raises(CrossFamilyMixError, match="other-family"):
        build([record(0), record(1, family="other-family")])
    with pytest.raises(CrossFamilyMixError):
        build([record(0, family="other-family")])


def test_stale_record_is_refused() -> None:
    with pytest.raises(StaleRecordError, match="3 revisions behind"):
        build([record(0, rev=5), record(1, rev=2)], target_rev=5, bound=2)
    assert build([record(1, rev=3)], target_rev=5, bound=2).records[0].policy.revision == 3


def test_record_from_the_future_is_refused() -> None:
    with pytest.raises(StaleRecordError, match="ahead of target"):
        build([record(0, rev=6)], target_rev=5)
    assert stale_reason(record(0, rev=5), revision(5), 0) is None


def test_target_revision_without_checkpoint_is_refused() -> None:
    with pytest.raises(MissingCheckpointError, match="no checkpoint digest"):
        assemble_batch([record(0, rev=5)], revision(5, checkpoint=False), 2, run_id="run-1", producer="b")


def test_record_offered_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="offered twice"):
        build([record(0, rev=5), record(0, rev=5)])


# Canonical encoding v1 is a format: replays of old runs recompute these digests and compare them with the ones
# their batches carry. Pinned values, computed once with the first implementation; any change is a new version.
PINNED = {
    "policy_revision": "549fe2ba9c93eb97093f530b4ed54ab0bda5ccf4ea84f5fe9e700da932ac239b",
    "step": "a8b1299a80712e3da1e4625b64a1cb0862d008cec8964b3f1b052d05a4d588d5",
    "rollout": "de597d0840f382d24daa718380472f99c93338f533a54f68fd787e67ab134d5e",
    "rollout_scored": "2ce4270a25ed9ff610d125feec0a95669ed88334cbfdc248ba46092834ad7cc1",
    "training_record": "e54b3ba89db1a625470c96c483c2d32db651a84a6e8ade91fa5dfa187b50aa05",
    "trainer_batch": "a9ac336fd1d62f4dd9c027a1ef38944c08b09dbaafc57d55c96476d022bad12d",
    "dead_letter": "0e27d3af30076d63dd014f7aa45f1d1b47c34b50416eb126e542036b5986c5ad",
}


def test_canonical_digests_are_pinned() -> None:
    from _contract_factories import fixture_events

    from schemas.digests import digest

    events = fixture_events()
    assert {k: digest("record", events[k]) for k in PINNED} == PINNED


def test_array_digest_is_of_little_endian_c_order_bytes() -> None:
    from schemas.digests import digest

    a = np.arange(12, dtype="<i4")
    same = [a.astype(">i4"), np.repeat(a, 2)[::2]]  # big-endian; a strided (non-contiguous) view
    assert not same[1].flags.c_contiguous
    for b in same:
        assert np.array_equal(a, b)
        assert digest("x", b) == digest("x", a)
    assert digest("x", a.astype("<i8")) != digest("x", a)  # the dtype is part of the digest


def test_an_added_optional_field_counts_only_when_set() -> None:
    """PolicyRevision.served_model came after the digests were pinned: unset, an event digests as it always did;
    set, it is part of the content."""
    from _contract_factories import fixture_events

    from schemas.digests import digest

    rev = fixture_events()["policy_revision"]
    assert rev.served_model is None and digest("record", rev) == PINNED["policy_revision"]
    stood_in = rev.model_copy(update={"served_model": "SmolLM2-135M-Instruct standing in for org/model"})
    assert digest("record", stood_in) != PINNED["policy_revision"]
    letter = fixture_events()["dead_letter"]  # DeadLetter.partial, a flag added later: False digests as before
    assert letter.partial is False and digest("record", letter) == PINNED["dead_letter"]
    assert digest("record", letter.model_copy(update={"partial": True})) != PINNED["dead_letter"]
