"""The pure parts of a derived run (schemas.history, consumers.batching with a history rule): the staleness
rule, the range a derived run takes, the re-scoring, and the batcher's pace. No Kafka."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from consumers import scoring, testing
from consumers.batching import HISTORY_AHEAD, BatchPolicy, Batcher
from consumers.credit import record_id, records_for
from schemas.batch import assemble_batch, stale_reason
from schemas.envelope import SourceEvent
from schemas.history import Derivation, HistoryRule, Rescore, history_lag
from schemas.policy import PolicyRef
from schemas.scoring import ScoringSpec, WeightedFunc

FORK = PolicyRef(family="tiny", revision=3)
RULE = HistoryRule(source_run_id="a", fork=FORK)
DERIVED = "tiny.b"


def _target(revision: int):
    return testing.revision(revision, family=DERIVED, run_id="b")


@pytest.mark.parametrize("j, t, lag", [(0, 3, 3), (3, 3, 0), (5, 3, 2), (2, 7, 5), (9, 4, 5)])
def test_history_lag_is_the_distance_between_revision_numbers_on_the_chain_numbered_on_from_the_fork(j, t, lag):
    assert history_lag(PolicyRef(family="tiny", revision=j), PolicyRef(family=DERIVED, revision=t), RULE) == lag
    assert history_lag(PolicyRef(family="other", revision=j), PolicyRef(family=DERIVED, revision=t), RULE) is None


def test_a_history_record_past_the_bound_is_refused_with_its_reason_and_another_family_is_refused():
    far = testing.training_record(1, revision_=0, family="tiny")
    near = testing.training_record(2, revision_=4, family="tiny")
    target = _target(6)
    assert stale_reason(near, target, 2, RULE) is None
    assert stale_reason(far, target, 2, RULE) == (
        f"record {far.record_id} from r0 is 6 revisions behind target r6 through the fork tiny@r3 "
        "(max_off_policy_steps=2)")
    assert "is from family 'tiny'" in stale_reason(near, target, 2)  # without the rule: another family
    other = testing.training_record(3, revision_=4, family="other")
    assert "is from family 'other'" in stale_reason(other, target, 2, RULE)
    batch = assemble_batch([near], target, 2, run_id="b", producer="t", history=RULE)
    assert batch.history == RULE and batch.family == DERIVED


def test_the_derived_batcher_stays_at_most_HISTORY_AHEAD_batches_ahead_of_the_trainer_and_refuses_stale_history():
    b: Batcher = Batcher(BatchPolicy(family=DERIVED, max_off_policy_steps=2, batch_records=2, history=RULE), "b")
    for i in range(2 * (HISTORY_AHEAD + 2)):
        assert b.add(testing.training_record(i, revision_=3, family="tiny"), 0.0) is None
    assert b.add(testing.training_record(99, family="other"), 0.0).error_type == "CrossFamilyMixError"
    batches, refused = b.poll(_target(3), 1.0)  # at the fork: more batches' worth waiting than may go
    assert len(batches) == HISTORY_AHEAD and not refused and b.emitted_batches == HISTORY_AHEAD
    assert b.poll(_target(3), 2.0) == ([], [])  # the trainer has not published from them yet
    assert len(b.poll(_target(4), 3.0)[0]) == 1  # one trained: one more
    batches, refused = b.poll(_target(6), 4.0)  # r6 is 3 from the records' r3: past the bound of 2
    assert not batches and [r.error_type for r in refused] == ["StaleRecordError"] * 2


def test_batches_the_trainer_dead_lettered_give_the_derived_batcher_its_room_back():
    """A dead-lettered batch will never become a revision: counted as still ahead of the trainer, HISTORY_AHEAD of
    them stopped the derived batcher for good; counted as gone (``dropped``), it goes on."""
    b: Batcher = Batcher(BatchPolicy(family=DERIVED, max_off_policy_steps=2, batch_records=2, history=RULE), "b")
    for i in range(2 * 2 * HISTORY_AHEAD):
        b.add(testing.training_record(i, revision_=3, family="tiny"), 0.0)
    assert len(b.poll(_target(3), 1.0)[0]) == HISTORY_AHEAD
    assert b.poll(_target(3), 2.0) == ([], [])  # every one dead-lettered, but not known so: no room
    batches, refused = b.poll(_target(3), 3.0, dropped=HISTORY_AHEAD)
    assert len(batches) == HISTORY_AHEAD and not refused and b.emitted_batches == 2 * HISTORY_AHEAD


def test_the_range_a_derived_run_takes():
    t0 = datetime(2026, 11, 1, tzinfo=UTC)
    d = Derivation(run_id="b", source_run_id="a", source_prefix="a.", fork=FORK, from_revision=2, to_revision=5,
                   since=t0, until=t0 + timedelta(days=1))
    assert d.takes("a", 2, t0) and d.takes("a", 5, t0 + timedelta(hours=23))
    assert not d.takes("other", 3, t0)  # another run under the same prefix
    assert not d.takes("a", 1, t0) and not d.takes("a", 6, t0)
    assert not d.takes("a", 3, t0 - timedelta(seconds=1)) and not d.takes("a", 3, t0 + timedelta(days=1))
    assert Derivation(run_id="b", source_run_id="a", source_prefix="a.", fork=FORK).takes("a", None, t0)
    # the documented form (docs/DERIVED-RUNS.md), `--since 2026-11-01` (datetime.fromisoformat: no zone), is UTC: it compares, and so
    naive = Derivation(run_id="b", source_run_id="a", source_prefix="a.", fork=FORK,
                       since=datetime.fromisoformat("2026-11-01"), until=datetime.fromisoformat("2026-11-02"))
    assert naive.since == t0 and naive.takes("a", 3, t0) and not naive.takes("a", 3, t0 - timedelta(seconds=1))


async def test_a_rescore_replaces_the_reward_functions_and_keeps_the_rollouts_answer():
    [(steps, ro)] = testing.arithmetic_group("g", 1)
    spec = scoring.spec_of(ro)
    rescore = Rescore(kind="rubric", funcs=[WeightedFunc(fn="tests._rewards:fixed_sum", weight=2.0)])
    assert rescore.apply(spec) == ScoringSpec(kind="rubric", answer=spec.answer, funcs=rescore.funcs)
    verdict = await scoring.score(ro, steps, rescore=rescore)
    said = int(steps[0].completion[0].content.split()[-1])
    assert verdict.rewards == {"solver": 2.0 * (said == int(spec.answer))}
    where = SourceEvent.of("a", "a.rollouts", 3, 17, b"raw")
    scored = scoring.to_scored(ro, steps, verdict, producer="v", derived=("b", where, rescore))
    assert scored.run_id == "b" and scored.source == where and scored.verifier_version == f"1+{rescore.version()}"
    # a derived record names its source, and differs in id from the source run's record of the same step
    [rec] = records_for(scored, {"solver": 0.5}, "grpo", producer="c")
    assert rec.source == where and rec.record_id != record_id(ro.rollout_id, steps[0].step_id)
    assert rec.record_id == record_id(ro.rollout_id, steps[0].step_id, "b")
